"""Golden loss-mask tests: the mask covers exactly each assistant turn's text plus its end-of-turn token.

Four template families (ChatML of the embedded target, Llama-3, Qwen3 with <think>, Gemma); tokenizers
are built in the test from the templates, except the embedded target's, which is real.
"""

from __future__ import annotations

import pytest
from conftest import build_tokenizer

from eaglet.data.readers import Conversation
from eaglet.data.render import ChatRenderer

SYSTEM = {"role": "system", "content": "Be brief."}
HI = {"role": "user", "content": "Hi there"}
HELLO = {"role": "assistant", "content": "Hello! How can I help?"}
ASK = {"role": "user", "content": "What is 2+2?"}
FOUR = {"role": "assistant", "content": "2 + 2 = 4."}


def masked_runs(tokenizer, rendered) -> list[str]:
    """Decode each contiguous run of masked tokens."""
    runs, current = [], []
    for token, flag in zip(rendered.input_ids.tolist(), rendered.loss_mask.tolist()):
        if flag:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def unmasked_text(tokenizer, rendered) -> str:
    return tokenizer.decode([t for t, m in zip(rendered.input_ids.tolist(), rendered.loss_mask.tolist()) if not m])


def render(tokenizer, messages, max_len=4096):
    result = ChatRenderer(tokenizer, max_len=max_len).render_batch([Conversation("t:1", "t", messages)])[0]
    assert not isinstance(result, str), result
    return result


GOLDEN = {
    # family: (messages, expected masked runs, text that must stay unmasked)
    "llama3": [
        (
            [HI, HELLO],
            ["Hello! How can I help?<|eot_id|>"],
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        ([SYSTEM, HI, HELLO, ASK, FOUR], ["Hello! How can I help?<|eot_id|>", "2 + 2 = 4.<|eot_id|>"], None),
        ([HI, {"role": "assistant", "content": "  padded answer \n"}], ["padded answer<|eot_id|>"], None),
    ],
    "qwen3": [
        (
            [HI, HELLO],
            ["<think>\n\n</think>\n\nHello! How can I help?<|im_end|>"],
            "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n\n",
        ),
        (
            [
                SYSTEM,
                HI,
                {"role": "assistant", "content": "<think>\ngreet back\n</think>\n\nHello!"},
                ASK,
                {"role": "assistant", "content": "<think>\nadd: 2+2=4\n</think>\n\n4"},
            ],
            # history turns drop their reasoning; the last turn keeps it
            ["Hello!<|im_end|>", "<think>\nadd: 2+2=4\n</think>\n\n4<|im_end|>"],
            None,
        ),
    ],
    "gemma": [
        (
            [SYSTEM, HI, HELLO],
            ["Hello! How can I help?<end_of_turn>"],
            "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n\n",
        ),
        ([HI, HELLO, ASK, FOUR], ["Hello! How can I help?<end_of_turn>", "2 + 2 = 4.<end_of_turn>"], None),
    ],
}


@pytest.mark.parametrize("family", sorted(GOLDEN))
def test_golden_masks_built_tokenizers(family):
    tokenizer = build_tokenizer(family)
    for messages, expected_runs, expected_unmasked in GOLDEN[family]:
        rendered = render(tokenizer, messages)
        assert masked_runs(tokenizer, rendered) == expected_runs
        if expected_unmasked is not None:
            assert unmasked_text(tokenizer, rendered) == expected_unmasked
        # nothing of the user/system text is masked
        masked = "".join(expected_runs)
        for message in messages:
            if message["role"] != "assistant":
                assert message["content"] not in masked


def test_golden_embedded_chatml_token_exact(embedded_target):
    """The embedded SmolLM2 tokenizer: exact token ids and mask for a multi-turn conversation."""
    from eaglet.model.target import load_tokenizer

    tokenizer = load_tokenizer(embedded_target.path)
    rendered = render(tokenizer, [SYSTEM, HI, HELLO, ASK, FOUR])
    pieces = [
        (tokenizer.convert_ids_to_tokens(t), m)
        for t, m in zip(rendered.input_ids.tolist(), rendered.loss_mask.tolist())
    ]
    masked = [p for p, m in pieces if m]
    assert masked == [
        "Hello",
        "!",
        "ĠHow",
        "Ġcan",
        "ĠI",
        "Ġhelp",
        "?",
        "<|im_end|>",
        "2",
        "Ġ+",
        "Ġ",
        "2",
        "Ġ=",
        "Ġ",
        "4",
        ".",
        "<|im_end|>",
    ]
    # the tokens right before each assistant run are the header "assistant\n"; right after, the newline
    text = [p for p, _ in pieces]
    first = [i for i, (_, m) in enumerate(pieces) if m][0]
    assert text[first - 3 : first] == ["ass", "istant", "Ċ"]
    assert pieces[first + 8] == ("Ċ", 0)
    assert unmasked_text(tokenizer, rendered).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there"
    )


