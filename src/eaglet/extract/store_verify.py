"""`eaglet store verify` and `eaglet store info`: check every shard, name the bad ones, repair them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console

from ..config import ExtractConfig, describe_validation_error
from ..errors import EagletError
from ..formats.files import MANIFEST_FILE, record_name, shard_name
from ..formats.prepared import load_prepared
from ..formats.store_manifest import manifest_keeps_target_top, prepared_path, read_manifest
from ..model.shards import StoreReader
from ..progress import progress_bar


@dataclass
class ShardProblem:
    file: str
    index: int
    reason: str


def verify_store(store: Path, check_prepared: bool = True, console: Console | None = None) -> list[ShardProblem]:
    """Every listed shard read as training reads it (``StoreReader``: size, sha256, tensors of the storage format,
    offsets, planned samples, token ids — against the prepared set when it is still where the manifest says), and
    its features decoded and checked to be finite."""
    console = console or Console(stderr=True)
    manifest = read_manifest(store)
    prepared = None
    if check_prepared:
        prepared_dir = prepared_path(store, manifest)
        if (prepared_dir / MANIFEST_FILE).is_file():
            prepared = load_prepared(prepared_dir)
            if prepared.manifest_sha256 != manifest["prepared"]["manifest_sha256"]:
                raise EagletError(
                    f"{store}: the prepared set at {prepared_dir} changed since extraction (manifest sha256 differs); "
                    "re-extract, or pass --no-prepared to skip the token check"
                )
        else:
            console.print(f"[yellow]prepared set {prepared_dir} not found: token ids are not checked[/]")
    reader = StoreReader(store, manifest, prepared)
    problems = []
    listed = {entry["index"] for entry in manifest["shards"]}
    for index in range(manifest["num_shards"]):
        if index not in listed:
            problems.append(ShardProblem(shard_name(index), index, "missing (extraction incomplete)"))
    with progress_bar("shards", console) as progress:
        task = progress.add_task("verify", total=len(manifest["shards"]))
        for entry in manifest["shards"]:
            reason = reader.verify(entry)
            if reason:
                problems.append(ShardProblem(entry["file"], entry["index"], reason))
            progress.advance(task)
    return sorted(problems, key=lambda p: p.index)


# What a repair never takes from the store's manifest: whether remote code runs, and where weights are placed or
# offloaded to. Those come from the user's flags (a store is data; data never turns on remote code).
REPAIR_SETTINGS_FROM_FLAGS = ("trust_remote_code", "placement", "max_memory", "offload_dir", "replica")


def repair_store(
    store: Path,
    problems: list[ShardProblem],
    console: Console | None = None,
    target: str | None = None,
    trust_remote_code: bool = False,
) -> Any:
    """Re-extract only the bad shards with the settings the manifest records, the target given here (default: the
    one recorded), loaded without remote code unless ``trust_remote_code``; the loaded target must be the one the
    store was extracted from (extraction's own resume check)."""
    from .extractor import run_extract

    manifest = read_manifest(store)
    settings = {key: value for key, value in manifest["config"].items() if key not in REPAIR_SETTINGS_FROM_FLAGS}
    settings |= {
        "out": str(store),
        "prepared": str(prepared_path(store, manifest)),
        "trust_remote_code": trust_remote_code,
    }
    if target is not None:
        settings["target"] = target
    try:
        config = ExtractConfig.model_validate(settings)
    except ValidationError as exc:
        raise EagletError(describe_validation_error(exc, f"{store / MANIFEST_FILE} 'config'")) from None
    for problem in problems:
        (store / record_name(problem.index)).unlink(missing_ok=True)
    return run_extract(config, console, only_shards={p.index for p in problems})


def store_summary(store: Path) -> dict[str, Any]:
    manifest = read_manifest(store)
    return {
        "store": str(store),
        "complete": manifest["complete"],
        "target": manifest["target"]["name"],
        "aux_layer_ids": manifest["aux_layer_ids"],
        "convention": manifest["aux_convention"],
        "storage_dtype": manifest["storage_dtype"],
        "hidden_size": manifest["hidden_size"],
        # the target's argmax per token: training's mask read, not computed from the whole LM head each step
        "target_top": manifest_keeps_target_top(manifest),
        "shards": f"{len(manifest['shards'])} of {manifest['num_shards']}",
        "samples": manifest["totals"]["samples"],
        "tokens": manifest["totals"]["tokens"],
        "bytes": manifest["totals"]["bytes"],
        "prepared": str(prepared_path(store, manifest)),
    }
