"""The row spool between vLLM's worker and eaglet: one file per shard that vLLM's worker fills, request by request.

eaglet's connector (``model.vllm_connector``) runs inside vLLM's worker process, so the captured hidden states cross a
process boundary. They cross it once, as one file per shard: eaglet creates ``NAME.partial`` at its final size before
the shard's requests are sent, each request carries where its rows go (``RowsTarget``), the worker writes each finished
request's token ids and hidden-state rows at that place (one ``pwrite`` each), and renames the file to ``NAME`` once
every row of it is written. A worker that cannot write leaves ``NAME.error`` with the reason. No per-request files,
no locks, no headers to parse: the reader knows the shape it asked for.

File layout (``total`` rows, ``width`` = captured layers x hidden size, ``itemsize`` of the model dtype)::

    [total] int32 token ids | [total, width] hidden states (row-major, the model's dtype)

Nothing here imports vLLM: the frontend, the worker and the tests share it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import EagletError

SPOOL_SUFFIX = ".rows"  # a shard's spool file: shard-00012.rows
PARTIAL = ".partial"  # the file while vLLM's worker fills it
ERROR = ".error"  # written by the worker instead of the rename when a write fails
TOKEN_ID_DTYPE = np.int32
TOKEN_ID_BYTES = np.dtype(TOKEN_ID_DTYPE).itemsize
PARAMS_KEY = "eaglet_rows"  # the key of a request's kv_transfer_params that says where its rows go
SAVED_KEY = "rows_file"  # the key of a finished request's kv_transfer_params: the connector took its rows
POLL_S = 0.002


@dataclass(frozen=True)
class RowsTarget:
    """Where one request's rows go: ``path`` (the ``.partial`` file), starting at ``row`` of ``total`` rows of
    ``row_bytes`` each. Travels in the request's ``kv_transfer_params`` (JSON-safe)."""

    path: str
    row: int
    total: int
    row_bytes: int

    def to_params(self) -> dict[str, Any]:
        return {PARAMS_KEY: {"path": self.path, "row": self.row, "total": self.total, "row_bytes": self.row_bytes}}

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> RowsTarget | None:
        """The request's target, or None for a request that is not eaglet's."""
        value = (params or {}).get(PARAMS_KEY)
        if not isinstance(value, dict):
            return None
        return cls(str(value["path"]), int(value["row"]), int(value["total"]), int(value["row_bytes"]))

    def offsets(self) -> tuple[int, int]:
        """Byte offsets of this request's token ids and of its first hidden-state row."""
        return self.row * TOKEN_ID_BYTES, self.total * TOKEN_ID_BYTES + self.row * self.row_bytes


def create_spool(path: Path, total: int, row_bytes: int) -> Path:
    """The empty ``.partial`` file of ``total`` rows (sparse until written); returns its path."""
    partial = path.with_name(path.name + PARTIAL)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in (path, partial, path.with_name(path.name + ERROR)):
        stale.unlink(missing_ok=True)
    with open(partial, "wb") as handle:
        handle.truncate(total * (TOKEN_ID_BYTES + row_bytes))
    return partial


