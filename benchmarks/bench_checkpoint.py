"""What writing and reading a checkpoint's optimizer state costs: eaglet's safetensors + JSON
(``eaglet.train.tensor_tree`` through ``model.shards.write_safetensors``) beside ``torch.save`` / ``torch.load
(weights_only=True)``, the pickle it replaced, on a real AdamW state of a draft's shape.

    python benchmarks/bench_checkpoint.py --shape 8b --out benchmarks/results/checkpoint_cpu.json

The state is the fused-free AdamW's after one step on the draft's trainable parameters (two float32 moments a
parameter, a 0-dim step each); each format is written to and read from the same directory ``--runs`` times, the
page cache left warm (what a run's next checkpoint meets), medians reported. A read includes summing every tensor
(safetensors maps the file; its pages are read when touched).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from eaglet.formats.draft_config import DraftConfig
from eaglet.model.draft import Eagle3Draft
from eaglet.model.shards import write_safetensors
from eaglet.train.tensor_tree import join_tensors, split_tensors

SHAPES = {  # hidden, intermediate, heads, kv heads, target vocab, draft vocab
    "8b": (4096, 14336, 32, 8, 128256, 32000),
    "embedded": (576, 1536, 9, 3, 49152, 8192),
}


def optimizer_state(shape: str) -> dict:
    hidden, intermediate, heads, kv_heads, vocab, draft_vocab = SHAPES[shape]
    target = {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "num_hidden_layers": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "model_type": "llama",
    }
    draft = Eagle3Draft(DraftConfig.from_target(target, draft_vocab, (1, 15, 29)))
    parameters = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=1e-4)
    for parameter in parameters:
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    return optimizer.state_dict()


def touched(state: dict) -> float:
    """Every tensor of a read state summed: its bytes in memory, whether the reader copied or mapped them."""
    return float(sum(t.double().sum() for s in state["state"].values() for t in s.values()))


def timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    state = optimizer_state(args.shape)
    root = Path(tempfile.mkdtemp(dir=args.dir))
    tensor_bytes = sum(t.numel() * t.element_size() for s in state["state"].values() for t in s.values())
    times: dict[str, list[float]] = {
        "safetensors_write": [],
        "safetensors_read": [],
        "pickle_write": [],
        "pickle_read": [],
    }
    try:
        for _ in range(args.runs):

            def write_ours() -> None:
                document, tensors = split_tensors(state)
                write_safetensors(root / "optimizer.safetensors", tensors, hashed=False)  # as the checkpoint writes it
                (root / "optimizer.json").write_text(json.dumps(document))

            times["safetensors_write"].append(timed(write_ours))
            times["safetensors_read"].append(
                timed(
                    lambda: touched(
                        join_tensors(
                            json.loads((root / "optimizer.json").read_text()), load_file(root / "optimizer.safetensors")
                        )
                    )
                )
            )
            times["pickle_write"].append(timed(lambda: torch.save(state, root / "optimizer.pt")))
            times["pickle_read"].append(
                timed(lambda: touched(torch.load(root / "optimizer.pt", weights_only=True, map_location="cpu")))
            )
        sizes = {
            "safetensors_bytes": (root / "optimizer.safetensors").stat().st_size
            + (root / "optimizer.json").stat().st_size,
            "pickle_bytes": (root / "optimizer.pt").stat().st_size,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "benchmark": "checkpoint_optimizer_state",
        "shape": args.shape,
        "tensor_bytes": tensor_bytes,
        "runs": args.runs,
        **sizes,
        **{f"{name}_s_median": round(statistics.median(values), 3) for name, values in times.items()},
        **{f"{name}_s": [round(v, 3) for v in values] for name, values in times.items()},
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
