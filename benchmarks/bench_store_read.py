"""What checking a shard's sha256 while training reads it costs: a shard read three ways, best of N, from the page
cache (this measures the CPU work; a disk adds the same read time to every row).

  - unchecked:     safetensors.torch.load_file, every tensor then read (what training did before: it copies the
                   features into batches; load_file alone only maps the file)
  - streamed:      eaglet.model.shards.read_shard (one pass: read into one buffer, hash as it arrives, tensors are views)
  - second pass:   sha256 of the file, then load_file (a verify pass before the read)
  - StoreReader:   what training runs now: read_shard, then the content checks (layout, offsets, planned samples,
                   ids in the vocabulary, ids and masks equal to the prepared rows)
  - beside a busy Python thread: read_shard while another thread runs Python without pause, as the training loop's
                   does when it launches kernels (each read or hash call gives the GIL up and waits to have it back)

    python benchmarks/bench_store_read.py --mb 512 --runs 5 --out benchmarks/results/store_read_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from eaglet.formats.prepared import PreparedSet
from eaglet.fsio import sha256_file
from eaglet.model.shards import StoreReader, read_shard, write_safetensors

sys.path.insert(0, str(Path(__file__).parent))
from contention import busy_python_thread  # noqa: E402

HIDDEN = 4096  # an 8B target's hidden size: features dominate the shard
SAMPLES = 32  # samples in the shard (about 490 tokens each at 512 MB)
VOCAB = 128_256


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
    length = int(args.mb * 1e6 / (4 * HIDDEN * 2)) // SAMPLES
    tokens = length * SAMPLES
    ids = np.random.default_rng(0).integers(0, VOCAB, tokens).astype(np.int32)
    mask = (np.arange(tokens) % length > length // 3).astype(np.uint8)
    offsets = np.arange(SAMPLES + 1, dtype=np.int64) * length
    tensors = {
        "aux": torch.randn(tokens, 3, HIDDEN).to(torch.bfloat16),
        "last": torch.randn(tokens, HIDDEN).to(torch.bfloat16),
        "input_ids": torch.from_numpy(ids),
        "loss_mask": torch.from_numpy(mask),
        "offsets": torch.from_numpy(offsets),
        "sample_index": torch.arange(SAMPLES),
    }
    prepared = PreparedSet(Path("prepared"), {}, "", [f"s{i}" for i in range(SAMPLES)], ids, mask, offsets)
    manifest = {
        "hidden_size": HIDDEN,
        "storage_dtype": "bf16",
        "target": {"vocab_size": VOCAB},
        "prepared": {"samples": SAMPLES},
        "tokens_per_shard": tokens,
        "sort_window_shards": 64,
        "num_shards": 1,
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard-00000.safetensors"
        size, digest = write_safetensors(path, tensors)
        entry = {
            "file": path.name,
            "index": 0,
            "bytes": size,
            "sha256": digest,
            "tokens": tokens,
            "num_samples": SAMPLES,
        }
        reader = StoreReader(Path(tmp), manifest, prepared)
        rows = {
            "unchecked (load_file)": best_of(args.runs, lambda: [t.clone() for t in load_file(str(path)).values()]),
            "streamed sha256 (read_shard)": best_of(args.runs, lambda: read_shard(Path(tmp), entry)),
            "second pass (sha256, then load_file)": best_of(
                args.runs, lambda: (sha256_file(path), [t.clone() for t in load_file(str(path)).values()])
            ),
            "StoreReader.read (streamed sha256 + content checks)": best_of(args.runs, lambda: reader.read(entry)),
        }
        with busy_python_thread():
            rows["read_shard beside a busy Python thread"] = best_of(args.runs, lambda: read_shard(Path(tmp), entry))
        read = read_shard(Path(tmp), entry)
        rows["content checks alone (on the read tensors)"] = best_of(
            args.runs,
            lambda: (reader._check_packing(entry, read["offsets"], read["sample_index"]), reader._check_tokens(read)),
        )
    base = rows["unchecked (load_file)"]
    result = {
        "shard_mb": round(size / 1e6, 1),
        "runs": args.runs,
        "torch": torch.__version__,
        "rows": {
            name: {"seconds": round(s, 4), "GB_per_s": round(size / s / 1e9, 2), "vs_unchecked": round(s / base, 3)}
            for name, s in rows.items()
        },
    }
    for name, row in result["rows"].items():
        print(f"{name:40s} {row['seconds']:8.3f} s  {row['GB_per_s']:6.2f} GB/s  {row['vs_unchecked']:.2f}x unchecked")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
