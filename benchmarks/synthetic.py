"""Synthetic conversations for benchmarks (deterministic given a seed)."""

from __future__ import annotations

import json
import random
from pathlib import Path

LLAMA_8B_SHAPE = dict(  # Llama-3.1-8B's shape: the 8B-shaped random targets of the benchmarks
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)


def useful_forward_flops(params: int, num_layers: int, hidden_size: int, lengths) -> float:
    """Useful forward FLOPs of the extraction benchmarks' MFU: 2 x the non-embedding ``params`` per token + causal
    attention 2 x layers x hidden x L^2 per sample."""
    squares = sum(int(length) ** 2 for length in lengths)
    return 2 * params * int(sum(lengths)) + 2 * num_layers * hidden_size * squares


WORDS = (
    "the model answers each question with care and detail while keeping the style clear and the facts "
    "right so that a reader can follow every step of the reasoning from start to end"
).split()


def conversation(rng: random.Random, index: int, answer_words: int) -> dict:
    """A system prompt half the time, then 1-3 user/assistant exchanges sharing ``answer_words`` words."""
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": "You are a careful assistant. Answer clearly."})
    exchanges = rng.randint(1, 3)
    for _ in range(exchanges):
        user = " ".join(rng.choices(WORDS, k=rng.randint(10, 30))) + "?"
        answer = " ".join(rng.choices(WORDS, k=max(1, answer_words // exchanges))) + "."
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return {"id": f"bench-{index}", "messages": messages}


def write_conversations(path: Path, count: int, answer_words: int | tuple[int, int], seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for i in range(count):
            words = answer_words if isinstance(answer_words, int) else rng.randint(*answer_words)
            handle.write(json.dumps(conversation(rng, i, words)) + "\n")
    return path
