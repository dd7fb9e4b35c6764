"""`eaglet synthesize`'s prompt filter at scale: messages filtered per second (CPU, no model).

Deterministic messages of 6-30 words drawn from a fixed vocabulary, every fifth one a near copy of an earlier one and
every third one opening "can you", go through ``filter_prompts`` (exact duplicate, near-duplicate and opening checks).
Usage: python benchmarks/bench_synthesize_filter.py [--messages 20000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from eaglet.data.synthesize import filter_prompts

VOCABULARY_WORDS = 5000
MIN_WORDS, MAX_WORDS = 6, 30


def messages(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocabulary = [f"w{index}" for index in range(VOCABULARY_WORDS)]
    texts: list[str] = []
    for index in range(count):
        if index % 5 == 4 and texts:  # a near copy: one word of an earlier message changed
            words = rng.choice(texts).split()
            words[rng.randrange(len(words))] = rng.choice(vocabulary)
        else:
            words = [rng.choice(vocabulary) for _ in range(rng.randint(MIN_WORDS, MAX_WORDS))]
            if index % 3 == 0:
                words[:2] = ["can", "you"]
        texts.append(" ".join(words))
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    texts = messages(args.messages)
    started = time.perf_counter()
    kept = filter_prompts(texts, min_words=4, max_similarity=0.6, count=args.messages, max_opening_share=0.1)
    seconds = time.perf_counter() - started
    result = {
        "messages": len(texts),
        "kept": len(kept.kept),
        "dropped": kept.dropped,
        "seconds": round(seconds, 3),
        "messages_per_s": round(len(texts) / seconds),
    }
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
