"""Where stages write: never over their own inputs, never into a file, one writer at a time; a full disk, a
file-size limit, a read-only filesystem, a damaged checkpoint or unreadable target weights are one line each,
leaving nothing half-written."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import extract_args, run_cli, small_conversations, write_jsonl
from helpers import assert_refused, tree_digest

TRAIN = ["--token-budget", "128", "--log-every", "1", "--seed", "1"]


# ---------------------------------------------------------------------------------------------
# Outputs over inputs: refused whatever --overwrite says


def test_export_over_its_own_run_is_refused(tmp_path, capsys, tiny_draft):
    run = tmp_path / "run"
    shutil.copytree(tiny_draft, run)
    before = tree_digest(run)
    for out in (run, run / "vllm"):
        assert_refused(
            run_cli(["export", "--draft", run, "--format", "vllm", "--out", out, "--overwrite"], capsys),
            f"--out {out}",
            "the input",
            "choose an --out outside the inputs",
        )
    assert tree_digest(run) == before


def test_prepare_over_its_own_input_is_refused(tmp_path, capsys, tiny_target):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    data = write_jsonl(data_dir / "convs.jsonl", small_conversations(5))
    before = tree_digest(data_dir)
    assert_refused(
        run_cli(["prepare", data, "--out", data_dir, "--target", tiny_target, "--overwrite"], capsys),
        f"--out {data_dir}",
        "contains the input",
        str(data),
    )
    assert tree_digest(data_dir) == before


@pytest.mark.parametrize("stage", ["train-into-store", "extract-into-prepared", "eval-into-draft"])
def test_stage_outputs_inside_their_inputs_are_refused(
    tmp_path, capsys, tiny_store, tiny_prepared, tiny_draft, tiny_target, stage
):
    args = {
        "train-into-store": ["train", "--store", tiny_store, "--out", tiny_store],
        "extract-into-prepared": extract_args(tiny_prepared, tiny_prepared / "store", tiny_target),
        "eval-into-draft": ["eval", "--draft", tiny_draft, "--out", tiny_draft / "eval"],
    }[stage]
    watched = {"train-into-store": tiny_store, "extract-into-prepared": tiny_prepared, "eval-into-draft": tiny_draft}[
        stage
    ]
    before = tree_digest(watched)
    assert_refused(run_cli(args, capsys), "the input", "outside the inputs")
    assert tree_digest(watched) == before


# ---------------------------------------------------------------------------------------------
# An --out that is a file


@pytest.mark.parametrize("stage", ["train", "eval", "export", "prepare"])
def test_an_out_that_is_a_file(tmp_path, capsys, tiny_store, tiny_draft, tiny_target, stage):
    out = tmp_path / "out"
    out.write_text("keep me")
    data = write_jsonl(tmp_path / "d.jsonl", small_conversations(3))
    args = {
        "train": ["train", "--store", tiny_store, "--out", out, "--max-steps", "1", "--skip-preflight"],
        "eval": ["eval", "--draft", tiny_draft, "--out", out, "--max-prompts", "1", "--skip-preflight"],
        "export": ["export", "--draft", tiny_draft, "--format", "vllm", "--out", out, "--overwrite"],
        "prepare": ["prepare", data, "--out", out, "--target", tiny_target, "--overwrite"],
    }[stage]
    code, _, err = run_cli(args, capsys)
    assert_refused((code, "", err), f"--out {out}", "a file, not a directory")
    assert "eval ━" not in err  # refused before any decoding
    assert out.read_text() == "keep me"


# ---------------------------------------------------------------------------------------------
# One writer at a time


@pytest.mark.parametrize("stage", ["extract", "train", "regenerate"])
def test_a_second_writer_is_told_who_holds_the_output(tmp_path, capsys, tiny_prepared, tiny_store, tiny_target, stage):
    from eaglet.fsio import output_lock

    out = {"extract": tmp_path / "store", "train": tmp_path / "run", "regenerate": tmp_path / "a.jsonl"}[stage]
    args = {
        "extract": extract_args(tiny_prepared, out, tiny_target),
        "train": ["train", "--store", tiny_store, "--out", out, "--max-steps", "1", *TRAIN],
        "regenerate": [
            "regenerate",
            "demo",
            "--out",
            out,
            "--target",
            tiny_target,
            "--max-prompts",
            "1",
            "--max-new-tokens",
            "2",
        ],
    }[stage]
    with output_lock(out):
        assert_refused(run_cli(args, capsys), f"{out}: in use by pid {os.getpid()}", "wait for it to finish")
    assert not out.exists()


def test_two_extractions_into_one_store_at_once(tmp_path, tiny_prepared, tiny_target):
    """Two real processes: the first, paused while it holds the store, keeps it; the second is refused at once
    instead of computing every shard again. Resumed, the first finishes the store."""
    import signal

    store = tmp_path / "store"
    command = [sys.executable, "-m", "eaglet.cli", *map(str, extract_args(tiny_prepared, store, tiny_target))]
    first = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    lock = tmp_path / ".store.lock"
    try:
        for _ in range(1200):
            if lock.is_file() and lock.read_text().startswith(f"pid {first.pid}"):
                break
            subprocess.run(["sleep", "0.05"])
        first.send_signal(signal.SIGSTOP)
        second = subprocess.run(command, capture_output=True, text=True)
    finally:
        first.send_signal(signal.SIGCONT)
    _, first_err = first.communicate(timeout=300)
    assert first.returncode == 0, first_err
    assert second.returncode == 2 and f"in use by pid {first.pid}" in second.stderr, second.stderr
    assert "Traceback" not in second.stderr and "computed" not in second.stderr


# ---------------------------------------------------------------------------------------------
# The operating system says no


def run_limited(args: list, file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    """The real CLI in a child process, with a file-size limit (RLIMIT_FSIZE, as `ulimit -f` sets) when given."""
    import resource

    def limit() -> None:
        if file_size_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.run(
        [sys.executable, "-m", "eaglet.cli", *map(str, args)], capture_output=True, text=True, preexec_fn=limit
    )


def assert_one_line(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert_refused((proc.returncode, proc.stdout, proc.stderr), *fragments)


def no_temporary_files(root: Path) -> bool:
    return not [p for p in root.rglob("*") if p.name.endswith((".tmp", ".partial"))]


def test_the_file_size_limit_during_extract(tmp_path, tiny_prepared, tiny_target):
    store = tmp_path / "store"
    proc = run_limited(extract_args(tiny_prepared, store, tiny_target), file_size_limit=20_000)
    assert_one_line(proc, "File too large (EFBIG)", "--shard-mb")
    assert no_temporary_files(tmp_path)
    again = run_limited(extract_args(tiny_prepared, store, tiny_target))  # the same command resumes, the limit gone
    assert again.returncode == 0, again.stderr


def test_the_file_size_limit_during_checkpointing(tmp_path, tiny_store, tiny_target):
    run = tmp_path / "run"
    proc = run_limited(
        ["train", "--store", tiny_store, "--out", run, "--target", tiny_target, "--max-steps", "2", *TRAIN],
        file_size_limit=100_000,
    )
    assert_one_line(proc, "File too large (EFBIG)")
    assert not run.exists()  # nothing to resume from: no directory holding only train_config.json


def test_a_full_disk_during_extract_and_checkpointing(tmp_path, tiny_prepared, tiny_store, tiny_target, mounts):
    full = mounts("full")
    proc = run_limited(extract_args(tiny_prepared, full / "store", tiny_target))
    assert_one_line(proc, "No space left on device (ENOSPC)", "free space", "the same command resumes")
    assert no_temporary_files(full)
    for child in full.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()
    proc = run_limited(
        [
            "train",
            "--store",
            tiny_store,
            "--out",
            full / "run",
            "--target",
            tiny_target,
            "--max-steps",
            "40",
            "--save-every",
            "1",
            "--set",
            "keep_last=30",
            *TRAIN,
        ]
    )
    assert_one_line(proc, "No space left on device (ENOSPC)")
    assert no_temporary_files(full)


def test_a_read_only_filesystem_with_preflight_skipped(tmp_path, tiny_prepared, tiny_store, tiny_target, mounts):
    read_only = mounts("ro")
    for args in (
        extract_args(tiny_prepared, read_only / "store", tiny_target, "--skip-preflight"),
        [
            "train",
            "--store",
            tiny_store,
            "--out",
            read_only / "run",
            "--target",
            tiny_target,
            "--max-steps",
            "1",
            "--skip-preflight",
            *TRAIN,
        ],
    ):
        assert_one_line(run_limited(args), "Read-only file system (EROFS)", "choose a writable output")


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints and target weights


@pytest.fixture
def trained(tmp_path, tiny_store, tiny_target):
    run = tmp_path / "run"
    code = run_limited(
        [
            "train",
            "--store",
            tiny_store,
            "--out",
            run,
            "--target",
            tiny_target,
            "--max-steps",
            "2",
            "--save-every",
            "1",
            *TRAIN,
        ]
    )
    assert code.returncode == 0, code.stderr
    return run


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda c: (c / "trainer.json").write_text('{"state": {"step": 2'), "trainer.json:1: not valid JSON"),
        (lambda c: (c / "trainer.json").write_text("[1, 2]"), "trainer.json: '(top level)'"),
        (
            lambda c: (c / "trainer.json").write_text('{"state": {"step": -1}, "scheduler": {}, "identity": {}}'),
            "'state.step': Input should be greater than or equal to 0",
        ),
        (
            lambda c: (c / "draft.safetensors").write_bytes((c / "draft.safetensors").read_bytes()[:100]),
            "damaged checkpoint",
        ),
        (
            lambda c: (c / "optimizer.safetensors").write_bytes((c / "optimizer.safetensors").read_bytes()[:200]),
            "optimizer.safetensors",
        ),
        (
            lambda c: (c / "optimizer.json").write_text('{"state": {"__tensor__": "/state/nope"}}'),
            "optimizer.json: /state: refers to tensor '/state/nope', which is not stored",
        ),
        (lambda c: (c / "optimizer.json").write_text('{"param_groups": []}'), "no 'state' mapping"),
        (  # a checkpoint of an earlier eaglet: its optimizer state pickled, which is never loaded
            lambda c: [(c / "optimizer.json").unlink(), (c / "optimizer.safetensors").rename(c / "optimizer.pt")],
            "optimizer state pickled in optimizer.pt",
        ),
    ],
)
def test_a_damaged_checkpoint_at_resume(tmp_path, capsys, trained, tiny_store, tiny_target, damage, message):
    latest = sorted((trained / "checkpoints").glob("step-*"))[-1]
    damage(latest)
    before = tree_digest(trained)
    assert_refused(
        run_cli(
            [
                "train",
                "--store",
                tiny_store,
                "--out",
                trained,
                "--target",
                tiny_target,
                "--max-steps",
                "4",
                "--save-every",
                "1",
                *TRAIN,
            ],
            capsys,
        ),
        str(latest),
        message,
    )
    assert tree_digest(trained) == before


def _rewrite_optimizer(checkpoint: Path, edit) -> None:
    """The optimizer's tensors edited by ``edit(tensors)`` and the file's checksum recorded anew: state as a faulty
    eaglet (or a careful hand) would have written it, so that only the state's own checks can refuse it."""
    from safetensors.torch import load_file, save_file

    from eaglet.fsio import sha256_file

    path = checkpoint / "optimizer.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))
    trainer = json.loads((checkpoint / "trainer.json").read_text())
    trainer["files"]["optimizer.safetensors"] = sha256_file(path)
    (checkpoint / "trainer.json").write_text(json.dumps(trainer))


