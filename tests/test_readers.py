"""Bad input: every bad form is one clear line naming file:line, a non-zero exit, and no output directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_cli, write_jsonl

from eaglet.data.readers import BadRow, Conversation, read_conversations

GOOD = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}
USER_HI = {"role": "user", "content": "Hi"}


def tool_call(function: dict) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": function}]}


# (name, line written to the file, expected fragment of the error)
BAD_ROWS = [
    ("bad_json", '{"messages": [', "invalid JSON"),
    ("not_object", '["user", "hi"]', "row must be a JSON object"),
    ("no_known_field", '{"text": "hello"}', "no 'conversations', 'messages' or 'prompt' field"),
    ("ambiguous", json.dumps({"prompt": "a", "messages": GOOD["conversations"]}), "ambiguous row"),
    ("turns_not_list", '{"messages": "hi"}', "must be a list of turns"),
    ("empty_turns", '{"messages": []}', "'messages' is empty"),
    ("turn_not_object", '{"messages": ["hi"]}', "turn 0 must be an object"),
    ("missing_content", '{"messages": [{"role": "user"}]}', "turn 0: missing 'content'"),
    ("missing_role", '{"messages": [{"content": "hi"}]}', "turn 0: missing 'role'"),
    ("unknown_role", json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}), "unknown role 'wizard'"),
    (
        "content_wrong_type",
        json.dumps({"messages": [{"role": "user", "content": 42}]}),
        "content must be a string, got int",
    ),
    (
        "content_null",
        json.dumps({"messages": [{"role": "user", "content": None}]}),
        "content must be a string, got NoneType",
    ),
    (
        "empty_content",
        json.dumps({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]}),
        "empty content",
    ),
    (
        "image_part",
        json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}),
        "only text parts",
    ),
    ("no_assistant", json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "no assistant turn"),
    ("prompt_only", json.dumps({"prompt": "hi"}), "no assistant turn"),
    (
        "two_systems",
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "a"},
                    {"role": "system", "content": "b"},
                    {"role": "user", "content": "c"},
                    {"role": "assistant", "content": "d"},
                ]
            }
        ),
        "2 system messages",
    ),
    (
        "system_not_first",
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "system", "content": "b"},
                    {"role": "assistant", "content": "d"},
                ]
            }
        ),
        "system message at turn 1",
    ),
    (
        "assistant_first",
        json.dumps({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}),
        "first non-system turn must be from the user",
    ),
    (
        "not_alternating",
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "user", "content": "b"},
                    {"role": "assistant", "content": "c"},
                ]
            }
        ),
        "two user turns in a row",
    ),
    ("bad_id", json.dumps({"id": [1], **GOOD}), "'id' must be a non-empty string or an integer"),
    (
        "tool_turn_without_a_call",
        json.dumps({"messages": [USER_HI, {"role": "tool", "content": "18"}, {"role": "assistant", "content": "x"}]}),
        "turn 1: a tool turn must follow an assistant turn with 'tool_calls'",
    ),
    (
        "call_without_result",
        json.dumps({"messages": [USER_HI, tool_call({"name": "f"}), USER_HI, {"role": "assistant", "content": "x"}]}),
        "turn 2: the assistant's tool calls at turn 1 have no tool turn with results",
    ),
    (
        "call_without_name",
        json.dumps({"messages": [USER_HI, tool_call({"arguments": {}}), {"role": "tool", "content": "1"}]}),
        "turn 1: tool call 0: the function needs a non-empty 'name', got None",
    ),
    (
        "call_arguments_not_json",
        json.dumps(
            {"messages": [USER_HI, tool_call({"name": "f", "arguments": "{city"}), {"role": "tool", "content": ""}]}
        ),
        "turn 1: tool call 0: 'arguments' of 'f' is a string that is not JSON",
    ),
    (
        "call_not_a_function",
        json.dumps({"messages": [USER_HI, {"role": "assistant", "tool_calls": ["f()"]}]}),
        'turn 1: tool call 0: expected {"function"',
    ),
    (
        "tool_calls_not_a_list",
        json.dumps({"messages": [USER_HI, {"role": "assistant", "tool_calls": {"function": {"name": "f"}}}]}),
        "turn 1: 'tool_calls' must be a list of calls, got dict",
    ),
    (
        "user_calls_a_tool",
        json.dumps({"messages": [{"role": "user", "content": "a", "tool_calls": []}]}),
        "turn 0: 'tool_calls' in a user turn",
    ),
    (
        "tools_not_a_list",
        json.dumps({"tools": "get_weather", "messages": GOOD["conversations"]}),
        "'tools' must be a list of function schemas",
    ),
    ("prompt_not_string", json.dumps({"prompt": 3}), "'prompt': content must be a string"),
]


@pytest.mark.parametrize("name,line,fragment", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_bad_row_is_one_line_with_location(tmp_path, capsys, tiny_target, name, line, fragment):
    data = write_jsonl(tmp_path / "data.jsonl", [GOOD, line])
    out = tmp_path / "prepared"
    code, _, err = run_cli(["prepare", data, "--target", tiny_target, "--out", out], capsys)
    assert code == 2
    assert f"{data}:2: " in err and fragment in err
    assert "Traceback" not in err
    assert not out.exists() and not any(p.name.startswith(".prepared") for p in tmp_path.iterdir())


@pytest.mark.parametrize(
    "name,content,fragment",
    [
        ("missing_file", None, "file not found"),
        ("empty_file", b"", "file is empty"),
        ("blank_lines_only", b"\n\n  \n", "no rows"),
        ("wrong_suffix", b"a,b\n", "unsupported file type .csv"),
        ("json_not_list", b'{"a": 1}', "must hold a list of rows"),
        ("json_invalid", b'[{"prompt": "x"},', "invalid JSON"),
        ("parquet_corrupt", b"PAR1 not really parquet", "not a readable parquet file"),
    ],
)
def test_bad_file_is_one_line(tmp_path, capsys, tiny_target, name, content, fragment):
    suffix = {"wrong_suffix": ".csv", "json_not_list": ".json", "json_invalid": ".json", "parquet_corrupt": ".parquet"}
    path = tmp_path / f"data{suffix.get(name, '.jsonl')}"
    if content is not None:
        path.write_bytes(content)
    out = tmp_path / "prepared"
    code, _, err = run_cli(["prepare", path, "--target", tiny_target, "--out", out], capsys)
    assert code == 2 and fragment in err and str(path) in err
    assert not out.exists()


def test_non_utf8_line_names_the_line(tmp_path, capsys, tiny_target):
    path = tmp_path / "data.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"prompt": "caf\xe9"}\n')
    code, _, err = run_cli(["prepare", path, "--target", tiny_target, "--out", tmp_path / "o"], capsys)
    assert code == 2 and f"{path}:2: not valid UTF-8" in err


def test_duplicate_id_names_both_rows(tmp_path, capsys, tiny_target):
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", **GOOD}, {"id": "a", **GOOD}])
    code, _, err = run_cli(["prepare", path, "--target", tiny_target, "--out", tmp_path / "o"], capsys)
    assert code == 2 and f"{path}:2: duplicate id 'a' (first at {path}:1)" in err


def test_skip_mode_records_reasons_in_manifest(tmp_path, capsys, tiny_target):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, '{"oops"', {"prompt": "only a prompt"}, GOOD])
    out = tmp_path / "prepared"
    code, _, err = run_cli(["prepare", path, "--target", tiny_target, "--out", out, "--on-bad-row", "skip"], capsys)
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["samples"] == 2
    reasons = {row["source"]: row["reason"] for row in manifest["skipped_rows"]}
    assert reasons[f"{path}:2"].startswith("invalid JSON")
    assert "no assistant turn" in reasons[f"{path}:3"]


def test_all_forms_read_the_same(tmp_path):
    """ShareGPT (from/value and role/content), OpenAI (text parts too) and prompt rows, in jsonl/json/parquet."""
    sharegpt = {
        "id": "s",
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "Q"},
            {"from": "gpt", "value": "A"},
        ],
    }
    sharegpt_rc = {
        "id": "r",
        "conversations": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"},
        ],
    }
    openai = {
        "id": "o",
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "Q"}]},
            {"role": "assistant", "content": "A"},
        ],
    }
    prompt = {"id": "p", "prompt": "Q", "system": "S", "category": "math"}
    rows = [sharegpt, sharegpt_rc, openai, prompt]
    jsonl = write_jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "b.json").write_text(json.dumps([{**r, "id": r["id"] + "2"} for r in rows]))
    table = pa.Table.from_pylist(
        [
            {
                "id": "pq",
                "messages": openai["messages"][:1]
                + [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
            }
        ]
    )
    pq.write_table(table, tmp_path / "c.parquet")
    items = list(read_conversations([jsonl, tmp_path / "b.json", tmp_path / "c.parquet"]))
    assert all(isinstance(i, Conversation) for i in items), [str(i) for i in items if isinstance(i, BadRow)]
    expected = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ]
    for item in items:
        want = expected[:2] if item.id.startswith("p") and item.id != "pq" else expected
        assert item.messages == want, item.id
    assert items[3].meta == {"category": "math"}
    assert items[-1].source == f"{tmp_path / 'c.parquet'}:row 0"


def test_real_process_exit_code_and_single_line(tmp_path, tiny_target):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, '{"messages": 5}'])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "eaglet.cli",
            "prepare",
            str(data),
            "--target",
            str(tiny_target),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert lines[-1].startswith("error: ") and f"{data}:2:" in lines[-1]
    assert "Traceback" not in proc.stderr


def test_tool_conversations_read_in_openai_form(tmp_path):
    """A call (content null, arguments as a JSON string or an object), two results (one empty), the answer; the
    row's schemas kept for the template; a call may end the conversation (the model's last output)."""
    schema = {"type": "function", "function": {"name": "f", "parameters": {}}}
    rows = [
        {
            "tools": [schema],
            "messages": [
                USER_HI,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                        {"type": "function", "function": {"name": "f", "arguments": {"x": 2}}},
                    ],
                },
                {"role": "tool", "content": "one", "tool_call_id": "a"},
                {"role": "function", "content": "", "name": "f"},
                {"role": "assistant", "content": "done"},
            ],
        },
        {"messages": [USER_HI, tool_call({"name": "f"})]},
    ]
    items = list(read_conversations([write_jsonl(tmp_path / "t.jsonl", rows)]))
    assert all(isinstance(i, Conversation) for i in items), items
    first, second = items
    assert first.tools == [schema] and first.uses_tools and second.uses_tools
    call = first.messages[1]
    assert call["content"] == "" and [c["function"]["arguments"] for c in call["tool_calls"]] == ['{"x": 1}', {"x": 2}]
    assert call["tool_calls"][0]["id"] == "a"
    assert [m["role"] for m in first.messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert first.messages[3] == {"role": "tool", "content": "", "name": "f"}
    assert second.messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": {}}
    plain = next(iter(read_conversations([write_jsonl(tmp_path / "p.jsonl", [GOOD])])))
    assert not plain.uses_tools and plain.tools is None
