"""Per-token cost of the engine's plain target step (dynamic cache; static cache + CUDA graphs) vs HF `generate`,
batch 1, same model, same process.

The speculative speedup is measured against the engine's own target-only decoding; this shows whether that
baseline is itself as lean as HF's generation loop.
Usage: python benchmarks/bench_decode_step.py [--target embedded] [--tokens 64] [--device auto] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PROMPT_TOKENS = 60  # a short chat prompt's length
LAYER_IDS = (2, 15, 27)  # the embedded target's aux layers (any valid ids: the capture cost is the same)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch

    from eaglet.decode.baseline import target_only_decode
    from eaglet.decode.common import sync
    from eaglet.decode.runners import TargetRunner
    from eaglet.decode.static import StaticTarget
    from eaglet.model.sampling import Sampling
    from eaglet.model.target import load_model, pick_device, resolve_target

    device = pick_device(args.device)
    model = load_model(resolve_target(args.target).path, device, args.dtype)
    layers = tuple(i for i in LAYER_IDS if i < model.config.num_hidden_layers) or (0,)
    runner = TargetRunner(model, layers)
    prompt = list(range(100, 100 + PROMPT_TOKENS))
    target_only_decode(runner, prompt, 4, Sampling(), set())  # warm-up
    result = target_only_decode(runner, prompt, args.tokens, Sampling(), set())
    static = StaticTarget(model, layers, PROMPT_TOKENS + args.tokens + 1)  # CUDA graphs on GPU
    target_only_decode(static, prompt, 4, Sampling(), set())  # warm-up + capture
    static_result = target_only_decode(static, prompt, args.tokens, Sampling(), set())
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        sync(torch.device(device))
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
        sync(torch.device(device))
        generate_s = time.perf_counter() - started
    record = {
        "benchmark": "decode_step",
        "device": device,
        "torch": torch.__version__,
        "tokens": args.tokens,
        "engine_ms_per_token": round(1000 * result.seconds / len(result.tokens), 2),
        "static_cache_ms_per_token": round(1000 * static_result.seconds / len(static_result.tokens), 2),
        "static_cache_cuda_graphs": static.graphs,
        "same_tokens": static_result.tokens == result.tokens,
        "hf_generate_ms_per_token": round(1000 * generate_s / args.tokens, 2),
    }
    print(json.dumps(record, indent=2))
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
