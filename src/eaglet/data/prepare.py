"""`eaglet prepare`: conversation files -> token ids, assistant loss masks and the draft vocabulary.

Writes ``DIR/samples.parquet`` (``id``, ``input_ids`` list<int32>, ``loss_mask`` list<uint8>),
``DIR/vocab.safetensors`` (``d2t``, ``t2d``, ``counts``) and ``DIR/manifest.json``, all into a
temporary directory renamed at the end: an interrupted run leaves no ``DIR``.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

from .. import __version__
from ..config import PrepareConfig
from ..errors import EagletError
from ..formats.files import MANIFEST_FILE, PREPARED_SCHEMA, SAMPLES_FILE, VOCAB_FILE
from ..formats.target_record import target_source
from ..fsio import atomic_directory, check_output_apart, check_output_dir, sha256_file, sha256_json, write_json_atomic
from ..model.target import context_length, hub_id_of, load_tokenizer, resolve_target, target_info
from ..progress import progress_bar
from .readers import BadRow, Conversation, describe_splits, fail_on_bad_rows, read_conversations
from .render import ChatRenderer, Rendered
from .vocab import build_draft_vocab, default_draft_vocab_size

RENDER_BATCH = 512
# below this share of the answers' tokens in the draft vocabulary, say so: the draft can never propose the rest
MIN_DRAFT_VOCAB_COVERAGE = 0.95
PARQUET_SCHEMA = pa.schema(
    [("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8()))]
)


@dataclass
class PrepareResult:
    out: Path
    manifest: dict[str, Any]
    bad_rows: list[BadRow] = field(default_factory=list)


def _to_table(rows: list[Rendered]) -> pa.Table:
    lengths = np.fromiter((len(r.input_ids) for r in rows), dtype=np.int32, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    ids = pa.array(np.concatenate([r.input_ids for r in rows]), type=pa.int32())
    mask = pa.array(np.concatenate([r.loss_mask for r in rows]), type=pa.uint8())
    return pa.Table.from_arrays(
        [
            pa.array([r.id for r in rows], type=pa.string()),
            pa.ListArray.from_arrays(pa.array(offsets), ids),
            pa.ListArray.from_arrays(pa.array(offsets), mask),
        ],
        schema=PARQUET_SCHEMA,
    )


def _collect(config: PrepareConfig) -> tuple[list[Conversation], list[BadRow], Counter[str]]:
    """The conversations of ``config.split``, the bad rows, and how many rows each other split had."""
    conversations, bad, other_splits = [], [], Counter()
    for item in read_conversations(config.inputs):
        if isinstance(item, BadRow):
            bad.append(item)
        elif config.split != "all" and (split := item.meta.get("split", "train")) != config.split:
            other_splits[split] += 1
        elif not item.has_assistant:
            bad.append(
                BadRow(item.source, "no assistant turn (prompt-only rows need answers: run `eaglet regenerate` first)")
            )
        else:
            conversations.append(item)
    return conversations, bad, other_splits


def _length_stats(lengths: np.ndarray) -> dict[str, float]:
    if len(lengths) == 0:
        return {}
    return {
        "mean": round(float(lengths.mean()), 2),
        "p50": float(np.percentile(lengths, 50)),
        "p95": float(np.percentile(lengths, 95)),
        "max": int(lengths.max()),
    }


def run_prepare(config: PrepareConfig, console: Console | None = None) -> PrepareResult:
    console = console or Console(stderr=True)
    out = check_output_dir(config.out)
    check_output_apart(out, [*config.inputs, config.chat_template, config.target])
    if out.exists() and not config.overwrite:
        raise EagletError(f"{out}: already exists; pass --overwrite to replace it, or choose another --out")
    started = time.perf_counter()
    target = resolve_target(config.target, config.trust_remote_code)
    tokenizer = load_tokenizer(target.path, config.trust_remote_code)
    info = target_info(target, tokenizer)
    context = context_length(target.path)
    max_len = min(config.max_len, context or config.max_len)  # past the context: positions the target never saw
    renderer = ChatRenderer(tokenizer, chat_template=_chat_template(config), max_len=max_len)
    vocab_size = max(info.vocab_size, len(tokenizer))

    conversations, bad, other_splits = _collect(config)
    if bad and config.on_bad_row == "error":
        fail_on_bad_rows(bad, console)
    splits = describe_splits(other_splits)
    if not conversations and other_splits:
        raise EagletError(
            f"{', '.join(config.inputs)}: no rows of --split {config.split} (the rows' splits: {splits}); pass "
            "--split all to train on every row (a held-out row trained on inflates eval's τ on it)"
        )
    if not conversations:
        raise EagletError(f"{', '.join(config.inputs)}: no usable conversations (all {len(bad)} rows were bad)")
    if other_splits:
        console.print(
            f"left out {sum(other_splits.values()):,} rows not of --split {config.split} ({splits}); "
            "--split all trains on them",
            highlight=False,
        )
    if not any(m["role"] == "assistant" and m["content"].strip() for c in conversations for m in c.messages):
        raise EagletError(
            f"{', '.join(config.inputs)}: no assistant answer to train on; run `eaglet regenerate` "
            "to have the target write them"
        )

    with atomic_directory(out, overwrite=config.overwrite) as tmp:
        tally = _write_samples(conversations, renderer, vocab_size, tmp / SAMPLES_FILE, console)
        rejected = [row for row in tally.dropped if "max-len" not in row.reason]
        if rejected and config.on_bad_row == "error":
            fail_on_bad_rows(rejected, console)
        if not tally.lengths:
            raise EagletError(f"no usable samples: every conversation was dropped ({tally.dropped[0]})")
        if tally.assistant_tokens == 0:
            raise EagletError(
                f"{', '.join(config.inputs)}: no trainable token (no assistant token within the first {max_len} "
                f"tokens: --max-len {config.max_len}, the target's context {context or 'unsaid'}); raise --max-len or "
                "add answers"
            )
        draft_vocab_size = config.draft_vocab or default_draft_vocab_size(vocab_size)
        if draft_vocab_size > vocab_size:
            raise EagletError(f"--draft-vocab {draft_vocab_size} exceeds the target vocabulary ({vocab_size})")
        vocab = build_draft_vocab(tally.counts, draft_vocab_size)
        vocab.save(tmp / VOCAB_FILE)
        manifest = {
            "schema": PREPARED_SCHEMA,
            "eaglet_version": __version__,
            "target": info.identity.to_record() | {"template_hash": sha256_json(renderer.template)},
            "target_source": target_source(target.spec, target.path, hub_id_of(target)),
            "config": config.model_dump(),
            "inputs": [{"path": str(p), "sha256": sha256_file(p)} for p in config.inputs],
            "counts": {
                "rows_read": len(conversations) + len(bad) + sum(other_splits.values()),
                "left_out_other_splits": dict(other_splits),
                "samples": len(tally.lengths),
                "bad_rows_skipped": len(bad) + len(rejected),
                "dropped_no_assistant_tokens_within_max_len": len(tally.dropped) - len(rejected),
                "truncated_to_max_len": tally.truncated,
            },
            "max_len": max_len,  # --max-len, or the target's context where that is shorter
            "tokens": {
                "total": int(np.sum(tally.lengths)),
                "assistant": tally.assistant_tokens,
                "length": _length_stats(np.asarray(tally.lengths)),
            },
            "draft_vocab": {
                "size": vocab.size,
                "coverage": round(vocab.coverage, 6),
                "distinct_assistant_tokens": int((tally.counts > 0).sum()),
            },
            "skipped_rows": [{"source": r.source, "reason": r.reason} for r in bad + tally.dropped],
            "files": {
                SAMPLES_FILE: sha256_file(tmp / SAMPLES_FILE),
                VOCAB_FILE: sha256_file(tmp / VOCAB_FILE),
            },
            "seconds": round(time.perf_counter() - started, 3),
        }
        write_json_atomic(tmp / MANIFEST_FILE, manifest)
    if warning := coverage_warning(manifest["draft_vocab"]):
        console.print(f"[yellow]warning[/] {warning}", highlight=False)
    return PrepareResult(out=out, manifest=manifest, bad_rows=bad + tally.dropped)


def coverage_warning(draft_vocab: dict) -> str | None:
    """What a draft vocabulary covering too few of the answers' tokens costs, or None: each token outside it is one
    the draft can never propose, so acceptance stops there."""
    if draft_vocab["coverage"] >= MIN_DRAFT_VOCAB_COVERAGE:
        return None
    return (
        f"the draft vocabulary ({draft_vocab['size']:,} tokens) covers {draft_vocab['coverage']:.1%} of the answers' "
        f"tokens: the draft can never propose the rest, which caps acceptance (raise --draft-vocab; the answers use "
        f"{draft_vocab['distinct_assistant_tokens']:,} distinct tokens)"
    )


def _chat_template(config: PrepareConfig) -> str | None:
    """The --chat-template file's text (None: the tokenizer's own template)."""
    return read_chat_template(Path(config.chat_template)) if config.chat_template else None


def read_chat_template(path: Path) -> str:
    """A --chat-template file's text, refused in one line when it is missing, not UTF-8 or empty (an empty one
    would fall back to the target's own template without a word)."""
    if not path.is_file():
        raise EagletError(f"{path}: chat template file not found; pass the .jinja file the target is served with")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise EagletError(f"{path}: chat template unreadable ({exc.strerror}); check the file") from None
    except UnicodeDecodeError as exc:
        raise EagletError(f"{path}: chat template is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    if not text.strip():
        raise EagletError(
            f"{path}: the chat template file is empty; pass the .jinja file the target is served with, or leave "
            "out --chat-template to use the target's own"
        )
    return text


@dataclass
class _Tally:
    """What rendering the conversations found, for the manifest and the draft vocabulary."""

    counts: np.ndarray  # [vocab] how often each token is an assistant (loss) token
    lengths: list[int] = field(default_factory=list)  # tokens per written sample
    truncated: int = 0
    assistant_tokens: int = 0
    dropped: list[BadRow] = field(default_factory=list)  # conversations rendering refused


def _write_samples(
    conversations: list[Conversation], renderer: ChatRenderer, vocab_size: int, path: Path, console: Console
) -> _Tally:
    """Render in batches and stream the samples to parquet, counting assistant tokens on the way."""
    tally = _Tally(np.zeros(vocab_size, dtype=np.int64))
    writer = pq.ParquetWriter(path, PARQUET_SCHEMA, compression="zstd")
    with progress_bar("conv", console) as progress:
        task = progress.add_task("prepare", total=len(conversations))
        for begin in range(0, len(conversations), RENDER_BATCH):
            batch = conversations[begin : begin + RENDER_BATCH]
            rendered: list[Rendered] = []
            for conversation, result in zip(batch, renderer.render_batch(batch)):
                if isinstance(result, str):
                    tally.dropped.append(BadRow(conversation.source, result))
                    continue
                rendered.append(result)
                tally.truncated += result.truncated
                tally.lengths.append(len(result.input_ids))
                masked_ids = result.input_ids[result.loss_mask.astype(bool)]
                tally.assistant_tokens += len(masked_ids)
                tally.counts += np.bincount(masked_ids, minlength=vocab_size)
            if rendered:
                writer.write_table(_to_table(rendered))
            progress.advance(task, len(batch))
    writer.close()
    return tally
