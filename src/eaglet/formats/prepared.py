"""Read a prepared set (the output of `eaglet prepare`) as flat numpy arrays, without per-row Python objects.

Opening one checks it the way every later stage relies on: the manifest is eaglet's, the samples file is the one
the manifest hashed, every row's loss mask is as long as its ids, ids lie inside the target's vocabulary and mask
values are 0 or 1. A set that fails is refused with the file, the row and the fix, before any model loads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from ..errors import EagletError, shown
from ..fsio import load_json_file, sha256_file
from .files import MANIFEST_FILE, PREPARED_SCHEMA, SAMPLES_FILE, VOCAB_FILE, other_kind
from .records import Positive, Record, Sha256, parse_record

REQUIRED_COLUMNS = {"id": pa.string(), "input_ids": pa.list_(pa.int32()), "loss_mask": pa.list_(pa.uint8())}
PREPARE_AGAIN = "run `eaglet prepare` again to rewrite it"


@dataclass
class PreparedSet:
    path: Path
    manifest: dict[str, Any]
    manifest_sha256: str
    ids: list[str]
    tokens: np.ndarray  # [total] int32, all samples back to back
    mask: np.ndarray  # [total] uint8
    offsets: np.ndarray  # [N+1] int64

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.ids)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        begin, end = self.offsets[index], self.offsets[index + 1]
        return self.tokens[begin:end], self.mask[begin:end]

    def token_range(self, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and mask of samples ``first..stop-1``, packed."""
        begin, end = self.offsets[first], self.offsets[stop]
        return self.tokens[begin:end], self.mask[begin:end]

    def sample_digests(self, count: int | None = None) -> list[bytes]:
        """A 16-byte digest of each of the first ``count`` samples' token ids (all by default): equal samples,
        whatever their ids or files, have equal digests."""
        stop = len(self) if count is None else count
        return [
            hashlib.blake2b(self.tokens[self.offsets[i] : self.offsets[i + 1]].tobytes(), digest_size=16).digest()
            for i in range(stop)
        ]

    @property
    def vocab_path(self) -> Path:
        return self.path / VOCAB_FILE


class PreparedTarget(Record):
    name: str
    config_hash: str
    tokenizer_hash: str
    vocab_size: Positive
    num_layers: Positive
    hidden_size: Positive


class PreparedCounts(Record):
    samples: Positive


class PreparedTokens(Record):
    total: Positive
    assistant: Positive  # a set without a trainable token is never written (`eaglet prepare` refuses it)


class PreparedManifest(Record):
    """PREPARED/manifest.json: the target it was tokenized for, the counts, the hashes of its files."""

    schema_: Literal[PREPARED_SCHEMA] = Field(alias="schema")
    target: PreparedTarget
    counts: PreparedCounts
    tokens: PreparedTokens
    files: dict[str, Sha256]
    target_source: dict[str, Any] | None = None


def read_prepared_manifest(path: Path) -> dict[str, Any]:
    """The prepared set's manifest, refused in one line when it is missing, not JSON, not eaglet's or not whole."""
    manifest_path = path / MANIFEST_FILE
    if not path.is_dir() or not manifest_path.is_file():
        raise EagletError(f"{path}: not a prepared set (no {MANIFEST_FILE}); run `eaglet prepare` to make one")
    manifest = load_json_file(manifest_path, PREPARE_AGAIN)
    if not isinstance(manifest, dict) or manifest.get("schema") != PREPARED_SCHEMA:
        found = manifest.get("schema") if isinstance(manifest, dict) else type(manifest).__name__
        raise EagletError(
            other_kind(path, found, PREPARED_SCHEMA)
            or f"{manifest_path}: schema {shown(found)}, expected {PREPARED_SCHEMA!r}; {PREPARE_AGAIN}"
        )
    parse_record(PreparedManifest, manifest, manifest_path, PREPARE_AGAIN)
    return manifest


