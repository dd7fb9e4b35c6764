"""Greedy chain speculative decoding for a batch of prompts, and the same engine without a draft.

Rows accept different numbers of draft tokens each round, so the caches cannot simply be cropped.
Both keep every slot they ever computed and a per-row validity mask instead:

- the target's KV cache has one slot per forward position for every row ([B, S]); a row's rejected
  draft tokens (and its prompt padding) stay in the cache as invalid slots that no query attends to;
  positions (RoPE) count only a row's valid tokens, so each row sees exactly what the batch-1 engine
  (``chain.speculative_decode``) sees, and its greedy output is the target's own;
- the draft's cache is flat: every row's entries in one key set tagged with their row and position,
  and each query attends to its own row's entries only (a block-diagonal mask), so ``Eagle3Draft.step``
  runs all rows as one token list.

Greedy only (rejection sampling per row would need per-row random streams to stay reproducible);
``eaglet eval --batch-size`` refuses sampling and trees with a batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model.capture import FeatureCapture
from ..model.draft import Eagle3Draft
from ..model.support import cache_kwarg
from .common import DecodeResult, decode_step, draft_rope, draft_target_ids, finish, sync


class BatchTarget:
    """The target over a batch, with a DynamicCache and a validity mask per row ([B, S] bool)."""

    def __init__(self, model: torch.nn.Module, layer_ids: tuple[int, ...]):
        self.model = model
        self.capture = FeatureCapture(model, layer_ids)
        self.device = next(model.parameters()).device
        self.cache_kwarg = cache_kwarg(model)

    def reset(self, rows: int) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.valid = torch.zeros(rows, 0, dtype=torch.bool, device=self.device)  # [B, S]
        self.lengths = torch.zeros(rows, dtype=torch.long, device=self.device)  # valid tokens per row

    @decode_step
    def forward(self, ids: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``ids`` [B, q] (``real`` [B, q]: which are tokens, not padding) to every row; return
        logits [B, q, V] (float32) and aux features [B, q, 3, H]. All q new slots start valid where real."""
        rows, width = ids.shape
        positions = self.lengths[:, None] + real.long().cumsum(1) - 1  # [B, q]: padding repeats a position
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        block = (causal[None] & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=self.device)[None]
        mask = torch.cat([self.valid[:, None, :].expand(rows, width, -1), block], dim=2)[:, None]  # [B, 1, q, S+q]
        captured: dict[int, torch.Tensor] = {}
        with self.capture.hooks(captured):
            out = self.model(
                input_ids=ids,
                position_ids=positions.clamp_min(0),
                attention_mask=mask,
                use_cache=True,
                **{self.cache_kwarg: self.cache},
            )
        self.valid = torch.cat([self.valid, real], dim=1)
        self.lengths = self.lengths + real.sum(1)
        aux = torch.stack([captured[slot] for slot in range(len(self.capture.layer_ids))], dim=2)
        return out.logits.float(), aux

    def reject_after(self, kept: torch.Tensor, block: int) -> None:
        """Of the last ``block`` slots, keep the first ``kept[b]`` valid in row b (a verify pass's accepted prefix)."""
        start = self.valid.shape[1] - block
        keep = torch.arange(block, device=self.device)[None, :] < kept[:, None]
        self.lengths = self.lengths - (self.valid[:, start:] & ~keep).sum(1)
        self.valid = torch.cat([self.valid[:, :start], self.valid[:, start:] & keep], dim=1)


@dataclass
class _FlatCache:
    """One draft layer's keys/values for every row: [Hkv, N, d] with each entry's row and position."""

    keys: torch.Tensor
    values: torch.Tensor