def _first_moment(tensors):
    return next(name for name in sorted(tensors) if name.endswith("/exp_avg"))


def _nan_moment(tensors):
    tensors[_first_moment(tensors)][0] = float("nan")


def _reshaped_moment(tensors):
    name = _first_moment(tensors)
    tensors[name] = tensors[name].reshape(-1)[:-1].clone()


def _stranger_state(checkpoint: Path) -> None:
    document = json.loads((checkpoint / "optimizer.json").read_text())
    document["state"]["draft.extra.weight"] = next(iter(document["state"].values()))
    (checkpoint / "optimizer.json").write_text(json.dumps(document))


def _emptied_state(checkpoint: Path) -> None:
    document = json.loads((checkpoint / "optimizer.json").read_text())
    document["state"] = {}
    (checkpoint / "optimizer.json").write_text(json.dumps(document))


def _flipped_byte(checkpoint: Path) -> None:
    path = checkpoint / "optimizer.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's data: still a readable file
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage,message",
    [
        (_flipped_byte, "optimizer.safetensors changed since it was written"),
        (lambda c: _rewrite_optimizer(c, _nan_moment), "holds NaN or infinite values"),
        (lambda c: _rewrite_optimizer(c, _reshaped_moment), "optimizer state exp_avg of draft."),
        (_stranger_state, "state for draft.extra.weight, a parameter none of its groups has"),
        (_emptied_state, "no optimizer state for draft."),
    ],
    ids=["a flipped byte", "a NaN moment", "a moment of another shape", "state for no parameter", "emptied state"],
)
def test_resume_state_is_checked_like_any_artifact(tmp_path, capsys, trained, tiny_store, tiny_target, damage, message):
    """The optimizer state a resume reads: checksummed, finite, one entry per parameter of the draft and shaped
    like it — refused in one line with nothing changed, where before each resumed silently (Adam from zero, a NaN
    draft) or failed with a traceback at the first step."""
    test_a_damaged_checkpoint_at_resume(tmp_path, capsys, trained, tiny_store, tiny_target, damage, message)