def _check_rows(samples: Path, table: pa.Table, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, mask, offsets) of the table, each row checked: equal lengths, ids in the vocabulary, 0/1 masks."""
    for name, kind in REQUIRED_COLUMNS.items():
        if name not in table.column_names:
            raise EagletError(f"{samples}: no '{name}' column (not written by `eaglet prepare`); {PREPARE_AGAIN}")
        if table.schema.field(name).type != kind:
            raise EagletError(
                f"{samples}: column '{name}' is {table.schema.field(name).type}, expected {kind}; {PREPARE_AGAIN}"
            )
    ids_column = table.column("input_ids").combine_chunks()
    mask_column = table.column("loss_mask").combine_chunks()
    if ids_column.null_count or mask_column.null_count:
        row = int(np.flatnonzero(np.asarray(ids_column.is_null()) | np.asarray(mask_column.is_null()))[0])
        raise EagletError(f"{samples}: row {row}: null ids or loss mask; {PREPARE_AGAIN}")
    offsets = np.asarray(ids_column.offsets, dtype=np.int64)
    mask_offsets = np.asarray(mask_column.offsets, dtype=np.int64)
    offsets, mask_offsets = offsets - offsets[0], mask_offsets - mask_offsets[0]
    if not np.array_equal(offsets, mask_offsets):
        row = int(np.flatnonzero(np.diff(offsets) != np.diff(mask_offsets))[0])
        raise EagletError(
            f"{samples}: row {row}: loss_mask has {int(mask_offsets[row + 1] - mask_offsets[row])} entries "
            f"for {int(offsets[row + 1] - offsets[row])} tokens; {PREPARE_AGAIN}"
        )
    empty = np.flatnonzero(np.diff(offsets) == 0)
    if len(empty):  # prepare writes none: a sample is its rendered conversation, template tokens at the least
        raise EagletError(f"{samples}: row {int(empty[0])}: a sample of no tokens; {PREPARE_AGAIN}")
    tokens = np.asarray(ids_column.flatten(), dtype=np.int32)
    mask = np.asarray(mask_column.flatten(), dtype=np.uint8)
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    if len(bad):
        row = int(np.searchsorted(offsets, bad[0], side="right")) - 1
        raise EagletError(
            f"{samples}: row {row}: token id {int(tokens[bad[0]])} outside the target's vocabulary "
            f"(0..{vocab_size - 1}); {PREPARE_AGAIN}"
        )
    if len(mask) and int(mask.max()) > 1:
        row = int(np.searchsorted(offsets, int(np.argmax(mask > 1)), side="right")) - 1
        raise EagletError(f"{samples}: row {row}: loss mask values other than 0 and 1; {PREPARE_AGAIN}")
    if len(offsets) < 2:
        raise EagletError(f"{samples}: no samples; {PREPARE_AGAIN}")
    if not mask.any():
        raise EagletError(
            f"{samples}: no trainable token (every loss mask is 0: no assistant tokens); "
            f"{PREPARE_AGAIN} from conversations with assistant answers"
        )
    return tokens, mask, offsets


def load_prepared(path: str | Path, max_samples: int | None = None) -> PreparedSet:
    path = Path(path)
    manifest = read_prepared_manifest(path)
    samples = path / SAMPLES_FILE
    if SAMPLES_FILE not in manifest["files"]:
        raise EagletError(f"{path / MANIFEST_FILE}: records no sha256 of {SAMPLES_FILE}; {PREPARE_AGAIN}")
    # every file the set holds (the draft vocabulary too: training reads it after extraction's hours)
    for name, recorded in manifest["files"].items():
        if not (path / name).is_file():
            raise EagletError(f"{path / name}: missing (the set's manifest lists it); {PREPARE_AGAIN}")
        if sha256_file(path / name) != recorded:
            raise EagletError(
                f"{path / name}: changed since `eaglet prepare` wrote it (sha256 differs from the manifest's); "
                f"{PREPARE_AGAIN}"
            )
    try:
        table = pq.read_table(samples)
    except Exception as exc:  # pyarrow's errors for a damaged file
        raise EagletError(f"{samples}: unreadable ({str(exc).splitlines()[0]}); {PREPARE_AGAIN}") from None
    if table.num_rows != manifest["counts"]["samples"]:
        raise EagletError(
            f"{samples}: {table.num_rows:,} rows, its manifest counts {manifest['counts']['samples']:,}; "
            f"{PREPARE_AGAIN}"
        )
    if max_samples is not None:
        table = table.slice(0, max_samples)
    tokens, mask, offsets = _check_rows(samples, table, manifest["target"]["vocab_size"])
    return PreparedSet(
        path=path,
        manifest=manifest,
        manifest_sha256=sha256_file(path / MANIFEST_FILE),
        ids=table.column("id").to_pylist(),
        tokens=tokens,
        mask=mask,
        offsets=offsets,
    )
