"""`eaglet synthesize`: prompts written by the target itself (the Magpie method), for users with no prompt set.

An instruction-tuned model, given only its chat template's opening of a user turn, writes a user message: what its
own training made likely. Those messages are the target's own prompt distribution; `eaglet regenerate` answers them
like any prompt file. Kept are messages that end their turn, have ``min_words`` words or more, and are neither an
exact duplicate (after lower-casing and folding whitespace and punctuation) nor a near duplicate of one kept before
(Jaccard similarity of word trigrams above ``max_similarity``).

Crash safety: every batch's raw generations are appended (fsynced) to ``OUT.raw.jsonl`` with the batch index; a
restarted run reads them, skips those batches, and the filter runs over the same raw rows in the same order, so a
resumed run writes the same file as an uninterrupted one (seeded per batch).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from .. import __version__
from ..config import SynthesizeConfig
from ..errors import EagletError
from ..fsio import (
    append_lines_durable,
    check_output_apart,
    check_output_dir,
    output_lock,
    write_bytes_atomic,
    write_json_atomic,
)
from ..progress import progress_bar
from .generation import load_generator

MARKER = "\u2063EAGLET-USER-TEXT\u2063"  # invisible separators around a word no template writes itself
SHINGLE = 3  # words per shingle of the near-duplicate test
BATCH_SEED_STRIDE = 1_000_003
SPLIT_BUCKETS = 10_000


@dataclass(frozen=True)
class UserTurn:
    prefix: str  # the template's text before a user message (system prompt included when the template adds one)
    suffix: str  # the text that closes the user message


def user_turn(tokenizer: Any, where: str) -> UserTurn:
    """Where the user's text goes in the target's chat template, found by rendering a marker as the message."""
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        raise EagletError(f"target {where}: no chat template, so there is no user turn to start; pass a chat model")
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False)
    if text.count(MARKER) != 1:
        raise EagletError(f"target {where}: its chat template does not write the user's message once as given")
    prefix, suffix = text.split(MARKER)
    return UserTurn(prefix, suffix)


def normalized(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def shingles(text: str) -> set[tuple[str, ...]]:
    words = normalized(text).split()
    return {tuple(words[i : i + SHINGLE]) for i in range(max(1, len(words) - SHINGLE + 1))}


def similarity(a: set[tuple[str, ...]], b: set[tuple[str, ...]]) -> float:
    return len(a & b) / len(a | b) if a and b else 0.0


@dataclass
class Filtered:
    kept: list[str]
    dropped: dict[str, int]  # reason -> count


def filter_prompts(texts: list[str], min_words: int, max_similarity: float, count: int) -> Filtered:
    """The first ``count`` texts that are long enough and neither a duplicate nor a near duplicate of an earlier
    kept one, in order."""
    kept: list[str] = []
    seen: set[str] = set()
    kept_shingles: list[set[tuple[str, ...]]] = []
    dropped = {"unfinished": 0, "too short": 0, "duplicate": 0, "near duplicate": 0}
    for text in texts:
        if len(kept) == count:
            break
        if text is None:
            dropped["unfinished"] += 1
            continue
        key = normalized(text)
        if len(key.split()) < min_words:
            dropped["too short"] += 1
        elif key in seen:
            dropped["duplicate"] += 1
        elif any(similarity(shingles(text), other) > max_similarity for other in kept_shingles):
            dropped["near duplicate"] += 1
        else:
            kept.append(text.strip())
            seen.add(key)
            kept_shingles.append(shingles(text))
    return Filtered(kept, dropped)


def split_of(text: str, heldout_fraction: float) -> str:
    """A stable split from the text alone (the same prompt lands in the same split whatever the run)."""
    bucket = int(hashlib.sha256(normalized(text).encode()).hexdigest(), 16) % SPLIT_BUCKETS
    return "heldout" if bucket < heldout_fraction * SPLIT_BUCKETS else "train"


def settings_of(config: SynthesizeConfig) -> dict[str, Any]:
    """What decides the raw generations; a resumed run must use the same."""
    return {
        "target": config.target,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "max_new_tokens": config.max_new_tokens,
        "batch_size": config.batch_size,
        "seed": config.seed,
    }


def raw_path(out: Path) -> Path:
    return out.with_name(out.name.removesuffix(".jsonl") + ".raw.jsonl")


def load_raw(path: Path, settings: dict[str, Any]) -> dict[int, list[str | None]]:
    """Batches already generated (a torn last line is dropped); refused when made with other settings."""
    if not path.is_file():
        return {}
    batches: dict[int, list[str | None]] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # the batch a kill interrupted: generated again
            raise EagletError(f"{path}:{number}: not JSON; delete {path} to start over") from None
        if not isinstance(row, dict) or row.get("settings") != settings or not isinstance(row.get("texts"), list):
            raise EagletError(f"{path}:{number}: made with other settings; delete {path} or use another --out")
        batches[int(row["batch"])] = row["texts"]
    return batches


class Writer:
    """The target writing user turns: one batch of the same prefix, sampled, stopped where the turn closes."""

    def __init__(self, config: SynthesizeConfig):
        import torch

        self.config = config
        turns: list[UserTurn] = []

        def closing_token(tokenizer: Any) -> set[int]:  # the token that ends a user turn stops a message too
            turns.append(user_turn(tokenizer, config.target))
            closing = tokenizer.backend_tokenizer.encode(turns[0].suffix, add_special_tokens=False).ids
            return {closing[0]} if closing else set()

        self.generator = load_generator(config, closing_token)
        self.tokenizer = self.generator.tokenizer
        self.prefix = self.tokenizer.backend_tokenizer.encode(turns[0].prefix, add_special_tokens=False).ids
        self.writes = self.generator.writes
        self.torch = torch

    def batch(self, seed: int) -> list[str | None]:
        """``batch_size`` user messages; None for one that did not close its turn within max_new_tokens."""
        torch, generator = self.torch, self.generator
        input_ids = torch.tensor([self.prefix] * generator.batch_size, dtype=torch.long, device=generator.device)
        torch.manual_seed(seed)
        with torch.inference_mode():
            output = generator.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=self.config.max_new_tokens,
                do_sample=True,
                temperature=self.config.temperature,
                top_p=self.config.top_p,
                top_k=None,
                eos_token_id=generator.stop_ids,
                pad_token_id=generator.pad_id,
            )
        texts: list[str | None] = []
        for tokens in output[:, len(self.prefix) :].tolist():
            kept, stopped = generator.until_stop(tokens)
            texts.append(self.tokenizer.decode(kept, skip_special_tokens=True) if stopped else None)
        return texts


@dataclass
class SynthesizeResult:
    out: Path
    kept: int
    generated: int
    seconds: float
    manifest: dict[str, Any]


def run_synthesize(config: SynthesizeConfig, console: Console | None = None) -> SynthesizeResult:
    """``config.count`` prompts by the target in ``config.out`` (resumed where a killed run stopped)."""
    console = console or Console(stderr=True)
    out = Path(config.out)
    if out.suffix != ".jsonl":
        raise EagletError(f"{out}: --out must be a .jsonl file")
    if out.is_dir():
        raise EagletError(f"--out {out}: a directory; give a .jsonl file path")
    check_output_apart(out, [config.target])
    check_output_dir(out.parent, "--out's directory")
    with output_lock(out):
        return _synthesize(config, out, console)


def _synthesize(config: SynthesizeConfig, out: Path, console: Console) -> SynthesizeResult:
    settings = settings_of(config)
    raw = raw_path(out)
    batches = load_raw(raw, settings)
    max_batches = config.max_batches
    started = time.perf_counter()
    writer: Writer | None = None

    def texts() -> list[str | None]:
        return [text for index in sorted(batches) for text in batches[index]]

    with progress_bar("prompts", console) as progress:
        task = progress.add_task("synthesize", total=config.count)
        index = 0
        while True:
            filtered = filter_prompts(texts(), config.min_words, config.max_similarity, config.count)
            progress.update(task, completed=len(filtered.kept))
            if len(filtered.kept) >= config.count or index >= max_batches:
                break
            if index not in batches:
                writer = writer or Writer(config)
                batches[index] = writer.batch(config.seed * BATCH_SEED_STRIDE + index)
                if writer.writes:
                    append_lines_durable(
                        raw,
                        [
                            json.dumps(
                                {"batch": index, "settings": settings, "texts": batches[index]}, ensure_ascii=False
                            )
                        ],
                    )
            index += 1
    if writer is not None and not writer.writes:
        return SynthesizeResult(out, len(filtered.kept), len(texts()), time.perf_counter() - started, {})
    if len(filtered.kept) < config.count:
        raise EagletError(
            f"{out}: {len(filtered.kept)} of {config.count} prompts after {max_batches} batches (dropped: "
            f"{', '.join(f'{n} {reason}' for reason, n in filtered.dropped.items() if n)}); raise --max-batches, "
            "lower --min-words or raise --max-similarity"
        )
    rows = [
        {
            "id": f"synth-{number:06d}",
            "prompt": text,
            "split": split_of(text, config.heldout_fraction),
            "category": "synthesized",
        }
        for number, text in enumerate(filtered.kept)
    ]
    write_bytes_atomic(out, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8"))
    manifest = {
        "schema": "eaglet.synthesized/1",
        "eaglet_version": __version__,
        "settings": settings,
        "config": config.model_dump(),
        "counts": {
            "kept": len(rows),
            "generated": len(texts()),
            "dropped": filtered.dropped,
            "heldout": sum(row["split"] == "heldout" for row in rows),
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    write_json_atomic(out.with_name(out.name + ".manifest.json"), manifest)
    return SynthesizeResult(out, len(rows), len(texts()), manifest["seconds"], manifest)
