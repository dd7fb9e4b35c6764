"""The speculative decoder: target and draft, each with its own KV cache; chain drafting; lossless verify.

Per round (batch 1), with the target's cache holding positions ``0..n-1`` and ``x_n`` the newest token:

1. the draft proposes ``d_1..d_D``: ``d_1`` from its output at position n-1 (token ``x_n``, the target's
   aux features at n-1), then each ``d_{j+1}`` from one more step fed ``d_j`` and its own last hidden
   state, at the same RoPE position and attending to its cached positions plus this chain's earlier
   steps: exactly the training-time-test pattern the draft was trained with;
2. the target verifies ``[x_n, d_1..d_D]`` in one forward, which also yields the aux features of
   those positions (what serving engines feed the draft);
3. the longest agreeing prefix ``d_1..d_a`` is kept, plus one token from the target (the correction
   or the bonus); both caches drop everything after it, and the draft extends its cache with the
   new positions using the target's real features.

Greedy verification reproduces the target's own greedy decoding token for token; sampling uses
rejection sampling, so the output distribution is the target's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..capture import FeatureCapture
from ..draft import Eagle3Draft, rope_tables
from .sampling import Sampling, accept_or_resample


class TargetRunner:
    """The target with a DynamicCache; every forward also returns the aux features of its tokens."""

    def __init__(self, model: torch.nn.Module, layer_ids: tuple[int, ...]):
        import inspect

        self.model = model
        self.capture = FeatureCapture(model, layer_ids)
        self.device = next(model.parameters()).device
        self.cache = None
        # transformers renamed `past_key_values` to `cache` (5.2x); use whichever this version's forward takes
        self.cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    @torch.inference_mode()
    def forward(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``tokens``; return logits [n, V] (float32) and aux features [n, 3, H]."""
        start = self.length
        ids = torch.tensor([tokens], device=self.device)
        positions = torch.arange(start, start + len(tokens), device=self.device)[None]
        captured: dict[int, torch.Tensor] = {}
        with self.capture.hooks(captured):
            out = self.model(input_ids=ids, position_ids=positions, use_cache=True, **{self.cache_kwarg: self.cache})
        aux = torch.stack([captured[slot] for slot in range(len(self.capture.layer_ids))], dim=2)[0]
        return out.logits[0].float(), aux

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (a negative crop: the form every transformers version accepts)."""
        surplus = self.length - length
        if surplus > 0:
            self.cache.crop(-surplus)


class _DraftAttention:
    """Attention over the draft's cached (real) entries, plus this chain's speculative entries."""

    def __init__(self, runner: "DraftRunner", mode: str):
        self.runner, self.mode = runner, mode

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        runner = self.runner
        groups = q.shape[0] // k.shape[0]
        if self.mode == "extend":  # new real positions: causal over cache + block
            past = runner.keys.shape[1]
            keys, values = torch.cat([runner.keys, k], 1), torch.cat([runner.values, v], 1)
            runner.keys, runner.values = keys, values
            rows = torch.arange(q.shape[1], device=q.device)[:, None] + past
            mask = torch.arange(keys.shape[1], device=q.device)[None, :] <= rows  # [r, past + r]
        else:  # one speculative query: every real entry and this chain's earlier steps
            runner.spec_keys.append(k)
            runner.spec_values.append(v)
            keys = torch.cat([runner.keys, *runner.spec_keys], 1)
            values = torch.cat([runner.values, *runner.spec_values], 1)
            mask = None
        keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class DraftRunner:
    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.device = draft.fc.weight.device
        self.dtype = draft.fc.weight.dtype
        config = draft.config
        self.used = torch.arange(config.draft_vocab_size, device=self.device) + draft.d2t  # draft index -> target id
        self.reset()

    def reset(self) -> None:
        config = self.draft.config
        empty = torch.zeros(config.num_key_value_heads, 0, config.head_dim, device=self.device, dtype=self.dtype)
        self.keys, self.values = empty, empty.clone()
        self.spec_keys: list[torch.Tensor] = []
        self.spec_values: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_tables(positions, self.draft.config.head_dim, self.draft.config.rope_theta)
        return cos.to(self.dtype), sin.to(self.dtype)

    @torch.inference_mode()
    def extend(self, tokens: list[int], aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Real positions ``length..length+r-1`` with their tokens (x_{t+1}) and target features;
        returns the last position's hidden [H] and draft logits [Vd]. Clears the speculative chain."""
        self.spec_keys, self.spec_values = [], []
        start = self.length
        positions = torch.arange(start, start + len(tokens), device=self.device)
        cos, sin = self._rope(positions)
        hidden = self.draft.fuse(aux.to(self.dtype))
        hidden, logits = self.draft.step(torch.tensor(tokens, device=self.device), hidden, cos, sin,
                                         _DraftAttention(self, "extend"))
        return hidden[-1], logits[-1].float()

    @torch.inference_mode()
    def speculate(self, token: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One more chain step from the last real position (same RoPE position, as in training)."""
        cos, sin = self._rope(torch.tensor([self.length - 1], device=self.device))
        out, logits = self.draft.step(torch.tensor([token], device=self.device), hidden[None], cos, sin,
                                      _DraftAttention(self, "speculate"))
        return out[0], logits[0].float()

    def crop(self, length: int) -> None:
        self.keys, self.values = self.keys[:, :length], self.values[:, :length]
        self.spec_keys, self.spec_values = [], []

    def to_target_logits(self, draft_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Draft-vocab logits -> target-vocab logits (-inf outside the draft vocabulary)."""
        full = torch.full((vocab_size,), float("-inf"), device=draft_logits.device)
        full[self.used] = draft_logits
        return full


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per verification forward
    seconds: float = 0.0

    @property
    def forwards(self) -> int:
        return len(self.accepted)

    @property
    def acceptance_length(self) -> float:
        """Tokens per target forward: accepted draft tokens + the target's own token."""
        return (sum(self.accepted) + len(self.accepted)) / max(1, len(self.accepted))


def _finish(tokens: list[int], stop_ids: set[int], max_new: int) -> tuple[list[int], bool]:
    for index, token in enumerate(tokens[:max_new]):
        if token in stop_ids:
            return tokens[: index + 1], True
    return tokens[:max_new], len(tokens) >= max_new


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def target_only_decode(target: TargetRunner, prompt: list[int], max_new: int, sampling: Sampling,
                       stop_ids: set[int], generator: torch.Generator | None = None) -> DecodeResult:
    """The baseline: the same engine, one target forward per token, no draft."""
    _sync(target.device)
    started = time.perf_counter()
    target.reset()
    logits, _ = target.forward(prompt)
    out = [sampling.pick(logits[-1], generator)]
    while not _finish(out, stop_ids, max_new)[1]:
        logits, _ = target.forward([out[-1]])
        out.append(sampling.pick(logits[-1], generator))
    _sync(target.device)
    return DecodeResult(_finish(out, stop_ids, max_new)[0], seconds=time.perf_counter() - started)


def speculative_decode(target: TargetRunner, draft: DraftRunner, prompt: list[int], max_new: int, depth: int,
                       sampling: Sampling, stop_ids: set[int], generator: torch.Generator | None = None) -> DecodeResult:
    """Chain speculative decoding (see the module docstring)."""
    _sync(target.device)
    started = time.perf_counter()
    target.reset()
    draft.reset()
    vocab = target.model.config.get_text_config().vocab_size if hasattr(target.model.config, "get_text_config") \
        else target.model.config.vocab_size
    logits, aux = target.forward(prompt)
    out = [sampling.pick(logits[-1], generator)]
    hidden, draft_logits = draft.extend(prompt[1:] + [out[-1]], aux)
    accepted_counts: list[int] = []
    while not _finish(out, stop_ids, max_new)[1]:
        proposals, proposal_probs = [], []
        for step in range(depth):
            if step:
                hidden, draft_logits = draft.speculate(proposals[-1], hidden)
            full = draft.to_target_logits(draft_logits, vocab)
            token = sampling.pick(full, generator)
            proposals.append(token)
            proposal_probs.append(None if sampling.greedy else sampling.probs(full))
        base = target.length  # position of out[-1]
        verify_logits, verify_aux = target.forward([out[-1]] + proposals)  # [D+1, V], [D+1, 3, H]
        accepted, correction = 0, None
        for index, token in enumerate(proposals):
            if sampling.greedy:
                choice = int(verify_logits[index].argmax())
                ok = choice == token
            else:
                ok, choice = accept_or_resample(sampling.probs(verify_logits[index]), proposal_probs[index], token, generator)
            if not ok:
                correction = choice
                break
            accepted += 1
        if correction is None:
            correction = sampling.pick(verify_logits[depth], generator)
        new_tokens = proposals[:accepted] + [correction]
        accepted_counts.append(accepted)
        out.extend(new_tokens)
        target.crop(base + accepted + 1)  # keep out[-1-len(new)] .. d_a; the correction is not in the cache yet
        draft.crop(base)
        hidden, draft_logits = draft.extend(new_tokens, verify_aux[: accepted + 1])
    _sync(target.device)
    return DecodeResult(_finish(out, stop_ids, max_new)[0], accepted_counts, time.perf_counter() - started)
