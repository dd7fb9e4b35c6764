"""The vllm backend's host side of one shard, without vLLM: eaglet makes the spool file, the worker's writer puts the
rows in, eaglet checks it and moves it into the store (hashed as it is read). Prints one JSON line per variant.

    python benchmarks/bench_adopt.py --dir /dev/shm/adopt [--tokens 16540 --hidden 4096 --repeats 5 --beside-busy]

Variants: the spool file allocated when made (eaglet's) vs left sparse (the worker's writes allocate it), and the
shard hashed from its mapping in one call (``sha256_mapped``, what ``adopt_shard`` uses) vs through one reused 4 MiB
buffer (``sha256_file``) vs a new buffer per 64 MiB chunk. ``--beside-busy``: all of it while another thread runs
Python without pause (in eaglet's process, vLLM's frontend loop). Defaults: a shard of the 8B-shape vLLM runs
(215,012 tokens in 13 shards, bf16: ~540 MB).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from eaglet.formats.store_manifest import ShardPlan
from eaglet.fsio import sha256_file, sha256_mapped
from eaglet.model.shards import adopt_shard
from eaglet.model.vllm_rows import RowsTarget, RowsWriter, create_spool, cut_checks, read_checks, spool_layout

sys.path.insert(0, str(Path(__file__).parent))
from contention import busy_python_thread  # noqa: E402

SAMPLE_TOKENS = 236  # the 8B runs' mean sample length
NEW_BUFFER_CHUNK = 64 << 20


def spool_once(folder: Path, tokens: int, hidden: int, sparse: bool) -> dict[str, float]:
    """One shard through the host path; seconds of each part."""
    lengths = [SAMPLE_TOKENS] * (tokens // SAMPLE_TOKENS)
    total = sum(lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    host = {
        "input_ids": torch.zeros(total, dtype=torch.int32),
        "loss_mask": torch.ones(total, dtype=torch.uint8),
        "offsets": torch.from_numpy(offsets),
        "sample_index": torch.arange(len(lengths), dtype=torch.int64),
    }
    layout = spool_layout("bf16", 3, hidden)
    stored = {f.name: torch.ones((total, *f.shape), dtype=f.dtype) for f in layout}  # the rows, as one run
    started = time.perf_counter()
    partial, file = create_spool(folder / "spool" / "shard-00000.rows", host, layout)
    if sparse:  # as before the allocation: the file's blocks freed again, its size kept
        os.truncate(partial, 0)
        with open(partial, "r+b") as handle:
            handle.write(file.prefix)
            for name, tensor in host.items():
                handle.seek(file.spans[name][0])
                handle.write(tensor.view(torch.uint8).reshape(-1).numpy().data)
        os.truncate(partial, file.size)
    made = time.perf_counter()
    targets = [RowsTarget.for_rows(partial, file, row, (2, 0, 1), "bf16", hidden) for row in offsets[:-1].tolist()]
    RowsWriter().write_chunk(targets, [[0] * SAMPLE_TOKENS] * len(lengths), np.ones(total, dtype=np.uint8), stored)
    written = time.perf_counter()
    spool = folder / "spool" / "shard-00000.rows"
    read_checks(spool, file)
    cut_checks(spool, file)
    store = folder / "store"
    store.mkdir(exist_ok=True)
    checked = time.perf_counter()
    adopt_shard(store, ShardPlan(0, (0, len(lengths)), total), spool)
    adopted = time.perf_counter()
    shard = store / "shard-00000.safetensors"
    naive = hashlib.sha256()
    with open(shard, "rb") as handle:
        while chunk := handle.read(NEW_BUFFER_CHUNK):
            naive.update(chunk)
    hashed_naive = time.perf_counter()
    sha256_file(shard)
    hashed = time.perf_counter()
    sha256_mapped(shard)
    hashed_mapped = time.perf_counter()
    shutil.rmtree(store)
    return {
        "make_s": made - started,
        "worker_write_s": written - made,
        "check_s": checked - written,
        "adopt_s": adopted - checked,
        "hash_new_buffers_s": hashed_naive - adopted,
        "hash_reused_buffer_s": hashed - hashed_naive,
        "hash_mapped_s": hashed_mapped - hashed,
        "bytes": file.data_end,
    }


def shard_parser(description: str, where: str) -> argparse.ArgumentParser:
    """The options of the benchmarks of one shard's host path: ``--dir`` (``where``), its tokens and hidden size,
    repeats."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dir", type=Path, required=True, help=where)
    parser.add_argument("--tokens", type=int, default=16_540)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    return parser


def main() -> None:
    parser = shard_parser(__doc__.splitlines()[0], "where the spool and the store go (/dev/shm/...)")
    parser.add_argument("--beside-busy", action="store_true", help="with a thread running Python without pause")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        for sparse in (True, False):
            with busy_python_thread(args.beside_busy):
                runs = [spool_once(args.dir, args.tokens, args.hidden, sparse) for _ in range(args.repeats)]
            medians = {key: round(statistics.median(r[key] for r in runs), 4) for key in runs[0]}
            spreads = {
                key: [round(min(r[key] for r in runs), 4), round(max(r[key] for r in runs), 4)] for key in runs[0]
            }
            shard_gb = runs[0]["bytes"] / 1e9
            print(json.dumps({
                "spool": "sparse (worker's writes allocate)" if sparse else "allocated when made",
                "process": "beside a busy Python thread" if args.beside_busy else "otherwise idle",
                "shard_gb": round(shard_gb, 3),
                "median_s": medians,
                "min_max_s": spreads,
                "worker_write_gb_s": round(shard_gb / medians["worker_write_s"], 2),
                "hash_gb_s": {"new_buffers": round(shard_gb / medians["hash_new_buffers_s"], 2),
                              "reused_buffer": round(shard_gb / medians["hash_reused_buffer_s"], 2),
                              "mapped": round(shard_gb / medians["hash_mapped_s"], 2)},
            }))  # fmt: skip
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
