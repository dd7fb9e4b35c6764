"""Read conversation files into one normalised form, reporting every bad row as ``file:line: what``.

Accepted row forms (in .jsonl, .json and .parquet files):
- ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, ...]}`` (or role/content keys)
- OpenAI:   ``{"messages": [{"role": "user", "content": "..."}, ...]}`` (content may be text parts)
- prompt-only: ``{"prompt": "...", "system": "..."?}``
Optional per row: ``id`` (string or integer), ``category``, ``split``, and ``provenance`` as written by
`eaglet regenerate` (an answer cut at max_new_tokens has no real end of turn).
Tool use, in OpenAI's form: an assistant turn with ``tool_calls`` ([{"function": {"name", "arguments"}}], its
content may be empty), the results as ``tool`` turns after it, and the row's ``tools`` (the function schemas the
chat template lists); the calls are trained on like any answer, the results are input.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..errors import EagletError, shown
from ..fsio import json_error_text

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",  # OpenAI's older name for a function's result
}
CONVERSATION_KEYS = ("conversations", "messages", "prompt")
SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")
TOO_DEEP = "JSON nested too deeply for a conversation (thousands of levels); fix the row"


@dataclass
class Conversation:
    source: str  # "file:line" for messages
    id: str
    # [{"role": "system"|"user"|"assistant"|"tool", "content": str}]; an assistant turn may add "tool_calls" (a list
    # of {"type": "function", "function": {"name", "arguments"}}), a tool turn "tool_call_id" and "name"
    messages: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)  # category, split, ...
    tools: list[dict[str, Any]] | None = None  # the function schemas the template lists (OpenAI's "tools")

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in self.messages)

    @property
    def has_assistant(self) -> bool:
        return any(m["role"] == "assistant" for m in self.messages)

    @property
    def prompt_messages(self) -> list[dict[str, str]]:
        """Everything up to and including the last user turn: what the target answers."""
        last_user = max(i for i, m in enumerate(self.messages) if m["role"] == "user")
        return self.messages[: last_user + 1]


def describe_splits(counts: Counter[str]) -> str:
    """Rows left out per split, most first ("'heldout' 128, 'test' 3"): what a selection that skipped them names."""
    return ", ".join(f"{split!r} {count:,}" for split, count in counts.most_common())


@dataclass
class BadRow:
    source: str
    reason: str

    def __str__(self) -> str:
        return f"{self.source}: {self.reason}"


class RowError(ValueError):
    """Raised inside row parsing; becomes a BadRow carrying the row's location."""


MAX_BAD_ROWS_SHOWN = 20


def fail_on_bad_rows(bad: list[BadRow], console: Any) -> None:
    """Print the first bad rows, one line each, and stop with the first as the error."""
    for row in bad[:MAX_BAD_ROWS_SHOWN]:
        console.print(f"[red]bad row[/] {row}", highlight=False, soft_wrap=True)
    more = f" (first {MAX_BAD_ROWS_SHOWN} shown)" if len(bad) > MAX_BAD_ROWS_SHOWN else ""
    raise EagletError(f"{bad[0]}; {len(bad)} bad row(s){more}: fix them, or pass --on-bad-row skip to drop them")


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):  # OpenAI content parts
        pieces = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RowError(f"{where}: content part {index} is {kind!r}; only text parts are supported")
            pieces.append(part["text"])
        text = "".join(pieces)
    else:
        raise RowError(f"{where}: content must be a string, got {type(content).__name__}")
    if not text.strip():
        raise RowError(f"{where}: empty content")
    return _encodable(text, where)


