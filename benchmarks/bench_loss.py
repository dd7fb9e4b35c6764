"""The TTT loss alone: the fused soft cross-entropy (`eaglet.train.loss.soft_cross_entropy`) next to autograd
through log-softmax with the teacher shifted by copies (how `ttt_forward` computed it before), same inputs.

Times K steps' losses + backward to the logits (the draft itself left out) and reports peak memory on GPU.
Usage: python benchmarks/bench_loss.py [--tokens 16384] [--vocab 32000] [--steps 7] [--dtype bfloat16] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="T: the demo's token budget (the 8B bench: 2048)")
    parser.add_argument("--vocab", type=int, default=32000, help="draft vocabulary")
    parser.add_argument("--steps", type=int, default=7, help="K")
    parser.add_argument("--dtype", default="bfloat16", help="the logits' dtype (training: bf16 autocast)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--compiled",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile the fused row math (default: on GPU only, as training does)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from eaglet.model.target import pick_device
    from eaglet.train.loss import soft_cross_entropy
    from eaglet.train.ttt import shift

    device = torch.device(pick_device(args.device))
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    T, V, K = args.tokens, args.vocab, args.steps
    teacher_logits = torch.randn(T, V, device=device) * 3
    mask = torch.rand(T, device=device) > 0.2
    logits = [(torch.randn(T, V, device=device) * 3).to(dtype).requires_grad_() for _ in range(K)]

    def autograd_loss() -> None:
        total = 0.0
        for k in range(K):
            teacher = shift(teacher_logits, 1 + k)
            log_probs = F.log_softmax(logits[k].float(), dim=-1)
            m = shift(mask, 1 + k, False)
            total = total + 0.8**k * ((-(F.softmax(teacher, -1) * log_probs).sum(-1)) * m).sum() / m.sum().clamp_min(1)
        total.backward()

    def fused_loss() -> None:
        probs = teacher_logits.new_zeros(T + K, V)
        probs[:T] = F.softmax(teacher_logits, -1)
        total = 0.0
        for k in range(K):
            m = shift(mask, 1 + k, False)
            loss, _ = soft_cross_entropy(
                logits[k], probs[1 + k : 1 + k + T], m.float() / m.sum().clamp_min(1), compiled=args.compiled
            )
            total = total + 0.8**k * loss
        total.backward()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn) -> dict:
        fn()  # warm-up (compiles on GPU)
        times = []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.repeats):
            for x in logits:
                x.grad = None
            sync()
            started = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - started) * 1000)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        return {"ms": round(statistics.median(times), 2), "peak_gib": round(peak, 2) if peak else None}

    before = timed(autograd_loss)
    after = timed(fused_loss)
    record = {
        "benchmark": "ttt_loss",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "tokens": T,
        "vocab": V,
        "steps": K,
        "dtype": args.dtype,
        "compiled": args.compiled if args.compiled is not None else device.type == "cuda",
        "autograd_log_softmax": before,
        "fused": after,
        "speedup": round(before["ms"] / after["ms"], 2),
    }
    print(json.dumps(record, indent=2))
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
