"""Prepared sets damaged after `eaglet prepare`, wrong devices, wrong paths and broken targets: each refused in one
line naming the file (or option) and the fix, before any model loads, writing nothing."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import extract_args, run_cli, tiny_llama_dir
from helpers import assert_refused, tree_digest

PREPARE_AGAIN = "run `eaglet prepare` again"


@pytest.fixture
def prepared(tmp_path, tiny_prepared) -> Path:
    copy = tmp_path / "prepared"
    shutil.copytree(tiny_prepared, copy)
    return copy


def rewrite_samples(prepared: Path, table: pa.Table, keep_hash: bool = True) -> None:
    """Replace samples.parquet; ``keep_hash``: record its sha256 in the manifest, as if prepare had written it
    (so the row checks, not the checksum, are what refuses it)."""
    pq.write_table(table, prepared / "samples.parquet")
    if keep_hash:
        manifest = json.loads((prepared / "manifest.json").read_text())
        manifest["files"]["samples.parquet"] = hashlib.sha256((prepared / "samples.parquet").read_bytes()).hexdigest()
        (prepared / "manifest.json").write_text(json.dumps(manifest))


def refused_by_extract(tmp_path, prepared, target, capsys, *fragments) -> str:
    store = tmp_path / "store"
    before = tree_digest(prepared)
    line = assert_refused(run_cli(extract_args(prepared, store, target), capsys), *fragments)
    assert not store.exists() and tree_digest(prepared) == before
    return line


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "manifest.json:1: not valid JSON (Expecting value at column 1)"),
        ('{"schema": "eaglet.prepared/1", "target":', "not valid JSON"),
        ("[]", "schema 'list'"),
        ('{"schema": "eaglet.prepared/0"}', "schema 'eaglet.prepared/0'"),
    ],
)
def test_a_broken_manifest(tmp_path, capsys, prepared, tiny_target, text, message):
    (prepared / "manifest.json").write_text(text)
    line = refused_by_extract(
        tmp_path, prepared, tiny_target, capsys, str(prepared / "manifest.json"), message, PREPARE_AGAIN
    )
    assert "at at" not in line


def test_a_store_and_a_prepared_set_given_for_each_other(tmp_path, capsys, tiny_prepared, tiny_store, tiny_target):
    """The fix for a store passed where a prepared set goes (and back) is the other path, not a rerun."""
    refused_by_extract(
        tmp_path, tiny_store, tiny_target, capsys, f"{tiny_store}: a store (made by `eaglet extract`), not a prepared "
        "set; pass the --out of `eaglet prepare`",
    )  # fmt: skip
    for args in (["store", "info", tiny_prepared], ["store", "verify", tiny_prepared],
                 ["train", "--store", tiny_prepared, "--target", tiny_target, "--out", tmp_path / "run"]):  # fmt: skip
        assert_refused(
            run_cli(args, capsys), f"{tiny_prepared}: a prepared set (made by `eaglet prepare`), not a store; pass "
            "the --out of `eaglet extract`",
        )  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_samples_changed_after_prepare(tmp_path, capsys, prepared, tiny_target):
    table = pq.read_table(prepared / "samples.parquet")
    rewrite_samples(prepared, table.slice(0, len(table) - 1), keep_hash=False)
    refused_by_extract(tmp_path, prepared, tiny_target, capsys, "samples.parquet", "sha256 differs", PREPARE_AGAIN)


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_the_draft_vocabulary_damaged_after_prepare(tmp_path, capsys, prepared, tiny_target, damage):
    """Training reads vocab.safetensors after extraction: extraction refuses a set whose vocabulary broke."""
    vocab = prepared / "vocab.safetensors"
    if damage == "truncated":
        vocab.write_bytes(vocab.read_bytes()[:10])
        refused_by_extract(tmp_path, prepared, tiny_target, capsys, str(vocab), "sha256 differs", PREPARE_AGAIN)
    else:
        vocab.unlink()
        refused_by_extract(tmp_path, prepared, tiny_target, capsys, f"{vocab}: missing", PREPARE_AGAIN)


def test_no_input_ids_column(tmp_path, capsys, prepared, tiny_target):
    table = pq.read_table(prepared / "samples.parquet")
    rewrite_samples(prepared, table.drop(["input_ids"]))
    refused_by_extract(
        tmp_path, prepared, tiny_target, capsys, "samples.parquet", "no 'input_ids' column", PREPARE_AGAIN
    )


def test_a_loss_mask_shorter_than_its_ids(tmp_path, capsys, prepared, tiny_target):
    """Extracted as it was, every later sample's mask would have been shifted by one."""
    table = pq.read_table(prepared / "samples.parquet")
    masks = table.column("loss_mask").to_pylist()
    masks[3] = masks[3][:-1]
    rewrite_samples(prepared, table.set_column(2, "loss_mask", pa.array(masks, type=pa.list_(pa.uint8()))))
    refused_by_extract(
        tmp_path, prepared, tiny_target, capsys, "samples.parquet", "row 3: loss_mask has", PREPARE_AGAIN
    )


