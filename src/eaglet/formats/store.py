"""The hidden-state store's manifest side: how shards are planned, named and listed, and the checks a manifest
must pass before anything reads a shard (torch-free: preflight and `eaglet run --plan` read stores too).

Layout::

    STORE/manifest.json               schema, target identity, aux ids + convention, prepared set, shard list
    STORE/shard-00000.safetensors     input_ids [T] int32, loss_mask [T] uint8, offsets [N+1] int64,
                                      sample_index [N] int64 (the shard's samples, longest first: the
                                      order they were computed in), aux [T,3,H], last [T,H] (bf16, or fp8 e4m3
                                      with aux_scale [T,3] / last_scale [T] float32 per-token scales;
                                      STORAGE_FORMATS says which)
    STORE/shard-00000.json            the shard's record (sha256, bytes, samples, tokens), written after it

Shards are planned from the sample lengths alone, so the plan (and every shard's bytes) is the same
whoever computes it: one process, K torchrun ranks, or a resumed run. The prepared set is cut into
windows of consecutive samples (``SORT_WINDOW_SHARDS`` shards' worth of tokens); inside a window samples
are sorted longest first and cut into shards. A shard thus holds samples of nearly one length and the
extractor's right-padded batches waste almost nothing on padding, however small a shard is next to a batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EagletError
from ..fsio import read_json
from .files import MANIFEST_FILE, STORE_SCHEMA, record_name, shard_name

# Storage formats: the dtype each feature is stored in. fp8 (e4m3) carries a float32 scale per vector.
# "fp8-aux" keeps the teacher's input (`last`) in bf16: fp8 there flips 3% of teacher argmaxes, fp8 on the
# draft's inputs (aux) moves them by a cosine of 2e-4 (benchmarks/fp8_quality.py).
STORAGE_FORMATS: dict[str, dict[str, str]] = {
    "bf16": {"aux": "bf16", "last": "bf16"},
    "fp8": {"aux": "fp8", "last": "fp8"},
    "fp8-aux": {"aux": "fp8", "last": "bf16"},
}
BYTES_PER_DTYPE = {"bf16": 2, "fp8": 1}
SCALE_BYTES = 4
SORT_WINDOW_SHARDS = 64  # shards per length-sorted window: more = less padding, less mixing of neighbours


@dataclass(frozen=True)


class ShardPlan:
    index: int
    samples: tuple[int, ...]  # rows of the prepared set, in stored order (longest first)
    tokens: int

    @property
    def num_samples(self) -> int:
        return len(self.samples)


def bytes_per_token(hidden_size: int, storage_dtype: str) -> int:
    """Disk bytes per token: 4 feature vectors (3 aux + last), a scale per fp8 vector, ids and mask."""
    vectors = {"aux": 3, "last": 1}
    total = 4 + 1  # input id (int32) + loss mask (uint8)
    for feature, dtype in STORAGE_FORMATS[storage_dtype].items():
        total += vectors[feature] * (hidden_size * BYTES_PER_DTYPE[dtype] + (SCALE_BYTES if dtype == "fp8" else 0))
    return total


def _cut(samples: list[int], lengths: np.ndarray, tokens: int) -> list[list[int]]:
    """Consecutive runs of ``samples``, a new run once one holds ``tokens`` tokens."""
    runs: list[list[int]] = [[]]
    used = 0
    for sample in samples:
        runs[-1].append(sample)
        used += int(lengths[sample])
        if used >= tokens:
            runs.append([])
            used = 0
    return [run for run in runs if run]


def plan_shards(lengths: np.ndarray, tokens_per_shard: int, window_shards: int = SORT_WINDOW_SHARDS) -> list[ShardPlan]:
    """Windows of consecutive samples, each sorted longest first (stable) and cut into shards of
    about ``tokens_per_shard`` tokens."""
    plans: list[ShardPlan] = []
    for window in _cut(list(range(len(lengths))), lengths, tokens_per_shard * window_shards):
        ordered = sorted(window, key=lambda sample: -int(lengths[sample]))  # stable: ties keep row order
        for shard in _cut(ordered, lengths, tokens_per_shard):
            plans.append(ShardPlan(len(plans), tuple(shard), int(lengths[shard].sum())))
    return plans


def check_entry(entry: Any, where: str) -> None:
    """A shard entry (manifest or record) names its own shard by plain file name: nothing outside the store."""
    if not isinstance(entry, dict) or not isinstance(entry.get("index"), int) or entry["index"] < 0:
        raise EagletError(f"{where}: a shard entry without a valid index ({str(entry)[:80]}); re-run the same "
                          "`eaglet extract` command to rebuild the manifest from the shard records")
    if entry.get("file") != shard_name(entry["index"]):
        raise EagletError(f"{where}: shard {entry['index']} is listed as {entry.get('file')!r}, not "
                          f"{shard_name(entry['index'])!r} (shards are plain file names inside the store); re-run "
                          "the same `eaglet extract` command to rebuild the manifest from the shard records")
    for key in ("tokens", "num_samples", "bytes"):
        if not isinstance(entry.get(key), int) or entry[key] < 0:
            raise EagletError(f"{where}: shard {entry['index']} has no valid '{key}'; re-run the same `eaglet extract` "
                              "command to rebuild the manifest from the shard records")


def read_record(store: Path, index: int) -> dict[str, Any] | None:
    """A shard's record if the shard is complete (record present, file of the recorded size)."""
    path = store / record_name(index)
    if not path.is_file():
        return None
    try:
        record = read_json(path)
    except ValueError:
        return None  # a record cut short: the shard is computed again
    check_entry(record, str(path))
    shard = store / record["file"]
    if not shard.is_file() or shard.stat().st_size != record["bytes"]:
        return None
    return record


