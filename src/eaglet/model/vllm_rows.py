"""The row spool between vLLM's worker and eaglet: each shard's own file, which vLLM's worker fills request by request.

eaglet's connector (``model.vllm_connector``) runs inside vLLM's worker process, so the captured hidden states cross a
process boundary. They cross it once, already in the form and the place the store keeps them: the worker gathers a
finished request's rows on its GPU, forms the stored tensors there (``form_rows``: the aux columns in eaglet's order,
the target's final norm over the last layer's output, the store's encoding, a finite flag per token) and writes each
at the request's place in its shard's file (one ``pwrite`` per tensor for each run of requests whose rows follow
one another). eaglet creates ``NAME.partial`` at its final size — the shard's safetensors header and its ids, mask,
offsets and sample index already written — before the shard's requests are sent; each request carries where its rows
go (``RowsTarget``), and the worker renames the file to ``NAME`` once every row is written. A worker that cannot
write leaves ``NAME.error`` with the reason. eaglet then checks the tokens and finite flags the worker wrote after the
shard's data, cuts them off, and moves the file into the store: the features are never copied again.

File layout (``ShardFile``; T tokens)::

    the shard's safetensors file (header; then every tensor, names sorted) | [T] int32 token ids | [T] uint8 finite

Nothing here imports vLLM: the frontend, the worker and the tests share it.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import EagletError
from .shards import encode_features, safetensors_prefix
from .transfer import to_device

SPOOL_SUFFIX = ".rows"  # a shard's spool file: shard-00012.rows
PARTIAL = ".partial"  # the file while vLLM's worker fills it
ERROR = ".error"  # written by the worker instead of the rename when a write fails
TOKEN_ID_DTYPE = np.int32
TOKEN_ID_BYTES = np.dtype(TOKEN_ID_DTYPE).itemsize
FINITE_BYTES = 1  # one uint8 flag per token
PARAMS_KEY = "eaglet_rows"  # the key of a request's kv_transfer_params that says where its rows go
SAVED_KEY = "rows_file"  # the key of a finished request's kv_transfer_params: the connector took its rows
POLL_S = 0.002
CHECKS_ALIGN = 8  # bytes: the check region starts where its token ids can be viewed in place


@dataclass(frozen=True)
class SpoolField:
    """One stored tensor's region: its name in the shard, dtype and shape per token."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def token_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * torch.empty((), dtype=self.dtype).element_size()


@functools.cache
def spool_layout(storage_dtype: str, aux_layers: int, hidden_size: int) -> tuple[SpoolField, ...]:
    """The stored tensors of ``storage_dtype``, as ``encode_features`` makes them (names, dtypes, shapes per token).
    Cached: the worker's writers ask for it once per request."""
    encoded = encode_features(torch.zeros(1, aux_layers, hidden_size), torch.zeros(1, hidden_size), storage_dtype)
    return tuple(SpoolField(name, tensor.dtype, tuple(tensor.shape[1:])) for name, tensor in encoded.items())


@dataclass(frozen=True)
class ShardFile:
    """Where a shard's spool file holds what: ``spans`` each tensor's absolute [start, end) (the shard's safetensors
    file ends at ``data_end``), then the worker's token ids at ``ids_at`` and finite flags at ``finite_at``."""

    prefix: bytes  # the safetensors header's length and JSON
    spans: dict[str, tuple[int, int]]
    total: int  # tokens
    data_end: int
    ids_at: int
    finite_at: int

    @property
    def size(self) -> int:
        return self.finite_at + self.total * FINITE_BYTES


