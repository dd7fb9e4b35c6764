"""`eaglet prepare`: conversation files -> token ids, assistant loss masks and the draft vocabulary.

Writes ``DIR/samples.parquet`` (``id``, ``input_ids`` list<int32>, ``loss_mask`` list<uint8>),
``DIR/vocab.safetensors`` (``d2t``, ``t2d``, ``counts``) and ``DIR/manifest.json``, all into a
temporary directory renamed at the end: an interrupted run leaves no ``DIR``.
"""

from __future__ import annotations

import time
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
from ..fsio import atomic_directory, sha256_file, sha256_json, write_json_atomic
from ..progress import progress_bar
from ..target import load_tokenizer, resolve_target, target_info
from .readers import BadRow, Conversation, fail_on_bad_rows, read_conversations
from .render import ChatRenderer, Rendered
from .vocab import build_draft_vocab, default_draft_vocab_size

PREPARED_SCHEMA = "eaglet.prepared/1"
SAMPLES_FILE = "samples.parquet"
VOCAB_FILE = "vocab.safetensors"
MANIFEST_FILE = "manifest.json"
RENDER_BATCH = 512
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


def _collect(config: PrepareConfig) -> tuple[list[Conversation], list[BadRow]]:
    conversations, bad = [], []
    for item in read_conversations(config.inputs):
        if isinstance(item, BadRow):
            bad.append(item)
        elif not item.has_assistant:
            bad.append(BadRow(item.source, "no assistant turn (prompt-only rows need answers: run `eaglet regenerate` first)"))
        else:
            conversations.append(item)
    return conversations, bad


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
    out = Path(config.out)
    if out.exists() and not config.overwrite:
        raise EagletError(f"{out}: already exists; pass --overwrite to replace it, or choose another --out")
    started = time.perf_counter()
    target = resolve_target(config.target, config.trust_remote_code)
    tokenizer = load_tokenizer(target.path, config.trust_remote_code)
    info = target_info(target, tokenizer)
    template = None
    if config.chat_template:
        template_path = Path(config.chat_template)
        if not template_path.is_file():
            raise EagletError(f"{template_path}: chat template file not found")
        template = template_path.read_text(encoding="utf-8")
    renderer = ChatRenderer(tokenizer, chat_template=template, max_len=config.max_len)
    vocab_size = max(info.vocab_size, len(tokenizer))

    conversations, bad = _collect(config)
    if bad and config.on_bad_row == "error":
        fail_on_bad_rows(bad, console)
    if not conversations:
        raise EagletError(f"{', '.join(config.inputs)}: no usable conversations (all {len(bad)} rows were bad)")

    counts = np.zeros(vocab_size, dtype=np.int64)
    lengths: list[int] = []
    truncated = 0
    dropped: list[BadRow] = []
    assistant_tokens = 0
    with atomic_directory(out, overwrite=config.overwrite) as tmp:
        writer = pq.ParquetWriter(tmp / SAMPLES_FILE, PARQUET_SCHEMA, compression="zstd")
        with progress_bar("conv", console) as progress:
            task = progress.add_task("prepare", total=len(conversations))
            for begin in range(0, len(conversations), RENDER_BATCH):
                batch = conversations[begin : begin + RENDER_BATCH]
                rendered: list[Rendered] = []
                for conversation, result in zip(batch, renderer.render_batch(batch)):
                    if isinstance(result, str):
                        dropped.append(BadRow(conversation.source, result))
                        continue
                    rendered.append(result)
                    truncated += result.truncated
                    lengths.append(len(result.input_ids))
                    masked_ids = result.input_ids[result.loss_mask.astype(bool)]
                    assistant_tokens += len(masked_ids)
                    counts += np.bincount(masked_ids, minlength=vocab_size)
                if rendered:
                    writer.write_table(_to_table(rendered))
                progress.advance(task, len(batch))
        writer.close()
        rejected = [row for row in dropped if "max-len" not in row.reason]
        if rejected and config.on_bad_row == "error":
            fail_on_bad_rows(rejected, console)
        if not lengths:
            raise EagletError(f"no usable samples: every conversation was dropped ({dropped[0]})")

        draft_vocab_size = config.draft_vocab or default_draft_vocab_size(vocab_size)
        if draft_vocab_size > vocab_size:
            raise EagletError(f"--draft-vocab {draft_vocab_size} exceeds the target vocabulary ({vocab_size})")
        vocab = build_draft_vocab(counts, draft_vocab_size)
        vocab.save(tmp / VOCAB_FILE)
        length_array = np.asarray(lengths)
        manifest = {
            "schema": PREPARED_SCHEMA,
            "eaglet_version": __version__,
            "target": {
                "name": info.name,
                "config_hash": info.config_hash,
                "tokenizer_hash": info.tokenizer_hash,
                "template_hash": sha256_json(renderer.template),
                "vocab_size": vocab_size,
                "num_layers": info.num_layers,
                "hidden_size": info.hidden_size,
            },
            "config": config.model_dump(),
            "inputs": [{"path": str(p), "sha256": sha256_file(p)} for p in config.inputs],
            "counts": {
                "rows_read": len(conversations) + len(bad),
                "samples": len(lengths),
                "bad_rows_skipped": len(bad) + len(rejected),
                "dropped_no_assistant_tokens_within_max_len": len(dropped) - len(rejected),
                "truncated_to_max_len": truncated,
            },
            "tokens": {
                "total": int(length_array.sum()),
                "assistant": assistant_tokens,
                "length": _length_stats(length_array),
            },
            "draft_vocab": {
                "size": vocab.size,
                "coverage": round(vocab.coverage, 6),
                "distinct_assistant_tokens": int((counts > 0).sum()),
            },
            "skipped_rows": [{"source": r.source, "reason": r.reason} for r in bad + dropped],
            "files": {
                SAMPLES_FILE: sha256_file(tmp / SAMPLES_FILE),
                VOCAB_FILE: sha256_file(tmp / VOCAB_FILE),
            },
            "seconds": round(time.perf_counter() - started, 3),
        }
        write_json_atomic(tmp / MANIFEST_FILE, manifest)
    return PrepareResult(out=out, manifest=manifest, bad_rows=bad + dropped)