def _encodable(text: str, where: str) -> str:
    """``text`` if it is valid Unicode: JSON's ``\\ud800``-style escapes can decode to lone surrogates, which no
    tokenizer or UTF-8 file can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RowError(
            f"{where}: a lone surrogate ({text[exc.start]!a}) at character {exc.start}, not valid "
            "Unicode; fix the escape in the file"
        ) from None
    return text


def _parse_turn(turn: Any, index: int) -> dict[str, Any]:
    where = f"turn {index}"
    if not isinstance(turn, dict):
        raise RowError(f"{where} must be an object, got {type(turn).__name__}")
    if "from" in turn or "value" in turn:
        role_key, content_key = "from", "value"
    else:
        role_key, content_key = "role", "content"
    if role_key not in turn:
        raise RowError(f"{where}: missing '{role_key}'")
    raw_role = turn[role_key]
    if not isinstance(raw_role, str) or raw_role.strip().lower() not in ROLE_ALIASES:
        known = ", ".join(sorted(ROLE_ALIASES))
        raise RowError(f"{where}: unknown role {shown(raw_role)} (known: {known})")
    role = ROLE_ALIASES[raw_role.strip().lower()]
    calls = turn.get("tool_calls")
    if calls is not None and role != "assistant":
        raise RowError(f"{where}: 'tool_calls' in a {role} turn; only an assistant turn calls tools")
    if calls is not None and not isinstance(calls, list):
        raise RowError(f"{where}: 'tool_calls' must be a list of calls, got {type(calls).__name__}")
    if calls is not None and calls != []:
        content = turn.get(content_key)  # a turn that calls tools may say nothing
        message = {"role": role, "content": "" if content in (None, "") else _text_of(content, where)}
        message["tool_calls"] = [_parse_call(call, f"{where}: tool call {n}") for n, call in enumerate(calls)]
        return message
    if content_key not in turn:
        raise RowError(f"{where}: missing '{content_key}'")
    if role == "tool":  # a tool's result may be empty
        content = turn[content_key]
        text = content if isinstance(content, str) and not content.strip() else _text_of(content, where)
        message = {"role": role, "content": _encodable(text, where)}
        for key in ("tool_call_id", "name"):
            if isinstance(turn.get(key), str):
                message[key] = _encodable(turn[key], f"{where}: '{key}'")
        return message
    return {"role": role, "content": _text_of(turn[content_key], where)}


def _parse_call(call: Any, where: str) -> dict[str, Any]:
    """One OpenAI tool call -> {"type": "function", "function": {"name", "arguments"}} (+ "id"); the arguments
    stay as given (a JSON string or an object: templates render either)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise RowError(f'{where}: expected {{"function": {{"name": ..., "arguments": ...}}}}, got {shown(call)}')
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise RowError(f"{where}: the function needs a non-empty 'name', got {shown(name)}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            raise RowError(f"{where}: 'arguments' of {name!r} is a string that is not JSON") from None
    elif not isinstance(arguments, dict):
        raise RowError(f"{where}: 'arguments' of {name!r} must be an object or a JSON string, got {shown(arguments)}")
    parsed: dict[str, Any] = {"type": "function", "function": {"name": _encodable(name, where), "arguments": arguments}}
    if isinstance(call.get("id"), str):
        parsed["id"] = call["id"]
    return parsed


def _check_order(messages: list[dict[str, Any]]) -> None:
    roles = [m["role"] for m in messages]
    systems = [i for i, r in enumerate(roles) if r == "system"]
    if len(systems) > 1:
        raise RowError(f"{len(systems)} system messages; at most one is allowed")
    if systems and systems[0] != 0:
        raise RowError(f"system message at turn {systems[0]}; it must be the first turn")
    offset = 1 if systems else 0
    dialog = messages[offset:]
    if not dialog:
        raise RowError("no user or assistant turn")
    if dialog[0]["role"] != "user":
        raise RowError("the first non-system turn must be from the user")
    for index in range(1, len(dialog)):
        role, before = dialog[index]["role"], dialog[index - 1]
        turn = index + offset
        if role == "tool":  # a result answers the call before it (or follows another result)
            if not (before["role"] == "tool" or before.get("tool_calls")):
                raise RowError(f"turn {turn}: a tool turn must follow an assistant turn with 'tool_calls'")
        elif before.get("tool_calls"):
            raise RowError(f"turn {turn}: the assistant's tool calls at turn {turn - 1} have no tool turn with results")
        elif role == before["role"]:
            raise RowError(f"turn {turn}: two {role} turns in a row; roles must alternate")


def parse_row(row: Any, source: str, default_id: str) -> Conversation:
    """One raw row (already JSON-decoded) -> Conversation, or RowError naming the problem."""
    if not isinstance(row, dict):
        raise RowError(f"row must be a JSON object, got {type(row).__name__}")
    present = [key for key in CONVERSATION_KEYS if row.get(key) is not None]
    if not present:
        raise RowError("no 'conversations', 'messages' or 'prompt' field")
    if len(present) > 1:
        raise RowError(f"ambiguous row: has both {present[0]!r} and {present[1]!r}")
    key = present[0]
    if key == "prompt":
        messages = []
        if row.get("system") is not None:
            messages.append({"role": "system", "content": _text_of(row["system"], "'system'")})
        messages.append({"role": "user", "content": _text_of(row["prompt"], "'prompt'")})
    else:
        turns = row[key]
        if not isinstance(turns, list):
            raise RowError(f"'{key}' must be a list of turns, got {type(turns).__name__}")
        if not turns:
            raise RowError(f"'{key}' is empty")
        messages = [_parse_turn(turn, index) for index, turn in enumerate(turns)]
    _check_order(messages)
    raw_id = row.get("id", default_id)
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or (isinstance(raw_id, str) and not raw_id):
        raise RowError(f"'id' must be a non-empty string or an integer, got {shown(raw_id)}")
    if isinstance(raw_id, str):
        _encodable(raw_id, "'id'")
    for key in ("category", "split"):  # dropped silently, a row's split became the default: trained on
        if row.get(key) is not None and not isinstance(row[key], str):
            raise RowError(f"'{key}' must be a string, got {shown(row[key])}")
    meta: dict[str, Any] = {
        k: _encodable(row[k], f"'{k}'") for k in ("category", "split") if isinstance(row.get(k), str)
    }
    tools = row.get("tools")
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools) or key == "prompt"
    ):
        raise RowError("'tools' must be a list of function schemas (objects) beside 'messages'")
    provenance = row.get("provenance")
    if isinstance(provenance, dict) and provenance.get("finish_reason") == "length":
        meta["last_answer_truncated"] = True  # written by `eaglet regenerate` and cut at max_new_tokens
    return Conversation(source=source, id=str(raw_id), messages=messages, meta=meta, tools=tools or None)


