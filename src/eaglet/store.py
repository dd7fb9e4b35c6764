"""The hidden-state store's shards on the torch side: features encoded for disk (bf16 or fp8 with per-token
scales), shards written and read as safetensors, each read checked against its manifest entry and checksum.
How shards are planned, named and listed is ``formats.store``."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import EagletError
from .fsio import atomic_file, write_json_atomic
from .formats.files import record_name, shard_name
from .formats.store import STORAGE_FORMATS, ShardPlan

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


def decode_features(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored tensors of a shard -> aux [T,3,H], last [T,H] in ``dtype``."""
    return _decode(tensors, "aux", dtype), _decode(tensors, "last", dtype)


# ---------------------------------------------------------------------------------------------
# Shards


SAFETENSORS_DTYPES = {
    torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.int64: "I64", torch.int32: "I32",
    torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3",
}
SAFETENSORS_HEADER_ALIGN = 8
WRITE_CHUNK_BYTES = 64 << 20


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[int, str]:
    """Write a safetensors file straight from the tensors' memory, hashing as it goes.

    ``safetensors.torch.save_file`` first copies every tensor to bytes (0.8 GB/s measured on the
    H200 host, below the disk's 1.4 GB/s); this writes the same format (header: JSON, space-padded
    to 8 bytes; then the raw little-endian data) from zero-copy views with the GIL released, so
    several writer threads run in parallel. Files are read back with the safetensors library.
    Returns (bytes written, sha256 of the file).
    """
    import json as _json

    names = sorted(tensors)
    views, header, offset = [], {}, 0
    for name in names:
        tensor = tensors[name].contiguous()
        data = tensor.view(torch.uint8).reshape(-1).numpy() if tensor.numel() else np.empty(0, np.uint8)
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
        views.append(data)
    head = _json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % SAFETENSORS_HEADER_ALIGN)
    prefix = len(head).to_bytes(8, "little") + head
    digest = hashlib.sha256(prefix)
    with open(path, "wb") as handle:
        handle.write(prefix)
        for data in views:
            memory = memoryview(data)
            for begin in range(0, len(memory), WRITE_CHUNK_BYTES):
                chunk = memory[begin : begin + WRITE_CHUNK_BYTES]
                digest.update(chunk)  # hashlib and file writes release the GIL on large buffers
                handle.write(chunk)
    return len(prefix) + offset, digest.hexdigest()


def write_shard(store: Path, plan: ShardPlan, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Atomically write a shard, then its record. Returns the record."""
    final = store / shard_name(plan.index)
    with atomic_file(final) as tmp:
        size, digest = write_safetensors(tmp, tensors)
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


SAFETENSORS_TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()} | {"BOOL": torch.bool}
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
            count = int(np.prod(info["shape"], dtype=np.int64))
            width = torch.empty((), dtype=SAFETENSORS_TORCH_DTYPES[info["dtype"]]).element_size()
        except (KeyError, TypeError, ValueError):
            raise ShardError(f"corrupt safetensors header (tensor {name!r})") from None
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
    return torch.frombuffer(data, dtype=dtype).view(tuple(header[name]["shape"])) if data else torch.empty(0, dtype=dtype)


READ_CHUNK_BYTES = 4 << 20


def read_shard(store: Path, entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A shard's tensors, its sha256 computed over the bytes as they are read (one pass, no second read) and
    checked against the manifest before any tensor is returned. Tensors are views of the one read buffer."""
    path = store / entry["file"]
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


def expected_tensors(entry: dict[str, Any], hidden_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """What a shard holding ``entry``'s tokens and samples must contain (None: either storage dtype)."""
    tokens, samples = entry["tokens"], entry["num_samples"]
    return {
        "input_ids": ((tokens,), torch.int32),
        "loss_mask": ((tokens,), torch.uint8),
        "offsets": ((samples + 1,), torch.int64),
        "sample_index": ((samples,), torch.int64),
        "aux": ((tokens, 3, hidden_size), None),
        "last": ((tokens, hidden_size), None),
    }


def check_layout(found: dict[str, tuple[torch.dtype, tuple[int, ...]]], entry: dict[str, Any], hidden_size: int) -> None:
    """The shard holds the tensors its manifest entry says, in the right shapes and dtypes."""
    for key, (shape, dtype) in expected_tensors(entry, hidden_size).items():
        if key not in found:
            raise ShardError(f"tensor '{key}' missing")
        if tuple(found[key][1]) != shape:
            raise ShardError(f"tensor '{key}' has shape {tuple(found[key][1])}, the manifest's counts need {shape}")
        if dtype is not None and found[key][0] != dtype:
            raise ShardError(f"tensor '{key}' has dtype {found[key][0]}, expected {dtype}")


def verify_shard(store: Path, entry: dict[str, Any], hidden_size: int, prepared: Any | None,
                 plan: ShardPlan | None = None) -> str | None:
    """None if the shard is sound, else what is wrong with it (``plan``: the samples it must hold)."""
    try:
        tensors = read_shard(store, entry)
        check_layout({k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, entry, hidden_size)
    except ShardError as exc:
        return str(exc)
    offsets = tensors["offsets"]
    if offsets[0] != 0 or offsets[-1] != entry["tokens"] or bool((offsets[1:] < offsets[:-1]).any()):
        return "offsets are not a valid packing of the tokens"
    if plan is not None and tensors["sample_index"].tolist() != list(plan.samples):
        return "sample_index does not match the shard's planned samples"
    aux, last = decode_features(tensors)
    if not (torch.isfinite(aux).all() and torch.isfinite(last).all()):
        return "non-finite feature values"
    if prepared is not None:
        order = tensors["sample_index"].tolist()
        ids = np.concatenate([prepared.sample(i)[0] for i in order])
        mask = np.concatenate([prepared.sample(i)[1] for i in order])
        if not np.array_equal(ids, tensors["input_ids"].numpy()) or not np.array_equal(mask, tensors["loss_mask"].numpy()):
            return "token ids or loss mask differ from the prepared set"
    return None
