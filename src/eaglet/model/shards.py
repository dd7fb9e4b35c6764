"""The hidden-state store's shards on the torch side: features encoded for disk (bf16 or fp8 with per-token
scales), shards written and read as safetensors, each read checked against its manifest entry and checksum.
How shards are planned, named and listed is ``formats.store``."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..errors import EagletError, shown
from ..formats.files import record_name, shard_name
from ..formats.store_manifest import STORAGE_FORMATS, ShardPlan, manifest_keeps_target_top, read_manifest, store_plans
from ..fsio import atomic_file, fsync_dir, sha256_mapped, write_json_atomic

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MIN_SCALE = 1e-12


# ---------------------------------------------------------------------------------------------
# Feature encoding


def _fp8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-vector (last dim) absmax scaling into float8_e4m3fn."""
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(FP8_MIN_SCALE) / FP8_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def encode_features(aux: torch.Tensor, last: torch.Tensor, storage_dtype: str) -> dict[str, torch.Tensor]:
    """aux [T,3,H], last [T,H] -> the tensors stored for them (an fp8 feature adds its ``<name>_scale``)."""
    if storage_dtype not in STORAGE_FORMATS:
        raise EagletError(f"unknown storage dtype {storage_dtype!r} (use one of {', '.join(STORAGE_FORMATS)})")
    stored: dict[str, torch.Tensor] = {}
    for name, feature in (("aux", aux), ("last", last)):
        if STORAGE_FORMATS[storage_dtype][name] == "fp8":
            stored[name], stored[f"{name}_scale"] = _fp8_encode(feature)
        else:
            stored[name] = feature.to(torch.bfloat16)
    return stored


