"""A target placed over devices against the same target on one device: features equal? tokens per second?

Builds a random Llama checkpoint of a given shape (default 8B: H 4096, 32 layers, vocab 128k), saves it, then loads
it with eaglet's own loader under each placement and runs eaglet's feature capture (the extraction hot path) on the
same batches:

- ``one``: the whole model on cuda:0
- ``split``: transformers' ``device_map="auto"`` with cuda:0 capped by ``--gpu-gib``: the first layers on the GPU,
  the rest in CPU memory, streamed to the GPU for each forward (accelerate's offload) — the pipeline split a target
  larger than the GPUs takes in one process
- ``split-gpus`` (with 2+ GPUs): the layers spread over all GPUs

    python benchmarks/bench_placement.py --out results/placement_h200.json [--shape 8b|1b] [--gpu-gib 9]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import LLAMA_8B_SHAPE  # noqa: E402

SHAPES = {
    "8b": LLAMA_8B_SHAPE,
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
}


def build(shape: str, root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], torch_dtype="bfloat16")
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(root)
    del model
    torch.cuda.empty_cache()
    return root


def measure(
    path: Path, placement: SimpleNamespace, batches: list[torch.Tensor], layers: tuple[int, ...], repeats: int
) -> tuple[dict, list[tuple[torch.Tensor, torch.Tensor]]]:
    from eaglet.model.capture import FeatureCapture
    from eaglet.model.placement import describe
    from eaglet.model.target import load_model

    started = time.perf_counter()
    model = load_model(path, "cuda", "bfloat16", placement=placement)
    load_s = time.perf_counter() - started
    capture = FeatureCapture(model, layers)
    outputs = [tuple(t.cpu() for t in capture(batch)) for batch in batches[:1]]  # warm-up, kept for the comparison
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        for batch in batches:
            aux, last = capture(batch)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens = repeats * sum(b.numel() for b in batches)
    result = {
        "placement": placement.placement,
        "layout": describe(model),
        "load_s": round(load_s, 2),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }
    del model, capture, aux, last
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return result, outputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--gpu-gib", type=float, default=9.0, help="split: cuda:0's cap (the rest goes to CPU)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="eaglet-placement-")) / args.shape
    started = time.perf_counter()
    path = build(args.shape, root)
    build_s = time.perf_counter() - started
    layers_total = SHAPES[args.shape]["num_hidden_layers"]
    layers = (2, layers_total // 2, layers_total - 3)
    generator = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, SHAPES[args.shape]["vocab_size"], (args.batch, args.seq), generator=generator)
        for _ in range(args.batches)
    ]
    placements = [
        SimpleNamespace(placement="one", max_memory={}, offload_dir=None, replica="0/1"),
        SimpleNamespace(
            placement="split",
            max_memory={"cuda:0": f"{args.gpu_gib}GiB", "cpu": "400GiB"},
            offload_dir=None,
            replica="0/1",
        ),
    ]
    if torch.cuda.device_count() > 1:
        placements.append(SimpleNamespace(placement="split", max_memory={}, offload_dir=None, replica="0/1"))
    runs, reference = [], None
    for placement in placements:
        result, outputs = measure(path, placement, batches, layers, args.repeats)
        if reference is None:
            reference = outputs
        else:
            result["aux_max_abs_diff"] = float((outputs[0][0].float() - reference[0][0].float()).abs().max())
            result["last_max_abs_diff"] = float((outputs[0][1].float() - reference[0][1].float()).abs().max())
        runs.append(result)
        print(json.dumps(result), flush=True)
    report = {
        "shape": args.shape,
        "build_s": round(build_s, 1),
        "batch": [args.batch, args.seq],
        "runs": runs,
        "split_vs_one": round(runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"], 4),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "python": platform.python_version(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}))


if __name__ == "__main__":
    main()
