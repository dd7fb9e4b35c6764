"""`eaglet synthesize`: prompts written by the target itself (the Magpie method), for users with no prompt set.

An instruction-tuned model, given only its chat template's opening of a user turn, writes a user message: what its
own training made likely. Those messages are the target's own prompt distribution; `eaglet regenerate` answers them
like any prompt file. Kept are messages that end their turn, have ``min_words`` words or more, are neither an
exact duplicate (after lower-casing and folding whitespace and punctuation) nor a near duplicate of one kept before
(Jaccard similarity of word trigrams above ``max_similarity``), and whose first two words do not already open
``max_opening_share`` of the prompts asked for: a small chat model opens most of its user turns alike ("Can you
help me ..."), and a draft learns from the answers to what was asked.

Crash safety: every batch's raw generations are appended (fsynced) to ``OUT.raw.jsonl`` with the batch index; a
restarted run reads them, skips those batches, and the filter runs over the same raw rows in the same order, so a
resumed run writes the same file as an uninterrupted one (seeded per batch).
"""

from __future__ import annotations

import hashlib
import json
import math
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
OPENING_WORDS = 2  # a message's opening, for the diversity cap ("can you ...", "what is ...")
BATCH_SEED_STRIDE = 1_000_003
SPLIT_BUCKETS = 10_000
MANIFEST_SCHEMA = "eaglet.synthesized/1"
# give up early once a run that has kept nothing would, at this chance or less, have kept nothing so far even at
# the lowest rate that still fills --count within --max-batches (a message is kept less often as more are kept)
GIVE_UP_CHANCE = 1e-3


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


class PromptFilter:
    """Keeps, in the order given, the messages that closed their turn, are long enough, are neither a duplicate nor a
    near duplicate of one kept before, and open with two words not yet opening ``max_opening_share`` of ``count``
    kept ones. Incremental (one batch at a time, as they are generated) and exact: a
    message is compared only with the kept ones sharing a shingle with it (an index from shingle to kept messages),
    since a Jaccard similarity above ``max_similarity`` >= 0 needs one shared shingle."""

    def __init__(self, min_words: int, max_similarity: float, count: int, max_opening_share: float = 1.0):
        self.min_words, self.max_similarity, self.count = min_words, max_similarity, count
        self.opening_limit = max(1, math.ceil(max_opening_share * count))  # kept messages per opening
        self.kept: list[str] = []
        self.dropped = {"unfinished": 0, "too short": 0, "duplicate": 0, "near duplicate": 0, "common opening": 0}
        self._openings: dict[tuple[str, ...], int] = {}
        self._seen: set[str] = set()
        self._kept_shingles: list[set[tuple[str, ...]]] = []
        self._holders: dict[tuple[str, ...], list[int]] = {}  # shingle -> indices of kept messages that have it

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.count

    def add(self, texts: list[str | None]) -> None:
        for text in texts:
            if self.full:
                return
            if text is None:
                self.dropped["unfinished"] += 1
                continue
            key = normalized(text)
            opening, own = tuple(key.split()[:OPENING_WORDS]), shingles(text)
            reason = self._rejection(key, opening, own)
            if reason is not None:
                self.dropped[reason] += 1
                continue
            for shingle in own:
                self._holders.setdefault(shingle, []).append(len(self.kept))
            self._openings[opening] = self._openings.get(opening, 0) + 1
            self.kept.append(text.strip())
            self._seen.add(key)
            self._kept_shingles.append(own)

    def _rejection(self, key: str, opening: tuple[str, ...], own: set[tuple[str, ...]]) -> str | None:
        """Why a finished message (folded to ``key``, with its opening words and shingles) is dropped, or None."""
        if len(key.split()) < self.min_words:
            return "too short"
        if key in self._seen:
            return "duplicate"
        if self._openings.get(opening, 0) >= self.opening_limit:
            return "common opening"
        candidates = {index for shingle in own for index in self._holders.get(shingle, ())}
        if any(similarity(own, self._kept_shingles[index]) > self.max_similarity for index in candidates):
            return "near duplicate"
        return None


def filter_prompts(
    texts: list[str | None], min_words: int, max_similarity: float, count: int, max_opening_share: float = 1.0
) -> PromptFilter:
    """The first ``count`` texts that are long enough, neither a duplicate nor a near duplicate of an earlier kept
    one, and whose opening words are not yet on ``max_opening_share`` of ``count`` kept ones, in order."""
    kept = PromptFilter(min_words, max_similarity, count, max_opening_share)
    kept.add(texts)
    return kept


def hopeless(filtered: PromptFilter, config: SynthesizeConfig, batch_size: int, batches_done: int) -> bool:
    """Nothing kept after so many messages that even the lowest keep rate that could still fill ``config.count``
    in ``config.max_batches`` would have kept one by now, but for a ``GIVE_UP_CHANCE``: stop rather than run every
    batch (a --max-new-tokens too short to close a turn left a CPU run generating for hours)."""
    if filtered.kept or batches_done >= config.max_batches:
        return False
    lowest_rate = config.count / (config.max_batches * batch_size)
    return (1 - lowest_rate) ** (batches_done * batch_size) <= GIVE_UP_CHANCE


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