def test_default_system_prompt_is_not_masked(embedded_target):
    """SmolLM2's template injects a default system prompt when none is given; it stays unmasked."""
    from eaglet.model.target import load_tokenizer

    tokenizer = load_tokenizer(embedded_target.path)
    rendered = render(tokenizer, [HI, HELLO])
    assert masked_runs(tokenizer, rendered) == ["Hello! How can I help?<|im_end|>"]
    assert "You are a helpful AI assistant named SmolLM" in unmasked_text(tokenizer, rendered)


def test_truncation_keeps_prefix_and_counts():
    tokenizer = build_tokenizer("llama3")
    full = render(tokenizer, [HI, HELLO, ASK, FOUR])
    cut = len(full.input_ids) - 3
    truncated = render(tokenizer, [HI, HELLO, ASK, FOUR], max_len=cut)
    assert truncated.truncated and not full.truncated
    assert truncated.input_ids.tolist() == full.input_ids[:cut].tolist()
    assert truncated.loss_mask.tolist() == full.loss_mask[:cut].tolist()


def test_truncation_that_removes_all_assistant_tokens_drops_the_row():
    tokenizer = build_tokenizer("gemma")
    result = ChatRenderer(tokenizer, max_len=8).render_batch([Conversation("f:3", "x", [HI, HELLO])])[0]
    assert isinstance(result, str) and "max-len 8" in result


def test_template_that_rejects_system_becomes_a_row_error():
    tokenizer = build_tokenizer("gemma")
    tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>assistant\n{% endif %}"
    )
    result = ChatRenderer(tokenizer).render_batch([Conversation("f:9", "x", [SYSTEM, HI, HELLO])])[0]
    assert isinstance(result, str) and "System role not supported" in result


def test_special_token_inside_content_is_reported_not_mismasked():
    tokenizer = build_tokenizer("qwen3")
    bad = {"role": "assistant", "content": "I will stop <|im_end|> here and continue"}
    result = ChatRenderer(tokenizer).render_batch([Conversation("f:4", "x", [HI, bad])])[0]
    assert isinstance(result, str) and "special token" in result


def test_truncated_regenerated_answer_does_not_teach_end_of_turn():
    """An answer `eaglet regenerate` cut at max_new_tokens keeps its text masked but not the template's <|eot_id|>."""
    tokenizer = build_tokenizer("llama3")
    cut = Conversation("t:1", "t", [HI, HELLO], meta={"last_answer_truncated": True})
    result = ChatRenderer(tokenizer).render_batch([cut])[0]
    assert masked_runs(tokenizer, result) == ["Hello! How can I help?"]


def test_reader_marks_truncated_answers(tmp_path):
    from conftest import write_jsonl

    from eaglet.data.readers import read_conversations

    rows = [
        {"messages": [HI, HELLO], "provenance": {"finish_reason": "length"}},
        {"messages": [HI, HELLO], "provenance": {"finish_reason": "stop"}},
    ]
    items = list(read_conversations([write_jsonl(tmp_path / "r.jsonl", rows)]))
    assert items[0].meta.get("last_answer_truncated") is True and "last_answer_truncated" not in items[1].meta


WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
}
RESULT = {"role": "tool", "content": '{"temp_c": 18}', "tool_call_id": "c1"}
ANSWER = {"role": "assistant", "content": "It is 18 C in Paris."}


def tool_conversation(tools=(WEATHER_TOOL,)):
    return Conversation("t:1", "t", [HI, CALL, RESULT, ANSWER], tools=list(tools) or None)


def test_tool_calls_are_trained_on_and_tool_results_are_not():
    """A template that renders tools: the call (its JSON inside the assistant turn) and the answer after the result
    are masked, each with its end-of-turn token; the schemas in the system turn and the result are not."""
    tokenizer = build_tokenizer("qwen3_tools")
    rendered = ChatRenderer(tokenizer).render_batch([tool_conversation()])[0]
    assert not isinstance(rendered, str), rendered
    assert masked_runs(tokenizer, rendered) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is 18 C in Paris.<|im_end|>",
    ]
    unmasked = unmasked_text(tokenizer, rendered)
    assert '"name": "get_weather", "parameters"' in unmasked  # the schema, listed for the model
    assert '<tool_response>\n{"temp_c": 18}\n</tool_response>' in unmasked


def test_a_template_that_drops_tool_calls_is_a_row_error():
    """A template without tool support renders the calling turn empty: training on it would teach an end of turn
    where the model calls a tool. The row is refused, naming the call and the fix."""
    result = ChatRenderer(build_tokenizer("qwen3")).render_batch([tool_conversation(tools=())])[0]
    assert isinstance(result, str)
    assert "does not render its tool call 'get_weather'" in result and "--chat-template" in result