def test_a_sample_of_no_tokens(tmp_path, capsys, prepared, tiny_target):
    """prepare writes none; extract stored it silently, a zero-length sample training then had to step around."""
    table = pq.read_table(prepared / "samples.parquet")
    ids, masks = table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()
    ids[4], masks[4] = [], []
    table = table.set_column(1, "input_ids", pa.array(ids, type=pa.list_(pa.int32())))
    rewrite_samples(prepared, table.set_column(2, "loss_mask", pa.array(masks, type=pa.list_(pa.uint8()))))
    refused_by_extract(tmp_path, prepared, tiny_target, capsys, "row 4: a sample of no tokens", PREPARE_AGAIN)


def test_a_token_id_beyond_the_vocabulary(tmp_path, capsys, prepared, tiny_target):
    table = pq.read_table(prepared / "samples.parquet")
    ids = table.column("input_ids").to_pylist()
    vocab = json.loads((prepared / "manifest.json").read_text())["target"]["vocab_size"]
    ids[5][2] = vocab + 17
    rewrite_samples(prepared, table.set_column(1, "input_ids", pa.array(ids, type=pa.list_(pa.int32()))))
    refused_by_extract(tmp_path, prepared, tiny_target, capsys, "row 5: token id", f"(0..{vocab - 1})", PREPARE_AGAIN)


def test_online_training_without_the_draft_vocabulary(tmp_path, capsys, prepared, tiny_target):
    (prepared / "vocab.safetensors").unlink()
    out = tmp_path / "run"
    result = run_cli(
        ["train", "--prepared", prepared, "--out", out, "--target", tiny_target, "--max-steps", "2"], capsys
    )
    assert_refused(result, "vocab.safetensors: missing (the set's manifest lists it)", PREPARE_AGAIN)
    assert not out.exists()
    result = run_cli(
        [
            "train",
            "--prepared",
            prepared,
            "--out",
            out,
            "--target",
            tiny_target,
            "--max-steps",
            "2",
            "--skip-preflight",
        ],
        capsys,
    )  # the stage itself refuses too, before the target loads
    assert_refused(result, "vocab.safetensors: missing (the set's manifest lists it)", PREPARE_AGAIN)
    assert not out.exists()


@pytest.mark.parametrize(
    "device,message",
    [("tpu:7", "not a device"), ("cuda:0", "CUDA is not available here"), ("meta", "eaglet runs on cpu or cuda")],
)
def test_a_device_this_torch_does_not_have(tmp_path, capsys, tiny_prepared, tiny_store, tiny_target, device, message):
    import torch

    if torch.cuda.is_available() and device == "cuda:0":
        pytest.skip("this machine has CUDA")
    store, run = tmp_path / "store", tmp_path / "run"
    for skip in ((), ("--skip-preflight",)):  # the preflight and the stage itself both refuse
        assert_refused(
            run_cli(extract_args(tiny_prepared, store, tiny_target, "--device", device, *skip), capsys),
            f"--device {device}",
            message,
        )
        assert_refused(
            run_cli(
                ["train", "--store", tiny_store, "--out", run, "--target", tiny_target, "--device", device, *skip],
                capsys,
            ),
            f"--device {device}",
            message,
        )
        assert not store.exists() and not run.exists()


