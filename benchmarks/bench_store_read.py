"""What checking a shard's sha256 while training reads it costs: a shard read three ways, best of N, from the page
cache (this measures the CPU work; a disk adds the same read time to every row).

  - unchecked:     safetensors.torch.load_file, every tensor then read (what training did before: it copies the
                   features into batches; load_file alone only maps the file)
  - streamed:      eaglet.store.read_shard (one pass: read into one buffer, hash as it arrives, tensors are views)
  - second pass:   sha256 of the file, then load_file (a verify pass before the read)

    python benchmarks/bench_store_read.py --mb 512 --runs 5 --out benchmarks/results/store_read_cpu.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from eaglet.fsio import sha256_file
from eaglet.store import read_shard, write_safetensors

HIDDEN = 4096  # an 8B target's hidden size: features dominate the shard


def best_of(runs: int, fn) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=512, help="shard size")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    tokens = int(args.mb * 1e6 / (4 * HIDDEN * 2))
    tensors = {"aux": torch.randn(tokens, 3, HIDDEN).to(torch.bfloat16), "last": torch.randn(tokens, HIDDEN).to(torch.bfloat16),
               "input_ids": torch.zeros(tokens, dtype=torch.int32), "loss_mask": torch.ones(tokens, dtype=torch.uint8),
               "offsets": torch.tensor([0, tokens]), "sample_index": torch.tensor([0])}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard-00000.safetensors"
        size, digest = write_safetensors(path, tensors)
        entry = {"file": path.name, "index": 0, "bytes": size, "sha256": digest, "tokens": tokens, "num_samples": 1}
        rows = {
            "unchecked (load_file)": best_of(args.runs, lambda: [t.clone() for t in load_file(str(path)).values()]),
            "streamed sha256 (read_shard)": best_of(args.runs, lambda: read_shard(Path(tmp), entry)),
            "second pass (sha256, then load_file)": best_of(args.runs, lambda: (
                sha256_file(path), [t.clone() for t in load_file(str(path)).values()])),
        }
    base = rows["unchecked (load_file)"]
    result = {"shard_mb": round(size / 1e6, 1), "runs": args.runs, "torch": torch.__version__,
              "rows": {name: {"seconds": round(s, 4), "GB_per_s": round(size / s / 1e9, 2), "vs_unchecked": round(s / base, 3)}
                       for name, s in rows.items()}}
    for name, row in result["rows"].items():
        print(f"{name:40s} {row['seconds']:8.3f} s  {row['GB_per_s']:6.2f} GB/s  {row['vs_unchecked']:.2f}x unchecked")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
