"""Training-time test (TTT): the draft unrolled K steps on a packed batch, with the EAGLE-3 loss.

Step k at position t feeds token x[t+1+k] and (k=0) the fused target features at t, or (k>0) the
draft's own step-(k-1) output at t; it predicts x[t+2+k], whose teacher distribution is the target's
softmax at t+1+k restricted to the draft vocabulary. Step 0 attends causally inside its document;
step k also sees its own position's keys from steps 1..k (the "diagonal"), exactly what the draft
sees when it runs autoregressively in serving, at RoPE position t+k (serving advances the draft's
position by one per step). Loss: Σ_k decay^k · soft-CE_k over positions where
the target token is an assistant token and the teacher's full-vocab argmax lies in the draft vocab.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..model.draft import Eagle3Draft
from ..model.transfer import to_device
from .loss import head_soft_cross_entropy


@dataclass
class TTTInputs:
    """One packed batch on the device. T tokens, documents back to back."""

    input_ids: torch.Tensor  # [T] int64
    aux: torch.Tensor  # [T, 3, H_target]
    loss_mask: torch.Tensor  # [T] bool: token t is an assistant token
    doc_ids: torch.Tensor  # [T] int64: which document each token belongs to
    positions: torch.Tensor  # [T] int64: position inside its document (RoPE)
    doc_end: torch.Tensor  # [T] int64: exclusive end index of the token's document
    teacher_logits: torch.Tensor  # [T, Vd] float32: target logits at t over the draft vocab (predict t+1)
    teacher_in_vocab: torch.Tensor  # [T] bool: the target's full-vocab argmax at t is in the draft vocab


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar, Σ decay^k loss_k
    step_losses: list[torch.Tensor]  # K scalars (detached)
    step_correct: list[torch.Tensor]  # K counts of top-1 matches (detached)
    step_counts: list[torch.Tensor]  # K counts of positions that contributed


def documents(doc_offsets: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """doc_offsets [n+1] -> doc_ids [T], positions [T], doc_end [T]."""
    lengths = doc_offsets[1:] - doc_offsets[:-1]
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    positions = torch.arange(int(doc_offsets[-1])) - doc_offsets[:-1][doc_ids]
    doc_end = doc_offsets[1:][doc_ids]
    return to_device(doc_ids, device), to_device(positions, device), to_device(doc_end, device)


def shift(x: torch.Tensor, k: int, fill: float | int | bool = 0) -> torch.Tensor:
    """x[t + k] at t, ``fill`` past the end."""
    if k == 0:
        return x
    pad = torch.full((k, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[k:], pad])


ATTENTION_WEIGHT_BYTES = 4  # the dense path's softmax runs in float32
# the K steps' attention weights kept for the backward up to this size; above it they are recomputed (CPU steps at
# 1,024 tokens keep them: 15-20% faster; at 4,096 tokens recomputing saved 5 GB of 14.5)
ATTENTION_KEEP_BYTES = 1 << 30


def document_causal(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids [T] -> [T, T] bool: query t sees key s iff s <= t in the same document (step 0's keys)."""
    index = torch.arange(len(doc_ids), device=doc_ids.device)
    return (index[None, :] <= index[:, None]) & (doc_ids[None, :] == doc_ids[:, None])


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=0)