def test_extract_into_a_file(tmp_path, capsys, tiny_prepared, tiny_target):
    out = tmp_path / "store"
    out.write_text("not a store")
    for skip in ((), ("--skip-preflight",)):
        assert_refused(
            run_cli(extract_args(tiny_prepared, out, tiny_target, *skip), capsys), str(out), "not a directory"
        )
        assert out.read_text() == "not a store"


@pytest.mark.parametrize(
    "text,message",
    [('{"hidden_size": 64,', "config.json:1: not valid JSON"), ('{"model_type": "llama"}', "no integer 'hidden_size'")],
)
def test_a_target_with_a_broken_config(tmp_path, capsys, tiny_prepared, text, message):
    target = tiny_llama_dir(tmp_path / "target")
    (target / "config.json").write_text(text)
    line = refused_by_extract(tmp_path, tiny_prepared, target, capsys, str(target / "config.json"), message)
    assert "tokenizer" not in line and "at at" not in line


@pytest.mark.parametrize(
    "field,value",
    [("num_hidden_layers", 1_000_000_000), ("hidden_size", 0), ("vocab_size", 1 << 40), ("num_attention_heads", -1)],
)
def test_a_target_config_of_no_models_sizes(tmp_path, capsys, tiny_prepared, field, value):
    """A config past any model's sizes (a billion layers hung building them, before anything could refuse it) is
    refused in one line naming the field, by preflight and by the stage itself, before a layer is built."""
    target = tiny_llama_dir(tmp_path / "target")
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config | {field: value}))
    store, message = tmp_path / "store", f"{field} {value:,} is no model's"
    for skip in ((), ("--skip-preflight",)):
        args = extract_args(tiny_prepared, store, target, *skip)
        assert_refused(run_cli(args, capsys), str(target / "config.json"), message)
        assert not store.exists()


def test_an_eval_fraction_that_holds_out_every_sample(tmp_path, capsys, tiny_prepared, tiny_store, tiny_target):
    """A fraction that leaves nothing to train on says so, not that the samples have no trainable token."""
    from eaglet.train.data import held_out

    samples = pq.read_metadata(tiny_prepared / "samples.parquet").num_rows
    fraction = next(f for f in (0.9, 0.99, 0.999, 0.9999) if all(held_out(s, 1, f) for s in range(samples)))
    out = tmp_path / "run"
    args = ["train", "--store", tiny_store, "--out", out, "--target", tiny_target, "--seed", "1"]
    assert_refused(
        run_cli([*args, "--eval-fraction", str(fraction), "--max-steps", "1"], capsys),
        f"--eval-fraction {fraction} holds out all {samples} of its samples",
        "lower --eval-fraction",
    )
    assert not out.exists()


