"""Benchmark `eaglet prepare` on this machine: conversations/s at ~500 tokens per conversation.

Synthetic multi-turn conversations (1-3 exchanges, with and without a system prompt) are written
to a temporary .jsonl, then the whole stage runs as `eaglet prepare` would (read, validate, render
with the embedded target's chat template, tokenize, mask, draft vocab, write parquet + manifest).
Prints and writes JSON: python benchmarks/bench_prepare.py [--conversations 8000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import write_conversations  # noqa: E402

ANSWER_WORDS = 380  # ~460 tokens per conversation with the template's headers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8000)
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from rich.console import Console

    from eaglet.config import PrepareConfig
    from eaglet.data.prepare import run_prepare
    from eaglet.model.target import load_tokenizer, resolve_target

    with tempfile.TemporaryDirectory() as tmp:
        data = write_conversations(Path(tmp) / "conversations.jsonl", args.conversations, ANSWER_WORDS)
        load_started = time.perf_counter()
        load_tokenizer(resolve_target(args.target).path)  # warm the target cache; counted separately
        load_s = time.perf_counter() - load_started
        started = time.perf_counter()
        result = run_prepare(
            PrepareConfig(inputs=[str(data)], out=str(Path(tmp) / "prepared"), target=args.target, max_len=4096),
            Console(stderr=True, quiet=True),
        )
        wall = time.perf_counter() - started
    manifest = result.manifest
    record = {
        "benchmark": "prepare",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "conversations": args.conversations,
        "tokens_total": manifest["tokens"]["total"],
        "mean_tokens_per_conversation": manifest["tokens"]["length"]["mean"],
        "wall_s": round(wall, 3),
        "conversations_per_s": round(args.conversations / wall, 1),
        "tokens_per_s": round(manifest["tokens"]["total"] / wall, 1),
        "tokenizer_load_s": round(load_s, 3),
    }
    print(json.dumps(record, indent=2))
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
