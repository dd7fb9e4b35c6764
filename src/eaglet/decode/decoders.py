"""The decoders one evaluation compares: ``make_decoders`` picks, from the settings and the machine, the engine for
the speculative decoder (chain or tree; dynamic caches, graphed rounds, or batched chains) and the baseline that
runs on the same engine without a draft. Both take a group of prompts (one prompt, or ``--batch-size`` of them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from rich.console import Console

from ..config import EvalConfig
from ..errors import EagletError
from ..model.draft import Eagle3Draft
from ..model.sampling import Sampling
from ..model.support import compiles_draft_round, draft_compile_problem, uses_static_cache
from .baseline import GreedyTargetSteps, static_target_decode, target_only_decode
from .batched import BatchDraft, BatchTarget, batched_speculative_decode, batched_target_only_decode
from .chain import ChainRounds, StaticChainDraft, speculative_decode, static_chain_decode
from .common import DecodeResult
from .runners import DraftRunner, TargetRunner
from .static import GRAPH_BUCKETS, StaticTarget
from .tree import StaticTreeDraft, TreeRounds, static_tree_decode, tree_decode

WARM_UP_TOKENS = 4  # tokens decoded once before timing: kernels, caches, allocator, graph captures

Decode = Callable[[list[list[int]], int, int], list[DecodeResult]]  # (prompts, max new tokens, seed) -> per prompt


@dataclass
class Decoders:
    speculative: Decode
    baseline: Decode
    group_size: int  # prompts per call
    settings: dict[str, Any] = field(default_factory=dict)  # the engine chosen: static_cache, cuda_graphs, ...

    def warm_up(self, prompts: list[list[int]]) -> None:
        self.baseline(prompts, WARM_UP_TOKENS, 0)
        self.speculative(prompts, WARM_UP_TOKENS, 0)


def verify_tokens(config: EvalConfig) -> int:
    """Tokens in one verification forward: the last accepted token + a chain's depth / a tree's budget."""
    return (config.budget if config.mode == "tree" else config.depth) + 1


def static_cache_length(config: EvalConfig, longest_prompt: int) -> int:
    """Positions a static cache needs: the longest prompt, every new token, and the largest verification (a tree's
    budget or a chain's depth, padded to a graph bucket) written past the end before acceptance."""
    return longest_prompt + config.max_new_tokens + max(verify_tokens(config), GRAPH_BUCKETS[-1] + 1)


def check_settings(config: EvalConfig) -> None:
    """Refuse settings no engine decodes, before any model loads."""
    problem = config.decoding_problem()
    if problem:
        raise EagletError(problem)


def make_decoders(
    config: EvalConfig,
    model: torch.nn.Module,
    draft: Eagle3Draft,
    layer_ids: tuple[int, ...],
    stop: set[int],
    longest_prompt: int,
    device: str,
    console: Console,
) -> Decoders:
    check_settings(config)
    if config.batch_size > 1:
        return _batched(config, model, draft, layer_ids, stop)
    sampling = Sampling(config.temperature, config.top_p)
    static = config.placement == "one" and uses_static_cache(config.cuda_graphs, config.batch_size, device)
    cache_length = static_cache_length(config, longest_prompt)
    target: TargetRunner | StaticTarget = TargetRunner(model, layer_ids)
    if static:
        try:  # greedy rounds verify inside their own graph; sampled ones verify through a bucket of this size
            target = StaticTarget(
                model, layer_ids, cache_length, verify_tokens=1 if sampling.greedy else verify_tokens(config)
            )
        except EagletError as error:
            if config.cuda_graphs == "on":
                raise
            console.print(f"eaglet eval: dynamic cache, no CUDA graphs: {error}")
            static = False
    compiled = compiles_draft_round(config.compile_draft, static, sampling.greedy, device)
    problem = draft_compile_problem(device) if compiled else None
    if problem and config.compile_draft == "on":
        raise EagletError(f"--compile-draft on: {problem}; pass --compile-draft off")
    if problem:
        console.print(f"eaglet eval: the draft's rounds run uncompiled: {problem}")
        compiled = False
    settings = {
        "static_cache": static,
        "cuda_graphs": static and device.startswith("cuda"),
        "static_draft": static and sampling.greedy,
        "compiled_draft": compiled,
    }
    speculate, baseline = (_graphed if static and sampling.greedy else _dynamic)(
        config, target, draft, stop, sampling, cache_length, compiled
    )
    decoders = Decoders(
        lambda prompts, max_new, seed: [speculate(prompts[0], max_new, seed)],
        lambda prompts, max_new, seed: [baseline(prompts[0], max_new, seed)],
        1,
        settings,
    )
    if isinstance(target, StaticTarget):
        capture_all, warm = target.capture_all, decoders.warm_up

        def warm_up(prompts: list[list[int]]) -> None:
            capture_all()
            warm(prompts)

        decoders.warm_up = warm_up  # type: ignore[method-assign]
    return decoders


def _graphed(
    config: EvalConfig,
    target: StaticTarget,
    draft: Eagle3Draft,
    stop: set[int],
    sampling: Sampling,
    cache_length: int,
    compiled: bool,
) -> tuple[Callable, Callable]:
    """Greedy decoding with each round (and each baseline step) one CUDA graph on GPU."""
    steps = GreedyTargetSteps(target)
    if config.mode == "chain":
        chain_draft = StaticChainDraft(draft, cache_length, config.depth, compiled=compiled)
        chain_rounds = ChainRounds(target, chain_draft)

        def speculate(ids: list[int], max_new: int, seed: int) -> DecodeResult:
            return static_chain_decode(target, chain_draft, ids, max_new, stop, chain_rounds)
    else:
        tree_draft = StaticTreeDraft(draft, cache_length, config.depth, config.topk, config.budget, compiled=compiled)
        tree_rounds = TreeRounds(target, tree_draft)

        def speculate(ids: list[int], max_new: int, seed: int) -> DecodeResult:
            return static_tree_decode(target, tree_draft, ids, max_new, stop, tree_rounds)

    def baseline(ids: list[int], max_new: int, seed: int) -> DecodeResult:
        return static_target_decode(target, ids, max_new, stop, steps)

    return speculate, baseline


def _dynamic(
    config: EvalConfig,
    target: TargetRunner | StaticTarget,
    draft: Eagle3Draft,
    stop: set[int],
    sampling: Sampling,
    cache_length: int,
    compiled: bool,
) -> tuple[Callable, Callable]:
    """The draft on dynamic caches, eagerly (sampling, or no static cache); the target on either."""
    runner = DraftRunner(draft)

    def speculate(ids: list[int], max_new: int, seed: int) -> DecodeResult:
        generator = torch.Generator().manual_seed(seed)
        if config.mode == "tree":
            return tree_decode(
                target, runner, ids, max_new, config.depth, config.topk, config.budget, stop, sampling, generator
            )
        return speculative_decode(target, runner, ids, max_new, config.depth, sampling, stop, generator)

    def baseline(ids: list[int], max_new: int, seed: int) -> DecodeResult:
        return target_only_decode(target, ids, max_new, sampling, stop, torch.Generator().manual_seed(seed))

    return speculate, baseline


def _batched(
    config: EvalConfig, model: torch.nn.Module, draft: Eagle3Draft, layer_ids: tuple[int, ...], stop: set[int]
) -> Decoders:
    """Greedy chains for ``batch_size`` prompts at once; a group's wall time is shared evenly by its rows."""
    target, batch_draft = BatchTarget(model, layer_ids), BatchDraft(draft)
    return Decoders(
        lambda prompts, max_new, seed: batched_speculative_decode(
            target, batch_draft, prompts, max_new, config.depth, stop
        ),
        lambda prompts, max_new, seed: batched_target_only_decode(target, prompts, max_new, stop),
        config.batch_size,
        {"static_cache": False, "cuda_graphs": False, "static_draft": False, "compiled_draft": False},
    )
