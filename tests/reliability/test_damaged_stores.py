"""A store damaged after extraction is never trained on: each case built here, refused in one line that names the
file and the fix, with the training output untouched; the same damage is named by `store verify` and refused by a
resumed `extract`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import extract_args, run_cli
from helpers import assert_refused, copy_of, manifest_of, tree_digest

TRAIN = ["--token-budget", "128", "--max-steps", "3", "--log-every", "1", "--save-every", "1000", "--seed", "1"]
REPAIR = "eaglet store verify"


@pytest.fixture
def store(tmp_path, tiny_store) -> Path:
    return copy_of(tiny_store, tmp_path)


def write_manifest(store: Path, manifest: dict) -> None:
    (store / "manifest.json").write_text(json.dumps(manifest))


def train(store: Path, out: Path, target: Path, capsys, *extra: str):
    return run_cli(["train", "--store", store, "--out", out, "--target", target, *TRAIN, *extra], capsys)


def refused_by_training(tmp_path, store, tiny_target, capsys, *fragments, epochs: bool = False) -> str:
    out = tmp_path / "run"
    before = tree_digest(store)
    extra = ("--epochs", "1", "--set", "max_steps=null") if epochs else ()
    line = assert_refused(train(store, out, tiny_target, capsys, *extra), *fragments)
    assert tree_digest(store) == before
    assert not (out / "model.safetensors").exists() and not (out / "checkpoints").exists()
    return line


def test_a_shard_cut_in_half(tmp_path, capsys, store, tiny_target):
    shard = store / "shard-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    refused_by_training(tmp_path, store, tiny_target, capsys, str(shard), "size", REPAIR)
    assert not (tmp_path / "run").exists()  # found when the store opens, before anything is written


def test_a_deleted_shard(tmp_path, capsys, store, tiny_target):
    (store / "shard-00001.safetensors").unlink()
    refused_by_training(tmp_path, store, tiny_target, capsys, "shard-00001.safetensors: file missing", REPAIR)


def test_a_flipped_byte_is_caught_by_the_checksum_as_the_shard_is_read(tmp_path, capsys, store, tiny_target):
    shard = store / "shard-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x40  # inside the features: the header and the size are intact
    shard.write_bytes(bytes(data))
    refused_by_training(tmp_path, store, tiny_target, capsys, str(shard), "sha256 mismatch", REPAIR, epochs=True)


def test_an_entry_pointing_at_another_shard(tmp_path, capsys, store, tiny_target):
    manifest = manifest_of(store)
    manifest["shards"][1]["file"] = manifest["shards"][0]["file"]
    write_manifest(store, manifest)
    refused_by_training(
        tmp_path, store, tiny_target, capsys, "manifest.json", "shard 1 is listed as 'shard-00000.safetensors'"
    )


@pytest.mark.parametrize(
    "name", ["../../outside/x.safetensors", "/etc/passwd", "../../../etc/passwd", "sub/shard-00000.safetensors"]
)
def test_names_outside_the_store_are_refused_everywhere(tmp_path, capsys, store, tiny_target, tiny_prepared, name):
    """Path traversal: training, `store verify` and a resumed extract all refuse before opening the file."""
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(store / "shard-00000.safetensors", outside / "x.safetensors")
    manifest = manifest_of(store)
    manifest["shards"][0]["file"] = name
    write_manifest(store, manifest)
    refused_by_training(tmp_path, store, tiny_target, capsys, "manifest.json", repr(name), "plain file names")
    assert_refused(run_cli(["store", "verify", store], capsys), "manifest.json", repr(name))
    record = json.loads((store / "shard-00000.json").read_text())
    (store / "shard-00000.json").write_text(json.dumps(record | {"file": name}))
    before = tree_digest(store)
    assert_refused(run_cli(extract_args(tiny_prepared, store, tiny_target), capsys), "shard-00000.json", repr(name))
    assert tree_digest(store) == before


def test_a_manifest_listing_fewer_shards_than_planned(tmp_path, capsys, store, tiny_target):
    manifest = manifest_of(store)
    dropped = manifest["shards"].pop()
    for key, field in (("samples", "num_samples"), ("tokens", "tokens"), ("bytes", "bytes")):
        manifest["totals"][key] -= dropped[field]  # consistent totals: only the count of shards gives it away
    write_manifest(store, manifest)
    count = manifest["num_shards"]
    refused_by_training(tmp_path, store, tiny_target, capsys, "manifest.json", f"lists {count - 1} of {count} shards")


def test_wrong_token_counts(tmp_path, capsys, store, tiny_target):
    manifest = manifest_of(store)
    manifest["totals"]["tokens"] += 7
    write_manifest(store, manifest)
    refused_by_training(tmp_path, store, tiny_target, capsys, "manifest.json", "its shard list holds")
    manifest["totals"]["tokens"] -= 7
    manifest["shards"][2]["tokens"] += 7  # tokens moved between entries: totals agree, the shards' tensors do not
    manifest["shards"][3]["tokens"] -= 7
    write_manifest(store, manifest)
    refused_by_training(tmp_path, store, tiny_target, capsys, "shard-00002.safetensors", "the manifest's counts need")


def test_a_store_that_does_not_hold_its_prepared_set(tmp_path, capsys, store, tiny_target):
    manifest = manifest_of(store)
    manifest["prepared"]["samples"] -= 1  # the identity recorded at extraction no longer matches the shards
    write_manifest(store, manifest)
    refused_by_training(tmp_path, store, tiny_target, capsys, "manifest.json", "does not match its prepared set")


def test_an_unreadable_manifest(tmp_path, capsys, store, tiny_target):
    (store / "manifest.json").write_text('{"schema": "eaglet.model.shards/2", "shards": [')
    line = refused_by_training(
        tmp_path, store, tiny_target, capsys, "manifest.json", "not valid JSON", "re-run the same `eaglet extract`"
    )
    assert "at at" not in line
