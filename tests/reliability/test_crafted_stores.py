"""Stores whose shards were rewritten with a valid checksum (a buggy tool, or someone who knows the format): every
content the manifest and the prepared set pin down is checked as the shard is read, by training and by `store
verify` alike; non-finite features stop training at the step they reach, naming the shard and the sample."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from helpers import assert_refused, copy_of, manifest_of, rewrite_shard, tree_digest
from safetensors.torch import load_file

TRAIN = ["--token-budget", "128", "--log-every", "1", "--seed", "1", "--set", "eval_fraction=0"]


@pytest.fixture
def store(tmp_path, tiny_store) -> Path:
    return copy_of(tiny_store, tmp_path)


def a_shard_with(store: Path, samples: int = 2) -> int:
    """The index of the first shard holding at least ``samples`` samples."""
    return next(e["index"] for e in manifest_of(store)["shards"] if e["num_samples"] >= samples)


def refused_everywhere(tmp_path, capsys, store, target, *fragments) -> None:
    """Training refuses the store (nothing trained, nothing written) and `store verify` names the same problem."""
    run = tmp_path / "run"
    before = tree_digest(store)
    assert_refused(
        run_cli(["train", "--store", store, "--out", run, "--target", target, "--epochs", "1", *TRAIN], capsys),
        *fragments,
    )
    assert not run.exists() and tree_digest(store) == before
    code, _, err = run_cli(["store", "verify", store], capsys)
    assert code == 2 and "Traceback" not in err, err
    assert all(fragment in err for fragment in fragments if fragment != "--repair"), err


def _offsets(change):
    def edit(tensors):
        tensors["offsets"] = change(tensors["offsets"])
        return tensors

    return edit


@pytest.mark.parametrize(
    "case,edit,message",
    [
        (
            "non-monotone offsets",
            _offsets(lambda o: torch.cat([o[:1], o[2:3], o[1:2], o[3:]])),
            "offsets are not a valid packing",
        ),
        (
            "shifted offsets",
            _offsets(lambda o: torch.cat([o[:1], o[1:-1] + 1, o[-1:]])),
            "offsets do not give the prepared samples' lengths",
        ),
        ("int32 aux", lambda t: t | {"aux": t["aux"].float().to(torch.int32)}, "tensor 'aux' has dtype torch.int32"),
        ("float32 aux", lambda t: t | {"aux": t["aux"].float()}, "tensor 'aux' has dtype torch.float32"),
        (
            "ids of other tokens",
            lambda t: t | {"input_ids": (t["input_ids"] + 1) % 50},
            "token ids or loss mask differ from the prepared set",
        ),
        (
            "ids beyond the vocabulary",
            lambda t: t | {"input_ids": t["input_ids"] + 100_000},
            "token ids outside the target's vocabulary",
        ),
        (
            "every loss mask zero",
            lambda t: t | {"loss_mask": torch.zeros_like(t["loss_mask"])},
            "token ids or loss mask differ from the prepared set",
        ),
        (
            "a sample index out of range",
            lambda t: t | {"sample_index": t["sample_index"] + 10_000},
            "sample_index names samples outside",
        ),
        (
            "a sample index twice",
            lambda t: t | {"sample_index": t["sample_index"][:1].repeat(len(t["sample_index"]))},
            "sample_index names a sample twice",
        ),
        (
            "another shard's samples",
            lambda t: t | {"sample_index": t["sample_index"].flip(0)},
            "does not match the shard's planned samples",
        ),
        (
            "a tensor no store holds",
            lambda t: t | {"extra": torch.zeros(3)},
            "tensor 'extra' is not part of a bf16 store",
        ),
        (
            "the target's argmax beyond the vocabulary",
            lambda t: t | {"target_top": t["target_top"] + 100_000},
            "target_top names tokens outside the target's vocabulary",
        ),
        (
            "the target's argmax as int64",
            lambda t: t | {"target_top": t["target_top"].long()},
            "tensor 'target_top' has dtype torch.int64",
        ),
        (
            "the target's argmax missing from a store that keeps it",
            lambda t: {k: v for k, v in t.items() if k != "target_top"},
            "tensor 'target_top' missing",
        ),
    ],
)
def test_shard_content_is_checked_beyond_its_checksum(tmp_path, capsys, store, tiny_target, case, edit, message):
    index = a_shard_with(store, 2)
    rewrite_shard(store, index, edit)
    refused_everywhere(tmp_path, capsys, store, tiny_target, f"shard-{index:05d}.safetensors", message)


def test_a_sample_listed_in_two_shards_is_refused_without_its_prepared_set(tmp_path, tiny_store):
    """Without the prepared set (verify --no-prepared, or reading the store alone) the samples must still be unique."""
    from eaglet.errors import EagletError
    from eaglet.train.data import StoreSource

    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    manifest = manifest_of(store)
    first, second = manifest["shards"][0]["index"], manifest["shards"][1]["index"]
    taken = load_file(str(store / f"shard-{first:05d}.safetensors"))["sample_index"][:1]
    rewrite_shard(store, second, lambda t: t | {"sample_index": taken.repeat(len(t["sample_index"]))})
    with pytest.raises(EagletError, match="is also in another shard"):
        StoreSource(store, token_budget=128)


def test_a_directory_where_a_shard_belongs(tmp_path, capsys, store, tiny_target):
    shard = store / "shard-00001.safetensors"
    shard.unlink()
    shard.mkdir()
    run = tmp_path / "run"
    assert_refused(
        run_cli(["train", "--store", store, "--out", run, "--target", tiny_target, "--max-steps", "2", *TRAIN], capsys),
        str(shard),
        "not a file",
    )
    code, _, err = run_cli(["store", "verify", store], capsys)
    assert code == 2 and f"bad shard {shard}: a directory, not a file" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "key", ["target", "hidden_size", "storage_dtype", "aux_layer_ids", "totals", "tokens_per_shard"]
)
def test_manifest_keys_missing(tmp_path, capsys, store, tiny_target, key):
    manifest = manifest_of(store)
    del manifest[key]
    (store / "manifest.json").write_text(json.dumps(manifest))
    refused_everywhere(tmp_path, capsys, store, tiny_target, "manifest.json", f"'{key}' is missing")


@pytest.mark.parametrize(
    "path,value,message",
    [
        (("aux_layer_ids",), [2, 4, 99], "out of range for a target with 8 layers"),
        (("hidden_size",), "abc", "'hidden_size': Input should be a valid integer"),
        (("target", "num_layers"), 8.0, "'target.num_layers': Input should be a valid integer"),
        (("storage_dtype",), "fp4", "storage_dtype 'fp4' is none of bf16, fp8, fp8-aux"),
        (("shards", 0, "sha256"), "not-a-hash", "'shards.0.sha256': String should match pattern"),
        (("tail_pieces",), 0, "'tail_pieces': Input should be greater than or equal to 1"),
        (("tail_pieces",), "8", "'tail_pieces': Input should be a valid integer"),
        (("target_top",), "yes", "'target_top': Input should be a valid boolean"),
    ],
)
def test_manifest_values_out_of_their_range(tmp_path, capsys, store, tiny_target, path, value, message):
    manifest = manifest_of(store)
    node = manifest
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    (store / "manifest.json").write_text(json.dumps(manifest))
    refused_everywhere(tmp_path, capsys, store, tiny_target, "manifest.json", message)


def test_a_plan_other_than_its_shards_is_named_by_verify(capsys, store):
    """A manifest whose plan parameters make other shards than it lists: `store verify` plans the shards again from
    them and the prepared set and says the two disagree (training reads each shard's own samples and checks those)."""
    manifest = manifest_of(store)
    manifest["tail_pieces"] = 1  # the plan before pieces: its last shards whole, where this store's are in pieces
    (store / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_cli(["store", "verify", store], capsys)
    assert code == 2 and "Traceback" not in err and "the store does not match its prepared set" in err, err


def test_a_billion_planned_shards_is_refused_at_once(tmp_path, capsys, store):
    """`store verify` used to walk range(num_shards): a crafted count ran it out of memory."""
    import time

    manifest = manifest_of(store)
    manifest["num_shards"] = 1_000_000_000
    (store / "manifest.json").write_text(json.dumps(manifest))
    started = time.monotonic()
    assert_refused(
        run_cli(["store", "verify", store], capsys), "manifest.json", "num_shards 1,000,000,000 for 60 samples"
    )
    assert time.monotonic() - started < 10


def _poison(sample_row: int):
    """Make one sample's aux features NaN (the checksum recomputed)."""

    def edit(tensors):
        begin, end = tensors["offsets"][sample_row].item(), tensors["offsets"][sample_row + 1].item()
        aux = tensors["aux"].float()
        aux[begin:end] = float("nan")
        return tensors | {"aux": aux.to(torch.bfloat16)}

    return edit


def test_non_finite_features_stop_training_at_their_step_keeping_the_last_good_checkpoint(
    tmp_path, capsys, store, tiny_target
):
    """The NaN features reach training some steps in: training stops at that step naming the shard and the sample,
    the step is not applied, and the run keeps its last checkpoint and a finite draft."""
    manifest = manifest_of(store)
    index = manifest["shards"][-1]["index"]
    rewrite_shard(store, index, _poison(0))
    poisoned = int(load_file(str(store / f"shard-{index:05d}.safetensors"))["sample_index"][0])
    run = tmp_path / "run"
    line = assert_refused(
        run_cli(
            [
                "train",
                "--store",
                store,
                "--out",
                run,
                "--target",
                tiny_target,
                "--epochs",
                "1",
                "--save-every",
                "1",
                *TRAIN,
            ],
            capsys,
        ),
        "non-finite loss from non-finite features",
        f"shard-{index:05d}.safetensors sample {poisoned}",
        "the step was not applied",
        "eaglet store verify",
    )
    step = int(line.split("step ")[1].split(":")[0])
    checkpoints = sorted((run / "checkpoints").glob("step-*"))
    assert step > 1 and checkpoints and checkpoints[-1].name == f"step-{step - 1:06d}", (line, checkpoints)
    assert f"keeps its last good checkpoint {checkpoints[-1]}" in line
    draft = load_file(str(run / "model.safetensors"))
    assert all(torch.isfinite(t.float()).all() for t in draft.values())
    code, _, err = run_cli(["store", "verify", store], capsys)
    assert code == 2 and "non-finite feature values" in err


def test_a_target_computing_non_finite_features_stops_online_training_at_step_one(
    tmp_path, capsys, tiny_prepared, tiny_target
):
    """Online training, the target itself broken: the first step stops, nothing is left behind."""
    from safetensors.torch import save_file

    broken = tmp_path / "target"
    shutil.copytree(tiny_target, broken)
    weights = load_file(str(broken / "model.safetensors"))
    name = next(k for k in weights if k.endswith("layers.1.mlp.down_proj.weight"))
    weights[name] = torch.full_like(weights[name], float("inf"))
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    prepared = tmp_path / "prepared"
    shutil.copytree(tiny_prepared, prepared)
    run = tmp_path / "run"
    assert_refused(
        run_cli(
            [
                "train",
                "--prepared",
                prepared,
                "--out",
                run,
                "--target",
                broken,
                "--max-steps",
                "3",
                "--skip-preflight",
                *TRAIN,
            ],
            capsys,
        ),
        "step 1: non-finite loss from non-finite features",
        f"{prepared} sample",
        "the target computed them",
        "no checkpoint was written",
    )
    assert not run.exists()


@pytest.mark.parametrize("online", [False, True])
def test_a_set_with_no_trainable_token_is_refused(tmp_path, capsys, tiny_prepared, tiny_target, online):
    """Every loss mask zero (the sha256 recomputed): it would train at loss 0 and ship an untrained draft."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    prepared = tmp_path / "prepared"
    shutil.copytree(tiny_prepared, prepared)
    table = pq.read_table(prepared / "samples.parquet")
    masks = table.column("loss_mask").combine_chunks()
    zero = pa.ListArray.from_arrays(masks.offsets, pa.array([0] * len(masks.flatten()), type=pa.uint8()))
    pq.write_table(
        table.set_column(table.column_names.index("loss_mask"), "loss_mask", zero), prepared / "samples.parquet"
    )
    manifest = json.loads((prepared / "manifest.json").read_text())
    manifest["files"]["samples.parquet"] = hashlib.sha256((prepared / "samples.parquet").read_bytes()).hexdigest()
    (prepared / "manifest.json").write_text(json.dumps(manifest))
    run = tmp_path / "run"
    source = ["--prepared", prepared] if online else ["--store", tmp_path / "store"]
    if not online:  # a store of it: extraction refuses the set too
        assert_refused(
            run_cli(
                [
                    "extract",
                    "--prepared",
                    prepared,
                    "--out",
                    tmp_path / "store",
                    "--target",
                    tiny_target,
                    "--reserve-gb",
                    "0",
                ],
                capsys,
            ),
            "samples.parquet",
            "no trainable token",
        )
        assert not (tmp_path / "store").exists()
        return
    assert_refused(
        run_cli(["train", *source, "--out", run, "--target", tiny_target, "--max-steps", "2", *TRAIN], capsys),
        "samples.parquet",
        "no trainable token",
    )
    assert not run.exists()