def _decode(tensors: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    scale = tensors.get(f"{name}_scale")
    stored = tensors[name]
    return (stored.float() * scale.unsqueeze(-1) if scale is not None else stored).to(dtype)


def decode_features(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored tensors of a shard -> aux [T,3,H], last [T,H] in ``dtype``."""
    return _decode(tensors, "aux", dtype), _decode(tensors, "last", dtype)


# ---------------------------------------------------------------------------------------------
# Shards


SAFETENSORS_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
SAFETENSORS_HEADER_ALIGN = 8
WRITE_CHUNK_BYTES = 64 << 20


def safetensors_prefix(
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """The start of a safetensors file of tensors ``specs`` (name -> dtype, shape): the header's length and its JSON
    (names sorted, space-padded to 8 bytes), each tensor's [start, end) in the data after it, and the data's length.
    What ``write_safetensors`` writes, and what vLLM's worker fills in place (``model.vllm_rows``)."""
    import json as _json

    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    spans, offset = {}, 0
    for name in sorted(specs):
        dtype, shape = specs[name]
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        spans[name] = (offset, offset + nbytes)
        offset += nbytes
    head = _json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % SAFETENSORS_HEADER_ALIGN)
    return len(head).to_bytes(8, "little") + head, spans, offset


def write_safetensors(
    path: Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
    hashed: bool = True,
) -> tuple[int, str | None]:
    """Write a safetensors file straight from the tensors' memory, hashing as it goes (``hashed``: a checkpoint's
    optimizer state, whose bytes nothing records, skips it): every safetensors file eaglet writes (shards, drafts,
    checkpoints, exports), so a full disk or a file-size limit is the OSError it is.

    ``safetensors.torch.save_file`` first copies every tensor to bytes (0.8 GB/s measured on the
    H200 host, below the disk's 1.4 GB/s); this writes the same format (header: JSON, space-padded
    to 8 bytes; then the raw little-endian data) from zero-copy views with the GIL released, so
    several writer threads run in parallel. Files are read back with the safetensors library.
    Returns (bytes written, sha256 of the file or None).
    """
    contiguous = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
    specs = {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in contiguous.items()}
    prefix, _, data_bytes = safetensors_prefix(specs, metadata)
    digest = hashlib.sha256(prefix) if hashed else None
    with open(path, "wb") as handle:
        handle.write(prefix)
        for name in sorted(contiguous):
            tensor = contiguous[name]
            if not tensor.numel():
                continue
            memory = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # flat first: 0-dim tensors too
            for begin in range(0, len(memory), WRITE_CHUNK_BYTES):
                chunk = memory[begin : begin + WRITE_CHUNK_BYTES]
                if digest is not None:
                    digest.update(chunk)  # hashlib and file writes release the GIL on large buffers
                handle.write(chunk)
    return len(prefix) + data_bytes, None if digest is None else digest.hexdigest()


def write_shard(store: Path, plan: ShardPlan, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Atomically write a shard, then its record. Returns the record."""
    final = store / shard_name(plan.index)
    with atomic_file(final) as tmp:
        size, digest = write_safetensors(tmp, tensors)
    return _record(store, plan, size, digest)


def adopt_shard(store: Path, plan: ShardPlan, path: Path) -> dict[str, Any]:
    """A complete shard file written elsewhere (vLLM's worker filled it in place) moved into the store, hashed as it
    is read once; then its record. On another filesystem it is copied (atomically) instead. Returns the record."""
    final = store / shard_name(plan.index)
    digest = sha256_mapped(path)  # the spool file is eaglet's alone: nothing shrinks it while it is mapped
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
    size = path.stat().st_size
    try:
        os.replace(path, final)
        fsync_dir(store)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        with atomic_file(final) as tmp:
            shutil.copyfile(path, tmp)
        path.unlink()
    return _record(store, plan, size, digest)


def _record(store: Path, plan: ShardPlan, size: int, digest: str) -> dict[str, Any]:
    record = {
        "file": shard_name(plan.index),
        "index": plan.index,
        "num_samples": plan.num_samples,  # which ones: the shard's sample_index, or plan_shards() again
        "tokens": plan.tokens,
        "bytes": size,
        "sha256": digest,
    }
    write_json_atomic(store / record_name(plan.index), record)
    return record


class ShardError(Exception):
    """What is wrong with one shard (the caller names the store and the fix)."""


SAFETENSORS_TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit


def _parse_header(head: bytes, size: int) -> tuple[dict[str, Any], int]:
    """(the header's tensor entries, where the data starts) of a safetensors file of ``size`` bytes."""
    import json as _json

    if size < HEADER_LENGTH_BYTES:
        raise ShardError(f"{size} bytes: too short for a safetensors file")
    length = int.from_bytes(head[:HEADER_LENGTH_BYTES], "little")
    if length > MAX_HEADER_BYTES or HEADER_LENGTH_BYTES + length > size:
        raise ShardError(f"corrupt safetensors header (length {length} of a {size}-byte file)")
    try:
        header = _json.loads(bytes(head[HEADER_LENGTH_BYTES : HEADER_LENGTH_BYTES + length]))
    except (ValueError, UnicodeDecodeError):
        raise ShardError("corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise ShardError("corrupt safetensors header (not a mapping)")
    header.pop("__metadata__", None)
    data_start = HEADER_LENGTH_BYTES + length
    for name, info in header.items():
        try:
            begin, end = info["data_offsets"]
            shape = info["shape"]
            if not all(type(v) is int and v >= 0 for v in (begin, end, *shape)):
                raise ValueError(name)
            count = int(np.prod(shape, dtype=np.int64))
            width = torch.empty((), dtype=SAFETENSORS_TORCH_DTYPES[info["dtype"]]).element_size()
        except (KeyError, TypeError, ValueError):
            raise ShardError(f"corrupt safetensors header (tensor {shown(name)})") from None
        if not 0 <= begin <= end <= size - data_start or end - begin != count * width:
            raise ShardError(f"corrupt safetensors header (tensor {name!r} lies outside the file)")
    return header, data_start


def _read_header(handle: Any, size: int) -> tuple[dict[str, Any], int]:
    head = handle.read(HEADER_LENGTH_BYTES)
    if len(head) == HEADER_LENGTH_BYTES:
        head += handle.read(min(int.from_bytes(head, "little"), MAX_HEADER_BYTES))
    return _parse_header(head, size)


def read_header(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """A shard's tensor names, dtypes and shapes, from its header alone (no tensor data read)."""
    if path.is_dir():
        raise ShardError("a directory, not a file")
    try:
        with open(path, "rb") as handle:
            header, _ = _read_header(handle, path.stat().st_size)
    except FileNotFoundError:
        raise ShardError("file missing") from None
    return {name: (SAFETENSORS_TORCH_DTYPES[info["dtype"]], tuple(info["shape"])) for name, info in header.items()}


def read_tensor(path: Path, name: str) -> torch.Tensor:
    """One tensor of a shard, read by its header's offsets (not checksummed: the whole file is, when trained on)."""
    with open(path, "rb") as handle:
        header, data_start = _read_header(handle, path.stat().st_size)
        if name not in header:
            raise ShardError(f"tensor '{name}' missing")
        begin, end = header[name]["data_offsets"]
        handle.seek(data_start + begin)
        data = bytearray(handle.read(end - begin))
    dtype = SAFETENSORS_TORCH_DTYPES[header[name]["dtype"]]
    return (
        torch.frombuffer(data, dtype=dtype).view(tuple(header[name]["shape"])) if data else torch.empty(0, dtype=dtype)
    )


# A 512 MB shard in 9 reads: each read and hash gives the GIL up and waits up to 5 ms to have it back beside a busy
# thread (the training loop's); in 4 MiB chunks such a shard read 3.3x slower there (benchmarks/bench_store_read.py).
READ_CHUNK_BYTES = 64 << 20


def store_samples(store: Path) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Every sample of a store in shard order, each read shard checked: (sample index, {input_ids [T], loss_mask
    [T], aux [T, 3, H], last [T, H]} in float32), for tools that look at a store whole (parity checks, converters)."""
    for entry in read_manifest(store)["shards"]:
        tensors = read_shard(store, entry)
        aux, last = decode_features(tensors)
        offsets = tensors["offsets"].tolist()
        for row, sample in enumerate(tensors["sample_index"].tolist()):
            span = slice(offsets[row], offsets[row + 1])
            yield (
                sample,
                {
                    "input_ids": tensors["input_ids"][span],
                    "loss_mask": tensors["loss_mask"][span],
                    "aux": aux[span],
                    "last": last[span],
                },
            )


def read_shard(store: Path, entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A shard's tensors, its sha256 computed over the bytes as they are read (one pass, no second read) and
    checked against the manifest before any tensor is returned. Tensors are views of the one read buffer."""
    path = store / entry["file"]
    if path.is_dir():
        raise ShardError("a directory, not a file")
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ShardError("file missing") from None
    if size != entry["bytes"]:
        raise ShardError(f"size {size} bytes, the manifest says {entry['bytes']}")
    buffer = torch.empty(size, dtype=torch.uint8)  # not zero-filled: every byte is read into it
    view = memoryview(buffer.numpy())
    digest = hashlib.sha256()
    # chunk i is hashed on a second thread while chunk i+1 is read (both release the GIL): the check costs
    # max(read, hash) instead of their sum
    with open(path, "rb", buffering=0) as handle, ThreadPoolExecutor(max_workers=1) as hasher:
        position, hashing = 0, None
        while position < size:
            read = handle.readinto(view[position : position + READ_CHUNK_BYTES])
            if not read:
                raise ShardError(f"file ends at byte {position} of {size}")
            if hashing is not None:
                hashing.result()
            hashing = hasher.submit(digest.update, view[position : position + read])
            position += read
        if hashing is not None:
            hashing.result()
    if digest.hexdigest() != entry["sha256"]:
        raise ShardError("sha256 mismatch (the file changed after it was written)")
    header, data_start = _parse_header(view, size)
    tensors = {}
    for name, info in header.items():
        dtype, shape = SAFETENSORS_TORCH_DTYPES[info["dtype"]], tuple(info["shape"])
        begin, end = info["data_offsets"]
        raw = buffer[data_start + begin : data_start + end]
        if (data_start + begin) % torch.empty((), dtype=dtype).element_size():
            raw = raw.clone()  # a view must start at a multiple of its element size
        tensors[name] = raw.view(dtype).view(shape) if end > begin else torch.empty(shape, dtype=dtype)
    return tensors


def expected_tensors(
    entry: dict[str, Any], hidden_size: int, storage_dtype: str, target_top: bool
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What a shard holding ``entry``'s tokens and samples in ``storage_dtype`` contains: every tensor's shape
    and dtype (an fp8 feature adds its float32 ``<name>_scale``, one per vector; ``target_top``, the target's
    argmax per token, where the store keeps it)."""
    tokens, samples = entry["tokens"], entry["num_samples"]
    expected = {
        "input_ids": ((tokens,), torch.int32),
        "loss_mask": ((tokens,), torch.uint8),
        "offsets": ((samples + 1,), torch.int64),
        "sample_index": ((samples,), torch.int64),
    }
    for name, shape in (("aux", (tokens, 3, hidden_size)), ("last", (tokens, hidden_size))):
        if STORAGE_FORMATS[storage_dtype][name] == "fp8":
            expected[name] = (shape, torch.float8_e4m3fn)
            expected[f"{name}_scale"] = (shape[:-1], torch.float32)
        else:
            expected[name] = (shape, torch.bfloat16)
    if target_top:
        expected["target_top"] = ((tokens,), torch.int32)
    return expected


def check_layout(
    found: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    entry: dict[str, Any],
    hidden_size: int,
    storage_dtype: str,
    target_top: bool,
) -> None:
    """The shard holds exactly the tensors its manifest entry and storage format say, in their shapes and dtypes."""
    expected = expected_tensors(entry, hidden_size, storage_dtype, target_top)
    for key, (shape, dtype) in expected.items():
        if key not in found:
            raise ShardError(f"tensor '{key}' missing")
        if tuple(found[key][1]) != shape:
            raise ShardError(f"tensor '{key}' has shape {tuple(found[key][1])}, the manifest's counts need {shape}")
        if found[key][0] != dtype:
            raise ShardError(f"tensor '{key}' has dtype {found[key][0]}, a {storage_dtype} store holds {dtype}")
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        raise ShardError(f"tensor '{unexpected[0]}' is not part of a {storage_dtype} store")


class StoreReader:
    """Every read of a store's shards goes through here, for training and `store verify` alike: a shard is
    returned only once its bytes match the manifest's sha256 and its content what the manifest and the prepared
    set say it holds — tensors and dtypes of the storage format, offsets that pack its tokens, its planned samples
    (each once, inside the prepared set), token ids inside the vocabulary, 0/1 loss masks and, where the prepared
    set is at hand, ids and masks equal to its rows. All but the checksum cost a few passes over the small
    tensors; finite feature values are checked by `verify` (training checks its loss and gradients instead)."""

    def __init__(self, store: Path, manifest: dict[str, Any], prepared: Any | None = None):
        self.store = Path(store)
        self.manifest = manifest
        self.prepared = prepared  # a PreparedSet, or None (verify --no-prepared)
        self.hidden_size = manifest["hidden_size"]
        self.storage_dtype = manifest["storage_dtype"]
        self.target_top = manifest_keeps_target_top(manifest)
        self.vocab_size = manifest["target"]["vocab_size"]
        self.num_samples = manifest["prepared"]["samples"]
        self.plans: dict[int, ShardPlan] | None = None
        if prepared is not None:  # the samples each shard must hold, planned again from the lengths
            lengths = prepared.lengths[: self.num_samples]
            self.plans = {plan.index: plan for plan in store_plans(lengths, manifest)}
            if len(self.plans) != manifest["num_shards"]:
                raise EagletError(
                    f"{self.store}: plans {manifest['num_shards']} shards, its prepared set "
                    f"{prepared.path} makes {len(self.plans)}; the store does not match its prepared "
                    "set: extract it again"
                )

    def open(self, entry: dict[str, Any]) -> tuple[list[int], list[int]]:
        """A shard's (samples, offsets) from its header and two small tensors, checked (size, layout, samples):
        what planning an epoch needs, in seconds for a whole store."""
        path = self.store / entry["file"]
        if not path.is_file():
            raise ShardError("not a file" if path.exists() else "file missing")
        if path.stat().st_size != entry["bytes"]:
            raise ShardError(f"size {path.stat().st_size} bytes, the manifest says {entry['bytes']}")
        check_layout(read_header(path), entry, self.hidden_size, self.storage_dtype, self.target_top)
        offsets, samples = read_tensor(path, "offsets"), read_tensor(path, "sample_index")
        self._check_packing(entry, offsets, samples)
        return samples.tolist(), offsets.tolist()

    def read(self, entry: dict[str, Any]) -> dict[str, torch.Tensor]:
        """A shard's tensors, checksummed as they are read and their content checked."""
        tensors = read_shard(self.store, entry)
        found = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
        check_layout(found, entry, self.hidden_size, self.storage_dtype, self.target_top)
        self._check_packing(entry, tensors["offsets"], tensors["sample_index"])
        self._check_tokens(tensors)
        return tensors

    def verify(self, entry: dict[str, Any]) -> str | None:
        """None if the shard is sound, else what is wrong with it (its features are decoded and must be finite)."""
        try:
            tensors = self.read(entry)
        except ShardError as exc:
            return str(exc)
        aux, last = decode_features(tensors)
        if not (torch.isfinite(aux).all() and torch.isfinite(last).all()):
            return "non-finite feature values"
        return None

    def _check_packing(self, entry: dict[str, Any], offsets: torch.Tensor, samples: torch.Tensor) -> None:
        if int(offsets[0]) != 0 or int(offsets[-1]) != entry["tokens"] or bool((offsets[1:] <= offsets[:-1]).any()):
            raise ShardError("offsets are not a valid packing of the tokens (from 0, increasing, to the token count)")
        if len(samples) and (int(samples.min()) < 0 or int(samples.max()) >= self.num_samples):
            raise ShardError(f"sample_index names samples outside the prepared set's 0..{self.num_samples - 1}")
        if len(torch.unique(samples)) != len(samples):
            raise ShardError("sample_index names a sample twice")
        if self.plans is not None:
            plan = self.plans.get(entry["index"])
            if plan is None or samples.tolist() != list(plan.samples):
                raise ShardError("sample_index does not match the shard's planned samples")
            lengths = self.prepared.lengths[list(plan.samples)]
            if not np.array_equal(np.diff(offsets.numpy()), lengths):
                raise ShardError("offsets do not give the prepared samples' lengths")

    def _check_tokens(self, tensors: dict[str, torch.Tensor]) -> None:
        ids, mask = tensors["input_ids"], tensors["loss_mask"]
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ShardError(f"token ids outside the target's vocabulary (0..{self.vocab_size - 1})")
        top = tensors.get("target_top")
        if top is not None and len(top) and (int(top.min()) < 0 or int(top.max()) >= self.vocab_size):
            raise ShardError(f"target_top names tokens outside the target's vocabulary (0..{self.vocab_size - 1})")
        if len(mask) and int(mask.max()) > 1:
            raise ShardError("loss mask values other than 0 and 1")
        if self.prepared is not None:
            order = tensors["sample_index"].tolist()
            expected_ids = np.concatenate([self.prepared.sample(i)[0] for i in order])
            expected_mask = np.concatenate([self.prepared.sample(i)[1] for i in order])
            if not np.array_equal(expected_ids, ids.numpy()) or not np.array_equal(expected_mask, mask.numpy()):
                raise ShardError("token ids or loss mask differ from the prepared set")
