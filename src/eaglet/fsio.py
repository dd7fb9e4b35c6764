"""Atomic file and directory writes, hashing and JSON helpers.

Every artifact eaglet writes goes through here: a temporary file next to the destination,
fsync, then rename. A killed process leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

HASH_CHUNK_BYTES = 1 << 20


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: stable input for hashes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def sha256_json(obj: Any) -> str:
    return sha256_bytes(canonical_json(obj).encode("utf-8"))


def free_disk_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem that holds ``path`` (or would, once created)."""
    probe = Path(path).resolve()
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; after the block writes it, fsync and rename into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    text = json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False, default=str) + "\n"
    write_bytes_atomic(path, text.encode("utf-8"))


def json_error_text(error: json.JSONDecodeError) -> str:
    """``Expecting value at column 3``: json's message with its column, read as one phrase."""
    return f"{error.msg.removesuffix(' at')} at column {error.colno}"


def read_json(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


@contextlib.contextmanager
def atomic_directory(final: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; rename it to ``final`` only if the block succeeds.

    An interrupted or failed stage therefore leaves no ``final`` (and no half-written one).
    With ``overwrite`` an existing ``final`` is replaced after the new one is complete.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".partial"))
    try:
        yield tmp
        for child in tmp.rglob("*"):
            if child.is_file():
                with open(child, "rb") as handle:
                    os.fsync(handle.fileno())
        if final.exists():
            if not overwrite:
                raise FileExistsError(final)
            trash = final.with_name(f".{final.name}.old")
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def append_lines_durable(path: str | Path, lines: list[str]) -> None:
    """Append complete lines and fsync, so a kill loses at most the batch being written."""
    if not lines:
        return
    payload = "".join(line if line.endswith("\n") else line + "\n" for line in lines)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
