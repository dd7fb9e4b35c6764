"""The target and the draft on dynamic KV caches, run eagerly: what every decoding algorithm drives when there is
no static cache (sampling, ``--cuda-graphs off``, targets a static cache does not fit). ``static.py`` holds the same
two on static caches, replayed as CUDA graphs.

The target's every forward also returns the aux features of its tokens (the draft's input). The draft keeps, per
layer, the keys of real positions plus those of the current speculation (a chain's steps, a tree's levels), and
drops the speculation when real positions are added.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import EagletError
from ..model.capture import FeatureCapture
from ..model.draft import Eagle3Draft
from ..model.placement import full
from ..model.support import cache_kwarg
from .common import Tree, decode_step, draft_rope, draft_target_ids


class TargetRunner:
    """The target with a DynamicCache; every forward also returns the aux features of its tokens."""

    def __init__(self, model: torch.nn.Module, layer_ids: tuple[int, ...]):
        self.model = model
        self.capture = FeatureCapture(model, layer_ids)
        self.device = self.capture.input_device  # a split target's logits and features come out elsewhere
        self.cache = None
        self.cache_kwarg = cache_kwarg(model)

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    @decode_step
    def forward(
        self, tokens: list[int] | torch.Tensor, tree: "Tree | None" = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``tokens`` (a list, or a device tensor [n] so drafting need not wait for the host); return
        logits [n, V] (float32) and aux features [n, 3, H]. With ``tree``, the tokens are a tree (root
        first) and each one attends only to the cache and its ancestors."""
        start = self.length
        ids = (
            tokens[None].to(self.device)
            if isinstance(tokens, torch.Tensor)
            else torch.tensor([tokens], device=self.device)
        )
        extra: dict = {}
        if tree is None:
            positions = torch.arange(start, start + len(tokens), device=self.device)[None]
        else:
            positions = (start + torch.tensor(tree.depths, device=self.device))[None]
            mask = torch.ones(1, 1, len(tokens), start + len(tokens), dtype=torch.bool, device=self.device)
            mask[0, 0, :, start:] = tree.ancestor_mask().to(self.device)
            extra["attention_mask"] = mask
        captured: dict[int, torch.Tensor] = {}
        with self.capture.hooks(captured):
            out = self.model(
                input_ids=ids, position_ids=positions, use_cache=True, **{self.cache_kwarg: self.cache}, **extra
            )
        logits = full(out.logits[0]).float()  # [n, V]
        aux = torch.stack(
            [full(captured[slot]).to(logits.device) for slot in range(len(self.capture.layer_ids))], dim=2
        )[0]  # [n, 3, H]
        return logits, aux

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (a negative crop: the form every transformers version accepts)."""
        surplus = self.length - length
        if surplus > 0:
            self.cache.crop(-surplus)

    def keep(self, positions: torch.Tensor) -> None:
        """Keep only these cache positions (the accepted path of a tree), in order."""
        layers = getattr(self.cache, "layers", None)
        if layers is not None and all(hasattr(layer, "keys") for layer in layers):
            for layer in layers:
                layer.keys = layer.keys.index_select(-2, positions)
                layer.values = layer.values.index_select(-2, positions)
        elif hasattr(self.cache, "key_cache"):
            for index in range(len(self.cache.key_cache)):
                self.cache.key_cache[index] = self.cache.key_cache[index].index_select(-2, positions)
                self.cache.value_cache[index] = self.cache.value_cache[index].index_select(-2, positions)
        else:
            raise EagletError(
                f"this transformers version's {type(self.cache).__name__} exposes neither `layers[i].keys` nor "
                "`key_cache`; tree decoding cannot compact it (use --mode chain)"
            )


@dataclass
class _LayerCache:
    """One draft layer's keys/values: real positions, plus the current speculation's entries."""

    keys: torch.Tensor  # [Hkv, positions, d]
    values: torch.Tensor
    spec_keys: list[torch.Tensor] = field(default_factory=list)
    spec_values: list[torch.Tensor] = field(default_factory=list)


class _DraftAttention:
    """Attention over one layer's cached (real) entries, plus the current speculation's entries.

    ``extend``: new real positions, causal over the cache and the block. ``speculate``: one chain step, seeing every
    real entry and the chain's earlier steps. ``masked``: a tree level, seeing every real entry and the speculative
    entries ``spec_mask`` [rows, speculative entries so far] allows (its ancestors and itself)."""

    def __init__(self, cache: _LayerCache, mode: str, spec_mask: torch.Tensor | None = None):
        self.cache, self.mode, self.spec_mask = cache, mode, spec_mask

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        groups = q.shape[0] // k.shape[0]  # grouped-query attention: SDPA shares each KV head (enable_gqa)
        if self.mode == "extend":
            past = cache.keys.shape[1]
            keys, values = torch.cat([cache.keys, k], 1), torch.cat([cache.values, v], 1)
            cache.keys, cache.values = keys, values
            rows = torch.arange(q.shape[1], device=q.device)[:, None] + past
            mask = torch.arange(keys.shape[1], device=q.device)[None, :] <= rows  # [r, past + r]
        else:
            cache.spec_keys.append(k)
            cache.spec_values.append(v)
            keys = torch.cat([cache.keys, *cache.spec_keys], 1)
            values = torch.cat([cache.values, *cache.spec_values], 1)
            mask = None
            if self.mode == "masked":
                real = torch.ones(q.shape[1], cache.keys.shape[1], dtype=torch.bool, device=q.device)
                mask = torch.cat([real, self.spec_mask], 1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=groups > 1)


class DraftRunner:
    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.device = draft.fc.weight.device
        self.dtype = draft.fc.weight.dtype
        self.used = draft_target_ids(draft)
        self.reset()

    def reset(self) -> None:
        config = self.draft.config
        empty = torch.zeros(config.num_key_value_heads, 0, config.head_dim, device=self.device, dtype=self.dtype)
        self.caches = [_LayerCache(empty, empty.clone()) for _ in range(config.num_hidden_layers)]

    def _attends(self, mode: str, spec_mask: torch.Tensor | None = None) -> list[_DraftAttention]:
        return [_DraftAttention(cache, mode, spec_mask) for cache in self.caches]

    def clear_speculation(self) -> None:
        for cache in self.caches:
            cache.spec_keys, cache.spec_values = [], []

    @property
    def length(self) -> int:
        return self.caches[0].keys.shape[1]

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return draft_rope(self.draft, positions)

    @decode_step
    def extend(self, tokens: list[int], aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Real positions ``length..length+r-1`` with their tokens (x_{t+1}) and target features;
        returns the last position's hidden [H] and draft logits [Vd]. Clears the speculation."""
        self.clear_speculation()
        start = self.length
        positions = torch.arange(start, start + len(tokens), device=self.device)
        cos, sin = self._rope(positions)
        hidden = self.draft.fuse(aux.to(self.dtype))
        hidden, logits = self.draft.step(
            torch.tensor(tokens, device=self.device), hidden, cos, sin, self._attends("extend")
        )
        return hidden[-1], logits[-1].float()

    @decode_step
    def speculate(self, token: int | torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One more chain step: the j-th after the last real position runs at RoPE position last + j (as in
        training and serving); ``token`` is a target id, as an int or a device tensor [1]."""
        step = len(self.caches[0].spec_keys) + 1
        cos, sin = self._rope(torch.tensor([self.length - 1 + step], device=self.device))
        ids = token if isinstance(token, torch.Tensor) else torch.tensor([token], device=self.device)
        out, logits = self.draft.step(ids, hidden[None], cos, sin, self._attends("speculate"))
        return out[0], logits[0].float()

    @decode_step
    def tree_level(
        self, level: int, tokens: torch.Tensor, inputs: torch.Tensor, own: torch.Tensor, visible: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A tree level's k rows (``tree.grow_tree``'s step): tokens [k], input hiddens [k, H], each row seeing the
        speculative entries ``visible`` [k, all levels' entries] allows; its entries go after the previous
        levels' (``own`` [k] says where: they are appended in that order). Level L runs at RoPE position
        root + L - 1, as in training and as SGLang drafts trees."""
        rows = len(tokens)
        cos, sin = self._rope(torch.tensor([self.length - 1 + level - 1], device=self.device))
        entries = (level - 1) * rows  # every level so far, this one's included
        out, logits = self.draft.step(
            tokens, inputs, cos.expand(rows, -1), sin.expand(rows, -1), self._attends("masked", visible[:, :entries])
        )
        return out, logits.float()

    def crop(self, length: int) -> None:
        for cache in self.caches:
            cache.keys, cache.values = cache.keys[:, :length], cache.values[:, :length]
        self.clear_speculation()

    def to_target_logits(self, draft_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Draft-vocab logits -> target-vocab logits (-inf outside the draft vocabulary)."""
        full = torch.full((vocab_size,), float("-inf"), device=draft_logits.device)
        full[self.used] = draft_logits
        return full
