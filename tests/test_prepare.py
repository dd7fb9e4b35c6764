"""`eaglet prepare` end to end: outputs, manifest, atomicity, speed-relevant batching."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import run_cli, write_jsonl

from eaglet.data.vocab import DraftVocab


def conversations(n: int) -> list[dict]:
    return [
        {
            "id": f"c{i}",
            "messages": [
                {"role": "user", "content": f"Question number {i}?"},
                {"role": "assistant", "content": f"Answer {i}: " + "word " * (i % 7 + 1)},
            ],
        }
        for i in range(n)
    ]


def test_prepare_embedded_outputs(tmp_path, capsys, embedded_target):
    data = write_jsonl(tmp_path / "d.jsonl", conversations(40))
    out = tmp_path / "prepared"
    code, stdout, err = run_cli(["prepare", data, "--out", out, "--draft-vocab", "64", "--max-len", "45"], capsys)
    assert code == 0, err
    table = pq.read_table(out / "samples.parquet")
    assert table.schema.field("input_ids").type.value_type.bit_width == 32
    assert str(table.schema.field("loss_mask").type.value_type) == "uint8"
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == [f"c{i}" for i in range(40)]
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) <= 45 for r in rows)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["schema"] == "eaglet.prepared/1"
    assert manifest["target"]["name"] == "SmolLM2-135M-Instruct"
    assert manifest["counts"]["truncated_to_max_len"] > 0
    assert manifest["inputs"][0]["sha256"] and manifest["files"]["samples.parquet"]
    vocab = DraftVocab.load(out / "vocab.safetensors")
    assert vocab.size == 64 and vocab.t2d.shape == (49152,)
    masked = np.concatenate([np.array(r["input_ids"])[np.array(r["loss_mask"], bool)] for r in rows])
    assert vocab.counts.sum() == len(masked)
    assert abs(manifest["draft_vocab"]["coverage"] - vocab.coverage) < 1e-6
    assert "coverage" in stdout


def test_a_draft_vocabulary_too_small_for_the_answers_is_said(tmp_path, capsys, tiny_target):
    """A draft vocabulary covering < 95% of the answers' tokens caps acceptance: prepare says so, with the fix."""
    data = write_jsonl(tmp_path / "d.jsonl", conversations(40))
    code, _, err = run_cli(
        ["prepare", data, "--out", tmp_path / "few", "--target", tiny_target, "--draft-vocab", "2"], capsys
    )
    coverage = json.loads((tmp_path / "few" / "manifest.json").read_text())["draft_vocab"]["coverage"]
    assert code == 0 and coverage < 0.95
    assert f"covers {coverage:.1%} of the answers' tokens" in " ".join(err.split()) and "raise --draft-vocab" in err
    code, _, err = run_cli(["prepare", data, "--out", tmp_path / "all", "--target", tiny_target], capsys)
    assert code == 0 and "covers" not in err


def test_existing_out_is_not_clobbered(tmp_path, capsys, tiny_target):
    data = write_jsonl(tmp_path / "d.jsonl", conversations(3))
    out = tmp_path / "prepared"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run_cli(["prepare", data, "--target", tiny_target, "--out", out], capsys)
    assert code == 2 and "preflight failed for prepare: output:" in err and "pass --overwrite" in err
    code, _, err = run_cli(["prepare", data, "--target", tiny_target, "--out", out, "--skip-preflight"], capsys)
    assert code == 2 and "already exists; pass --overwrite" in err
    assert (out / "keep.txt").read_text() == "mine"
    code, _, err = run_cli(["prepare", data, "--target", tiny_target, "--out", out, "--overwrite"], capsys)
    assert code == 0 and not (out / "keep.txt").exists() and (out / "manifest.json").exists()


def test_deterministic(tmp_path, capsys, tiny_target):
    data = write_jsonl(tmp_path / "d.jsonl", conversations(20))
    for name in ("a", "b"):
        assert run_cli(["prepare", data, "--target", tiny_target, "--out", tmp_path / name], capsys)[0] == 0
    for file in ("samples.parquet", "vocab.safetensors"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes()


def test_killed_prepare_leaves_no_output(tmp_path, tiny_target):
    """SIGKILL in the middle of the work: no DIR appears (only a hidden .partial sibling may remain)."""
    data = write_jsonl(tmp_path / "d.jsonl", conversations(60000))
    out = tmp_path / "prepared"
    proc = subprocess.Popen(
        [sys.executable, "-m", "eaglet.cli", "prepare", str(data), "--target", str(tiny_target), "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 60
    while time.time() < deadline and not any(p.name.endswith(".partial") for p in tmp_path.iterdir()):
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()


def tool_rows(count: int) -> list[dict]:
    schema = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    return [
        {
            "id": f"t{i}",
            "tools": [schema],
            "messages": [
                {"role": "user", "content": f"Weather in city {i}?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": i}}}],
                },
                {"role": "tool", "content": f'{{"temp_c": {i}}}'},
                {"role": "assistant", "content": f"It is {i} C."},
            ],
        }
        for i in range(count)
    ]


