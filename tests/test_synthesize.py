"""`eaglet synthesize`: the target writes user prompts from its chat template's user turn (Magpie)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from eaglet.data.readers import read_conversations
from eaglet.data.synthesize import PromptFilter, filter_prompts, raw_path, split_of, user_turn
from eaglet.errors import EagletError


def test_the_filter_keeps_the_first_distinct_finished_long_enough_messages():
    texts = [
        "How do I bake bread at home?",
        None,  # did not close its turn
        "how do I bake bread, at home",  # the same after folding case and punctuation
        "Hi",
        "How do I bake bread at home quickly?",  # 4 of 6 trigrams shared with the first
        "Explain the French revolution to a child.",
        "Write a haiku about autumn leaves.",
    ]
    filtered = filter_prompts(texts, min_words=3, max_similarity=0.5, count=3)
    assert filtered.kept == [
        "How do I bake bread at home?",
        "Explain the French revolution to a child.",
        "Write a haiku about autumn leaves.",
    ]
    assert filtered.dropped == {
        "unfinished": 1,
        "too short": 1,
        "duplicate": 1,
        "near duplicate": 1,
        "common opening": 0,
    }


def test_the_diversity_cap_keeps_few_messages_of_one_opening_and_the_filter_is_the_same_batch_by_batch():
    """A small chat model opens most user turns with "Can you ..."; at most ceil(share * count) of one opening."""
    texts = [
        "Can you help me plan a garden?",
        "Can you help me write a cover letter?",
        "can you, explain black holes simply",
        "What is the capital of Peru?",
        "Can you list three prime numbers?",
        "Write a short poem about rain.",
        "What is a good name for a cat?",
        "Describe the water cycle in steps.",
    ]
    filtered = filter_prompts(texts, min_words=3, max_similarity=0.5, count=5, max_opening_share=0.25)
    assert filtered.kept == [
        "Can you help me plan a garden?",
        "Can you help me write a cover letter?",  # ceil(0.25 * 5) = 2 may open with "can you"
        "What is the capital of Peru?",
        "Write a short poem about rain.",
        "What is a good name for a cat?",
    ]
    assert filtered.dropped["common opening"] == 2
    batched = PromptFilter(min_words=3, max_similarity=0.5, count=5, max_opening_share=0.25)
    for start in range(0, len(texts), 3):  # as synthesize feeds it, one generated batch at a time
        batched.add(texts[start : start + 3])
    assert batched.kept == filtered.kept and batched.dropped == filtered.dropped and batched.full


def test_the_split_is_a_stable_function_of_the_text():
    texts = [f"question number {i} about something" for i in range(2000)]
    splits = [split_of(text, 0.1) for text in texts]
    assert splits == [split_of(text, 0.1) for text in texts]
    assert 0.07 < splits.count("heldout") / len(texts) < 0.13
    assert split_of("How do I bake bread?", 0.1) == split_of("how do i bake bread", 0.1)


def test_the_user_turn_is_found_in_the_template(tiny_target):
    from eaglet.model.target import load_tokenizer

    tokenizer = load_tokenizer(tiny_target)
    turn = user_turn(tokenizer, "tiny")
    assert turn.prefix.endswith("user\n") and turn.suffix.startswith("<|im_end|>")
    tokenizer.chat_template = None
    with pytest.raises(EagletError, match="no chat template"):
        user_turn(tokenizer, "tiny")


@pytest.mark.slow
def test_the_embedded_target_writes_prompts_that_regenerate_reads_and_a_rerun_resumes(tmp_path, capsys):
    out = tmp_path / "prompts.jsonl"
    args = [
        "synthesize",
        "--out",
        out,
        "--count",
        "4",
        "--batch-size",
        "8",
        "--max-new-tokens",
        "48",
        "--device",
        "cpu",
        "--heldout-fraction",
        "0.5",
    ]
    code, stdout, err = run_cli(args, capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and len({row["prompt"] for row in rows}) == 4
    assert {row["split"] for row in rows} <= {"train", "heldout"} and all(row["prompt"].strip() for row in rows)
    assert len([item for item in read_conversations([out])]) == 4  # what regenerate reads
    manifest = json.loads((tmp_path / "prompts.jsonl.manifest.json").read_text())
    assert manifest["counts"]["kept"] == 4 and manifest["counts"]["generated"] >= 4
    written, raw = out.read_bytes(), raw_path(out).read_bytes()
    out.unlink()  # a rerun (after a kill) takes the generated batches and writes the same file
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert out.read_bytes() == written and raw_path(out).read_bytes() == raw
    code, _, err = run_cli([*args, "--temperature", "0.7"], capsys)  # other settings, the same --out
    assert code == 2 and "made with other settings" in err and len(err.strip().splitlines()) == 1


def test_too_few_prompts_is_one_line_naming_the_drops(tmp_path, capsys, tiny_target):
    """A random model rarely closes its turn: every message unfinished, the run says so and writes nothing."""
    out = tmp_path / "prompts.jsonl"
    code, _, err = run_cli(
        [
            "synthesize",
            "--out",
            out,
            "--target",
            tiny_target,
            "--count",
            "2",
            "--batch-size",
            "2",
            "--max-new-tokens",
            "5",
            "--max-batches",
            "2",
            "--device",
            "cpu",
        ],
        capsys,
    )
    assert code == 2 and "0 of 2 prompts after 2 of --max-batches 2 (dropped: 4 unfinished)" in err, err
    assert "raise --max-new-tokens" in err and not out.exists()


def test_a_run_that_keeps_nothing_gives_up_early(tmp_path, capsys, tiny_target):
    """100 batches of 4 could fill --count 50 only at a keep rate of 1 in 8: nothing kept in 52 messages would
    happen at that rate once in a thousand runs, so the run stops there instead of generating all 100."""
    out = tmp_path / "prompts.jsonl"
    args = ["synthesize", "--out", out, "--target", tiny_target, "--count", "50", "--batch-size", "4"]
    code, _, err = run_cli([*args, "--max-new-tokens", "5", "--max-batches", "100", "--device", "cpu"], capsys)
    assert code == 2 and "0 of 50 prompts after 13 of --max-batches 100 (dropped: 52 unfinished)" in err, err
    assert not out.exists()


def test_settings_that_could_never_keep_a_message(tmp_path, capsys, tiny_target):
    out = tmp_path / "prompts.jsonl"
    code, _, err = run_cli(["synthesize", "--out", out, "--max-new-tokens", "3", "--min-words", "3"], capsys)
    assert code == 2 and "--max-new-tokens 3 cannot hold a message of --min-words 3 and its turn's end" in err
    code, _, err = run_cli(["regenerate", "demo", "--out", tmp_path / "a.jsonl", "--n", "2"], capsys)
    assert code == 2 and "--n 2 at --temperature 0 writes the same greedy answer 2 times" in err


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--out", "prompts.txt"], "is not a .jsonl file"),
        (["--out", "p.jsonl", "--count", "0"], "command line: --count: "),
        (["--out", "p.jsonl", "--max-similarity", "1.5"], "command line: --max-similarity: "),
        (["--out", "p.jsonl", "--max-opening-share", "0"], "command line: --max-opening-share: "),
    ],
)
def test_bad_settings_are_refused_before_the_target_loads(tmp_path, capsys, bad, message):
    code, _, err = run_cli(["synthesize", *[tmp_path / a if a.endswith(("jsonl", "txt")) else a for a in bad]], capsys)
    assert code == 2 and message in err and "Traceback" not in err, err


def test_a_damaged_raw_file_is_one_line_and_a_torn_last_batch_is_generated_again(tmp_path, capsys, tiny_target):
    from eaglet.config import SynthesizeConfig
    from eaglet.data.synthesize import load_raw, settings_of

    out = tmp_path / "prompts.jsonl"
    settings = settings_of(SynthesizeConfig(out=str(out), target=str(tiny_target)))
    good = json.dumps({"batch": 0, "settings": settings, "texts": ["a b c d"]})
    raw_path(out).write_text(good + "\n" + '{"batch": 1, "sett')  # killed while appending batch 1
    assert load_raw(raw_path(out), settings) == {0: ["a b c d"]}
    raw_path(out).write_text('{"batch": 0, "sett\n' + good + "\n")  # damaged before the end: not a torn write
    code, _, err = run_cli(["synthesize", "--out", out, "--target", tiny_target, "--device", "cpu"], capsys)
    assert code == 2 and f"{raw_path(out)}:1: not JSON; delete" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    for damaged, message in (
        (b"\xff\xfe" + good.encode() + b"\n", "not UTF-8 text (byte 0)"),
        (json.dumps({"batch": "0", "settings": settings, "texts": ["a"]}).encode() + b"\n", ":1: not a batch"),
        (json.dumps({"batch": 0, "settings": settings, "texts": [1, 2]}).encode() + b"\n", ":1: not a batch"),
    ):
        raw_path(out).write_bytes(damaged)
        code, _, err = run_cli(["synthesize", "--out", out, "--target", tiny_target, "--device", "cpu"], capsys)
        assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists() and raw_path(out).read_bytes() == damaged


@pytest.mark.parametrize("skip_preflight", [False, True])
def test_a_file_synthesize_did_not_write_is_never_replaced(tmp_path, capsys, tiny_target, skip_preflight):
    """--out is replaced whole at the end: a user's own prompt file there (no synthesis manifest beside it, or one
    that is not a synthesis manifest) is refused before any generation, by the preflight and by the stage itself."""
    out = tmp_path / "my_prompts.jsonl"
    out.write_text('{"id": "mine", "prompt": "a prompt I wrote"}\n')
    args = ["synthesize", "--out", out, "--target", tiny_target, "--device", "cpu", "--count", "1"]
    for manifest in (None, "{not json", '{"schema": "eaglet.prepared/1"}'):
        if manifest is not None:
            (tmp_path / "my_prompts.jsonl.manifest.json").write_text(manifest)
        code, _, err = run_cli([*args, *(["--skip-preflight"] if skip_preflight else [])], capsys)
        assert code == 2 and "exists and was not written by `eaglet synthesize`" in err, err
        error_lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
        assert "use another --out or delete the file" in err and len(error_lines) == 1, err
        assert out.read_text() == '{"id": "mine", "prompt": "a prompt I wrote"}\n' and not raw_path(out).exists()


@pytest.mark.parametrize("skip_preflight", [False, True])
def test_a_batch_whose_cache_cannot_fit_is_refused_before_the_weights_load(
    tmp_path, capsys, tiny_target, skip_preflight
):
    """--batch-size 1e8 allocated 19 GB after preflight passed: a batch's KV cache is counted against the device's free
    memory first, by preflight and by the stage (synthesize and regenerate share the writer), nothing written."""
    out = tmp_path / "prompts.jsonl"
    args = ["synthesize", "--out", out, "--target", tiny_target, "--device", "cpu", "--batch-size", "100000000"]
    code, _, err = run_cli([*args, *(["--skip-preflight"] if skip_preflight else [])], capsys)
    assert code == 2 and "Traceback" not in err, err
    error_lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "100,000,000" in error_lines[0] and "KV cache" in error_lines[0], err
    assert not out.exists() and not raw_path(out).exists()
