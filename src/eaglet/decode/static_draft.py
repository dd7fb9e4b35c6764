"""The draft on a static cache: a greedy chain's drafting (extend by the accepted rows, propose D tokens)
with fixed shapes, so it can be captured in a CUDA graph.

With the target replayed as a CUDA graph (``static.py``) a step of a small target costs a few ms, and the
draft's eager Python (~40 kernel launches per draft step, each step waiting on the host) would cost as much
as the verification it saves. So the draft side of a round — extending the draft's cache with the newly
accepted positions, then proposing D tokens — reads only device tensors (``in_*``); ``rounds.py`` captures
it together with the verification and the acceptance as one graph. ``round`` replays the draft's part alone
(what ``benchmarks/bench_static_round.py`` times).

The draft's static cache per layer is [Hkv, max_len + D, d]: real positions first (``0..length-1``), then
D slots for the chain's speculative entries. A round extends by a fixed R = D + 1 rows (the accepted
tokens and the correction, padded; padding rows write past ``length`` where nothing reads them), then runs
D - 1 chain steps, step j at the last real position + j, exactly the dynamic ``DraftRunner``'s arithmetic (tested).
"""

from __future__ import annotations

import os
import shutil
from typing import Callable, TypeVar

import torch
import torch.nn.functional as F

from ..draft import Eagle3Draft
from .engine import draft_rope, draft_target_ids
from .static import capture


# Sorts stay ATen's kernels (the eager rounds' ones): with persistent reductions on, inductor lowers sorts of
# <= 512 elements to a Triton bitonic network, and on the H200 (torch 2.11) the d10/k10/b96 tree's compiled
# round stopped on a device-side "index out of bounds" where its sort indices are used (the tree's per-level
# sorts of 10 and 100 scores; d8/k8/b64, whose level sorts hold 8 and 64, ran right).
COMPILE_OPTIONS = {"triton.persistent_reductions": False}
T = TypeVar("T")


def compile_round_part(fn: Callable[..., T], compiled: bool) -> Callable[..., T]:
    """``fn`` (fixed shapes, no host reads) through torch.compile when ``compiled``: its small kernels fused into a
    few, which a round's CUDA graph then replays like any other."""
    return torch.compile(fn, dynamic=False, fullgraph=True, options=COMPILE_OPTIONS) if compiled else fn


def compiles_draft_round(compile_draft: str, static: bool, greedy: bool, device: str) -> bool:
    """Whether eval runs the draft's round through torch.compile: greedy rounds on static caches, and
    ``--compile-draft on`` (any device) or ``auto`` on a GPU."""
    return static and greedy and (compile_draft == "on" or (compile_draft == "auto" and device.startswith("cuda")))


def draft_compile_problem(device: str) -> str | None:
    """Why torch.compile cannot build the draft's round here (Triton on GPU, a C++ compiler on CPU), or None."""
    if device.startswith("cuda"):
        from torch.utils._triton import has_triton

        return None if has_triton() else "torch.compile on GPU needs Triton, which this Python environment lacks"
    compiler = os.environ.get("CXX", "g++")  # what inductor's C++ backend calls
    return None if shutil.which(compiler) else f"torch.compile on CPU needs a C++ compiler ({compiler!r} is not on PATH)"


class _StaticAttention:
    """One draft layer's static cache; each call writes its keys at ``write_at`` and attends under ``mask``.
    ``fold``: the query heads sharing a key head folded into its rows ([1, Hkv, G*T, d], the mask repeated per
    group). A masked SDPA with ``enable_gqa`` has no fused kernel and runs as float32 math (two float32 GEMMs per
    draft step on the H200); the folded form takes cuDNN's — for the rounds' fixed shapes only: cuDNN builds a
    plan per new shape, and prompts of new lengths cost ~50 ms each that way (H200, session 9)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, write_at: torch.Tensor, mask: torch.Tensor,
                 fold: bool):
        self.keys, self.values, self.write_at, self.mask, self.fold = keys, values, write_at, mask, fold

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [Hq, T, d], k/v [Hkv, T, d] -> [Hq, T, d]."""
        self.keys.index_copy_(1, self.write_at, k)
        self.values.index_copy_(1, self.write_at, v)
        if not self.fold:
            return F.scaled_dot_product_attention(q, self.keys, self.values, attn_mask=self.mask,
                                                  enable_gqa=q.shape[0] != k.shape[0])
        heads, rows, dim = q.shape
        kv_heads = self.keys.shape[0]
        groups = heads // kv_heads
        mask = self.mask.expand(rows, self.mask.shape[-1]).repeat(groups, 1)  # [G*T, slots]
        out = F.scaled_dot_product_attention(q.reshape(1, kv_heads, groups * rows, dim), self.keys[None],
                                             self.values[None], attn_mask=mask[None, None])
        return out.reshape(heads, rows, dim)  # (the memory-efficient kernel's output is laid out [1, G*T, Hkv, d])


