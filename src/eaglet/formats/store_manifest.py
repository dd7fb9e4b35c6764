"""The hidden-state store's manifest side: how shards are planned, named and listed, and the checks a manifest
must pass before anything reads a shard (torch-free: preflight and `eaglet run --plan` read stores too).

Layout::

    STORE/manifest.json               schema, target identity, aux ids + convention, prepared set, shard list
    STORE/shard-00000.safetensors     input_ids [T] int32, loss_mask [T] uint8, offsets [N+1] int64,
                                      sample_index [N] int64 (the shard's samples, longest first: the
                                      order they were computed in), aux [T,3,H], last [T,H] (bf16, or fp8 e4m3
                                      with aux_scale [T,3] / last_scale [T] float32 per-token scales;
                                      STORAGE_FORMATS says which), and where the manifest's ``target_top``
                                      is true target_top [T] int32: the target's own argmax over its whole
                                      vocabulary at each token (training's in-draft-vocabulary mask)
    STORE/shard-00000.json            the shard's record (sha256, bytes, samples, tokens), written after it

Shards are planned from the sample lengths alone, so the plan (and every shard's bytes) is the same
whoever computes it: one process, K torchrun ranks, or a resumed run. The prepared set is cut into
windows of consecutive samples (``SORT_WINDOW_SHARDS`` shards' worth of tokens); inside a window samples
are sorted longest first and cut into shards. A shard thus holds samples of nearly one length and the
extractor's right-padded batches waste almost nothing on padding, however small a shard is next to a batch.
The last shard's worth of tokens is cut into ``TAIL_PIECES`` smaller shards: what is left to write, hash and move
after the last forward is one piece, not a whole shard (``plan_tail_pieces`` reads a store's own number).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from ..errors import EagletError, shown
from ..fsio import load_json_file, read_json
from .files import MANIFEST_FILE, STORE_SCHEMA, other_kind, record_name, shard_name
from .layers import AUX_CONVENTION, resolve_aux_layer_ids, validate_aux_layer_ids
from .records import Count, Positive, Record, Sha256, parse_record

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
# The run's last shard's worth of tokens, in pieces: after the target's last forward a shard still has to be hashed
# and moved (0.36 s for 541 MB at 1.5 GB/s, ~7% of a 230k-token run on the H200); a piece of it, an eighth of that.
TAIL_PIECES = 8
LEGACY_TAIL_PIECES = 1  # a store whose manifest has no ``tail_pieces`` was planned without pieces
TOP_BYTES = 4  # target_top: one int32 token id per token


@dataclass(frozen=True)
class ShardPlan:
    index: int
    samples: tuple[int, ...]  # rows of the prepared set, in stored order (longest first)
    tokens: int

    @property
    def num_samples(self) -> int:
        return len(self.samples)


def bytes_per_token(hidden_size: int, storage_dtype: str, target_top: bool) -> int:
    """Disk bytes per token: 4 feature vectors (3 aux + last), a scale per fp8 vector, ids and mask, and the
    target's argmax where the store keeps it."""
    vectors = {"aux": 3, "last": 1}
    total = 4 + 1 + (TOP_BYTES if target_top else 0)  # input id (int32) + loss mask (uint8) + target_top
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


def shard_tokens(shard_mb: float, per_token: int) -> int:
    """Tokens a shard of about ``shard_mb`` MB holds at ``per_token`` bytes a token (at least one)."""
    return max(1, int(shard_mb * 1e6 / per_token))


def _split_tail(ordered: list[int], lengths: np.ndarray, tokens: int) -> tuple[list[int], list[int]]:
    """``ordered`` as (head, tail): the tail the last samples holding at most ``tokens`` tokens together."""
    start, held = len(ordered), 0
    while start and held + int(lengths[ordered[start - 1]]) <= tokens:
        start -= 1
        held += int(lengths[ordered[start]])
    return ordered[:start], ordered[start:]