class BatchDraft:
    """The draft over a batch, all rows flattened into one token list (see the module docstring)."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.device = draft.fc.weight.device
        self.dtype = draft.fc.weight.dtype
        self.used = draft_target_ids(draft)

    def reset(self, rows: int) -> None:
        config = self.draft.config
        empty = torch.zeros(config.num_key_value_heads, 0, config.head_dim, device=self.device, dtype=self.dtype)
        self.layers = [_FlatCache(empty, empty.clone()) for _ in range(config.num_hidden_layers)]
        self.entry_rows = torch.zeros(0, dtype=torch.long, device=self.device)  # [N]
        self.entry_positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self.real_entries = 0  # entries before this index are real; after it, the current speculation's
        self.lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.spec_steps = 0  # chain steps since the last extend

    def _run(
        self, tokens: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, real: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over flat queries (their row and RoPE position); real queries may see real
        entries of their row at positions <= theirs, speculative ones all real entries of their row and
        the speculation's earlier entries."""
        if real:  # a new real block: the previous speculation is over
            for layer in self.layers:
                layer.keys, layer.values = layer.keys[:, : self.real_entries], layer.values[:, : self.real_entries]
            self.entry_rows = self.entry_rows[: self.real_entries]
            self.entry_positions = self.entry_positions[: self.real_entries]
        before = len(self.entry_rows)
        self.entry_rows = torch.cat([self.entry_rows, rows])
        self.entry_positions = torch.cat([self.entry_positions, positions])
        if real:
            self.real_entries = len(self.entry_rows)
        same_row = rows[:, None] == self.entry_rows[None, :]  # [T, N]
        index = torch.arange(len(self.entry_rows), device=self.device)
        if real:
            mask = (
                same_row & (self.entry_positions[None, :] <= positions[:, None]) & (index[None, :] < self.real_entries)
            )
        else:  # this step's own entry is at before + i
            earlier = index[None, :] < before
            mask = same_row & (
                earlier | (index[None, :] == before + torch.arange(len(rows), device=self.device)[:, None])
            )
        cos, sin = draft_rope(self.draft, positions)

        def attend_with(layer: _FlatCache):
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                layer.keys, layer.values = torch.cat([layer.keys, k], 1), torch.cat([layer.values, v], 1)
                return F.scaled_dot_product_attention(
                    q, layer.keys, layer.values, attn_mask=mask, enable_gqa=q.shape[0] != k.shape[0]
                )

            return attend

        return self.draft.step(tokens, hidden, cos, sin, [attend_with(layer) for layer in self.layers])

    @decode_step
    def extend(
        self, tokens: torch.Tensor, aux: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row b's next ``counts[b]`` real positions: ``tokens`` [B, q] and target features ``aux`` [B, q, 3, H]
        (the first counts[b] of each row are used). Returns each row's last hidden [B, H] and logits [B, Vd]."""
        width = tokens.shape[1]
        take = torch.arange(width, device=self.device)[None, :] < counts[:, None]  # [B, q]
        rows = torch.arange(len(counts), device=self.device)[:, None].expand(-1, width)[take]
        positions = (self.lengths[:, None] + torch.arange(width, device=self.device)[None, :])[take]
        hidden = self.draft.fuse(aux[take].to(self.dtype))
        out, logits = self._run(tokens[take], hidden, rows, positions, real=True)
        self.lengths = self.lengths + counts
        self.spec_steps = 0
        last = counts.cumsum(0) - 1  # each row's last new entry in the flat list
        return out[last], logits[last].float()

    @decode_step
    def speculate(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One more chain step for every row (token [B], hidden [B, H]): the j-th after a row's last real
        position runs at that position + j (as in training and serving)."""
        rows = torch.arange(len(tokens), device=self.device)
        self.spec_steps += 1
        out, logits = self._run(tokens, hidden, rows, self.lengths - 1 + self.spec_steps, real=False)
        return out, logits.float()


def _prefill(target: BatchTarget, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompts through the target: (first tokens [B], aux [B, L, 3, H], prompt lengths [B])."""
    device = target.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lengths.max())
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt)
    real = torch.arange(width, device=device)[None, :] < lengths[:, None]
    target.reset(len(prompts))
    logits, aux = target.forward(ids.to(device), real)
    first = logits[torch.arange(len(prompts), device=device), lengths - 1].argmax(-1)
    return first, aux, lengths


