"""Static KV caches and CUDA graphs: the machinery the graphed rounds of both algorithms (``chain.py``, ``tree.py``)
and the graphed baseline (``baseline.py``) run on.

At batch 1 a small target is launch-bound: on an H200 the dynamic-cache engine spends ~22 ms issuing the ~600
kernels of one SmolLM2-135M step from Python; replayed as a graph the step takes 3.4 ms
(``benchmarks/bench_decode_step.py``). Here every forward has a fixed shape — the caches are preallocated, a
forward of n tokens is padded to a bucket size, and what changes between calls (token ids, positions, where the
cache ends, which new token sees which) lives in device tensors the graph reads — so each shape is captured once
and replayed for the cost of one launch. A round (draft, verification, acceptance, cache compaction, the next
round's inputs) is one graph: the host reads its tokens once (``RoundGraph``).

Target cache semantics: positions ``0..length-1`` are real; a forward at ``start = length`` writes its n entries
at ``start..start+n-1`` and attends to ``key < start`` plus its own block under a [n, n] block mask (causal for
chains, ancestors for trees). Dropping entries is moving ``length`` back (stale entries past it are masked out and
overwritten later); keeping a tree's accepted path copies those entries down.

The draft's static cache per layer is [Hkv, max_len + speculative slots, d]: real positions first, then the slots a
round's speculation writes (a chain's D - 1 steps, a tree's k rows per expanded level). A round extends it by a
fixed R = D + 1 rows (the accepted tokens and the correction, padded; padding rows write past ``length`` where
nothing reads them). On CPU the same functions run eagerly (graphs are a CUDA feature), which the tests compare
with the dynamic engine (``runners.py``).
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

import torch
import torch.nn.functional as F

from ..errors import EagletError
from ..model.capture import FeatureCapture
from ..model.draft import Eagle3Draft
from ..model.graphs import capture
from ..model.support import cache_kwarg, static_cache_problem
from .common import DecodeResult, Tree, draft_rope, draft_target_ids, finish, sync

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # token counts captured as graphs; longer forwards (prompts) run eagerly
T = TypeVar("T")


def bucket_for(tokens: int, buckets: tuple[int, ...] = GRAPH_BUCKETS) -> int | None:
    """The smallest graph bucket holding ``tokens``, or None (run eagerly)."""
    return next((size for size in buckets if size >= tokens), None)


def buckets_for(verify_tokens: int) -> tuple[int, ...]:
    """GRAPH_BUCKETS plus one sized to the largest verification when it is past them: a tree of budget 96
    verifies 97 tokens every round, and an eager 97-token forward costs ~7x a replay
    (benchmarks/RESULTS.md: 0.48x instead of a speedup)."""
    return GRAPH_BUCKETS if verify_tokens <= GRAPH_BUCKETS[-1] else GRAPH_BUCKETS + (verify_tokens,)


def cache_too_short(holds: int, needs: int) -> EagletError:
    return EagletError(
        f"the static cache holds {holds} positions; this forward needs {needs} "
        "(raise max_len: prompt + max new tokens + the largest verification)"
    )


class _Graph:
    """One captured forward of ``size`` tokens: static inputs it reads, outputs it leaves."""

    def __init__(self, size: int, device: torch.device):
        self.ids = torch.zeros(1, size, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, size, dtype=torch.long, device=device)
        self.start = torch.zeros((), dtype=torch.long, device=device)
        self.eye = torch.eye(size, dtype=torch.bool, device=device)
        self.block = self.eye.clone()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [size, V] float32
        self.aux: torch.Tensor | None = None  # [size, layers, H]


class StaticTarget:
    """Target runner over a preallocated cache of ``max_len`` positions; CUDA graphs when ``graphs``.
    ``verify_tokens``: the largest forward decoding repeats (a tree's budget + 1), given its own bucket."""

    def __init__(
        self,
        model: torch.nn.Module,
        layer_ids: tuple[int, ...],
        max_len: int,
        graphs: bool | None = None,
        verify_tokens: int = 1,
    ):
        from transformers import StaticCache

        self.model = model
        self.capture = FeatureCapture(model, layer_ids)
        self.device = next(model.parameters()).device
        self.max_len = max_len
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.cache_kwarg = cache_kwarg(model)
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self._check_cache()
        self._entries = self._stack_entries()
        self._length = 0
        self._key_index = torch.arange(max_len, device=self.device)  # [max_len]
        self._graphs: dict[int, _Graph] = {}
        self.buckets = buckets_for(verify_tokens)

    def _check_cache(self) -> None:
        problem = static_cache_problem(self.model.config, self.graphs, self.cache)
        if problem:
            raise EagletError(f"{problem} (run eval with --cuda-graphs off)")

    def _stack_entries(self) -> torch.Tensor | None:
        """Back every layer's keys and values by one tensor [layers, 2, 1, Hkv, max_len, d] (the layers' own
        tensors become views of it), so a compaction moves the accepted path in all layers with one gather and
        one scatter instead of a gather and scatter per layer and tensor (the launch overhead of those is a tenth
        of a tree round on a 135 M target).
        None where the layers' shapes differ (then ``move_entries`` goes layer by layer)."""
        if not hasattr(self.cache, "early_initialization"):
            return None
        config = (
            self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        )
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype = self.model.dtype  # the activations' dtype (what the keys are computed in)
        self.cache.early_initialization(1, heads, head_dim, dtype, self.device)
        layers = self.cache.layers
        shape = layers[0].keys.shape  # [1, Hkv, max_len, d]
        if any(tensor.shape != shape for layer in layers for tensor in (layer.keys, layer.values)):
            return None
        entries = torch.zeros(len(layers), 2, *shape, dtype=dtype, device=self.device)
        for layer, (keys, values) in zip(layers, entries):
            layer.keys, layer.values = keys, values
        return entries

    # --- TargetRunner's interface -------------------------------------------------------------------
    def reset(self) -> None:
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def forward(
        self, tokens: list[int] | torch.Tensor, tree: "Tree | None" = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``tokens`` at ``length``; logits [n, V] float32 and aux features [n, layers, H]."""
        if tree is not None:
            return self.forward_tree(tokens, torch.tensor(tree.depths), tree.ancestor_mask())
        count = len(tokens)  # a chain: made on the device (a host-built mask would be a synchronising copy)
        return self.forward_tree(
            tokens,
            torch.arange(count, device=self.device),
            torch.ones(count, count, dtype=torch.bool, device=self.device).tril(),
        )

    @torch.inference_mode()
    def forward_tree(
        self, tokens: list[int] | torch.Tensor, depths: torch.Tensor, block: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` with the tree given as tensors (host or device): depths [n] (RoPE offsets from
        ``length``) and block [n, n] (which new token sees which); a tree drafted on the device stays there."""
        count = len(tokens)
        start = self._length
        if start + count > self.max_len:
            raise cache_too_short(self.max_len, start + count)
        size = bucket_for(count, self.buckets)
        if size is None or start + size > self.max_len:  # no bucket, or its padding would run past the cache
            logits, aux = self._run(
                self._as_ids(tokens)[None],
                (start + depths.to(self.device))[None],
                torch.tensor(start, device=self.device),
                block.to(self.device),
            )
        else:
            logits, aux = self._replay(size, tokens, depths, start, block)
        self._length = start + count
        return logits[:count].clone(), aux[:count].clone()

    @property
    def buckets_used(self) -> list[int]:
        """Bucket sizes forwards have run in so far (each a captured graph on GPU)."""
        return sorted(self._graphs)

    def crop(self, length: int) -> None:
        self._length = min(self._length, length)

    def set_length(self, length: int) -> None:
        """Where the cache ends after rounds that kept their count on the device (``rounds.py``)."""
        self._length = length

    def run_block(
        self, ids: torch.Tensor, depths: torch.Tensor, block: torch.Tensor, start: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A forward whose every input is a device tensor — ids [n], depths [n], block [n, n], start 0-d —
        for a caller capturing it inside a larger graph: logits [n, V], aux [n, layers, H]. ``length`` is
        not moved (the caller keeps it on the device)."""
        return self._run(ids[None], (start + depths)[None], start, block)

    def move_entries(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copy the cache entries at positions ``source`` [m] to ``destination`` [m] in every layer (device
        indices: no host read, so a graph can capture it)."""
        if self._entries is not None:  # all layers at once; the gather completes before the scatter
            self._entries.index_copy_(4, destination, self._entries.index_select(4, source))
            return
        for layer in self.cache.layers:
            layer.keys.index_copy_(2, destination, layer.keys.index_select(2, source))
            layer.values.index_copy_(2, destination, layer.values.index_select(2, source))

    @torch.inference_mode()
    def keep(self, positions: torch.Tensor) -> None:
        """Keep these cache positions, in order: the prefix up to the tree's root is already in place, the
        accepted path's entries are copied down behind it."""
        positions = positions.to(self.device)
        moved = (positions != torch.arange(len(positions), device=self.device)).nonzero()
        if len(moved):
            first = int(moved[0])
            self.move_entries(positions[first:], torch.arange(first, len(positions), device=self.device))
        self._length = len(positions)

    def capture_all(self) -> None:
        """Capture every bucket now (prompts of any length up to the largest bucket then replay a graph), so
        no timed decode pays a capture."""
        for size in self.buckets:
            if size <= self.max_len:
                self.reset()
                self.forward([0] * size)
        self.reset()

    # --- one forward --------------------------------------------------------------------------------
    def _as_ids(self, tokens: list[int] | torch.Tensor) -> torch.Tensor:
        return tokens.to(self.device) if isinstance(tokens, torch.Tensor) else torch.tensor(tokens, device=self.device)

    def _run(
        self, ids: torch.Tensor, positions: torch.Tensor, start: torch.Tensor, block: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids/positions [1, n], start 0-d, block [n, n] bool (device tensors) -> logits [n, V], aux [n, L, H].
        Everything position-dependent is computed on the device from these, so the graph can replay it."""
        count = ids.shape[1]
        for layer in self.cache.layers:  # where this forward's entries go (StaticCache appends at it)
            layer.cumulative_length.copy_(start)
        offset = self._key_index - start  # [max_len]: key index relative to this forward's first entry
        inside = (offset >= 0) & (offset < count)
        mask = (offset < 0)[None, :] | (inside[None, :] & block[:, offset.clamp(0, count - 1)])  # [n, max_len]
        captured: dict[int, torch.Tensor] = {}
        with self.capture.hooks(captured):
            out = self.model(
                input_ids=ids,
                position_ids=positions,
                attention_mask=mask[None, None],
                use_cache=True,
                **{self.cache_kwarg: self.cache},
            )
        aux = torch.stack([captured[slot] for slot in range(len(self.capture.layer_ids))], dim=2)[0]
        return out.logits[0].float(), aux

    def _replay(
        self, size: int, tokens: list[int] | torch.Tensor, depths: torch.Tensor, start: int, block: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        graph = self._graphs.get(size)
        if graph is None:
            graph = self._graphs[size] = _Graph(size, self.device)
        count = len(tokens)
        graph.ids.zero_()
        graph.ids[0, :count].copy_(self._as_ids(tokens))
        graph.start.fill_(start)
        graph.positions.fill_(start)  # padding rows: at the cache end, seeing the cache and themselves only
        graph.positions[0, :count].copy_(depths)
        graph.positions[0, :count].add_(start)
        graph.block.copy_(graph.eye)
        graph.block[:count, :count].copy_(block)
        if not self.graphs:
            return self._run(graph.ids, graph.positions, graph.start, graph.block)
        if graph.graph is None:
            self._capture(graph)
        graph.graph.replay()
        return graph.logits, graph.aux

    def _capture(self, graph: _Graph) -> None:
        """The warm-up runs write the same entries the replay that follows writes, so capturing mid-decode
        changes nothing."""
        graph.graph, (graph.logits, graph.aux) = capture(
            self.device, lambda: self._run(graph.ids, graph.positions, graph.start, graph.block)
        )


# Sorts stay ATen's kernels (the eager rounds' ones): with persistent reductions on, inductor lowers sorts of
# <= 512 elements to a Triton bitonic network, and on the H200 (torch 2.11) the d10/k10/b96 tree's compiled
# round stopped on a device-side "index out of bounds" where its sort indices are used (the tree's per-level
# sorts of 10 and 100 scores; d8/k8/b64, whose level sorts hold 8 and 64, ran right).
COMPILE_OPTIONS = {"triton.persistent_reductions": False}


def compile_round_part(fn: Callable[..., T], compiled: bool) -> Callable[..., T]:
    """``fn`` (fixed shapes, no host reads) through torch.compile when ``compiled``: its small kernels fused into a
    few, which a round's CUDA graph then replays like any other."""
    return torch.compile(fn, dynamic=False, fullgraph=True, options=COMPILE_OPTIONS) if compiled else fn


class _StaticAttention:
    """One draft layer's static cache; each call writes its keys at ``write_at`` and attends under ``mask``.
    ``fold``: the query heads sharing a key head folded into its rows ([1, Hkv, G*T, d], the mask repeated per
    group). A masked SDPA with ``enable_gqa`` has no fused kernel and runs as float32 math (two float32 GEMMs per
    draft step on the H200); the folded form takes cuDNN's — for the rounds' fixed shapes only: cuDNN builds a
    plan per new shape, and prompts of new lengths cost ~50 ms each that way (H200)."""

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, write_at: torch.Tensor, mask: torch.Tensor, fold: bool
    ):
        self.keys, self.values, self.write_at, self.mask, self.fold = keys, values, write_at, mask, fold

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [Hq, T, d], k/v [Hkv, T, d] -> [Hq, T, d]."""
        self.keys.index_copy_(1, self.write_at, k)
        self.values.index_copy_(1, self.write_at, v)
        if not self.fold:
            return F.scaled_dot_product_attention(
                q, self.keys, self.values, attn_mask=self.mask, enable_gqa=q.shape[0] != k.shape[0]
            )
        heads, rows, dim = q.shape
        kv_heads = self.keys.shape[0]
        groups = heads // kv_heads
        mask = self.mask.expand(rows, self.mask.shape[-1]).repeat(groups, 1)  # [G*T, slots]
        out = F.scaled_dot_product_attention(
            q.reshape(1, kv_heads, groups * rows, dim), self.keys[None], self.values[None], attn_mask=mask[None, None]
        )
        return out.reshape(heads, rows, dim)  # (the memory-efficient kernel's output is laid out [1, G*T, Hkv, d])


class StaticDraft:
    """The draft on a static cache: prompts prefilled eagerly, then each round extends by the last round's accepted
    rows and drafts (``_round``, the algorithm's part), as one CUDA graph on GPU (eager elsewhere)."""

    def __init__(
        self,
        draft: Eagle3Draft,
        max_len: int,
        depth: int,
        spec_slots: int,
        graphs: bool | None = None,
        compiled: bool = False,
    ):
        config = draft.config
        self.draft = draft
        self.compiled = compiled
        # the round through torch.compile (fixed shapes, one graph): its ~60 small kernels per draft step fused into
        # a few, captured in the round's CUDA graph like any kernel; prompts (any length) stay eager
        self._draft_round = compile_round_part(self._round, compiled)
        self.device = draft.fc.weight.device
        self.dtype = draft.fc.weight.dtype
        self.depth, self.rows, self.max_len = depth, depth + 1, max_len
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        slots = max_len + spec_slots  # real positions, then speculative entries
        shape = (config.num_key_value_heads, slots, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros_like(keys) for keys in self.keys]
        self.used = draft_target_ids(draft)
        self._slot = torch.arange(slots, device=self.device)  # [slots]
        self.length = 0
        # the round's static inputs and output
        aux_width = config.target_hidden_size
        layers = len(config.eagle_aux_hidden_state_layer_ids)
        self.in_tokens = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        self.in_aux = torch.zeros(self.rows, layers, aux_width, dtype=self.dtype, device=self.device)
        self.in_real_rows = torch.ones((), dtype=torch.long, device=self.device)
        self.in_start = torch.zeros((), dtype=torch.long, device=self.device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()

    def reset(self) -> None:
        self.length = 0

    def _attends(self, write_at: torch.Tensor, mask: torch.Tensor, fold: bool = True) -> list[_StaticAttention]:
        return [_StaticAttention(k, v, write_at, mask, fold) for k, v in zip(self.keys, self.values)]

    def _extend(
        self, tokens: torch.Tensor, aux: torch.Tensor, start: torch.Tensor, fold: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows at positions start.. (causal over the real cache): hidden [n, H], logits [n, Vd]."""
        rows = torch.arange(len(tokens), device=self.device) + start  # [n] positions
        cos, sin = draft_rope(self.draft, rows)
        mask = self._slot[None, :] <= rows[:, None]  # [n, slots]: real keys up to its own position
        return self.draft.step(tokens, self.draft.fuse(aux.to(self.dtype)), cos, sin, self._attends(rows, mask, fold))

    @torch.inference_mode()
    def prefill(self, tokens: list[int], aux: torch.Tensor) -> None:
        """The prompt's rows (all but the newest), eagerly: their count varies by prompt."""
        if tokens:
            self._extend(
                torch.tensor(tokens, device=self.device), aux, torch.tensor(self.length, device=self.device), fold=False
            )
            self.length += len(tokens)

    def _extend_round_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Extend by ``in_real_rows`` of the R input rows: the last real row's hidden [1, H], logits [1, Vd],
        token [1], and the draft's length after it (0-d)."""
        hidden, logits = self._extend(self.in_tokens, self.in_aux, self.in_start)
        last = (self.in_real_rows - 1).view(1)
        return (
            hidden.index_select(0, last),
            logits.index_select(0, last),
            self.in_tokens.index_select(0, last),
            self.in_start + self.in_real_rows,
        )

    def draft_round(self) -> tuple[torch.Tensor, ...]:
        """The draft's part of a round, from the ``in_*`` tensors (what a graph captures)."""
        return self._draft_round()

    def _round(self) -> tuple[torch.Tensor, ...]:
        """The algorithm's drafting from the ``in_*`` rows (``chain.StaticChainDraft``, ``tree.StaticTreeDraft``)."""
        raise NotImplementedError

    @torch.inference_mode()
    def _run_round(self, tokens: torch.Tensor, aux: torch.Tensor, real_rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.in_tokens.copy_(tokens)
        self.in_aux.copy_(aux)
        self.in_real_rows.copy_(real_rows)
        self.in_start.fill_(self.length)
        if not self.graphs:
            return self.draft_round()
        if self._graph is None:
            self._graph, self._outputs = capture(self.device, self.draft_round)
        self._graph.replay()
        return tuple(output.clone() for output in self._outputs)

    def round(self, tokens: torch.Tensor, aux: torch.Tensor, real_rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """tokens [R] and aux [R, layers, H] on the device (rows past ``real_rows`` are padding), real_rows 0-d: the
        round's drafting replayed alone (what ``benchmarks/bench_static_round.py`` times). Call ``advance`` with the
        real row count once it is known on the host."""
        return self._run_round(tokens, aux, real_rows)

    def advance(self, real_rows: int) -> None:
        self.length += real_rows

    def round_state(self) -> list[torch.Tensor]:
        """The device tensors a round advances: next rows, their features, count, start."""
        return [self.in_tokens, self.in_aux, self.in_real_rows, self.in_start]

    def set_round_inputs(self, tokens: torch.Tensor, aux: torch.Tensor, real_rows: int) -> None:
        """The first round's rows (tokens [R], aux [R, layers, H]), starting at the draft's host ``length``."""
        self.in_tokens.copy_(tokens)
        self.in_aux.copy_(aux)
        self.in_real_rows.fill_(real_rows)
        self.in_start.fill_(self.length)


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


def check_room(
    target: StaticTarget, target_length: int, writes: int, draft: StaticDraft | None = None, draft_length: int = 0
) -> None:
    """A round writes ``writes`` target entries at ``target_length`` and the draft's R rows at ``draft_length``;
    inside a graph an index past the cache would be a device-side fault, so the host refuses it first."""
    needed = max(target_length + writes, draft_length + draft.rows if draft is not None else 0)
    if needed > target.max_len or (draft is not None and needed > draft.max_len):
        raise cache_too_short(min(target.max_len, draft.max_len if draft else target.max_len), needed)


class Rounds:
    """The device state shared by the round bodies: where the target's cache ends (0-d)."""

    def __init__(self, target: StaticTarget):
        self.target = target
        self.target_length = torch.zeros((), dtype=torch.long, device=target.device)


def prefill_rounds(target: StaticTarget, draft: StaticDraft, prompt: list[int]) -> int:
    """The prompt through the target (eagerly or in a bucket) and the draft; the first round's inputs set on
    the device; returns the target's first token."""
    target.reset()
    draft.reset()
    logits, aux = target.forward(prompt)
    first = logits[-1].argmax().view(1)  # [1]
    draft.prefill(prompt[1:], aux[:-1])
    draft.set_round_inputs(first.expand(draft.rows), aux[-1:].expand(draft.rows, -1, -1), 1)
    return int(first)


def decode_in_rounds(
    target: StaticTarget,
    draft: StaticDraft,
    rounds: "Rounds",
    prompt: list[int],
    max_new: int,
    stop_ids: set[int],
    verify_writes: int,
) -> DecodeResult:
    """Greedy speculative decoding of one prompt with ``rounds`` (its ``graph`` one round: it returns [D+2], the
    accepted count then the new tokens); ``verify_writes``: the most target entries a round writes."""
    sync(target.device)
    started = time.perf_counter()
    out = [prefill_rounds(target, draft, prompt)]
    target_length, draft_rows = target.length, 1
    rounds.target_length.fill_(target_length)
    accepted_counts: list[int] = []
    while not finish(out, stop_ids, max_new)[1]:
        check_room(target, target_length, verify_writes, draft, draft.length)
        host = rounds.graph.run()
        count = host[0]
        out.extend(host[1 : count + 2])
        accepted_counts.append(count)
        draft.advance(draft_rows)
        target_length, draft_rows = target_length + count + 1, count + 1
    target.set_length(target_length)
    sync(target.device)
    return DecodeResult(finish(out, stop_ids, max_new)[0], accepted_counts, time.perf_counter() - started)
