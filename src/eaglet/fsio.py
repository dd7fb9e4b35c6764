"""Atomic file and directory writes, hashing and JSON helpers.

Every artifact eaglet writes goes through here: a temporary file next to the destination,
fsync, then rename. A killed process leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import secrets
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from .errors import EagletError

HASH_CHUNK_BYTES = 4 << 20
GIB = 1 << 30  # bytes in the GiB every size message is given in


def sha256_file(path: str | Path) -> str:
    """The file's sha256, read into one reused buffer: a new buffer per chunk costs its page faults each time (a
    shard hashed at 0.9 GB/s that way, 1.5 GB/s this way; benchmarks/bench_adopt.py)."""
    digest = hashlib.sha256()
    buffer = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while read := handle.readinto(buffer):
            digest.update(view[:read])
    return digest.hexdigest()


def sha256_mapped(path: str | Path) -> str:
    """The sha256 of a file only eaglet writes, hashed from its mapping in one call: no copy, and the GIL given up
    once (a thread that gives it up per chunk waits up to 5 ms each time to have it back beside a busy thread: a
    541 MB shard hashed at 0.32 GB/s that way, 1.48 GB/s this way; benchmarks/bench_adopt.py). Not for files others
    may shrink meanwhile: reading a mapped page past a new end kills the process (SIGBUS)."""
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return hashlib.sha256().hexdigest()  # an empty file cannot be mapped
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return hashlib.sha256(mapped).hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: stable input for hashes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def sha256_json(obj: Any) -> str:
    return sha256_bytes(canonical_json(obj).encode("utf-8"))


def nearest_existing(path: str | Path) -> Path:
    """``path`` or its nearest existing ancestor: where a path not yet made will live."""
    probe = Path(path).resolve()
    while not probe.exists():
        probe = probe.parent
    return probe


def free_disk_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem that holds ``path`` (or would, once created)."""
    return shutil.disk_usage(nearest_existing(path)).free


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


SIBLING_NAME_TRIES = 100  # random names tried before a temporary sibling is given up on


TEMPORARY_SUFFIXES = (".tmp", ".partial")  # new_sibling's: a file's, a directory's


def _host() -> str:
    return socket.gethostname().replace(".", "_")  # a temporary's name splits at dots


def _owner_tag() -> str:
    """``HOST-PID`` of this process, in every temporary's name: a later run on this host can tell one a killed
    process left (SIGKILL, a lost node) from one a live process is still writing."""
    return f"{_host()}-{os.getpid()}"


