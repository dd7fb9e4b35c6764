"""Render conversations with the target's own chat template and mark the assistant tokens.

No per-model patterns: the start of assistant turn ``i`` is where the full rendering stops agreeing
with ``render(messages[:i], add_generation_prompt=True)`` (the prompt the target sees when it writes
that turn). From there the mask runs to and including the first *special* token (the end-of-turn
token: ``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``...). Role headers, system and user text,
and separators after the end-of-turn token stay unmasked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import EagletError
from .readers import Conversation


@dataclass
class Rendered:
    id: str
    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] uint8, 1 on assistant content + end-of-turn tokens
    truncated: bool


class TemplateRejected(ValueError):
    """The chat template raised for this conversation (e.g. it does not accept a system turn)."""


def _common_prefix_length(a: str, b: str) -> int:
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    lo, hi = 0, limit  # binary search on the first differing character
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _final_answer(content: str) -> str:
    """The part of an assistant message that every template keeps verbatim (reasoning may be dropped)."""
    return content.split("</think>")[-1].strip()


class ChatRenderer:
    """Turns a Conversation into token ids and an assistant-token mask, for one tokenizer+template."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None, max_len: int = 2048):
        self.tokenizer = tokenizer
        self.template = chat_template or tokenizer.chat_template
        if not isinstance(self.template, str) or not self.template:
            raise EagletError(
                "target has no chat template; pass --chat-template FILE.jinja (the template the model will be served with)"
            )
        self.max_len = max_len
        self.backend = tokenizer.backend_tokenizer
        self.special_ids = np.array(
            sorted(i for i, token in tokenizer.added_tokens_decoder.items() if token.special), dtype=np.int64
        )

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list | None = None) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as exc:  # jinja raise_exception(...) and friends
            raise TemplateRejected(f"chat template rejected the conversation: {str(exc).splitlines()[0]}") from None

    def spans(self, conversation: Conversation) -> tuple[str, list[int]]:
        """The full rendering and the character offset where each assistant turn's text starts."""
        messages, tools = conversation.messages, conversation.tools
        full = self._render(messages, add_generation_prompt=False, tools=tools)
        starts = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self._render(messages[:index], add_generation_prompt=True, tools=tools)
            starts.append(_common_prefix_length(prompt, full))
        return full, starts

    def render_batch(self, conversations: list[Conversation]) -> list[Rendered | str]:
        """Render + tokenize a batch; an entry is a reason string where the row cannot be used."""
        texts: list[str] = []
        starts: list[list[int]] = []
        failures: dict[int, str] = {}
        for position, conversation in enumerate(conversations):
            try:
                text, turn_starts = self.spans(conversation)
            except TemplateRejected as exc:
                failures[position] = str(exc)
                text, turn_starts = "", []
            texts.append(text)
            starts.append(turn_starts)
        encodings = self.backend.encode_batch(texts, add_special_tokens=False)
        results: list[Rendered | str] = []
        for position, (conversation, encoding) in enumerate(zip(conversations, encodings)):
            if position in failures:
                results.append(failures[position])
                continue
            results.append(self._mask(conversation, texts[position], starts[position], encoding))
        return results

    def _mask(self, conversation: Conversation, text: str, starts: list[int], encoding: Any) -> Rendered | str:
        ids = np.asarray(encoding.ids, dtype=np.int64)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), dtype=np.uint8)
        is_special = np.isin(ids, self.special_ids)
        turns = [m for m in conversation.messages if m["role"] == "assistant"]
        answers = [_final_answer(m["content"]) for m in turns]
        cut_last = bool(conversation.meta.get("last_answer_truncated"))
        for turn, (start_char, answer) in enumerate(zip(starts, answers)):
            first = int(np.searchsorted(offsets[:, 1], start_char, side="right"))  # first token ending past start
            while first < len(ids) and is_special[first] and offsets[first, 0] < start_char:
                first += 1  # a special token of the header that merely touches the start
            following = np.nonzero(is_special[first:])[0]
            if len(following) == 0:
                return f"assistant turn {turn}: no end-of-turn token after it in the rendered template"
            last = first + int(following[0])  # inclusive: the end-of-turn token
            # an answer cut at max_new_tokens never ended: its template-added end-of-turn is not a target
            mask[first : last + (0 if cut_last and turn == len(starts) - 1 else 1)] = 1
            span_text = text[offsets[first, 0] : offsets[last, 1]]
            if answer and answer not in span_text:
                return (
                    f"assistant turn {turn}: its text is not where the chat template renders the turn (the text "
                    "holds a special token, or the template rewrites it; use --chat-template with one that emits it verbatim)"
                )
            missing = [c["function"]["name"] for c in turns[turn].get("tool_calls", [])]
            missing = [name for name in missing if name not in span_text]
            if missing:
                return (
                    f"assistant turn {turn}: the chat template does not render its tool call {missing[0]!r} in the "
                    "turn; use --chat-template with one that renders tool calls (the one the model is served with)"
                )
        truncated = len(ids) > self.max_len
        if truncated:
            ids, mask = ids[: self.max_len], mask[: self.max_len]
        if not mask.any():
            return f"no assistant tokens within --max-len {self.max_len}"
        return Rendered(conversation.id, ids.astype(np.int32), mask, truncated)