def manifest_path(out: Path) -> Path:
    return out.with_name(out.name + ".manifest.json")


def foreign_output_problem(out: Path) -> str | None:
    """Why writing ``out`` would destroy a file this stage did not write, or None. --out is replaced whole at the
    end, so an existing file must be a finished synthesis (its manifest beside it), never the user's own data."""
    if not out.exists():
        return None
    try:
        schema = json.loads(manifest_path(out).read_text(encoding="utf-8")).get("schema")
    except (OSError, ValueError, AttributeError, RecursionError):  # ValueError: JSONDecodeError and bad UTF-8
        schema = None
    if schema == MANIFEST_SCHEMA:
        return None
    return (
        f"--out {out}: exists and was not written by `eaglet synthesize` (no {manifest_path(out).name} beside it); "
        "it would be replaced: use another --out or delete the file"
    )


def load_raw(path: Path, settings: dict[str, Any]) -> dict[int, list[str | None]]:
    """Batches already generated (a torn last line is dropped); refused when made with other settings."""
    if not path.is_file():
        return {}
    batches: dict[int, list[str | None]] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise EagletError(f"{path}: not UTF-8 text (byte {exc.start}); delete {path} to start over") from None
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            if number == len(lines):
                break  # the batch a kill interrupted: generated again
            raise EagletError(f"{path}:{number}: not JSON; delete {path} to start over") from None
        if not isinstance(row, dict) or row.get("settings") != settings or not isinstance(row.get("texts"), list):
            raise EagletError(f"{path}:{number}: made with other settings; delete {path} or use another --out")
        batch, texts = row.get("batch"), row["texts"]
        if type(batch) is not int or batch < 0 or not all(text is None or isinstance(text, str) for text in texts):
            raise EagletError(
                f"{path}:{number}: not a batch `eaglet synthesize` wrote (its batch number or texts); delete {path} "
                "to start over"
            )
        batches[batch] = texts
    return batches


class Writer:
    """The target writing user turns: one batch of the same prefix, sampled, stopped where the turn closes."""

    def __init__(self, config: SynthesizeConfig):
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

    def batch(self, seed: int) -> list[str | None]:
        """``batch_size`` user messages; None for one that did not close its turn within max_new_tokens."""
        generator, config = self.generator, self.config
        new = generator.sample(
            [self.prefix] * generator.batch_size, config.max_new_tokens, config.temperature, config.top_p, seed
        )
        texts: list[str | None] = []
        for tokens in new:
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
        problem = foreign_output_problem(out)
        if problem:
            raise EagletError(problem)
        return _synthesize(config, out, console)


def _synthesize(config: SynthesizeConfig, out: Path, console: Console) -> SynthesizeResult:
    settings = settings_of(config)
    raw = raw_path(out)
    batches = load_raw(raw, settings)
    started = time.perf_counter()
    writer: Writer | None = None

    def texts() -> list[str | None]:
        return [text for index in sorted(batches) for text in batches[index]]

    filtered = PromptFilter(config.min_words, config.max_similarity, config.count, config.max_opening_share)
    with progress_bar("prompts", console) as progress:
        task = progress.add_task("synthesize", total=config.count)
        for index in range(config.max_batches):  # batches in order, read back or generated: a resumed run filters alike
            if index not in batches:
                writer = writer or Writer(config)
                batches[index] = writer.batch(config.seed * BATCH_SEED_STRIDE + index)
                if writer.writes:
                    line = json.dumps(
                        {"batch": index, "settings": settings, "texts": batches[index]}, ensure_ascii=False
                    )
                    append_lines_durable(raw, [line])
            filtered.add(batches[index])
            progress.update(task, completed=len(filtered.kept))
            if filtered.full or hopeless(filtered, config, len(batches[index]), index + 1):
                break
    if writer is not None and not writer.writes:
        return SynthesizeResult(out, len(filtered.kept), len(texts()), time.perf_counter() - started, {})
    if len(filtered.kept) < config.count:
        raise EagletError(
            f"{out}: {len(filtered.kept)} of {config.count} prompts after {index + 1} of --max-batches "
            f"{config.max_batches} (dropped: "
            f"{', '.join(f'{n} {reason}' for reason, n in filtered.dropped.items() if n)}); "
            + (
                "raise --max-new-tokens (messages must close their turn within it)"
                if filtered.dropped["unfinished"] == sum(filtered.dropped.values())
                else "raise --max-batches, lower --min-words, or raise --max-similarity or --max-opening-share"
            )
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
        "schema": MANIFEST_SCHEMA,
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
        "hf_engine": writer.generator.used if writer is not None else None,  # engine -> why it ran (this run)
    }
    write_json_atomic(manifest_path(out), manifest)
    return SynthesizeResult(out, len(rows), len(texts()), manifest["seconds"], manifest)
