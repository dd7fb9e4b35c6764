"""What every reliability test asserts of a refused input: one `error:` line naming the file and the fix, exit
code 2, no traceback, and the output left as it was."""

from __future__ import annotations

import hashlib
from pathlib import Path


def tree_digest(path: Path) -> dict[str, str] | None:
    """Every file under ``path`` (relative name -> sha256), None when ``path`` does not exist."""
    if not path.exists():
        return None
    if path.is_file():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def assert_refused(result: tuple[int, str, str], *fragments: str) -> str:
    """``result`` from ``run_cli``: exit 2 and one error line, the last (after any progress bar), holding every
    fragment; no traceback."""
    code, _, err = result
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2, err
    assert "Traceback" not in err and lines and lines[-1].startswith("error:"), err
    assert sum(line.startswith("error:") for line in lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, lines[-1])
    return lines[-1]


def copy_of(source: Path, tmp_path: Path) -> Path:
    """A copy of an artifact directory to damage (the session's fixtures stay intact)."""
    import shutil

    copy = tmp_path / source.name
    shutil.copytree(source, copy)
    return copy


def manifest_of(directory: Path) -> dict:
    import json

    return json.loads((directory / "manifest.json").read_text())


def rewrite_shard(store: Path, index: int, change) -> None:
    """Replace shard ``index``'s tensors with ``change(tensors)`` and record the new file's sha256 and size in its
    record and the manifest, as an attacker (or a buggy tool) who knows the format would: only content checks can
    tell."""
    import json

    from safetensors.torch import load_file

    from eaglet.model.shards import write_safetensors

    name = f"shard-{index:05d}.safetensors"
    tensors = change({k: v.clone() for k, v in load_file(str(store / name)).items()})
    size, digest = write_safetensors(store / name, tensors)
    record_file = store / f"shard-{index:05d}.json"
    record = json.loads(record_file.read_text())
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["totals"]["bytes"] += size - record["bytes"]
    record |= {"bytes": size, "sha256": digest}
    record_file.write_text(json.dumps(record))
    manifest["shards"] = [record if entry["index"] == index else entry for entry in manifest["shards"]]
    (store / "manifest.json").write_text(json.dumps(manifest))
