"""The baseline speculative decoding is measured against: the same engine without a draft, one target forward per
token — on dynamic caches (``target_only_decode``, greedy or sampled), or greedy with each step one CUDA graph
(forward, argmax, the next input; ``static_target_decode``), so a speedup compares equally lean loops."""

from __future__ import annotations

import time

import torch

from ..model.sampling import Sampling
from .common import DecodeResult, finish, sync
from .runners import TargetRunner
from .static import RoundGraph, Rounds, StaticTarget, check_room


def target_only_decode(
    target: TargetRunner,
    prompt: list[int],
    max_new: int,
    sampling: Sampling,
    stop_ids: set[int],
    generator: torch.Generator | None = None,
) -> DecodeResult:
    """The baseline: the same engine, one target forward per token, no draft."""
    sync(target.device)
    started = time.perf_counter()
    target.reset()
    logits, _ = target.forward(prompt)
    out = [sampling.pick(logits[-1], generator)]
    while not finish(out, stop_ids, max_new)[1]:
        logits, _ = target.forward([out[-1]])
        out.append(sampling.pick(logits[-1], generator))
    sync(target.device)
    return DecodeResult(finish(out, stop_ids, max_new)[0], seconds=time.perf_counter() - started)


class GreedyTargetSteps(Rounds):
    """The baseline's step: one forward of the newest token, its argmax becomes the next input."""

    def __init__(self, target: StaticTarget):
        super().__init__(target)
        device = target.device
        self.token = torch.zeros(1, dtype=torch.long, device=device)  # [1]: the newest token, not yet in the cache
        self._depth = torch.zeros(1, dtype=torch.long, device=device)
        self._block = torch.ones(1, 1, dtype=torch.bool, device=device)
        self.graph = RoundGraph(device, target.graphs, self._body, [self.target_length, self.token])

    def _body(self) -> torch.Tensor:
        logits, _ = self.target.run_block(self.token, self._depth, self._block, self.target_length)  # [1, V]
        self.token.copy_(logits.argmax(-1))
        self.target_length.add_(1)
        return self.token


def static_target_decode(
    target: StaticTarget, prompt: list[int], max_new: int, stop_ids: set[int], steps: GreedyTargetSteps | None = None
) -> DecodeResult:
    """The greedy baseline on the same engine: one graph (forward, argmax, next input) and one read per token."""
    steps = steps or GreedyTargetSteps(target)
    sync(target.device)
    started = time.perf_counter()
    target.reset()
    logits, _ = target.forward(prompt)
    steps.token.copy_(logits[-1].argmax().view(1))
    out = [int(steps.token)]
    length = target.length
    steps.target_length.fill_(length)
    while not finish(out, stop_ids, max_new)[1]:
        check_room(target, length, 1)
        out.extend(steps.graph.run())
        length += 1
    target.set_length(length)
    sync(target.device)
    return DecodeResult(finish(out, stop_ids, max_new)[0], seconds=time.perf_counter() - started)