def shard_file(host: dict[str, torch.Tensor], layout: tuple[SpoolField, ...]) -> ShardFile:
    """The spool file of a shard whose ``host`` tensors (ids, mask, offsets, sample index) eaglet has and whose
    ``layout`` tensors vLLM's worker forms: the header ``model.shards.write_safetensors`` would write for all of them."""
    total = len(host["input_ids"])
    specs = {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in host.items()}
    specs |= {field.name: (field.dtype, (total, *field.shape)) for field in layout}
    prefix, spans, data_bytes = safetensors_prefix(specs)
    data_end = len(prefix) + data_bytes
    ids_at = -(-data_end // CHECKS_ALIGN) * CHECKS_ALIGN
    return ShardFile(
        prefix,
        {name: (len(prefix) + start, len(prefix) + end) for name, (start, end) in spans.items()},
        total,
        data_end,
        ids_at,
        ids_at + total * TOKEN_ID_BYTES,
    )


@dataclass(frozen=True)
class RowsTarget:
    """Where one request's rows go: ``path`` (the ``.partial`` file), starting at ``row`` of ``total`` rows, each
    stored tensor's region at ``fields_at`` (in ``layout()`` order), the token ids' at ``ids_at``, the finite flags' at
    ``finite_at``; and how they are stored: ``columns`` (the aux ids' places among the captured layers, in eaglet's
    order; the last captured layer is the last layer's output), ``storage`` (the store's storage dtype). Travels in
    the request's ``kv_transfer_params`` (JSON-safe)."""

    path: str
    row: int
    total: int
    columns: tuple[int, ...]
    storage: str
    hidden_size: int
    fields_at: tuple[int, ...]
    ids_at: int
    finite_at: int

    def to_params(self) -> dict[str, Any]:
        return {
            PARAMS_KEY: {
                "path": self.path,
                "row": self.row,
                "total": self.total,
                "columns": list(self.columns),
                "storage": self.storage,
                "hidden_size": self.hidden_size,
                "fields_at": list(self.fields_at),
                "ids_at": self.ids_at,
                "finite_at": self.finite_at,
            }
        }

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> RowsTarget | None:
        """The request's target, or None for a request that is not eaglet's."""
        value = (params or {}).get(PARAMS_KEY)
        if not isinstance(value, dict):
            return None
        return cls(
            str(value["path"]),
            int(value["row"]),
            int(value["total"]),
            tuple(int(c) for c in value["columns"]),
            str(value["storage"]),
            int(value["hidden_size"]),
            tuple(int(at) for at in value["fields_at"]),
            int(value["ids_at"]),
            int(value["finite_at"]),
        )

    @classmethod
    def for_rows(
        cls, partial: Path, file: ShardFile, row: int, columns: tuple[int, ...], storage: str, hidden_size: int
    ) -> RowsTarget:
        """Rows from ``row`` on of ``file`` (being filled at ``partial``)."""
        layout = spool_layout(storage, len(columns), hidden_size)
        fields_at = tuple(file.spans[field.name][0] for field in layout)
        return cls(str(partial), row, file.total, columns, storage, hidden_size, fields_at, file.ids_at, file.finite_at)

    @property
    def captured_layers(self) -> int:
        return len(self.columns) + 1

    def layout(self) -> tuple[SpoolField, ...]:
        return spool_layout(self.storage, len(self.columns), self.hidden_size)

    def offsets(self, layout: tuple[SpoolField, ...]) -> tuple[int, int, list[int]]:
        """Byte offsets of this request's token ids, of its finite flags and of its row in each stored tensor."""
        return (
            self.ids_at + self.row * TOKEN_ID_BYTES,
            self.finite_at + self.row * FINITE_BYTES,
            [at + self.row * field.token_bytes for at, field in zip(self.fields_at, layout)],
        )


def column_index(columns: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The aux columns as an index tensor on ``device``, made once per form: indexing a GPU tensor with a Python list
    copies the list from pageable memory, which waits for everything queued on the stream (in vLLM's worker, the
    forward the rows' forming is overlapped with)."""
    return to_device(torch.tensor(columns, dtype=torch.long), device)


@torch.inference_mode()
def form_rows(
    rows: torch.Tensor, columns: torch.Tensor, norm: nn.Module, storage_dtype: str
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Captured rows [n, captured layers, H] -> (finite [n] bool, the stored tensors of the n tokens): ``aux`` the
    aux ``columns`` (``column_index``: in eaglet's order), ``last`` the target's final norm over the last captured
    layer (the last layer's output), as the hf backend's ``last_hidden_state`` is; both encoded as the store keeps
    them. Only GPU work is queued: nothing here waits for the device."""
    aux = rows.index_select(1, columns)  # [n, 3, H]
    last = norm(rows[:, -1])  # [n, H]
    finite = torch.isfinite(aux).flatten(1).all(1) & torch.isfinite(last).all(1)
    return finite, encode_features(aux, last, storage_dtype)


def rows_to_host(
    rows: torch.Tensor, columns: torch.Tensor, norm: nn.Module, storage_dtype: str
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``form_rows`` on the GPU, then copies of the finite flags [n] (uint8) and the stored tensors into new pinned
    host memory, all queued on the current stream: the caller records an event after them and reads the host tensors
    once it has passed. Rows in host memory (vLLM's CPU build) are formed there, ready at return."""
    finite, stored = form_rows(rows, columns, norm, storage_dtype)
    if rows.device.type == "cpu":
        return finite.to(torch.uint8), stored
    return _pinned_copy(finite.to(torch.uint8)), {name: _pinned_copy(tensor) for name, tensor in stored.items()}


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """An asynchronous device-to-host copy of ``tensor`` into new pinned memory (on the current stream)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def create_spool(path: Path, host: dict[str, torch.Tensor], layout: tuple[SpoolField, ...]) -> tuple[Path, ShardFile]:
    """The ``.partial`` file of a shard: its header and ``host`` tensors written, its whole size allocated; returns its
    path and layout.

    Allocated here, in eaglet's request-making thread ahead of vLLM, rather than page by page by vLLM's worker: the
    worker's writes into one file are serialised by the filesystem, and into a sparse tmpfs file they ran at less than
    half the speed (allocation inside the write; benchmarks/RESULTS.md). A disk without room for the shard says so
    here, naming the file, before vLLM computes it. Nothing is left of a file that could not be made."""
    file = shard_file(host, layout)
    partial = path.with_name(path.name + PARTIAL)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in (path, partial, path.with_name(path.name + ERROR)):
        stale.unlink(missing_ok=True)
    try:
        with open(partial, "wb") as handle:
            _allocate(handle.fileno(), file.size, partial)
            handle.write(file.prefix)
            for name, tensor in host.items():
                handle.seek(file.spans[name][0])
                handle.write(tensor.contiguous().view(torch.uint8).reshape(-1).numpy().data)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return partial, file


UNALLOCATABLE = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)  # a filesystem that cannot allocate ahead


def _allocate(fd: int, size: int, path: Path) -> None:
    """``size`` bytes of the file allocated now; a filesystem that cannot allocate ahead gets a sparse file (its
    writes allocate); a refusal for want of room names the file (``os.posix_fallocate`` does not)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in UNALLOCATABLE:
            os.ftruncate(fd, size)
            return
        raise OSError(exc.errno, exc.strerror, str(path)) from None


def slot_indices(block_ids: list[int], block_size: int, num_tokens: int) -> np.ndarray:
    """The KV-cache slots of a request's first ``num_tokens`` tokens, in token order: token t sits in block
    ``block_ids[t // block_size]`` at offset ``t % block_size``."""
    positions = np.arange(num_tokens, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)
    needed = -(-num_tokens // block_size)
    if len(blocks) < needed:
        raise ValueError(f"{num_tokens} tokens need {needed} blocks of {block_size}, the request holds {len(blocks)}")
    return blocks[positions // block_size] * block_size + positions % block_size


def row_order(target: RowsTarget) -> tuple[str, int]:
    """The order a chunk's requests are gathered and written in: by file, then row."""
    return target.path, target.row


def contiguous_runs(targets: list[RowsTarget], counts: list[int]) -> list[tuple[int, int]]:
    """[first, last) ranges of ``targets`` (of ``counts`` rows each, in ``row_order``) whose rows follow one another in
    one file."""
    runs: list[tuple[int, int]] = []
    for index, target in enumerate(targets):
        previous = targets[index - 1] if index else None
        if previous is not None and previous.path == target.path and previous.row + counts[index - 1] == target.row:
            runs[-1] = (runs[-1][0], index + 1)
        else:
            runs.append((index, index + 1))
    return runs


def file_groups(targets: list[RowsTarget]) -> list[tuple[int, int]]:
    """[first, last) ranges of ``targets`` (in ``row_order``) that go to one file."""
    groups: list[tuple[int, int]] = []
    for index, target in enumerate(targets):
        if index and targets[index - 1].path == target.path:
            groups[-1] = (groups[-1][0], index + 1)
        else:
            groups.append((index, index + 1))
    return groups


class RowsWriter:
    """The worker's side: writes requests' rows into their spool files and finishes each file when it is full.

    Thread-safe: vLLM's step thread hands batches to writer threads, each write touches its own byte range, and the
    count of rows written per file is kept under a lock. Files stay open until their last row is written."""

    def __init__(self):
        self.lock = threading.Lock()
        self.open_files: dict[str, tuple[int, int]] = {}  # partial path -> (fd, rows written so far)
        self.failed: set[str] = set()

    def write(
        self, target: RowsTarget, token_ids: np.ndarray, finite: np.ndarray, stored: dict[str, torch.Tensor]
    ) -> None:
        """One request's ``token_ids`` [n], ``finite`` [n] flags and ``stored`` tensors [n, ...] (CPU, contiguous)
        at the target's places."""
        if target.path in self.failed:
            return
        try:
            layout = target.layout()
            if [field.name for field in layout] != list(stored):
                raise EagletError(f"worker formed {list(stored)}, eaglet expected {[f.name for f in layout]}")
            count = len(token_ids)
            if target.row + count > target.total:
                raise EagletError(f"rows {target.row}..{target.row + count} overrun the file's {target.total}")
            fd = self._fd(target.path)
            ids_at, finite_at, fields_at = target.offsets(layout)
            os.pwrite(fd, np.ascontiguousarray(token_ids, dtype=TOKEN_ID_DTYPE).tobytes(), ids_at)
            os.pwrite(fd, np.ascontiguousarray(finite, dtype=np.uint8).tobytes(), finite_at)
            for field, at in zip(layout, fields_at):
                data = stored[field.name].reshape(count, -1).view(torch.uint8)
                if data.shape[1] != field.token_bytes:
                    raise EagletError(
                        f"vLLM's worker formed {data.shape[1]} bytes per token of {field.name}, eaglet expected "
                        f"{field.token_bytes} (the layers or the hidden size differ from the request's)"
                    )
                os.pwrite(fd, data.numpy().data, at)
            self._count(target, count)
        except (OSError, EagletError, ValueError, RuntimeError) as exc:
            self.fail(target.path, f"{type(exc).__name__}: {exc}")

    def write_chunk(
        self,
        targets: list[RowsTarget],
        token_ids: list[list[int]],
        finite: np.ndarray,
        stored: dict[str, torch.Tensor],
    ) -> None:
        """A chunk's requests (``targets`` in file and row order, ``row_order``) whose ``finite`` flags [rows] and
        ``stored`` tensors [rows, ...] follow one another: each run of requests whose rows also follow one another in
        one file is written as one request, one ``pwrite`` per tensor.

        Fewer calls matter more than their size: vLLM's engine core loops in Python in the process these writes run
        in, and a thread that gave up the GIL for a system call waits up to the switch interval (5 ms) to have it back
        (a 541 MB shard written request by request took 2.21 s beside a busy thread, by runs 0.19 s;
        benchmarks/bench_rows_writer.py)."""
        counts = [len(ids) for ids in token_ids]
        starts = np.cumsum([0, *counts])
        for first, last in contiguous_runs(targets, counts):
            begin, end = int(starts[first]), int(starts[last])
            self.write(
                targets[first],
                np.concatenate([np.asarray(ids, dtype=TOKEN_ID_DTYPE) for ids in token_ids[first:last]]),
                finite[begin:end],
                {name: tensor[begin:end] for name, tensor in stored.items()},
            )

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
class RowChecks:
    """What vLLM's worker wrote beside a shard's rows: ``token_ids`` [T] it computed and ``finite`` [T] (uint8)."""

    token_ids: torch.Tensor
    finite: torch.Tensor


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


def read_checks(path: Path, file: ShardFile) -> RowChecks:
    """The finished file's check region (copied out: the file is cut and moved next)."""
    size = path.stat().st_size
    if size != file.size:
        raise EagletError(f"{path}: {size} bytes, expected {file.size}; extract again")
    with open(path, "rb") as handle:
        handle.seek(file.ids_at)
        checks = handle.read(file.size - file.ids_at)
    raw = torch.frombuffer(bytearray(checks), dtype=torch.uint8)
    ids_bytes = file.total * TOKEN_ID_BYTES
    return RowChecks(raw[:ids_bytes].view(torch.int32), raw[file.finite_at - file.ids_at :])


def cut_checks(path: Path, file: ShardFile) -> None:
    """Drop the check region: the file is now the shard's safetensors file."""
    os.truncate(path, file.data_end)
