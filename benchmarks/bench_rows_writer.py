"""vLLM's worker writing a shard's rows into its spool file, without vLLM: request by request (``RowsWriter.write``) vs
a chunk's runs of rows at once (``RowsWriter.write_chunk``), each with the process otherwise idle and beside a thread
that runs Python without pause (vLLM's engine core loops in Python in the process the worker's writes run in: a
writer thread that gave up the GIL for a system call waits for it). Prints one JSON line per variant.

    python benchmarks/bench_rows_writer.py --dir /dev/shm/rows [--tokens 16540 --hidden 4096 --repeats 5]

Defaults: a shard of the 8B-shape vLLM runs (bf16, 236-token requests, ~540 MB), in chunks of the connector's
``COPY_CHUNK_BYTES`` of captured rows, written by ``WRITER_THREADS`` threads as the connector hands them out.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from eaglet.model.vllm_rows import RowsTarget, RowsWriter, create_spool, spool_layout, wait_for_rows

sys.path.insert(0, str(Path(__file__).parent))
from bench_adopt import SAMPLE_TOKENS, shard_parser  # noqa: E402
from contention import busy_python_thread  # noqa: E402

CAPTURED_LAYERS = 4  # three aux layers and the last
COPY_CHUNK_BYTES = 256 * 2**20  # eaglet.model.vllm_connector's (that module imports vLLM)
WRITER_THREADS = 4  # eaglet.model.vllm_connector's


def write_shard(folder: Path, tokens: int, hidden: int, by_chunk: bool) -> float:
    """Seconds for every chunk of one shard to be written (the file renamed complete)."""
    requests = tokens // SAMPLE_TOKENS
    total = requests * SAMPLE_TOKENS
    host = {
        "input_ids": torch.zeros(total, dtype=torch.int32),
        "loss_mask": torch.ones(total, dtype=torch.uint8),
        "offsets": torch.arange(0, total + 1, SAMPLE_TOKENS, dtype=torch.int64),
        "sample_index": torch.arange(requests, dtype=torch.int64),
    }
    layout = spool_layout("bf16", 3, hidden)
    spool = folder / "spool" / "shard-00000.rows"
    partial, file = create_spool(spool, host, layout)
    per_chunk = max(1, COPY_CHUNK_BYTES // (SAMPLE_TOKENS * CAPTURED_LAYERS * hidden * 2))  # requests
    chunk_rows = per_chunk * SAMPLE_TOKENS
    stored = {f.name: torch.ones((chunk_rows, *f.shape), dtype=f.dtype) for f in layout}  # a chunk's pinned copies
    finite = np.ones(chunk_rows, dtype=np.uint8)
    ids = [0] * SAMPLE_TOKENS
    targets = [
        RowsTarget.for_rows(partial, file, r * SAMPLE_TOKENS, (2, 0, 1), "bf16", hidden) for r in range(requests)
    ]
    chunks = [targets[first : first + per_chunk] for first in range(0, requests, per_chunk)]
    writer = RowsWriter()

    def write(chunk: list[RowsTarget]) -> None:
        rows = len(chunk) * SAMPLE_TOKENS
        if by_chunk:
            writer.write_chunk(chunk, [ids] * len(chunk), finite[:rows], stored)
            return
        for index, target in enumerate(chunk):
            at = slice(index * SAMPLE_TOKENS, (index + 1) * SAMPLE_TOKENS)
            writer.write(target, np.asarray(ids), finite[at], {name: t[at] for name, t in stored.items()})

    started = time.perf_counter()
    with ThreadPoolExecutor(WRITER_THREADS) as pool:
        list(pool.map(write, chunks))
    wait_for_rows(spool, timeout_s=60)
    seconds = time.perf_counter() - started
    spool.unlink()
    return seconds


def main() -> None:
    args = shard_parser(__doc__.splitlines()[0], "where the spool goes (/dev/shm/...)").parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        for beside_busy in (False, True):
            with busy_python_thread(beside_busy):
                for by_chunk in (False, True):
                    runs = [write_shard(args.dir, args.tokens, args.hidden, by_chunk) for _ in range(args.repeats)]
                    print(json.dumps({
                        "writes": "a chunk's runs at once" if by_chunk else "request by request",
                        "process": "beside a busy Python thread" if beside_busy else "otherwise idle",
                        "median_s": round(statistics.median(runs), 4),
                        "min_max_s": [round(min(runs), 4), round(max(runs), 4)],
                    }))  # fmt: skip
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