@pytest.mark.parametrize("damage", ["cut", "cut in its data", "directory"])
def test_unreadable_target_weights(tmp_path, capsys, tiny_prepared, tiny_target, damage):
    """Known from the headers before the load: the load would fail at this file, after the files before it."""
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    weights = target / "model.safetensors"
    (header_length,) = struct.unpack("<Q", weights.read_bytes()[:8])
    if damage == "cut":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "cut in its data":  # the header whole, the last tensor's bytes missing
        weights.write_bytes(weights.read_bytes()[: 8 + header_length + 64])
    else:
        weights.unlink()
        weights.mkdir()
    for skip in ((), ("--skip-preflight",)):
        assert_refused(
            run_cli(extract_args(tiny_prepared, tmp_path / "store", target, *skip), capsys),
            f"{target}: model.safetensors is unreadable",
            "download or convert the target again",
        )
    assert not (tmp_path / "store").exists()


def sharded_copy(target: Path, copy: Path) -> Path:
    """``target`` with its weights split over two files and an index, as large checkpoints are published."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(target, copy)
    tensors = load_file(copy / "model.safetensors")
    (copy / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, copy / file, metadata={"format": "pt"})
    weight_map = {key: file for file, keys in halves.items() for key in keys}
    (copy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return copy


def test_a_shard_missing_from_the_targets_download(tmp_path, capsys, tiny_prepared, tiny_target):
    """A download cut short: the index names a shard that is not there. Known from the index in milliseconds; the
    load would fail only at that shard, after loading the ones before it."""
    target = sharded_copy(tiny_target, tmp_path / "target")
    (target / "model-00002-of-00002.safetensors").unlink()
    for skip in ((), ("--skip-preflight",)):
        assert_refused(
            run_cli(extract_args(tiny_prepared, tmp_path / "store", target, *skip), capsys),
            f"{target}: 1 of the 2 weight files its model.safetensors.index.json names are missing",
            "first: model-00002-of-00002.safetensors",
            "download the target again",
        )
    assert not (tmp_path / "store").exists()


def test_weights_published_twice_are_counted_once(tmp_path, tiny_target):
    """Some repositories carry the weights both sharded (named by the index) and consolidated in one more file;
    the memory plan counts what transformers loads, once."""
    from eaglet.model.target import count_parameters

    target = sharded_copy(tiny_target, tmp_path / "target")
    shutil.copy(tiny_target / "model.safetensors", target / "consolidated.safetensors")
    assert count_parameters(target) == count_parameters(tiny_target) > 0


# ---------------------------------------------------------------------------------------------
# Exports an engine cannot load


def _edit_config(directory: Path, change) -> None:
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))


def _wrong_fc(directory: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    tensors["fc.weight"] = torch.zeros(tensors["fc.weight"].shape[0], 7, dtype=tensors["fc.weight"].dtype)
    save_file(tensors, str(directory / "model.safetensors"))


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda d: _edit_config(d, lambda c: c.pop("hidden_size")), "config.json: no 'hidden_size'"),
        (
            lambda d: _edit_config(d, lambda c: c.update(hidden_size="abc")),
            "'hidden_size': Input should be a valid integer",
        ),
        (_wrong_fc, "fc.weight: shape"),
        (
            lambda d: _edit_config(d, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 99])),
            "out of range for a target with 8 layers",
        ),
    ],
)
def test_export_check_fails_what_an_engine_cannot_load(tmp_path, capsys, tiny_draft, damage, message):
    out = tmp_path / "vllm"
    assert run_cli(["export", "--draft", tiny_draft, "--format", "vllm", "--out", out], capsys)[0] == 0
    damage(out)
    code, stdout, err = run_cli(["export", "--check", out, "--json"], capsys)
    assert code == 2 and "Traceback" not in err, err
    layout = next(r for r in json.loads(stdout)["results"] if r["consumer"] == "layout")
    assert layout["status"] == "fail" and any(message in f for f in layout["findings"]), layout


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("hidden_size", "abc", "'hidden_size': Input should be a valid integer"),
        ("eagle_aux_hidden_state_layer_ids", [2, 4, 99], "out of range"),
    ],
)
def test_a_crafted_draft_config_is_not_exported(tmp_path, capsys, tiny_draft, field, value, message):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_draft, draft)
    _edit_config(draft, lambda c: c.update({field: value}))
    assert_refused(
        run_cli(["export", "--draft", draft, "--format", "vllm", "--out", tmp_path / "out"], capsys),
        "config.json",
        message,
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stage", ["export", "eval"])
def test_a_trained_drafts_layer_ids_edited_by_hand(tmp_path, capsys, tiny_draft, tiny_target, stage):
    """config.json's layer ids moved by one (an engine's convention "fixed" by hand): valid ids, but not the ones the
    weights learned from; eval and export would capture the wrong layers and lose acceptance silently."""
    draft = tmp_path / "draft"
    shutil.copytree(tiny_draft, draft)
    trained = json.loads((draft / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    _edit_config(draft, lambda c: c.update({"eagle_aux_hidden_state_layer_ids": [i - 1 for i in trained]}))
    out = tmp_path / "out"
    args = {
        "export": ["export", "--draft", draft, "--format", "vllm", "--out", out],
        "eval": ["eval", "--draft", draft, "--out", out, "--target", tiny_target, "--max-prompts", "1"],
    }[stage]
    assert_refused(run_cli(args, capsys), "config.json", f"trained on {trained}", f"put {trained} back")
    assert not out.exists()


def _duplicate_target_id(tensors: dict) -> None:
    tensors["d2t"][1] = tensors["d2t"][0] - 1  # draft ids 0 and 1 both become target id d2t[0]


def _t2d_off_by_one(tensors: dict) -> None:
    marked, unmarked = tensors["t2d"].nonzero()[0, 0], (~tensors["t2d"]).nonzero()[0, 0]
    tensors["t2d"][marked] = False  # a target id d2t maps to, unmarked
    tensors["t2d"][unmarked] = True  # and another marked in its place


@pytest.mark.parametrize(
    "damage,message",
    [(_duplicate_target_id, "d2t: maps two draft ids to one target id"), (_t2d_off_by_one, "t2d: marks other")],
    ids=["two-draft-ids-one-target-id", "t2d-disagrees"],
)
def test_a_vocabulary_mapping_that_disagrees_with_itself(tmp_path, capsys, tiny_target, damage, message):
    """vLLM reads d2t, SGLang and speculators read t2d: a mapping whose halves tell two stories, or that maps two
    draft ids to one target id, is refused by export and fails `export --check`, instead of serving another draft."""
    from safetensors.torch import load_file, save_file
    from test_consumers import random_draft

    draft = random_draft(tmp_path / "draft", tiny_target, 300)
    tensors = load_file(str(draft / "model.safetensors"))
    damage(tensors)
    save_file(tensors, str(draft / "model.safetensors"))
    out = tmp_path / "out"
    assert_refused(run_cli(["export", "--draft", draft, "--format", "vllm", "--out", out], capsys), message)
    assert not out.exists()

    good = random_draft(tmp_path / "good", tiny_target, 300)
    assert run_cli(["export", "--draft", good, "--format", "sglang", "--out", out], capsys)[0] == 0
    exported = load_file(str(out / "model.safetensors"))
    damage(exported)
    save_file(exported, str(out / "model.safetensors"))
    code, stdout, err = run_cli(["export", "--check", out, "--json"], capsys)
    assert code == 2 and "Traceback" not in err, err
    layout = next(r for r in json.loads(stdout)["results"] if r["consumer"] == "layout")
    assert layout["status"] == "fail" and any(message in f for f in layout["findings"]), layout


def test_draft_weights_of_another_shape_are_refused(tmp_path, capsys, tiny_draft):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_draft, draft)
    _wrong_fc(draft)
    assert_refused(
        run_cli(["export", "--draft", draft, "--format", "sglang", "--out", tmp_path / "out"], capsys),
        "model.safetensors: does not hold the draft",
        "fc.weight: shape",
    )


# ---------------------------------------------------------------------------------------------
# Permissions: what eaglet writes is readable by whoever the umask lets read any other file


@pytest.mark.parametrize("umask", [0o022, 0o077])
@pytest.mark.parametrize("stage", ["export", "prepare"])
def test_outputs_take_the_permissions_of_any_other_file(tmp_path, capsys, tiny_draft, tiny_target, stage, umask):
    """A draft exported for vLLM is often served by another user (a container's, a service account); under the
    usual umask 022 its directory and files must be readable by others, and a private umask keeps them private."""
    out = tmp_path / stage
    args = {
        "export": ["export", "--draft", tiny_draft, "--format", "vllm", "--out", out],
        "prepare": ["prepare", write_jsonl(tmp_path / "c.jsonl", small_conversations(3)), "--out", out]
        + ["--target", tiny_target],
    }[stage]
    previous = os.umask(umask)
    try:
        code, _, err = run_cli(args, capsys)
        (tmp_path / "plain_file").touch()
        (tmp_path / "plain_dir").mkdir()
    finally:
        os.umask(previous)
    assert code == 0, err
    plain = {True: (tmp_path / "plain_dir").stat().st_mode & 0o777, False: (tmp_path / "plain_file").stat().st_mode}
    written = [out, *out.rglob("*")]
    assert len(written) > 2
    for path in written:
        assert oct(path.stat().st_mode & 0o777) == oct(plain[path.is_dir()] & 0o777), path