class TTTAttention:
    """Attention for step k: causal over step 0's keys (same document) + diagonal over steps 1..k.

    Dense path: the causal part is one masked [Hq, T, T] score matrix; the diagonal part is an
    elementwise product per earlier step, so cost grows by T (not T²) per extra step. Numbers are the
    same as running the steps one by one with explicit masks (tested)."""

    def __init__(self, doc_ids: torch.Tensor, steps: int = 1):
        self.doc_ids = doc_ids
        self.steps = steps
        self.causal = document_causal(doc_ids)  # [T, T]
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        kept_bytes = self.steps * q.shape[0] * self.causal.numel() * ATTENTION_WEIGHT_BYTES  # K steps' [Hq, T, T]
        if torch.is_grad_enabled() and q.requires_grad and kept_bytes > ATTENTION_KEEP_BYTES:
            # recomputed in the backward instead of kept: at 4,096 tokens the K steps' weights were most of a CPU
            # step's memory (12 GB for the embedded target's draft); below the bound keeping them is faster
            return checkpoint(self._attend, q, *self.keys, *self.values, use_reentrant=False)
        return self._attend(q, *self.keys, *self.values)

    def _attend(self, q: torch.Tensor, *keys_then_values: torch.Tensor) -> torch.Tensor:
        keys, values = keys_then_values[: len(keys_then_values) // 2], keys_then_values[len(keys_then_values) // 2 :]
        groups = q.shape[0] // keys[0].shape[0]
        scale = q.shape[-1] ** -0.5
        acc = torch.promote_types(q.dtype, torch.float32)  # softmax in at least fp32
        k0, v0 = _expand_kv(keys[0], groups), _expand_kv(values[0], groups)
        scores = (q @ k0.transpose(-1, -2)).to(acc) * scale  # [Hq, T, T]
        scores = scores.masked_fill(~self.causal, float("-inf"))
        extra_k = [_expand_kv(key, groups) for key in keys[1:]]
        extra_v = [_expand_kv(value, groups) for value in values[1:]]
        if extra_k:
            diagonal = torch.stack([(q * key).sum(-1) for key in extra_k], dim=-1).to(acc) * scale  # [Hq, T, k]
            weights = torch.softmax(torch.cat([scores, diagonal], dim=-1), dim=-1)
            tokens = scores.shape[-1]
            out = weights[..., :tokens].to(v0.dtype) @ v0
            for j, value in enumerate(extra_v):
                out = out + weights[..., tokens + j, None].to(value.dtype) * value
            return out
        return torch.softmax(scores, dim=-1).to(v0.dtype) @ v0


def unroll(
    draft: Eagle3Draft,
    input_ids: torch.Tensor,
    aux: torch.Tensor,
    doc_ids: torch.Tensor,
    positions: torch.Tensor,
    doc_end: torch.Tensor,
    steps: int,
    attention_factory=TTTAttention,
) -> Iterator[torch.Tensor]:
    """Each TTT step's input to the draft's LM head [T, H] in turn (the module docstring says what step k sees);
    ``draft.lm_head`` of it is the step's logits [T, Vd]."""
    attends = [attention_factory(doc_ids, steps) for _ in range(draft.config.num_hidden_layers)]  # key caches per layer
    hidden = draft.fuse(aux.to(draft.fc.weight.dtype))
    index = torch.arange(len(input_ids), device=input_ids.device)
    for k in range(steps):
        ids = torch.where(index + 1 + k < doc_end, shift(input_ids, 1 + k), 0)
        # step k sits k positions past t, as serving runs it (vLLM and SGLang advance the draft's positions by
        # one per step; EAGLE-3's reference trains with position_ids + step): its query and its own key
        cos, sin = draft.rope(positions + k)
        hidden, head_input = draft.advance(ids, hidden, cos, sin, attends)
        yield head_input


def ttt_forward(
    draft: Eagle3Draft,
    inputs: TTTInputs,
    steps: int,
    decay: float = 0.8,
    attention_factory=TTTAttention,
    feature_noise_std: float = 0.0,
) -> TTTOutput:
    """Unroll ``steps`` draft steps and return the weighted loss plus per-step statistics."""
    aux = inputs.aux
    if feature_noise_std > 0:
        aux = aux + torch.randn_like(aux) * feature_noise_std
    tokens = len(inputs.input_ids)
    index = torch.arange(tokens, device=inputs.input_ids.device)
    # the teacher once per batch, K zero rows past the end: step k reads rows 1+k..T+k as a view (no shifted copies)
    teacher = inputs.teacher_logits
    teacher_probs = teacher.new_zeros(tokens + steps, teacher.shape[1])  # [T+K, Vd]
    teacher_probs[:tokens] = F.softmax(teacher, dim=-1)
    teacher_top = torch.cat([teacher.argmax(-1), teacher.new_full((steps,), -1, dtype=torch.long)])  # [T+K]
    total = torch.zeros((), device=aux.device)
    step_losses, step_correct, step_counts = [], [], []
    head_inputs = unroll(
        draft, inputs.input_ids, aux, inputs.doc_ids, inputs.positions, inputs.doc_end, steps, attention_factory
    )
    for k, head_input in enumerate(head_inputs):
        mask = (
            (index + 2 + k < inputs.doc_end)
            & shift(inputs.loss_mask, 2 + k, False)
            & shift(inputs.teacher_in_vocab, 1 + k, False)
        )
        count = mask.sum()
        weights = mask.to(teacher_probs.dtype) / count.clamp_min(1)
        # teacher at t+1+k: the target's distribution over x[t+2+k], what step k predicts
        loss, predicted = head_soft_cross_entropy(
            draft.lm_head, head_input, teacher_probs[1 + k : 1 + k + tokens], weights
        )
        total = total + decay**k * loss
        step_losses.append(loss.detach())
        step_correct.append(((predicted == teacher_top[1 + k : 1 + k + tokens]) & mask).sum().detach())
        step_counts.append(count.detach())
    return TTTOutput(total, step_losses, step_correct, step_counts)


class TTTModule(torch.nn.Module):
    """The draft plus its TTT loss as one forward, so DDP/FSDP see a single module call."""

    def __init__(self, draft: Eagle3Draft, steps: int, decay: float, noise_std: float, attention_kernels: str):
        super().__init__()
        self.draft = draft
        self.steps, self.decay, self.noise_std = steps, decay, noise_std
        self.attention_kernels = attention_kernels

    def attention(self, device: torch.device):
        return attention_for(device, self.draft.config.head_dim, self.attention_kernels)

    def forward(self, inputs: TTTInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out = ttt_forward(
            self.draft,
            inputs,
            self.steps,
            self.decay,
            self.attention(inputs.input_ids.device),
            self.noise_std if self.training else 0.0,
        )
        return out.loss, torch.stack(out.step_losses), torch.stack(out.step_correct), torch.stack(out.step_counts)


def acceptance_length(accuracies: list[float]) -> float:
    """τ = 1 + Σ_k Π_{j<=k} acc_j: tokens per target forward of a chain of ``len(accuracies)`` draft tokens, were
    step k's top-1 accepted with its held-out accuracy. The 1 is the target's own token each round, counted as vLLM
    and `eaglet eval` count it (1 + accepted / rounds), so training's τ and the served one are the same quantity."""
    total, running = 1.0, 1.0
    for accuracy in accuracies:
        running *= accuracy
        total += running
    return total


FLEX_BLOCK = 128  # FlexAttention's default block-mask tile (torch's _DEFAULT_SPARSE_BLOCK_SIZE)


def _ordered(listed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[QB, KVB] bool (key block b listed for query block q) -> counts [1, 1, QB] int32 and indices
    [1, 1, QB, KVB] int32 holding each row's listed key blocks first, in increasing order (BlockMask's layout)."""
    columns = torch.arange(listed.shape[1], device=listed.device)
    indices = torch.where(listed, columns, columns + listed.shape[1]).argsort(dim=-1)
    return listed.sum(-1, dtype=torch.int32)[None, None], indices.to(torch.int32)[None, None]


def ttt_block_mask(doc_ids: torch.Tensor, filled_steps: int, key_steps: int, mask_mod):
    """The TTT attention's block mask for a query of step ``filled_steps - 1`` over ``key_steps`` steps' keys,
    built from the document layout in O(blocks²) instead of by evaluating ``mask_mod`` at all T × T·K points
    (``create_block_mask``: 1.9 G evaluations per step at the demo's T = 16,384, K = 7).

    Query block q lists, over step-0 keys, every block from the one holding its first query's document start to
    q itself — *full* (no mask needed) where the key block lies before q inside the document of q's last query,
    partial otherwise — and, for each step 1 ≤ j < filled_steps, the diagonal block j·QB + q (partial: only
    the query's own position). ``mask_mod`` decides inside partial blocks. Needs T to be a multiple of
    FLEX_BLOCK (batches are padded to the token budget); otherwise ``create_block_mask`` builds it."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    tokens = len(doc_ids)
    if tokens % FLEX_BLOCK:
        return create_block_mask(
            mask_mod,
            None,
            None,
            tokens,
            tokens * key_steps,
            device=doc_ids.device,
            _compile=doc_ids.device.type == "cuda",
        )
    blocks = tokens // FLEX_BLOCK
    device = doc_ids.device
    query_block = torch.arange(blocks, device=device)[:, None]  # [QB, 1]
    key_block = torch.arange(blocks * key_steps, device=device)[None, :]  # [1, KVB]
    doc_start = torch.searchsorted(doc_ids, doc_ids)  # [T]: first index of each token's document
    first_start = doc_start[query_block * FLEX_BLOCK]  # [QB, 1]: document start of the block's first query
    last_start = doc_start[query_block * FLEX_BLOCK + FLEX_BLOCK - 1]  # ... and of its last query
    step0 = key_block < blocks
    causal = step0 & (key_block >= first_start // FLEX_BLOCK) & (key_block <= query_block)
    full = step0 & (key_block < query_block) & (key_block * FLEX_BLOCK >= last_start)
    diagonal = ~step0 & (key_block % blocks == query_block) & (key_block < filled_steps * blocks)
    return BlockMask.from_kv_blocks(
        *_ordered((causal & ~full) | diagonal),
        *_ordered(full),
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(tokens, tokens * key_steps),
    )


class FlexTTTAttention:
    """The same attention through FlexAttention block masks (GPU; compiled). Keys live in one buffer of
    all K steps ([T*K]: step j's keys at j*T..(j+1)*T, steps not yet run are zeros), and the mask allows
    step-0 keys causally within the document, step-j keys (1 <= j <= current step) only at the query's own
    position, and nothing past the current step. Never materialises a [T, T] score matrix.

    Every step has the same shapes and the step limit is a tensor the mask reads, so one compiled kernel
    (and one compiled mask builder) serves all K steps: with a key set growing per step, each of the K
    shapes compiled its own (~30 s each on an H200). Grad mode is part of torch.compile's guards, so every
    caller runs with autograd on (see ``train.evaluate``): a no_grad variant would compile again."""

    _compiled = None

    def __init__(self, doc_ids: torch.Tensor, steps: int):
        self.doc_ids = doc_ids
        self.steps = steps
        # key-buffer length visible after each step, made on the device (a host scalar copied per step would
        # synchronise the stream every step)
        self.key_limits = torch.arange(1, steps + 1, device=doc_ids.device) * len(doc_ids)  # [K]
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._layout = None  # the batch's block layout, built at the first step

    @classmethod
    def _kernel(cls, device: torch.device):
        from torch.nn.attention.flex_attention import flex_attention

        if device.type != "cuda":
            return flex_attention
        if cls._compiled is None:
            cls._compiled = torch.compile(flex_attention, dynamic=False)
        return cls._compiled

    def key_steps(self, filled_steps: int) -> int:
        """Steps' worth of keys the kernel sees: all K, whatever has run (one shape, one kernel)."""
        return self.steps

    def mask_mod(self, filled_steps: int):
        """FlexAttention's per-point rule for a query of step ``filled_steps - 1``; the step limit stays in it
        (not only in the block layout) because eager FlexAttention applies the rule without the block layout."""
        tokens = len(self.doc_ids)
        doc_ids = self.doc_ids
        key_limit = self.key_limits[filled_steps - 1]  # a 0-d tensor, not an int: no recompile per step

        def allowed(batch, head, query, key):
            position = key % tokens
            same_doc = doc_ids[position] == doc_ids[query]
            return (key < key_limit) & torch.where(key < tokens, (key <= query) & same_doc, position == query)

        return allowed

    def _block_mask(self, filled_steps: int):
        """One block layout per batch, listing every step's diagonal blocks (the kernel always sees all K steps'
        keys); each step gets it with its own ``mask_mod``, whose step limit masks the steps not run yet. Building
        the layout is ~60 small tensor ops: once per batch instead of once per step keeps them off a host that is
        already the step's bottleneck (8B shape, H200: 66 ms of GPU work in a 96 ms step)."""
        if self._layout is None:
            self._layout = ttt_block_mask(self.doc_ids, self.steps, self.steps, self.mask_mod(self.steps))
        mask = copy.copy(self._layout)
        mask.mask_mod = self.mask_mod(filled_steps)
        return mask

    def _all_steps(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """[Hkv, T, d] per step so far -> [1, Hkv, T*key_steps, d], zeros for the steps not run yet."""
        missing = self.key_steps(len(parts)) - len(parts)
        if missing:
            first = parts[0]
            parts = parts + [first.new_zeros(first.shape[0], first.shape[1] * missing, first.shape[2])]
        return torch.cat(parts, dim=1)[None]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        kernel = self._kernel(q.device)
        out = kernel(
            q[None],
            self._all_steps(self.keys),
            self._all_steps(self.values),
            block_mask=self._block_mask(len(self.keys)),
            enable_gqa=q.shape[0] != k.shape[0],
        )
        return out[0]


class PerStepFlexTTTAttention(FlexTTTAttention):
    """The same attention with each step's kernel seeing only the keys run so far ([T*(k+1)]): K compiled
    kernels (one per key length) instead of one, but steps without the padded key buffer. On the 8B-shaped
    step (H200, ``benchmarks/bench_train.py``) per-step kernels ran 95 ms/step, the single kernel 117 ms:
    long runs amortise the extra compiles, short ones (the GPU demo) do not."""

    def key_steps(self, filled_steps: int) -> int:
        return filled_steps

    def _block_mask(self, filled_steps: int):  # the key length changes per step: a layout per step
        return ttt_block_mask(self.doc_ids, filled_steps, filled_steps, self.mask_mod(filled_steps))


def merge_diagonal(
    prefix: torch.Tensor,
    prefix_lse: torch.Tensor,
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    visible: torch.Tensor,
) -> torch.Tensor:
    """Attention over step-0 keys (its output ``prefix`` [Hq, T, d] and log-sum-exp ``prefix_lse`` [Hq, T]) widened
    by one key per query and earlier step: ``keys``/``values`` hold S slots [Hkv, T, d], slot j's key at the query's
    own position, the first ``visible`` (a 0-d tensor) slots real. Slots come as separate tensors, not one stacked
    [Hkv, T, S, d]: compiled, the merge reads them where they are instead of a copy made every step.
    Softmax over the union, from the two parts' sums:
    out = (e^(lse - m)·prefix + Σ_j e^(s_j - m)·v_j) / (e^(lse - m) + Σ_j e^(s_j - m)), m the largest term."""
    kv_heads, tokens, head_dim = keys[0].shape
    groups = q.shape[0] // kv_heads
    acc = torch.promote_types(q.dtype, torch.float32)
    grouped_q = q.view(kv_heads, groups, tokens, head_dim).to(acc)
    scores = torch.stack([(grouped_q * key[:, None].to(acc)).sum(-1) for key in keys], -1)  # [Hkv, G, T, S]
    scores = scores * head_dim**-0.5
    hidden = torch.arange(len(keys), device=q.device) >= visible  # [S]: slots of steps not run yet
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = prefix_lse.view(kv_heads, groups, tokens).to(acc)
    top = torch.maximum(lse, scores.amax(-1))  # [Hkv, G, T]; finite: every query sees its own step-0 key
    prefix_weight = torch.exp(lse - top)
    diagonal_weights = torch.exp(scores - top[..., None])  # [Hkv, G, T, S]
    mixed = prefix_weight[..., None] * prefix.view(kv_heads, groups, tokens, head_dim).to(acc)
    for slot, value in enumerate(values):
        mixed = mixed + diagonal_weights[..., slot, None] * value[:, None].to(acc)
    total = prefix_weight + diagonal_weights.sum(-1)
    return (mixed / total[..., None]).view(q.shape).to(prefix.dtype)


@functools.cache
def _compiled_merge():
    return torch.compile(merge_diagonal, dynamic=False)


class SplitFlexTTTAttention(FlexTTTAttention):
    """The same attention in two parts merged by their log-sum-exps: step-0 keys (causal inside the document)
    through FlexAttention over T keys — one block mask and one compiled kernel for all K steps — and the
    diagonal keys of steps 1..k (one per query, at its own position) elementwise (``merge_diagonal``).

    The one-kernel layout instead runs FlexAttention over all K steps' keys: it concatenates them into a
    [T*K] buffer every step and lists each step's diagonal as a masked 128 x 128 block per query block,
    128 scores computed for each one kept. Off the GPU with autograd on (FlexAttention has no CPU backward)
    the step-0 part is a dense masked softmax."""

    def __init__(self, doc_ids: torch.Tensor, steps: int):
        super().__init__(doc_ids, steps)
        # [K]: how many diagonal slots step k sees, a tensor (as an int it would compile the merge once per step)
        self.visible = torch.arange(steps, device=doc_ids.device)
        self._dense_allowed: torch.Tensor | None = None  # the CPU path's step-0 mask, made on first use

    def prefix_mask_mod(self):
        """FlexAttention's rule for step-0 keys: causal inside the query's document."""
        doc_ids = self.doc_ids

        def allowed(batch, head, query, key):
            return (key <= query) & (doc_ids[key] == doc_ids[query])

        return allowed

    def _block_mask(self, filled_steps: int):
        if self._layout is None:
            self._layout = ttt_block_mask(self.doc_ids, 1, 1, self.prefix_mask_mod())
        return self._layout

    def _prefix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over step-0 keys: output [Hq, T, d] and its log-sum-exp [Hq, T] (natural log)."""
        if q.device.type == "cuda" or not torch.is_grad_enabled():
            from torch.nn.attention.flex_attention import AuxRequest

            out, aux = self._kernel(q.device)(
                q[None],
                k[None],
                v[None],
                block_mask=self._block_mask(1),
                enable_gqa=q.shape[0] != k.shape[0],
                return_aux=AuxRequest(lse=True),
            )
            return out[0], aux.lse[0]
        groups = q.shape[0] // k.shape[0]
        if self._dense_allowed is None:
            self._dense_allowed = document_causal(self.doc_ids)  # [T, T], the same for every step and layer call
        scores = (q @ _expand_kv(k, groups).transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32))
        scores = (scores * q.shape[-1] ** -0.5).masked_fill(~self._dense_allowed, float("-inf"))  # [Hq, T, T]
        lse = torch.logsumexp(scores, dim=-1)
        return torch.softmax(scores, dim=-1).to(v.dtype) @ _expand_kv(v, groups), lse

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        prefix, lse = self._prefix(q, self.keys[0], self.values[0])
        slots = self.steps - 1
        if slots == 0:
            return prefix
        # the slots of steps not run yet: a distinct zero tensor each (aliased inputs would be a new guard, a new
        # compile), needing a gradient like the real ones (a different requires_grad pattern per step would too)
        missing = range(slots - len(self.keys) + 1)
        keys = self.keys[1:] + [torch.zeros_like(k, requires_grad=k.requires_grad) for _ in missing]
        values = self.values[1:] + [torch.zeros_like(v, requires_grad=v.requires_grad) for _ in missing]
        merge = _compiled_merge() if q.device.type == "cuda" else merge_diagonal
        return merge(prefix, lse, q, keys, values, self.visible[len(self.keys) - 1])


ATTENTION_KERNELS = {"one": FlexTTTAttention, "per_step": PerStepFlexTTTAttention, "split": SplitFlexTTTAttention}


class ReferenceAttention:
    """The slow, obviously-correct reference: each step's keys appended to one growing key set
    ([T*(k+1)]) under one explicit boolean mask — query t sees step-0 key s iff s <= t in the same
    document, and step-j key s (j >= 1) iff s == t. Used by the tests and as the naive baseline."""

    def __init__(self, doc_ids: torch.Tensor, steps: int = 1):
        self.doc_ids = doc_ids
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        tokens = q.shape[1]
        groups = q.shape[0] // k.shape[0]
        keys = torch.cat(self.keys, dim=1).repeat_interleave(groups, 0)  # [Hq, T*(k+1), d]
        values = torch.cat(self.values, dim=1).repeat_interleave(groups, 0)
        diagonal = torch.eye(tokens, dtype=torch.bool, device=q.device)
        allowed = torch.cat([document_causal(self.doc_ids)] + [diagonal] * (len(self.keys) - 1), dim=1)  # [T, T*(k+1)]
        scores = (q @ keys.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)) * q.shape[-1] ** -0.5
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return weights.to(values.dtype) @ values


FLEX_MIN_HEAD_DIM = 16  # FlexAttention's compiled GPU kernels refuse smaller heads (torch 2.11: "NYI ... at least 16")


def attention_for(device: torch.device, head_dim: int, kernels: str = "split"):
    """FlexAttention on GPU (``kernels``: step-0 keys with the diagonal merged in, "split"; "one" compiled kernel
    over all TTT steps' keys; or one per key length, "per_step"), the dense path elsewhere (FlexAttention has no
    CPU backward) and for heads too small for its kernels."""
    return ATTENTION_KERNELS[kernels] if device.type == "cuda" and head_dim >= FLEX_MIN_HEAD_DIM else TTTAttention
