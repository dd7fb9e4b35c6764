"""The target with a static KV cache, each forward of a fixed token count replayed as a CUDA graph.

At batch 1 a small target is launch-bound: on an H200 the dynamic-cache engine spends ~22 ms issuing the
~600 kernels of one SmolLM2-135M step from Python; replayed as a graph the step takes 3.4 ms
(``benchmarks/bench_decode_step.py``). Here every forward has a fixed shape — the cache is preallocated
(HF ``StaticCache``), a forward of n tokens is padded to a bucket size, and what changes between calls
(token ids, positions, where the cache ends, which new token sees which) lives in device tensors the graph
reads — so on GPU each bucket is captured once and replayed for the cost of one launch.

Cache semantics: positions ``0..length-1`` are real; a forward at ``start = length`` writes its n entries
at ``start..start+n-1`` and attends to ``key < start`` plus its own block under a [n, n] block mask
(causal for chains, ancestors for trees). Dropping entries is moving ``length`` back (stale entries past it
are masked out and overwritten later); keeping a tree's accepted path copies those entries down.
On CPU the same functions run eagerly (graphs are a CUDA feature), which is what the tests compare.

Implements ``TargetRunner``'s interface, so every decode loop in ``engine.py`` runs on it unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

from ..capture import FeatureCapture
from ..errors import EagletError
from .engine import Tree, cache_kwarg

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # token counts captured as graphs; longer forwards (prompts) run eagerly
WARMUP_RUNS = 2  # eager runs on a side stream before capture (cuBLAS/allocator set-up must not be captured)
T = TypeVar("T")


def capture(device: torch.device, body: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``body`` WARMUP_RUNS times on a side stream, then capture it as a CUDA graph; returns the graph
    and the outputs ``body`` left in the graph's memory (rewritten by every replay)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            outputs = body()
    except RuntimeError as error:  # an op that syncs with the host, or one graphs do not support
        raise EagletError(f"CUDA graph capture failed ({str(error).splitlines()[0]}); run eval with "
                          "--cuda-graphs off") from None
    return graph, outputs


def bucket_for(tokens: int, buckets: tuple[int, ...] = GRAPH_BUCKETS) -> int | None:
    """The smallest graph bucket holding ``tokens``, or None (run eagerly)."""
    return next((size for size in buckets if size >= tokens), None)


def buckets_for(verify_tokens: int) -> tuple[int, ...]:
    """GRAPH_BUCKETS plus one sized to the largest verification when it is past them: a tree of budget 96
    verifies 97 tokens every round, and an eager 97-token forward costs ~7x a replay (H200, session 5:
    0.48x instead of a speedup)."""
    return GRAPH_BUCKETS if verify_tokens <= GRAPH_BUCKETS[-1] else GRAPH_BUCKETS + (verify_tokens,)


EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def uses_static_cache(cuda_graphs: str, batch_size: int, device: str) -> bool:
    """Whether eval decodes on static caches: batch 1, and ``--cuda-graphs on`` (any device) or ``auto`` on a
    GPU (graphs then replay the forwards; elsewhere the same functions run eagerly)."""
    return batch_size == 1 and (cuda_graphs == "on" or (cuda_graphs == "auto" and device.startswith("cuda")))


def static_cache_problem(config: Any, graphs: bool, cache: Any = None) -> str | None:
    """Why this target cannot decode on a movable static cache (or, with ``graphs``, be captured as a CUDA
    graph), or None. Needs only the config (preflight asks before any weights load)."""
    import transformers
    from transformers import StaticCache

    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if graphs and any(getattr(text_config, key, None) for key in EXPERT_COUNT_KEYS):
        return (f"{type(config).__name__} is a mixture of experts: transformers routes tokens with host-side "
                "reads (nonzero), which a CUDA graph cannot capture")
    cache = cache if cache is not None else StaticCache(config=config, max_cache_len=GRAPH_BUCKETS[-1])
    layers = getattr(cache, "layers", None)
    if not layers or not all(hasattr(layer, "cumulative_length") for layer in layers):
        return (f"transformers {transformers.__version__}'s StaticCache keeps no per-layer `cumulative_length`; "
                "static-cache decoding cannot position it")
    if any(getattr(layer, "is_sliding", False) for layer in layers):
        return (f"{type(config).__name__} has sliding-window attention layers (a rolling cache that positions cannot "
                "be moved back in); static-cache decoding covers full-attention targets")
    return None


def cache_too_short(holds: int, needs: int) -> EagletError:
    return EagletError(f"the static cache holds {holds} positions; this forward needs {needs} "
                       "(raise max_len: prompt + max new tokens + the largest verification)")


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

    def __init__(self, model: torch.nn.Module, layer_ids: tuple[int, ...], max_len: int, graphs: bool | None = None,
                 verify_tokens: int = 1):
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
        one scatter: per layer it was 120 kernels, 0.44 ms of a 5.9 ms tree round (H200, 135 M target).
        None where the layers' shapes differ (then ``move_entries`` goes layer by layer)."""
        if not hasattr(self.cache, "early_initialization"):
            return None
        config = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") \
            else self.model.config
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

    def forward(self, tokens: list[int] | torch.Tensor, tree: Tree | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``tokens`` at ``length``; logits [n, V] float32 and aux features [n, layers, H]."""
        if tree is not None:
            return self.forward_tree(tokens, torch.tensor(tree.depths), tree.ancestor_mask())
        count = len(tokens)  # a chain: made on the device (a host-built mask would be a synchronising copy)
        return self.forward_tree(tokens, torch.arange(count, device=self.device),
                                 torch.ones(count, count, dtype=torch.bool, device=self.device).tril())

    @torch.inference_mode()
    def forward_tree(self, tokens: list[int] | torch.Tensor, depths: torch.Tensor,
                     block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` with the tree given as tensors (host or device): depths [n] (RoPE offsets from
        ``length``) and block [n, n] (which new token sees which); a tree drafted on the device stays there."""
        count = len(tokens)
        start = self._length
        if start + count > self.max_len:
            raise cache_too_short(self.max_len, start + count)
        size = bucket_for(count, self.buckets)
        if size is None or start + size > self.max_len:  # no bucket, or its padding would run past the cache
            logits, aux = self._run(self._as_ids(tokens)[None], (start + depths.to(self.device))[None],
                                    torch.tensor(start, device=self.device), block.to(self.device))
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

    def run_block(self, ids: torch.Tensor, depths: torch.Tensor, block: torch.Tensor,
                  start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, start: torch.Tensor,
             block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask[None, None],
                             use_cache=True, **{self.cache_kwarg: self.cache})
        aux = torch.stack([captured[slot] for slot in range(len(self.capture.layer_ids))], dim=2)[0]
        return out.logits[0].float(), aux

    def _replay(self, size: int, tokens: list[int] | torch.Tensor, depths: torch.Tensor, start: int,
                block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
            self.device, lambda: self._run(graph.ids, graph.positions, graph.start, graph.block))
