"""Read a prepared set (the output of `eaglet prepare`) as flat numpy arrays, without per-row Python objects."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from ..errors import EagletError
from ..fsio import read_json, sha256_file
from .prepare import MANIFEST_FILE, PREPARED_SCHEMA, SAMPLES_FILE, VOCAB_FILE


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

    @property
    def vocab_path(self) -> Path:
        return self.path / VOCAB_FILE


def load_prepared(path: str | Path, max_samples: int | None = None) -> PreparedSet:
    path = Path(path)
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise EagletError(f"{path}: not a prepared set (no {MANIFEST_FILE}); run `eaglet prepare` first")
    manifest = read_json(manifest_path)
    if manifest.get("schema") != PREPARED_SCHEMA:
        raise EagletError(f"{manifest_path}: schema {manifest.get('schema')!r}, expected {PREPARED_SCHEMA!r}")
    try:
        table = pq.read_table(path / SAMPLES_FILE)
    except Exception as exc:
        raise EagletError(f"{path / SAMPLES_FILE}: unreadable ({str(exc).splitlines()[0]})") from None
    if max_samples is not None:
        table = table.slice(0, max_samples)
    ids_column = table.column("input_ids").combine_chunks()
    mask_column = table.column("loss_mask").combine_chunks()
    offsets = np.asarray(ids_column.offsets, dtype=np.int64)
    offsets = offsets - offsets[0]
    return PreparedSet(
        path=path,
        manifest=manifest,
        manifest_sha256=sha256_file(manifest_path),
        ids=table.column("id").to_pylist(),
        tokens=np.asarray(ids_column.flatten(), dtype=np.int32),
        mask=np.asarray(mask_column.flatten(), dtype=np.uint8),
        offsets=offsets,
    )