def new_sibling(final: Path, suffix: str, directory: bool = False) -> Path:
    """A new, empty file or directory beside ``final`` under a hidden name carrying this process's ``HOST-PID``,
    made with the permissions the umask gives everything else (tempfile's are owner-only: a draft exported through
    one could not be read by a server running as another user, nor a shared store by a teammate)."""
    for _ in range(SIBLING_NAME_TRIES):
        candidate = final.parent / f".{final.name}.{_owner_tag()}-{secrets.token_hex(4)}{suffix}"
        try:
            if directory:
                os.mkdir(candidate, 0o777)
            else:
                os.close(os.open(candidate, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(final))


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def sweep_dead_temporaries(directory: Path) -> list[Path]:
    """Remove the temporaries (``new_sibling``'s) that processes of this host left in ``directory`` when they were
    killed beyond cleaning up (SIGKILL, the OOM killer): a live process's, another host's and names of any other
    form are kept. Returns what was removed."""
    host, removed = _host(), []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(directory):
            if not entry.name.startswith(".") or not entry.name.endswith(TEMPORARY_SUFFIXES):
                continue
            owner = entry.name.rsplit(".", 1)[0].rsplit(".", 1)[-1]  # .NAME.HOST-PID-HEX.SUFFIX -> HOST-PID-HEX
            parts = owner.rsplit("-", 2)
            if len(parts) != 3 or parts[0] != host or not parts[1].isdigit() or _process_alive(int(parts[1])):
                continue
            path = Path(entry.path)
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            removed.append(path)
    return removed


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; after the block writes it, fsync and rename into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_sibling(path, ".tmp")
    try:
        yield tmp
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


MAX_JSON_BYTES = 256 << 20  # a store manifest of ~1M shard entries; anything larger is not eaglet's


def load_json_file(path: str | Path, fix: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """A JSON file eaglet wrote (a manifest, a record, a config), refused in one line naming the file and ``fix``
    when it is missing, not a file, too large, not UTF-8, not JSON or nested past Python's recursion limit."""
    path = Path(path)
    if not path.is_file():
        raise EagletError(f"{path}: {'not a file' if path.exists() else 'missing'}; {fix}")
    size = path.stat().st_size
    if size > max_bytes:
        raise EagletError(f"{path}: {size:,} bytes, more than any eaglet metadata file ({max_bytes:,}); {fix}")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise EagletError(f"{path}: not UTF-8 text (byte {exc.start}); {fix}") from None
    except json.JSONDecodeError as exc:
        raise EagletError(f"{path}:{exc.lineno}: not valid JSON ({json_error_text(exc)}); {fix}") from None
    except RecursionError:
        raise EagletError(f"{path}: JSON nested too deeply to be eaglet's; {fix}") from None


# ---------------------------------------------------------------------------------------------
# Outputs: never over an input, never a file where a directory goes, one writer at a time


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def check_output_apart(out: str | Path, inputs: Sequence[str | Path | None], flag: str = "--out") -> None:
    """Refuse an output that is, contains or lies inside one of the stage's inputs, whatever --overwrite says:
    writing it would replace (or delete, on overwrite) what the stage reads."""
    target = Path(out).expanduser().resolve()
    for raw in inputs:
        if raw is None or str(raw) in ("", "embedded", "demo"):
            continue
        source = Path(raw).expanduser()
        if not source.exists():
            continue
        source = source.resolve()
        if _inside(source, target) or (source.is_dir() and _inside(target, source)):
            relation = "is" if source == target else "contains" if _inside(source, target) else "lies inside"
            raise EagletError(
                f"{flag} {out}: {relation} the input {raw}; writing it would destroy what this stage "
                f"reads: choose an {flag} outside the inputs"
            )


def check_output_dir(out: str | Path, flag: str = "--out") -> Path:
    """An output directory's path, refused when something other than a directory is already there."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise EagletError(f"{flag} {out}: a file, not a directory; give {flag} a directory path (new or existing)")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise EagletError(f"{flag} {out}: {parent} is a file, not a directory; choose another {flag}")
            break
    return path


def lock_path(output: str | Path, tag: str = "") -> Path:
    """Where the lock of an output (a directory or a file) lives: beside it, so taking it creates nothing inside."""
    output = Path(output)
    return output.parent / f".{output.name}{tag}.lock"


@contextlib.contextmanager
def output_lock(output: str | Path, tag: str = "") -> Iterator[Path]:
    """Hold an exclusive lock on an output (fcntl on ``lock_path(output, tag)``) for the block. A second writer is
    refused at once with who holds it (host, pid, command, since when) instead of computing everything twice. The
    kernel drops the lock when its holder dies, so a killed run never leaves a stale one; ``tag`` tells apart
    writers meant to share the output (the replicas of an extraction)."""
    import fcntl

    path = lock_path(output, tag)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+", encoding="utf-8")
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise EagletError(
                f"{output}: in use by {holder}; wait for it to finish, or choose another output (lock: {path})"
            ) from None
        handle.seek(0)
        handle.truncate()
        command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:MAX_COMMAND_SHOWN] if sys.argv else ""
        handle.write(
            f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')} ({command})\n"
        )
        handle.flush()
        yield path
    finally:
        handle.close()


MAX_COMMAND_SHOWN = 300  # characters of the lock holder's command line


# ---------------------------------------------------------------------------------------------
# The operating system's refusals, as one line


OS_ERROR_FIXES = {
    errno.ENOSPC: "the disk is full: free space or choose another output; the same command resumes",
    errno.EDQUOT: "the disk quota is used up: free space or choose another output; the same command resumes",
    errno.EFBIG: "a file passed the file-size limit (`ulimit -f`): raise it, or write smaller files "
    "(extract --shard-mb)",
    errno.EROFS: "the filesystem is read-only: choose a writable output",
    errno.EACCES: "permission denied: fix the permissions or choose another path",
    errno.EPERM: "operation not permitted: fix the permissions or choose another path",
    errno.EIO: "the device reported an I/O error: check the disk",
    errno.EISDIR: "a directory where a file was expected: move it away or choose another path",
    errno.ENOTDIR: "a file where a directory was expected: move it away or choose another path",
    errno.ENOENT: "no such file or directory: check the path",
}


def os_error_line(error: OSError) -> str:
    """``PATH: what the system said; the fix`` for an OSError that reached the top of a command."""
    where = error.filename or "eaglet"
    said = error.strerror or str(error)
    fix = OS_ERROR_FIXES.get(error.errno or -1, "check the path and the disk")
    return f"{where}: {said} ({errno.errorcode.get(error.errno or -1, 'OSError')}); {fix}"


@contextlib.contextmanager
def atomic_directory(final: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; rename it to ``final`` only if the block succeeds.

    An interrupted or failed stage therefore leaves no ``final`` (and no half-written one).
    With ``overwrite`` an existing ``final`` is replaced after the new one is complete.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    sweep_dead_temporaries(final.parent)  # a directory's writes are few (exports, checkpoints): one listing each
    tmp = new_sibling(final, ".partial", directory=True)
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