class StaticDraft:
    """The draft on a static cache; ``round`` is one CUDA graph on GPU (eager elsewhere)."""

    def __init__(self, draft: Eagle3Draft, max_len: int, depth: int, graphs: bool | None = None,
                 spec_slots: int | None = None, compiled: bool = False):
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
        slots = max_len + (depth if spec_slots is None else spec_slots)  # real positions, then speculative entries
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

    def _extend(self, tokens: torch.Tensor, aux: torch.Tensor, start: torch.Tensor,
                fold: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows at positions start.. (causal over the real cache): hidden [n, H], logits [n, Vd]."""
        rows = torch.arange(len(tokens), device=self.device) + start  # [n] positions
        cos, sin = draft_rope(self.draft, rows)
        mask = self._slot[None, :] <= rows[:, None]  # [n, slots]: real keys up to its own position
        return self.draft.step(tokens, self.draft.fuse(aux.to(self.dtype)), cos, sin, self._attends(rows, mask, fold))

    @torch.inference_mode()
    def prefill(self, tokens: list[int], aux: torch.Tensor) -> None:
        """The prompt's rows (all but the newest), eagerly: their count varies by prompt."""
        if tokens:
            self._extend(torch.tensor(tokens, device=self.device), aux, torch.tensor(self.length, device=self.device),
                         fold=False)
            self.length += len(tokens)

    def _extend_round_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Extend by ``in_real_rows`` of the R input rows: the last real row's hidden [1, H], logits [1, Vd],
        token [1], and the draft's length after it (0-d)."""
        hidden, logits = self._extend(self.in_tokens, self.in_aux, self.in_start)
        last = (self.in_real_rows - 1).view(1)
        return (hidden.index_select(0, last), logits.index_select(0, last), self.in_tokens.index_select(0, last),
                self.in_start + self.in_real_rows)

    def draft_round(self) -> tuple[torch.Tensor, ...]:
        """The draft's part of a round, from the ``in_*`` tensors (what a graph captures)."""
        return self._draft_round()

    def _round(self) -> tuple[torch.Tensor, ...]:
        """Extend, then propose D tokens: (drafted [D] target ids,)."""
        hidden, logits, _, end = self._extend_round_rows()
        token = self.used[logits.argmax(-1)]  # [1]
        drafted = [token]
        real = self._slot < end
        for step in range(1, self.depth):
            cos, sin = draft_rope(self.draft, (end - 1 + step).view(1))  # step j: the last real position + j
            spec_slot = self.max_len + step - 1
            mask = (real | ((self._slot >= self.max_len) & (self._slot <= spec_slot)))[None]  # [1, slots]
            hidden, logits = self.draft.step(token, hidden, cos, sin, self._attends(self._slot[spec_slot:spec_slot + 1], mask))
            token = self.used[logits.argmax(-1)]
            drafted.append(token)
        return (torch.cat(drafted),)

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

    def round(self, tokens: torch.Tensor, aux: torch.Tensor, real_rows: torch.Tensor) -> torch.Tensor:
        """tokens [R] and aux [R, layers, H] on the device (rows past ``real_rows`` are padding), real_rows
        0-d: the draft's proposals [D]. Call ``advance`` with the real row count once it is known on the host."""
        return self._run_round(tokens, aux, real_rows)[0]

    def advance(self, real_rows: int) -> None:
        self.length += real_rows

    def round_state(self) -> list[torch.Tensor]:
        """The device tensors a fused round (``rounds.py``) advances: next rows, their features, count, start."""
        return [self.in_tokens, self.in_aux, self.in_real_rows, self.in_start]

    def set_round_inputs(self, tokens: torch.Tensor, aux: torch.Tensor, real_rows: int) -> None:
        """The first round's rows (tokens [R], aux [R, layers, H]), starting at the draft's host ``length``."""
        self.in_tokens.copy_(tokens)
        self.in_aux.copy_(aux)
        self.in_real_rows.fill_(real_rows)
        self.in_start.fill_(self.length)

