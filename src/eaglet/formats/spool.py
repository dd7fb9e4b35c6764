"""The vllm backend's spool folder: where vLLM's worker fills each shard's file before eaglet moves it into the store.

Its place, how many shard files it holds at once and whether it can: torch-free, so preflight asks the extraction's
own questions before anything loads.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from ..fsio import GIB, free_disk_bytes, nearest_existing

# spool files at once: the shards whose requests vLLM holds or whose rows its worker writes, and those eaglet checks
# and moves into the store; a shard's requests go to vLLM as soon as its file is made
SPOOLED_SHARDS = 8
VLLM_SPOOL_SUFFIX = ".vllm-spool"  # `.STORE.vllm-spool` beside the store unless --set spool_dir says otherwise


def spool_dir(spool_setting: str | None, store: Path) -> Path:
    """Where vLLM's connector writes: beside the store (not in it: a failed load must leave no store behind)."""
    return Path(spool_setting) if spool_setting else store.parent / f".{store.name}{VLLM_SPOOL_SUFFIX}"


def remove_spool(spool: Path, own: bool, files: str) -> None:
    """eaglet's own spool folder goes whole; in a folder the user named, only the shards' spool files (``files``, a
    glob: a failed shard's are not kept: resumed, it is recomputed), and the folder once it is empty."""
    if own:
        shutil.rmtree(spool, ignore_errors=True)
        return
    for leftover in spool.glob(files):
        leftover.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        spool.rmdir()


def spool_problem(spool: Path, store: Path, shard_bytes: list[int]) -> str | None:
    """Why vLLM's spool cannot hold this extraction's shards, or None: a file where the folder should be, or, on
    another filesystem than the store's, too little room for the ``SPOOLED_SHARDS`` largest shards (their files are
    allocated whole when eaglet makes them). Beside the store, the spool's files are the store's own shards, which the
    store's disk check counts. Known in milliseconds, before vLLM loads the target (minutes)."""
    there = nearest_existing(spool)  # the spool itself, or the ancestor it will be made in
    if not there.is_dir():
        return f"--set spool_dir={spool}: {there} is a file, not a folder; name a folder (or leave spool_dir unset)"
    if os.stat(there).st_dev == os.stat(nearest_existing(store)).st_dev:
        return None
    needed = sum(sorted(shard_bytes, reverse=True)[:SPOOLED_SHARDS])
    free = free_disk_bytes(spool)
    if needed <= free:
        return None
    return (
        f"--set spool_dir={spool}: vLLM's worker fills up to {SPOOLED_SHARDS} shards there at once, "
        f"~{needed / GIB:.2f} GiB, but {free / GIB:.2f} GiB are free; free space there, choose another spool_dir, "
        "or lower --shard-mb"
    )
