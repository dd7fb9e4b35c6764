"""The user's files a stage of `eaglet run` reads (conversations, prompts, a chat template, a draft vocabulary): their
content is part of the stage's fingerprint, so an edited or grown file re-runs the stage instead of being skipped
as "done". A file is hashed again only when its size or modification time differs from what the stage recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..fsio import sha256_file

# settings that name files whose content decides a stage's output (built-in names like `demo` are not files)
USER_FILE_KEYS = ("inputs", "prompts", "chat_template", "draft_vocab_file")


def named_files(settings: list[dict[str, Any]], run: Path) -> list[str]:
    """The paths, as the settings give them, of existing files outside the run directory ``run``."""
    found = set()
    for section in settings:
        for key in USER_FILE_KEYS:
            value = section.get(key)
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, str) and _is_outside_file(Path(item), run):
                    found.add(item)
    return sorted(found)


def _is_outside_file(path: Path, run: Path) -> bool:
    try:
        return path.is_file() and not path.resolve().is_relative_to(run.resolve())
    except OSError:  # a value that is not a path at all (too long a name)
        return False


def digests(paths: list[str], recorded: dict[str, Any], memo: dict[tuple, str]) -> dict[str, dict[str, Any]]:
    """path -> {sha256, size, mtime_ns}; ``recorded`` (the stage's last record of them) and ``memo`` (this process's)
    spare a file whose size and modification time are unchanged from being read again."""
    out = {}
    for path in paths:
        stat = Path(path).stat()
        key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
        before = recorded.get(path) or {}
        if key not in memo:
            same = before.get("size") == stat.st_size and before.get("mtime_ns") == stat.st_mtime_ns
            memo[key] = before["sha256"] if same and isinstance(before.get("sha256"), str) else sha256_file(path)
        out[path] = {"sha256": memo[key], "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return out


def changed(now: dict[str, dict[str, Any]], recorded: dict[str, Any]) -> str | None:
    """The first file whose content differs from the record's (or that the record lacks), or None."""
    for path, digest in now.items():
        if (recorded.get(path) or {}).get("sha256") != digest["sha256"]:
            return path
    return None
