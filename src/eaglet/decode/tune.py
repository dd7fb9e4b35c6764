"""`eaglet eval --tune`: the tree shape that decodes fastest for this target and draft on this machine, by timing.

Acceptance grows with a tree's size and a verification's cost grows with it too; where they cross depends on the
target, the draft and the GPU, so each candidate is timed on a few prompts instead of guessed."""

from __future__ import annotations

import gc
from typing import Any, Callable

import torch

from ..config import EvalConfig
from .common import acceptance_length
from .decoders import Decoders


def tune_tree(
    config: EvalConfig, build: Callable[[EvalConfig], Decoders], prompts: list[list[int]]
) -> tuple[list[int], list[dict[str, Any]]]:
    """Time each of ``config.tune_trees`` decoding ``prompts`` (after a warm-up: compiles and graph captures are not
    counted) -> (the fastest shape as [depth, top-k, budget], each shape's tokens/s and τ)."""
    timings = []
    for depth, topk, budget in config.tune_trees:
        shaped = config.model_copy(update={"depth": depth, "topk": topk, "budget": budget})
        decoders = build(shaped)
        decoders.warm_up(prompts[: decoders.group_size])
        results = [
            result for ids in prompts for result in decoders.speculative([ids], config.max_new_tokens, config.seed)
        ]
        seconds = sum(result.seconds for result in results)
        timings.append(
            {
                "tree": [depth, topk, budget],
                "tokens_per_s": round(sum(len(result.tokens) for result in results) / max(seconds, 1e-9), 2),
                "acceptance_length": round(acceptance_length(results), 4),
            }
        )
        del decoders, results  # a shape's static caches and graphs go before the next one's are made
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return max(timings, key=lambda timing: timing["tokens_per_s"])["tree"], timings
