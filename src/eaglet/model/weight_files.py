"""Which files hold a target's weights, and a fingerprint of what is in them read from a sample of each tensor.

The fingerprint tells a target rewritten in place (a new fine-tune saved over the old directory: the same config and
tokenizer) from the one a store's features were extracted from, reading the safetensors headers and a few hundred
small pieces whatever the target's size: ``SAMPLED_ELEMENTS`` elements at the start and the middle of up to
``TENSORS_PER_KIND`` tensors of each kind (a kind: the name with its numbers taken out, as every layer's q_proj, or
every expert's down_proj), so a fine-tune of any one kind of tensor (LoRA merged into the attention, say) is seen in
a 1T MoE's ~70,000 tensors as in an 8B's 291. It is keyed by tensor name, so how the weights are split over files or
ordered in them does not count; their dtype does (a bfloat16 copy of a float32 checkpoint computes other features).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Iterable, NamedTuple

from ..errors import EagletError
from ..fsio import load_json_file

WEIGHT_INDEX_FILE = "model.safetensors.index.json"
HEADER_LENGTH_BYTES = 8  # a safetensors file starts with its header's length, a little-endian u64
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
TENSORS_PER_KIND = 16  # evenly spaced over the kind's sorted names
SAMPLED_ELEMENTS = 32  # read at the start and at the middle of each sampled tensor
NUMBER = re.compile(r"\d+")
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip


def weight_index(path: Path) -> dict[str, Path] | None:
    """The index's map of tensor name -> file, None for a target without one; refused when it names a file that is
    not there (a download cut short: transformers would fail at that shard, after loading the ones before it)."""
    index_file = path / WEIGHT_INDEX_FILE
    if not index_file.is_file():
        return None
    weight_map = load_json_file(index_file, "download or convert the target again")
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) and "/" not in f for f in weight_map.values()):
        raise EagletError(
            f"{index_file}: no 'weight_map' of tensor names to file names; download or convert the target again"
        )
    files = {name: path / name for name in set(weight_map.values())}  # a 1T MoE: ~200k tensors in 64 files
    missing = sorted(name for name, file in files.items() if not file.is_file())
    if missing:
        raise EagletError(
            f"target {path}: {len(missing)} of the {len(files)} weight files its {WEIGHT_INDEX_FILE} names are "
            f"missing (first: {missing[0]}); the download is incomplete: download the target again"
        )
    return {key: files[name] for key, name in weight_map.items()}


def weight_files(path: Path) -> list[Path]:
    """The safetensors files transformers loads: those the index names when there is one (a repository may also
    carry the same weights consolidated into one more file), else every one in the directory."""
    index = weight_index(path)
    return sorted(set(index.values())) if index is not None else sorted(path.glob("*.safetensors"))


class WeightFileHeader(NamedTuple):
    """One safetensors file's header: its tensors' entries (name -> dtype, shape, data_offsets), the byte their
    data starts at and the elements they hold (a packed INT4 tensor counts its int32 words)."""

    file: Path
    data_start: int
    tensors: dict[str, dict]
    parameters: int


def read_header(file: Path, target: Path) -> WeightFileHeader:
    """A safetensors file's header, refused in one line where safetensors' loader would refuse it: no JSON object
    of tensor entries, or tensors past the file's end (a file cut in its data: known here, in preflight, not when
    the load reaches it). Entries are checked in one pass over all of them: a 1T MoE has ~200k."""

    def damaged(why: str) -> EagletError:
        return EagletError(
            f"target {target}: {file.name} is unreadable ({why}); its weights are damaged or incomplete: download or "
            "convert the target again"
        )

    try:
        with open(file, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            length_bytes = handle.read(HEADER_LENGTH_BYTES)
            if len(length_bytes) < HEADER_LENGTH_BYTES:
                raise damaged("shorter than a safetensors header")
            (length,) = struct.unpack("<Q", length_bytes)
            if length > min(MAX_HEADER_BYTES, size - HEADER_LENGTH_BYTES):
                raise damaged(f"a header of {length:,} bytes in a file of {size:,}")
            raw = handle.read(length)
    except OSError as exc:  # a directory in its place, no permission, an I/O error
        raise damaged(exc.strerror or type(exc).__name__) from None
    try:
        tensors = json.loads(raw)
    except (ValueError, RecursionError):
        raise damaged("its header is not JSON") from None
    if not isinstance(tensors, dict):
        raise damaged("its header is not a JSON object")
    tensors.pop("__metadata__", None)
    try:
        data_end = max((entry["data_offsets"][1] for entry in tensors.values()), default=0)
        parameters = sum(math.prod(entry["shape"]) for entry in tensors.values())
        valid = type(data_end) is int and type(parameters) is int
    except (KeyError, TypeError, IndexError):
        valid = False
    if not valid:
        raise damaged("a tensor entry without integer data_offsets and shape")
    data_start = HEADER_LENGTH_BYTES + length
    if data_start + data_end > size:
        raise damaged(f"its tensors end at byte {data_start + data_end:,}, the file at {size:,}: it was cut short")
    return WeightFileHeader(file, data_start, tensors, parameters)


def read_headers(path: Path) -> list[WeightFileHeader]:
    """The headers of the target's weight files (``weight_files``): one read of each serves the parameter count and
    the fingerprint."""
    return [read_header(file, path) for file in weight_files(path)]


def parameter_count(headers: list[WeightFileHeader]) -> int:
    return sum(header.parameters for header in headers)


def weights_fingerprint(path: Path, headers: list[WeightFileHeader] | None = None) -> str | None:
    """A sha256 over the sampled tensors' names, dtypes, shapes and sampled bytes; None for a target without
    safetensors weights (a config-only directory planned with --plan). ``headers``: ``read_headers(path)``, when
    the caller has read them already."""
    headers = read_headers(path) if headers is None else headers
    where = {name: header for header in headers for name in header.tensors}  # the index's map, from the headers
    if not where:
        return None
    digest = hashlib.sha256()
    handles: dict[Path, int] = {}
    try:
        for name in sampled_names(where):
            header = where[name]
            entry = header.tensors[name]
            if header.file not in handles:
                handles[header.file] = os.open(header.file, os.O_RDONLY)
            digest.update(json.dumps([name, entry.get("dtype"), entry.get("shape")]).encode())
            digest.update(_sampled_bytes(handles[header.file], header.data_start, entry))
    except (OSError, TypeError, ValueError, AttributeError) as exc:  # an entry's fields not safetensors'
        raise EagletError(
            f"target {path}: its weights could not be read ({exc}); download or convert the target again"
        ) from None
    finally:
        for handle in handles.values():
            os.close(handle)
    return digest.hexdigest()


def sampled_names(names: Iterable[str]) -> list[str]:
    """Up to ``TENSORS_PER_KIND`` names of each kind, evenly spaced over its sorted names."""
    kinds: dict[str, list[str]] = {}
    for name in sorted(names):
        kinds.setdefault(NUMBER.sub("#", name), []).append(name)
    sampled = []
    for members in kinds.values():
        step = -(-len(members) // TENSORS_PER_KIND)  # ceil: at most TENSORS_PER_KIND of them
        sampled += members[::step]
    return sorted(sampled)


def _sampled_bytes(handle: int, data_start: int, entry: dict) -> bytes:
    """``SAMPLED_ELEMENTS`` elements from the start of a tensor's data and as many from its middle."""
    begin, end = (int(offset) for offset in entry["data_offsets"])
    element = DTYPE_BYTES.get(str(entry.get("dtype")), 1)
    middle = begin + (end - begin) // 2 // element * element
    chunk = SAMPLED_ELEMENTS * element
    return b"".join(
        os.pread(handle, min(chunk, end - offset), data_start + offset) for offset in (begin, middle) if offset < end
    )