# ---------------------------------------------------------------------------------------------
# Files


def _raw_rows(path: Path) -> Iterator[tuple[str, Any | BadRow]]:
    """Yield (location, decoded row or BadRow) for every row in the file."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl_rows(path)
    elif suffix == ".json":
        yield from _json_rows(path)
    elif suffix == ".parquet":
        yield from _parquet_rows(path)
    else:
        raise EagletError(f"{path}: unsupported file type {suffix or '(none)'}; use .jsonl, .json or .parquet")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any | BadRow]]:
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            if not raw.strip():
                continue  # blank lines are allowed
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, BadRow(where, f"not valid UTF-8 (byte {exc.start}); re-encode the file as UTF-8")
                continue
            try:
                yield where, json.loads(text)
            except json.JSONDecodeError as exc:
                yield where, BadRow(where, f"invalid JSON ({json_error_text(exc)})")
            except RecursionError:
                yield where, BadRow(where, TOO_DEEP)


def _json_rows(path: Path) -> Iterator[tuple[str, Any | BadRow]]:
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise EagletError(f"{path}: not valid UTF-8 (byte {exc.start}); re-encode the file as UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EagletError(f"{path}:{exc.lineno}: invalid JSON ({json_error_text(exc)})") from None
    except RecursionError:
        raise EagletError(f"{path}: {TOO_DEEP}") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise EagletError(f'{path}: a .json file must hold a list of rows (or {{"data": [...]}})')
    for index, row in enumerate(data):
        yield f"{path}:[{index}]", row


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any | BadRow]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:
        raise EagletError(f"{path}: not a readable parquet file ({str(exc).splitlines()[0]})") from None
    number = 0
    for batch in parquet.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            yield f"{path}:row {number}", {k: v for k, v in row.items() if v is not None}
            number += 1


def read_conversations(paths: list[str | Path]) -> Iterator[Conversation | BadRow]:
    """Every row of every file, in order: a Conversation or a BadRow. File-level problems raise."""
    seen_ids: dict[str, str] = {}
    for raw_path in paths:
        path = Path(raw_path)
        if not path.exists():
            raise EagletError(f"{path}: file not found")
        if path.is_dir():
            raise EagletError(f"{path}: is a directory; pass the data files inside it")
        if path.stat().st_size == 0:
            raise EagletError(f"{path}: file is empty")
        count = 0
        for where, row in _raw_rows(path):
            count += 1
            if isinstance(row, BadRow):
                yield row
                continue
            try:
                conversation = parse_row(row, where, default_id=f"{path.stem}:{count}")
            except RowError as exc:
                yield BadRow(where, str(exc))
                continue
            if conversation.id in seen_ids:
                yield BadRow(where, f"duplicate id {conversation.id!r} (first at {seen_ids[conversation.id]})")
                continue
            seen_ids[conversation.id] = where
            yield conversation
        if count == 0:
            raise EagletError(f"{path}: no rows (the file holds only blank lines)")