def read_manifest(store: Path, check_shards: bool = True) -> dict[str, Any]:
    """The store's manifest; with ``check_shards`` its shard list is checked too (names, indices, counts)."""
    store = Path(store)
    path = store / MANIFEST_FILE
    if not path.is_file():
        raise EagletError(f"{store}: not a store (no {MANIFEST_FILE}); run `eaglet extract` to make one")
    try:
        manifest = read_json(path)
    except ValueError as exc:
        raise EagletError(f"{path}: unreadable manifest ({exc}); re-run the same `eaglet extract` command to "
                          "rewrite it") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != STORE_SCHEMA:
        found = manifest.get("schema") if isinstance(manifest, dict) else type(manifest).__name__
        raise EagletError(f"{path}: schema {found!r}, this eaglet reads {STORE_SCHEMA!r}; extract the store again")
    if check_shards:
        check_shard_list(path, manifest)
    return manifest


def check_shard_list(path: Path, manifest: dict[str, Any]) -> None:
    """Entries name their own shards, each once, inside the plan; totals and completeness agree with them."""
    shards = manifest.get("shards")
    planned = manifest.get("num_shards")
    if not isinstance(shards, list) or not isinstance(planned, int):
        raise EagletError(f"{path}: no shard list; re-run the same `eaglet extract` command to rebuild it")
    seen: set[int] = set()
    for entry in shards:
        check_entry(entry, str(path))
        if entry["index"] in seen or entry["index"] >= planned:
            raise EagletError(f"{path}: shard {entry['index']} listed twice or beyond the {planned} planned; re-run the "
                              "same `eaglet extract` command to rebuild the manifest from the shard records")
        seen.add(entry["index"])
    totals = manifest.get("totals", {})
    for key, field in (("samples", "num_samples"), ("tokens", "tokens"), ("bytes", "bytes")):
        listed = sum(entry[field] for entry in shards)
        if totals.get(key) != listed:
            raise EagletError(f"{path}: totals say {totals.get(key)} {key}, its shard list holds {listed}; re-run the "
                              "same `eaglet extract` command to rebuild the manifest from the shard records")
    if manifest.get("complete") and len(seen) != planned:
        raise EagletError(f"{path}: marked complete but lists {len(seen)} of {planned} shards; re-run the same "
                          "`eaglet extract` command to finish the store and rebuild its manifest")


def check_store_counts(store: Path, manifest: dict[str, Any], prepared: Any) -> None:
    """A complete store holds exactly the samples and tokens of the prepared set it was extracted from."""
    samples = manifest["prepared"]["samples"]
    expected = {"samples": samples, "tokens": int(prepared.lengths[:samples].sum())}
    for key, value in expected.items():
        if manifest["totals"][key] != value:
            raise EagletError(f"{store / MANIFEST_FILE}: holds {manifest['totals'][key]:,} {key}, its prepared set "
                              f"{prepared.path} has {value:,}; the store does not match its prepared set: re-extract it")


def prepared_path(store: Path, manifest: dict[str, Any]) -> Path:
    """Where the store's prepared set is: the path recorded at extraction, or, when that is gone and the two
    moved together (a run directory moved or copied to another machine), the same place relative to the store."""
    recorded = Path(manifest["prepared"]["path"])
    relative = manifest.get("prepared_relative")
    if not (recorded / MANIFEST_FILE).is_file() and relative is not None and (store / relative / MANIFEST_FILE).is_file():
        return (store / relative).resolve()
    return recorded


def check_same_target(store_manifest: dict[str, Any], target: dict[str, Any], what: str) -> None:
    """Refuse a store made from another target or tokenizer, naming both. ``target`` may carry
    ``legacy_config_hash`` (``TargetInfo``'s), which stores extracted before the config identity recorded."""
    stored = store_manifest["target"]
    for key, label in (("config_hash", "target"), ("tokenizer_hash", "tokenizer")):
        if stored.get(key) not in {target.get(key), target.get(f"legacy_{key}")} - {None}:
            raise EagletError(
                f"{what}: extracted from {label} {stored.get('name')} ({key} {str(stored.get(key))[:12]}), "
                f"but this run uses {target.get('name')} ({str(target.get(key))[:12]}); use the matching target or re-extract"
            )