def slot_indices(block_ids: list[int], block_size: int, num_tokens: int) -> np.ndarray:
    """The KV-cache slots of a request's first ``num_tokens`` tokens, in token order: token t sits in block
    ``block_ids[t // block_size]`` at offset ``t % block_size``."""
    positions = np.arange(num_tokens, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)
    needed = -(-num_tokens // block_size)
    if len(blocks) < needed:
        raise ValueError(f"{num_tokens} tokens need {needed} blocks of {block_size}, the request holds {len(blocks)}")
    return blocks[positions // block_size] * block_size + positions % block_size


class RowsWriter:
    """The worker's side: writes requests' rows into their spool files and finishes each file when it is full.

    Thread-safe: vLLM's step thread hands batches to writer threads, each write touches its own byte range, and the
    count of rows written per file is kept under a lock. Files stay open until their last row is written."""

    def __init__(self):
        self.lock = threading.Lock()
        self.open_files: dict[str, tuple[int, int]] = {}  # partial path -> (fd, rows written so far)
        self.failed: set[str] = set()

    def write(self, target: RowsTarget, token_ids: np.ndarray, rows: torch.Tensor) -> None:
        """One request's ``token_ids`` [n] and ``rows`` [n, ...] (CPU, contiguous) at the target's place."""
        if target.path in self.failed:
            return
        try:
            data = rows.reshape(len(token_ids), -1).view(torch.uint8)
            if data.shape[1] != target.row_bytes:
                raise EagletError(
                    f"vLLM captured {data.shape[1]} bytes per token, eaglet expected {target.row_bytes} "
                    "(the layers or the dtype differ from the request's)"
                )
            if target.row + len(token_ids) > target.total:
                raise EagletError(f"rows {target.row}..{target.row + len(token_ids)} overrun the file's {target.total}")
            fd = self._fd(target.path)
            ids_at, rows_at = target.offsets()
            os.pwrite(fd, np.ascontiguousarray(token_ids, dtype=TOKEN_ID_DTYPE).tobytes(), ids_at)
            os.pwrite(fd, data.numpy().data, rows_at)
            self._count(target, len(token_ids))
        except (OSError, EagletError, ValueError) as exc:
            self.fail(target.path, f"{type(exc).__name__}: {exc}")

    def fail(self, partial: str, reason: str) -> None:
        """Leave ``NAME.error`` for the reader instead of a file that will never be complete."""
        with self.lock:
            self.failed.add(partial)
            fd, _ = self.open_files.pop(partial, (None, 0))
        if fd is not None:
            os.close(fd)
        final = partial.removesuffix(PARTIAL)
        try:
            Path(final + ERROR).write_text(reason + "\n")
        except OSError:
            pass  # the reader's wait ends on its timeout instead

    def close(self) -> None:
        with self.lock:
            for fd, _ in self.open_files.values():
                os.close(fd)
            self.open_files.clear()

    def _fd(self, partial: str) -> int:
        with self.lock:
            if partial not in self.open_files:
                self.open_files[partial] = (os.open(partial, os.O_WRONLY), 0)
            return self.open_files[partial][0]

    def _count(self, target: RowsTarget, rows: int) -> None:
        with self.lock:
            fd, written = self.open_files[target.path]
            written += rows
            if written < target.total:
                self.open_files[target.path] = (fd, written)
                return
            del self.open_files[target.path]
        os.close(fd)
        os.rename(target.path, target.path.removesuffix(PARTIAL))  # complete: the reader's signal


@dataclass(frozen=True)
class SpooledRows:
    """One shard's captured rows, read back: ``token_ids`` [T] and ``hidden`` [T, layers, H]."""

    token_ids: torch.Tensor
    hidden: torch.Tensor


def wait_for_rows(
    path: Path, timeout_s: float, poll_s: float = POLL_S, abandoned: threading.Event | None = None
) -> None:
    """Block until vLLM's worker has finished ``path`` (renamed from ``.partial``), or refuse with its reason.
    ``abandoned`` is set by whoever hands vLLM the requests when it stops early: the file will never come."""
    error = path.with_name(path.name + ERROR)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if error.exists():
            raise EagletError(f"{path}: vLLM's worker could not write the hidden states: {error.read_text().strip()}")
        if abandoned is not None and abandoned.is_set():
            raise EagletError(f"{path}: its requests never ran (vLLM's engine stopped first: see the error above)")
        if time.monotonic() > deadline:
            raise EagletError(
                f"{path}: vLLM's worker has not finished writing it after {timeout_s:.0f} s; run vLLM's engine core "
                "in its own process (unset VLLM_ENABLE_V1_MULTIPROCESSING) and extract again"
            )
        time.sleep(poll_s)


def read_rows(path: Path, total: int, layers: int, hidden_size: int, dtype: torch.dtype) -> SpooledRows:
    """The finished file as tensors: a private mapping of it, so the file can be removed while they are in use."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = total * (TOKEN_ID_BYTES + layers * hidden_size * itemsize)
    size = path.stat().st_size
    if size != expected:
        raise EagletError(f"{path}: {size} bytes, expected {expected}; extract again")
    raw = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    ids_end = total * TOKEN_ID_BYTES
    token_ids = raw[:ids_end].view(torch.int32)
    hidden = raw[ids_end:].view(dtype).reshape(total, layers, hidden_size)
    return SpooledRows(token_ids, hidden)