def test_tool_conversations_prepare_with_a_template_that_renders_them(tmp_path, capsys, tiny_target):
    """Agent traces train the draft on the target's tool calls: with a template that renders them they prepare; with
    one that drops them (the tiny target's own) every row is refused, naming the call and the fix; regenerate, which
    answers plain prompts, refuses them too."""
    from pathlib import Path

    data = write_jsonl(tmp_path / "tools.jsonl", tool_rows(6))
    template = Path(__file__).parent / "templates" / "qwen3_tools.jinja"
    out = tmp_path / "prepared"
    code, _, err = run_cli(
        ["prepare", data, "--out", out, "--target", tiny_target, "--chat-template", template], capsys
    )
    assert code == 0, err
    rows = pq.read_table(out / "samples.parquet").to_pylist()
    assert [r["id"] for r in rows] == [f"t{i}" for i in range(6)] and all(sum(r["loss_mask"]) for r in rows)
    code, _, err = run_cli(["prepare", data, "--out", tmp_path / "p2", "--target", tiny_target], capsys)
    assert code == 2 and "does not render its tool call 'get_weather'" in err and not (tmp_path / "p2").exists()
    code, _, err = run_cli(["regenerate", data, "--out", tmp_path / "r.jsonl", "--target", tiny_target], capsys)
    assert code == 2 and "the conversation calls tools: regenerate answers plain conversations" in err, err


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "chat template file not found"),
        (b"", "the chat template file is empty"),
        (b" \n", "the chat template file is empty"),
        (b"\xff\xfe{{ x }}", "chat template is not UTF-8 text (byte 0)"),
    ],
)
def test_a_chat_template_file_that_holds_no_template(tmp_path, capsys, tiny_target, content, message):
    """An empty --chat-template fell back to the target's own template without a word; one not in UTF-8 was a
    traceback. Both are refused in one line, in preflight and in the stage."""
    data = write_jsonl(
        tmp_path / "c.jsonl",
        [{"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
    )
    template = tmp_path / "t.jinja"
    if content is not None:
        template.write_bytes(content)
    for skip in ((), ("--skip-preflight",)):
        code, _, err = run_cli(
            ["prepare", data, "--out", tmp_path / "p", "--target", tiny_target, "--chat-template", template, *skip],
            capsys,
        )
        assert code == 2 and f"{template}: {message}" in err and "Traceback" not in err, err
        assert not (tmp_path / "p").exists()


def test_held_out_rows_are_left_out_of_training(tmp_path, capsys, tiny_target):
    """Rows marked held out are what `eaglet eval` scores (its default split): prepare leaves them out unless
    --split all asks, says how many, and refuses a file with none of the split, naming the splits it has."""
    rows = conversations(6)
    for row in rows[:2]:
        row["split"] = "heldout"
    rows[2]["split"] = "train"
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    code, _, err = run_cli(["prepare", data, "--target", tiny_target, "--out", tmp_path / "train"], capsys)
    assert code == 0 and "left out 2 rows not of --split train ('heldout' 2); --split all trains on them" in err, err
    prepared = pq.read_table(tmp_path / "train" / "samples.parquet").column("id").to_pylist()
    manifest = json.loads((tmp_path / "train" / "manifest.json").read_text())
    assert prepared == ["c2", "c3", "c4", "c5"] and manifest["counts"]["left_out_other_splits"] == {"heldout": 2}
    assert manifest["counts"]["rows_read"] == 6
    code, _, err = run_cli(
        ["prepare", data, "--target", tiny_target, "--out", tmp_path / "all", "--split", "all"], capsys
    )
    assert code == 0 and "left out" not in err
    assert len(pq.read_table(tmp_path / "all" / "samples.parquet")) == 6
    held = write_jsonl(tmp_path / "held.jsonl", rows[:2])
    code, _, err = run_cli(["prepare", held, "--target", tiny_target, "--out", tmp_path / "none"], capsys)
    assert code == 2 and "no rows of --split train (the rows' splits: 'heldout' 2); pass --split all" in err, err
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("key,value", [("split", 1), ("split", ["heldout"]), ("category", {"name": "math"})])
def test_a_split_or_category_that_is_not_a_string_is_a_bad_row(tmp_path, capsys, tiny_target, key, value):
    """A split that was not a string was dropped without a word, and the row counted as the default split: a row
    meant to be held out was trained on."""
    rows = conversations(2)
    rows[1][key] = value
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    code, _, err = run_cli(["prepare", data, "--target", tiny_target, "--out", tmp_path / "p"], capsys)
    assert code == 2 and f"d.jsonl:2: '{key}' must be a string, got" in err and "Traceback" not in err, err
    assert not (tmp_path / "p").exists()