def test_a_token_budget_that_cuts_the_answers_off(tmp_path, capsys, tiny_prepared, tiny_store, tiny_target):
    """Training sees a sample's first --token-budget tokens: a budget ending before every sample's first trainable
    token is refused (it would train at loss 0); one that cuts some trainable tokens trains and says how many."""
    from eaglet.formats.prepared import load_prepared

    prepared = load_prepared(tiny_prepared)
    masks = [prepared.sample(sample)[1] for sample in range(len(prepared))]
    before_any = min(int(mask.nonzero()[0][0]) for mask in masks if mask.any())  # no sample trains on a token before
    longest = max(len(mask) for mask in masks)
    past_last = max(int(mask.nonzero()[0][-1]) + 1 for mask in masks if mask.any())  # ... nor on one from here on
    args = ["train", "--store", tiny_store, "--target", tiny_target, "--eval-fraction", "0", "--max-steps", "1"]
    out = tmp_path / "refused"
    assert_refused(
        run_cli([*args, "--out", out, "--token-budget", str(before_any)], capsys),
        f"--token-budget {before_any} cuts every training sample before its first trainable token",
        f"raise --token-budget to {longest}",
    )
    assert not out.exists()
    budget = past_last - 1  # the sample training on the latest token loses it
    cut = sum(len(mask) > budget for mask in masks)
    code, out_text, err = run_cli([*args, "--out", tmp_path / "cut", "--token-budget", str(budget)], capsys)
    assert code == 0, err
    assert f"--token-budget {budget} cuts {cut} of {len(prepared)} training samples (the longest {longest}" in err
    assert "of the trainable tokens are never trained on" in err
    code, _, err = run_cli([*args, "--out", tmp_path / "whole", "--token-budget", str(past_last)], capsys)
    assert code == 0 and "never trained on" not in err, err


def long_answers(path: Path, words: int) -> Path:
    """Conversations whose answers run to about ``words`` tokens."""
    rows = [
        {
            "id": f"c{i}",
            "messages": [
                {"role": "user", "content": f"Tell a story {i}"},
                {"role": "assistant", "content": "once upon a time " * (words // 4)},
            ],
        }
        for i in range(3)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_samples_past_the_targets_context(tmp_path, capsys, tiny_target):
    """The tiny target's context is 512 positions. `prepare --max-len 2048` warns and cuts samples at 512 (features
    past the context are positions the target never saw); a set prepared for a longer-context sibling (the same
    tokenizer) is refused by extract's preflight, before the target loads."""
    data = long_answers(tmp_path / "long.jsonl", 1200)
    prepared = tmp_path / "prepared"
    code, _, err = run_cli(["prepare", data, "--out", prepared, "--target", tiny_target, "--max-len", "2048"], capsys)
    assert code == 0 and "--max-len 2,048 is past the target's context: samples are cut at 512" in err, err
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["max_len"] == 512 and manifest["tokens"]["length"]["max"] == 512

    sibling = tmp_path / "sibling"
    shutil.copytree(tiny_target, sibling)
    config = json.loads((sibling / "config.json").read_text())
    (sibling / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096}))
    longer = tmp_path / "prepared_longer"
    assert run_cli(["prepare", data, "--out", longer, "--target", sibling, "--max-len", "2048"], capsys)[0] == 0
    store = tmp_path / "store"
    assert_refused(
        run_cli(extract_args(longer, store, tiny_target), capsys),
        "the longest sample is",
        "past the target's context of 512",
        "prepare again with this --target",
    )
    assert not store.exists()


def test_a_target_that_names_no_end_of_sequence_cannot_answer(tmp_path, capsys):
    """No eos in generation_config.json, config.json or the tokenizer, none added by the chat template: answers
    could never end (the hf engine then had no pad token either: an IndexError). Refused before the weights load."""
    target = tiny_llama_dir(tmp_path / "target")
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config | {"eos_token_id": None, "pad_token_id": None}))
    generation = target / "generation_config.json"
    if generation.exists():
        fields = json.loads(generation.read_text())
        generation.write_text(
            json.dumps({k: v for k, v in fields.items() if k not in ("eos_token_id", "pad_token_id")})
        )
    tokenizer = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer | {"eos_token": None, "pad_token": None}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "hello there"}) + "\n")
    out = tmp_path / "answers.jsonl"
    result = run_cli(["regenerate", prompts, "--out", out, "--target", target, "--max-new-tokens", "8"], capsys)
    assert_refused(result, str(target), "names no end-of-sequence token", "set eos_token_id")
    assert not out.exists() and not any(p.name.startswith("answers") for p in tmp_path.iterdir())
