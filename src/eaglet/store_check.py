"""`eaglet store verify` and `eaglet store info`: check every shard, name the bad ones, repair them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from .config import ExtractConfig
from .errors import EagletError
from .formats.files import MANIFEST_FILE, record_name
from .formats.prepared import load_prepared
from .formats.store import plan_shards, prepared_path, read_manifest
from .progress import progress_bar
from .store import verify_shard


@dataclass
class ShardProblem:
    file: str
    index: int
    reason: str


def verify_store(store: Path, check_prepared: bool = True, console: Console | None = None) -> list[ShardProblem]:
    """Every listed shard: size, sha256, tensor names/shapes/dtypes, offsets, finite values, and the
    token ids against the prepared set (when it is still where the manifest says)."""
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
    plans = None
    if prepared is not None:  # the samples each shard must hold, planned again from the lengths
        plans = {p.index: p for p in plan_shards(prepared.lengths, manifest["tokens_per_shard"],
                                                  manifest["sort_window_shards"])}
    problems = []
    listed = {entry["index"] for entry in manifest["shards"]}
    for index in range(manifest["num_shards"]):
        if index not in listed:
            problems.append(ShardProblem(f"shard-{index:05d}.safetensors", index, "missing (extraction incomplete)"))
    with progress_bar("shards", console) as progress:
        task = progress.add_task("verify", total=len(manifest["shards"]))
        for entry in manifest["shards"]:
            reason = verify_shard(store, entry, manifest["hidden_size"], prepared,
                                  None if plans is None else plans.get(entry["index"]))
            if reason:
                problems.append(ShardProblem(entry["file"], entry["index"], reason))
            progress.advance(task)
    return sorted(problems, key=lambda p: p.index)


def repair_store(store: Path, problems: list[ShardProblem], console: Console | None = None) -> Any:
    """Re-extract only the bad shards, with the settings recorded in the manifest."""
    from .extract import run_extract

    manifest = read_manifest(store)
    for problem in problems:
        (store / record_name(problem.index)).unlink(missing_ok=True)
    config = ExtractConfig.model_validate(manifest["config"] | {"out": str(store), "prepared": str(prepared_path(store, manifest))})
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
        "shards": f"{len(manifest['shards'])} of {manifest['num_shards']}",
        "samples": manifest["totals"]["samples"],
        "tokens": manifest["totals"]["tokens"],
        "bytes": manifest["totals"]["bytes"],
        "prepared": str(prepared_path(store, manifest)),
    }
