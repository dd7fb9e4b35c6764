"""Greedy decoding on static caches with each round one CUDA graph: draft, verification, acceptance, cache
compaction and the next round's inputs, all on the device; the host reads the round's tokens once.

With the draft and the target as separate graphs (session 7), a tree round of the 135 M target on an H200
spent 0.84 ms of its 7.8 ms between them on the host: building the accepted path, two synchronising reads to
compact the cache, ~120 eager copy launches, input tensors built from Python lists
(``benchmarks/bench_static_round.py``: round wall time against its parts). Here everything that flows from
one round to the next lives in device tensors the graph updates itself — the target's length, the draft's
length, its next input rows — so a round is a replay and a read of D + 2 integers. The baseline (the same
engine without a draft) gets the same treatment: one graph per token (forward, argmax, the next input), one
read, so the speedup compares equally lean loops.

On CPU (or with graphs off) the same bodies run eagerly; the tests compare their tokens with the dynamic
engine's.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from .engine import DecodeResult, _finish, _sync
from .static import StaticTarget, cache_too_short, capture
from .static_draft import StaticDraft, compile_round_part
from .static_tree import StaticTreeDraft


class RoundGraph:
    """``body`` replayed as one CUDA graph (eagerly off GPU). ``state``: the device tensors ``body`` advances;
    the capture's warm-up runs advance them too, so they are put back before the first real replay (the
    cache entries those runs wrote lie past the lengths, where nothing reads and the replay rewrites)."""

    def __init__(self, device: torch.device, graphs: bool, body: Callable[[], torch.Tensor], state: list[torch.Tensor]):
        self.device, self.graphs, self.body, self.state = device, graphs, body, state
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None

    @torch.inference_mode()
    def run(self) -> list[int]:
        """One round; its output read to the host (the round's one synchronisation)."""
        if not self.graphs:
            return self.body().tolist()
        if self.graph is None:
            saved = [tensor.clone() for tensor in self.state]
            self.graph, self.output = capture(self.device, self.body)
            for tensor, value in zip(self.state, saved):
                tensor.copy_(value)
        self.graph.replay()
        return self.output.tolist()


def _check_room(target: StaticTarget, target_length: int, writes: int, draft: StaticDraft | None = None,
                draft_length: int = 0) -> None:
    """A round writes ``writes`` target entries at ``target_length`` and the draft's R rows at ``draft_length``;
    inside a graph an index past the cache would be a device-side fault, so the host refuses it first."""
    needed = max(target_length + writes, draft_length + draft.rows if draft is not None else 0)
    if needed > target.max_len or (draft is not None and needed > draft.max_len):
        raise cache_too_short(min(target.max_len, draft.max_len if draft else target.max_len), needed)


class _Rounds:
    """The device state shared by the round bodies: where the target's cache ends (0-d)."""

    def __init__(self, target: StaticTarget):
        self.target = target
        self.target_length = torch.zeros((), dtype=torch.long, device=target.device)


class GreedyTargetSteps(_Rounds):
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


class ChainRounds(_Rounds):
    """Draft a chain of D, verify [x, d_1..d_D], keep the agreeing prefix and the target's next token."""

    def __init__(self, target: StaticTarget, draft: StaticDraft):
        super().__init__(target)
        self.draft = draft
        depth, device = draft.depth, target.device
        self._row = torch.arange(depth + 1, device=device)  # [D+1]: row index, and the chain's RoPE offsets
        self._causal = torch.ones(depth + 1, depth + 1, dtype=torch.bool, device=device).tril()
        self.graph = RoundGraph(device, target.graphs, self._body, [self.target_length, *draft.round_state()])

    def _body(self) -> torch.Tensor:
        """-> [D+2]: accepted count a, then the new tokens d_1..d_a, correction (padded with the correction)."""
        draft, depth = self.draft, self.draft.depth
        last = draft.in_tokens.index_select(0, (draft.in_real_rows - 1).view(1))  # [1]: the newest real token
        drafted = draft.draft_round()[0]  # [D]
        draft.in_start.add_(draft.in_real_rows)
        logits, aux = self.target.run_block(torch.cat([last, drafted]), self._row, self._causal, self.target_length)
        choices = logits.argmax(-1)  # [D+1]
        accepted = (choices[:depth] == drafted).int().cumprod(0).sum()  # 0-d
        correction = choices.index_select(0, accepted.view(1))  # [1]
        new_tokens = torch.where(self._row < accepted, torch.cat([drafted, correction]), correction)  # [D+1]
        self.target_length.add_(accepted + 1)  # [x, d_1..d_a] stay; the correction is the next round's x
        draft.in_tokens.copy_(new_tokens)  # the draft's next rows: d_1..d_a, correction, with their verify features
        draft.in_aux.copy_(aux)
        draft.in_real_rows.copy_(accepted + 1)
        return torch.cat([accepted.view(1), new_tokens])


class TreeRounds(_Rounds):
    """Draft an EAGLE-2 tree, verify it with tree attention, follow the target's argmax down it, move the
    accepted path's cache entries behind the root."""

    def __init__(self, target: StaticTarget, draft: StaticTreeDraft):
        super().__init__(target)
        self.draft = draft
        depth, device = draft.depth, target.device
        self._levels = torch.arange(1, depth + 1, device=device)  # [D]
        self._row = torch.arange(depth + 1, device=device)  # [D+1]
        self._root = torch.zeros(1, dtype=torch.long, device=device)
        # the greedy walk's ~60 small kernels (D passes down the tree) fused when the draft's part is compiled
        self._accept = compile_round_part(self._walk, draft.compiled)
        self.graph = RoundGraph(device, target.graphs, self._body, [self.target_length, *draft.round_state()])

    def _walk(self, tokens: torch.Tensor, depths: torch.Tensor, parents: torch.Tensor,
              logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Follow the target's argmax down the tree: (accepted count 0-d, nodes [D+1]: root then the path, 0 past
        its end; new tokens [D+1]: the path's, then the correction, padded with it)."""
        choices = logits.argmax(-1)  # [N]: the target's token after each node
        is_root = torch.arange(len(tokens), device=tokens.device) == 0
        accepted = is_root
        for _ in range(self.draft.depth):  # a node is accepted when its parent is and it is the parent's choice
            accepted = ((tokens == choices[parents]) & accepted[parents]) | is_root
        count = accepted.sum() - 1  # 0-d: siblings hold distinct tokens, so the accepted nodes form one path
        at_level = accepted[None, :] & (depths[None, :] == self._levels[:, None])  # [D, N]
        nodes = torch.cat([self._root, at_level.int().argmax(-1)])  # [D+1]
        correction = choices.index_select(0, nodes.index_select(0, count.view(1)))  # [1]
        new_tokens = torch.where(self._row < count, torch.cat([tokens[nodes[1:]], correction]), correction)  # [D+1]
        return count, nodes, new_tokens

    def _body(self) -> torch.Tensor:
        """-> [D+2]: accepted count a, then the path's tokens and the correction (padded with the correction)."""
        draft = self.draft
        tokens, depths, parents, block = draft.draft_round()  # [N], [N], [N], [N, N]; node 0 is the root
        draft.in_start.add_(draft.in_real_rows)
        start = self.target_length
        logits, aux = self.target.run_block(tokens, depths, block, start)  # [N, V], [N, layers, H]
        count, nodes, new_tokens = self._accept(tokens, depths, parents, logits)
        self.target.move_entries(start + nodes, start + self._row)  # root + path behind the prefix
        self.target_length.add_(count + 1)
        draft.in_tokens.copy_(new_tokens)
        draft.in_aux.copy_(aux.index_select(0, nodes))
        draft.in_real_rows.copy_(count + 1)
        return torch.cat([count.view(1), new_tokens])


def _prefill(target: StaticTarget, draft: StaticDraft, prompt: list[int]) -> int:
    """The prompt through the target (eagerly or in a bucket) and the draft; the first round's inputs set on
    the device; returns the target's first token."""
    target.reset()
    draft.reset()
    logits, aux = target.forward(prompt)
    first = logits[-1].argmax().view(1)  # [1]
    draft.prefill(prompt[1:], aux[:-1])
    draft.set_round_inputs(first.expand(draft.rows), aux[-1:].expand(draft.rows, -1, -1), 1)
    return int(first)


def _speculate(target: StaticTarget, draft: StaticDraft, rounds: ChainRounds | TreeRounds, prompt: list[int],
               max_new: int, stop_ids: set[int], verify_writes: int) -> DecodeResult:
    _sync(target.device)
    started = time.perf_counter()
    out = [_prefill(target, draft, prompt)]
    target_length, draft_rows = target.length, 1
    rounds.target_length.fill_(target_length)
    accepted_counts: list[int] = []
    while not _finish(out, stop_ids, max_new)[1]:
        _check_room(target, target_length, verify_writes, draft, draft.length)
        host = rounds.graph.run()
        count = host[0]
        out.extend(host[1:count + 2])
        accepted_counts.append(count)
        draft.advance(draft_rows)
        target_length, draft_rows = target_length + count + 1, count + 1
    target.set_length(target_length)
    _sync(target.device)
    return DecodeResult(_finish(out, stop_ids, max_new)[0], accepted_counts, time.perf_counter() - started)


def static_chain_decode(target: StaticTarget, draft: StaticDraft, prompt: list[int], max_new: int,
                        stop_ids: set[int], rounds: ChainRounds | None = None) -> DecodeResult:
    """Greedy chain speculative decoding (``engine.speculative_decode``'s tokens and acceptance), each round
    one graph and one host read. Pass the same ``rounds`` (``ChainRounds(target, draft)``) for every prompt so
    its graph is captured once."""
    rounds = rounds or ChainRounds(target, draft)
    return _speculate(target, draft, rounds, prompt, max_new, stop_ids, draft.depth + 1)


def static_tree_decode(target: StaticTarget, draft: StaticTreeDraft, prompt: list[int], max_new: int,
                       stop_ids: set[int], rounds: TreeRounds | None = None) -> DecodeResult:
    """Greedy tree speculative decoding (``engine.tree_decode``'s tokens and acceptance), each round one graph
    and one host read."""
    rounds = rounds or TreeRounds(target, draft)
    return _speculate(target, draft, rounds, prompt, max_new, stop_ids, max(draft.budget + 1, draft.depth + 1))


def static_target_decode(target: StaticTarget, prompt: list[int], max_new: int, stop_ids: set[int],
                         steps: GreedyTargetSteps | None = None) -> DecodeResult:
    """The greedy baseline on the same engine: one graph (forward, argmax, next input) and one read per token."""
    steps = steps or GreedyTargetSteps(target)
    _sync(target.device)
    started = time.perf_counter()
    target.reset()
    logits, _ = target.forward(prompt)
    steps.token.copy_(logits[-1].argmax().view(1))
    out = [int(steps.token)]
    length = target.length
    steps.target_length.fill_(length)
    while not _finish(out, stop_ids, max_new)[1]:
        _check_room(target, length, 1)
        out.extend(steps.graph.run())
        length += 1
    target.set_length(length)
    _sync(target.device)
    return DecodeResult(_finish(out, stop_ids, max_new)[0], seconds=time.perf_counter() - started)