def batched_target_only_decode(
    target: BatchTarget, prompts: list[list[int]], max_new: int, stop_ids: set[int]
) -> list[DecodeResult]:
    """The baseline: the same batched engine, one target forward per token, no draft (greedy)."""
    sync(target.device)
    started = time.perf_counter()
    token, _, _ = _prefill(target, prompts)
    outputs = [[t] for t in token.tolist()]
    real = torch.ones(len(prompts), 1, dtype=torch.bool, device=target.device)
    while not all(finish(out, stop_ids, max_new)[1] for out in outputs):
        logits, _ = target.forward(token[:, None], real)
        token = logits[:, -1].argmax(-1)
        for out, value in zip(outputs, token.tolist()):
            out.append(value)
    sync(target.device)
    seconds = time.perf_counter() - started
    return [DecodeResult(finish(out, stop_ids, max_new)[0], seconds=seconds / len(prompts)) for out in outputs]


def batched_speculative_decode(
    target: BatchTarget, draft: BatchDraft, prompts: list[list[int]], max_new: int, depth: int, stop_ids: set[int]
) -> list[DecodeResult]:
    """Greedy chain speculative decoding of every prompt at once; each row's output is the target's own
    greedy decoding of that prompt (rows that finish keep running until all have, their extra tokens dropped)."""
    device = target.device
    rows = len(prompts)
    sync(device)
    started = time.perf_counter()
    last, aux, lengths = _prefill(target, prompts)
    draft.reset(rows)
    width = int(lengths.max())
    # draft position t pairs token x_{t+1} with the target's features at t: prompt[1:] + the first new token
    shifted = torch.zeros(rows, width, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        shifted[row, : len(prompt) - 1] = torch.tensor(prompt[1:], device=device)
    shifted[torch.arange(rows, device=device), lengths - 1] = last
    hidden, draft_logits = draft.extend(shifted, aux, lengths)
    outputs = [[t] for t in last.tolist()]
    accepted_counts: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    every_row = torch.arange(rows, device=device)
    while not all(done):
        proposals = []  # each [B]
        for step in range(depth):
            if step:
                hidden, draft_logits = draft.speculate(proposals[-1], hidden)
            proposals.append(draft.used[draft_logits.argmax(-1)])
        drafted = torch.stack(proposals, 1)  # [B, D]
        block = torch.cat([last[:, None], drafted], 1)  # [B, D+1]
        verify_logits, verify_aux = target.forward(block, torch.ones_like(block, dtype=torch.bool))
        choices = verify_logits.argmax(-1)  # [B, D+1]
        accepted = (choices[:, :depth] == drafted).long().cumprod(1).sum(1)  # [B]
        correction = choices[every_row, accepted]
        target.reject_after(accepted + 1, depth + 1)  # keep out[-1], d_1..d_a; the correction is not in yet
        new_tokens = torch.cat([drafted, torch.zeros_like(last)[:, None]], 1)
        new_tokens[every_row, accepted] = correction  # [B, D+1]: d_1..d_a, correction, (unused)
        hidden, draft_logits = draft.extend(new_tokens, verify_aux, accepted + 1)
        last = correction
        host_tokens, host_accepted = new_tokens.tolist(), accepted.tolist()
        for row in range(rows):
            if done[row]:
                continue
            outputs[row].extend(host_tokens[row][: host_accepted[row] + 1])
            accepted_counts[row].append(host_accepted[row])
            done[row] = finish(outputs[row], stop_ids, max_new)[1]
    sync(device)
    seconds = time.perf_counter() - started
    return [
        DecodeResult(finish(out, stop_ids, max_new)[0], counts, seconds / rows)
        for out, counts in zip(outputs, accepted_counts)
    ]