def plan_shards(
    lengths: np.ndarray,
    tokens_per_shard: int,
    window_shards: int = SORT_WINDOW_SHARDS,
    tail_pieces: int = TAIL_PIECES,
) -> list[ShardPlan]:
    """Windows of consecutive samples, each sorted longest first (stable) and cut into shards of
    about ``tokens_per_shard`` tokens; the last window's last ``tokens_per_shard`` tokens (its shortest samples) into
    ``tail_pieces`` shards of about ``tokens_per_shard / tail_pieces``."""
    windows = _cut(list(range(len(lengths))), lengths, tokens_per_shard * window_shards)
    runs: list[list[int]] = []
    for number, window in enumerate(windows):
        ordered = sorted(window, key=lambda sample: -int(lengths[sample]))  # stable: ties keep row order
        if number == len(windows) - 1 and tail_pieces > 1:
            head, tail = _split_tail(ordered, lengths, tokens_per_shard)
            runs += _cut(head, lengths, tokens_per_shard)
            runs += _cut(tail, lengths, max(1, tokens_per_shard // tail_pieces))
        else:
            runs += _cut(ordered, lengths, tokens_per_shard)
    return [ShardPlan(index, tuple(run), int(lengths[run].sum())) for index, run in enumerate(runs)]


def plan_tail_pieces(manifest: dict[str, Any]) -> int:
    """How many pieces the store's plan cut its tail into (a store made before pieces has none in its manifest)."""
    return manifest.get("tail_pieces", LEGACY_TAIL_PIECES)


def store_plans(lengths: np.ndarray, manifest: dict[str, Any]) -> list[ShardPlan]:
    """The shards a store's manifest planned: ``plan_shards`` with its recorded parameters."""
    return plan_shards(
        lengths, manifest["tokens_per_shard"], manifest["sort_window_shards"], plan_tail_pieces(manifest)
    )


REBUILD = "re-run the same `eaglet extract` command to rebuild the manifest from the shard records"


class ShardEntry(Record):
    """A shard's entry in the manifest, and its record beside it (``shard-00000.json``). It names its own shard
    by plain file name: nothing outside the store is ever read."""

    file: str
    index: Count
    num_samples: Positive
    tokens: Positive
    bytes: Positive
    sha256: Sha256

    @model_validator(mode="after")
    def _own_file(self) -> "ShardEntry":
        if self.file != shard_name(self.index):
            raise ValueError(
                f"shard {self.index} is listed as {shown(self.file)}, not {shard_name(self.index)!r} "
                "(shards are plain file names inside the store)"
            )
        if self.tokens < self.num_samples:
            raise ValueError(f"shard {self.index} holds {self.tokens} tokens for {self.num_samples} samples")
        return self


class StoreTarget(Record):
    name: str
    config_hash: str
    tokenizer_hash: str
    compute_dtype: str
    num_layers: Positive
    hidden_size: Positive
    vocab_size: Positive


class StorePrepared(Record):
    path: str
    manifest_sha256: Sha256
    tokenizer_hash: str
    samples: Positive


class StoreTotals(Record):
    samples: Count
    tokens: Count
    bytes: Count


class StoreManifest(Record):
    """STORE/manifest.json: what was extracted from what, how it is stored, and the shards written so far."""

    schema_: Literal[STORE_SCHEMA] = Field(alias="schema")
    target: StoreTarget
    aux_layer_ids: list[int]
    aux_convention: Literal[AUX_CONVENTION]
    prepared: StorePrepared
    storage_dtype: str
    hidden_size: Positive
    tokens_per_shard: Positive
    sort_window_shards: Positive
    tail_pieces: Positive = LEGACY_TAIL_PIECES
    target_top: bool = False  # shards hold target_top (a store made before it was stored has none)
    complete: bool
    num_shards: Positive
    totals: StoreTotals
    shards: list[ShardEntry]
    config: dict[str, Any]

    @model_validator(mode="after")
    def _consistent(self) -> "StoreManifest":
        if self.storage_dtype not in STORAGE_FORMATS:
            raise ValueError(f"storage_dtype {shown(self.storage_dtype)} is none of {', '.join(STORAGE_FORMATS)}")
        if self.hidden_size != self.target.hidden_size:
            raise ValueError(f"hidden_size {self.hidden_size} is not its target's ({self.target.hidden_size})")
        try:
            validate_aux_layer_ids(self.aux_layer_ids, self.target.num_layers)
        except EagletError as exc:
            raise ValueError(f"aux_layer_ids: {exc}") from None
        if self.num_shards > self.prepared.samples:
            raise ValueError(
                f"num_shards {self.num_shards:,} for {self.prepared.samples:,} samples (a shard holds at least one)"
            )
        seen: set[int] = set()
        for entry in self.shards:
            if entry.index in seen or entry.index >= self.num_shards:
                raise ValueError(f"shard {entry.index} listed twice or beyond the {self.num_shards} planned")
            seen.add(entry.index)
        for key, field in (("samples", "num_samples"), ("tokens", "tokens"), ("bytes", "bytes")):
            listed = sum(getattr(entry, field) for entry in self.shards)
            if getattr(self.totals, key) != listed:
                raise ValueError(f"totals say {getattr(self.totals, key)} {key}, its shard list holds {listed}")
        if self.complete and len(seen) != self.num_shards:
            raise ValueError(f"marked complete but lists {len(seen)} of {self.num_shards} shards")
        return self


def check_entry(entry: Any, where: str) -> dict[str, Any]:
    """A shard entry (manifest or record) checked as a ``ShardEntry``."""
    parse_record(ShardEntry, entry, where, REBUILD)
    return entry


def read_record(store: Path, index: int) -> dict[str, Any] | None:
    """A shard's record if the shard is complete (record present, file of the recorded size)."""
    path = store / record_name(index)
    if not path.is_file():
        return None
    try:
        record = read_json(path)
    except (ValueError, RecursionError):
        return None  # a record cut short: the shard is computed again
    check_entry(record, str(path))
    if record["index"] != index:
        raise EagletError(f"{path}: the record of shard {record['index']}, not {index}; {REBUILD}")
    shard = store / record["file"]
    if not shard.is_file() or shard.stat().st_size != record["bytes"]:
        return None
    return record


def read_manifest(store: Path, check_shards: bool = True) -> dict[str, Any]:
    """The store's manifest, checked as a ``StoreManifest`` (every field, the shard list, the totals); without
    ``check_shards`` only the schema is (a resumed extraction rebuilds the rest from the shard records)."""
    store = Path(store)
    path = store / MANIFEST_FILE
    if not path.is_file():
        raise EagletError(f"{store}: not a store (no {MANIFEST_FILE}); run `eaglet extract` to make one")
    manifest = load_json_file(path, "re-run the same `eaglet extract` command to rewrite it")
    if not isinstance(manifest, dict) or manifest.get("schema") != STORE_SCHEMA:
        found = manifest.get("schema") if isinstance(manifest, dict) else type(manifest).__name__
        raise EagletError(
            other_kind(store, found, STORE_SCHEMA)
            or f"{path}: schema {shown(found)}, this eaglet reads {STORE_SCHEMA!r}; extract the store again"
        )
    if check_shards:
        parse_record(StoreManifest, manifest, path, REBUILD)
    return manifest


def check_store_counts(store: Path, manifest: dict[str, Any], prepared: Any) -> None:
    """A complete store holds exactly the samples and tokens of the prepared set it was extracted from."""
    samples = manifest["prepared"]["samples"]
    expected = {"samples": samples, "tokens": int(prepared.lengths[:samples].sum())}
    for key, value in expected.items():
        if manifest["totals"][key] != value:
            raise EagletError(
                f"{store / MANIFEST_FILE}: holds {manifest['totals'][key]:,} {key}, its prepared set "
                f"{prepared.path} has {value:,}; the store does not match its prepared set: re-extract it"
            )


def prepared_path(store: Path, manifest: dict[str, Any]) -> Path:
    """Where the store's prepared set is: the path recorded at extraction, or, when that is gone and the two
    moved together (a run directory moved or copied to another machine), the same place relative to the store."""
    recorded = Path(manifest["prepared"]["path"])
    relative = manifest.get("prepared_relative")
    if (
        not (recorded / MANIFEST_FILE).is_file()
        and relative is not None
        and (store / relative / MANIFEST_FILE).is_file()
    ):
        return (store / relative).resolve()
    return recorded


def require_complete(store: Path, manifest: dict[str, Any]) -> None:
    """Refuse a store whose extraction has not finished (every reader of a store for training asks this)."""
    if not manifest["complete"]:
        raise EagletError(f"{store}: extraction incomplete; run the same `eaglet extract` command again to finish it")


# ---------------------------------------------------------------------------------------------
# A store's identity: what decides its bytes, and what a resumed extraction must match


def store_identity(
    config: Any,
    info: Any,
    layers: tuple[int, ...],
    prepared: Any,
    tokens_per_shard: int,
    tail_pieces: int,
    model_dtype: str,
    target_top: bool,
) -> dict[str, Any]:
    """Everything that decides the store's bytes; a resumed run must match it exactly."""
    return {
        "schema": STORE_SCHEMA,
        "target": info.identity.to_record() | {"compute_dtype": model_dtype},
        "aux_layer_ids": list(layers),
        "aux_convention": AUX_CONVENTION,
        "prepared": {
            "path": str(prepared.path.resolve()),
            "manifest_sha256": prepared.manifest_sha256,
            "tokenizer_hash": prepared.manifest["target"]["tokenizer_hash"],
            "samples": len(prepared),
        },
        "storage_dtype": config.storage_dtype,
        "backend": config.backend,  # the kernels that computed the features: a resumed store keeps one
        "hidden_size": info.hidden_size,
        "tokens_per_shard": tokens_per_shard,
        "sort_window_shards": SORT_WINDOW_SHARDS,
        "tail_pieces": tail_pieces,
        "target_top": target_top,
    }


def planned_identity(config: Any, info: Any, prepared: Any, store: Path, model_dtype: str) -> dict[str, Any]:
    """``store_identity`` of the store an extract ``config`` asks for, its target (``info``: a ``TargetInfo``) computed
    in ``model_dtype``; a resumed store keeps its own tail plan. The preflight and the stage judge a resume by it."""
    layers = resolve_aux_layer_ids(config.layers, info.num_layers)
    top = planned_target_top(store, config.backend)
    tokens_per_shard = shard_tokens(config.shard_mb, bytes_per_token(info.hidden_size, config.storage_dtype, top))
    return store_identity(
        config, info, layers, prepared, tokens_per_shard, planned_tail_pieces(store), model_dtype, top
    )


def stores_target_top(backend: str) -> bool:
    """Whether an extraction by ``backend`` stores the target's argmax: transformers' forward has the LM head at
    hand; vLLM's worker hands over hidden states only (training computes the argmax from ``last`` instead)."""
    return backend == "hf"


def manifest_keeps_target_top(manifest: dict[str, Any]) -> bool:
    """Whether a store's shards hold ``target_top``, from its manifest (stores made before it was kept say nothing)."""
    return manifest.get("target_top") is True


def keeps_target_top(store: Path) -> bool:
    """Whether the store at ``store`` holds ``target_top`` in its shards (False where there is no store yet)."""
    if not (store / MANIFEST_FILE).is_file():
        return False
    return manifest_keeps_target_top(read_manifest(store, check_shards=False))


def planned_target_top(store: Path, backend: str) -> bool:
    """Whether the store's shards hold ``target_top``: a new store as its backend can, a resumed one as it began
    (every shard of a store holds the same tensors)."""
    return keeps_target_top(store) if (store / MANIFEST_FILE).is_file() else stores_target_top(backend)


def planned_tail_pieces(store: Path) -> int:
    """How the store's plan cuts its tail: a new store into ``TAIL_PIECES``, a resumed one as it was planned."""
    if not (store / MANIFEST_FILE).is_file():
        return TAIL_PIECES
    pieces = plan_tail_pieces(read_manifest(store, check_shards=False))
    return pieces if type(pieces) is int and pieces >= 1 else TAIL_PIECES  # anything else: ``resume_problem`` names it


# identity fields a resumed store may differ in: the prepared set's path (the same set, by manifest hash, moved) and the
# target's name (its directory's: renamed or reached by another path, the hashes say it is the same target)
RESUME_FREE_FIELDS = {("prepared", "path"), ("target", "name")}
# identity fields recorded since stores were first made: a store made before one resumes without it
RECORDED_SINCE = {("target", "weights_hash"), ("target_top",)}


def _first_difference(was: Any, now: Any, where: tuple[str, ...] = ()) -> tuple[str, Any, Any] | None:
    """(dotted field, value there, value asked for) of the first identity field that differs, or None."""
    if isinstance(was, dict) and isinstance(now, dict):
        for key in [*now, *(key for key in was if key not in now)]:
            if (*where, key) in RECORDED_SINCE and key not in was:
                continue
            if (*where, key) not in RESUME_FREE_FIELDS:
                found = _first_difference(was.get(key), now.get(key), (*where, key))
                if found:
                    return found
        return None
    return None if was == now else (".".join(where), was, now)


def resume_problem(store: Path, identity: dict[str, Any]) -> str | None:
    """Why the store already at ``store`` cannot be resumed as ``identity``, or None (none there, or the same)."""
    if not (store / MANIFEST_FILE).is_file():
        return None
    existing = read_manifest(store, check_shards=False)  # its shard list is rebuilt from the shard records
    existing = existing | {"tail_pieces": plan_tail_pieces(existing)}  # a store planned before pieces has none
    found = _first_difference({key: existing[key] for key in identity if key in existing}, identity)
    if found is None:
        return None
    field, was, now = found
    return (
        f"{store}: an existing store made with {field} {shown(was)}, this run asks for {shown(now)}; "
        "use another --out, or delete it to start over"
    )
