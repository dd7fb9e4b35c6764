"""The speculative decoder: target and draft, each with its own KV cache; chain drafting; lossless verify.

Per round (batch 1), with the target's cache holding positions ``0..n-1`` and ``x_n`` the newest token:

1. the draft proposes ``d_1..d_D``: ``d_1`` from its output at position n-1 (token ``x_n``, the target's
   aux features at n-1), then each ``d_{j+1}`` from one more step fed ``d_j`` and its own last hidden
   state, one RoPE position further per step (as vLLM and SGLang run drafts) and attending to its cached
   positions plus this chain's earlier steps: exactly the training-time-test pattern the draft was trained with;
2. the target verifies ``[x_n, d_1..d_D]`` in one forward, which also yields the aux features of
   those positions (what serving engines feed the draft);
3. the longest agreeing prefix ``d_1..d_a`` is kept, plus one token from the target (the correction
   or the bonus); both caches drop everything after it, and the draft extends its cache with the
   new positions using the target's real features.

Greedy verification reproduces the target's own greedy decoding token for token; sampling uses
rejection sampling, so the output distribution is the target's. ``batched.py`` runs greedy chains for
many prompts at once.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..capture import FeatureCapture
from ..draft import Eagle3Draft
from ..errors import EagletError
from ..target import decoding_attention
from .sampling import Sampling, accept_or_resample, walk_candidates


@dataclass
class Tree:
    """Draft tokens as a tree: index 0 is the root (the newest real token), parents come before children."""

    tokens: list[int]
    parents: list[int]  # -1 for the root
    depths: list[int]  # 0 for the root

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: j is i or an ancestor of i (what node i may attend to inside the tree)."""
        size = len(self.tokens)
        mask = torch.eye(size, dtype=torch.bool)
        for node in range(1, size):
            mask[node] |= mask[self.parents[node]]
        return mask

    def children(self, node: int) -> list[int]:
        """Node indices whose parent is ``node``, best draft score first (the tree's order)."""
        return [index for index in range(node + 1, len(self.tokens)) if self.parents[index] == node]

    def child(self, node: int, token: int) -> int | None:
        for index in range(node + 1, len(self.tokens)):
            if self.parents[index] == node and self.tokens[index] == token:
                return index
        return None



def decode_step(method):
    """Run a decoding method under inference mode with the decode attention backends."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        with torch.inference_mode(), decoding_attention():
            return method(*args, **kwargs)
    return run


def cache_kwarg(model: torch.nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x): the name this version's forward takes."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def draft_target_ids(draft: Eagle3Draft) -> torch.Tensor:
    """[Vd]: the target token id of each draft-vocabulary index."""
    return torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device) + draft.d2t


def draft_rope(draft: Eagle3Draft, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] for the draft at integer ``positions``, in the draft's dtype."""
    cos, sin = draft.rope(positions)
    dtype = draft.fc.weight.dtype
    return cos.to(dtype), sin.to(dtype)


class TargetRunner:
    """The target with a DynamicCache; every forward also returns the aux features of its tokens."""

    def __init__(self, model: torch.nn.Module, layer_ids: tuple[int, ...]):
        self.model = model
        self.capture = FeatureCapture(model, layer_ids)
        self.device = next(model.parameters()).device
        self.cache = None
        self.cache_kwarg = cache_kwarg(model)

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    @decode_step
    def forward(self, tokens: list[int] | torch.Tensor, tree: "Tree | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``tokens`` (a list, or a device tensor [n] so drafting need not wait for the host); return
        logits [n, V] (float32) and aux features [n, 3, H]. With ``tree``, the tokens are a tree (root
        first) and each one attends only to the cache and its ancestors."""
        start = self.length
        ids = tokens[None] if isinstance(tokens, torch.Tensor) else torch.tensor([tokens], device=self.device)
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
            out = self.model(input_ids=ids, position_ids=positions, use_cache=True, **{self.cache_kwarg: self.cache},
                             **extra)
        aux = torch.stack([captured[slot] for slot in range(len(self.capture.layer_ids))], dim=2)[0]
        return out.logits[0].float(), aux

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
    """Attention over one layer's cached (real) entries, plus this chain's speculative entries."""

    def __init__(self, cache: _LayerCache, mode: str, visible: list[list[int]] | None = None):
        self.cache, self.mode = cache, mode
        self.visible = visible or []  # tree mode: per query, the spec entries of its processed ancestors

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        groups = q.shape[0] // k.shape[0]  # grouped-query attention: SDPA shares each KV head (enable_gqa)
        if self.mode == "extend":  # new real positions: causal over cache + block
            past = cache.keys.shape[1]
            keys, values = torch.cat([cache.keys, k], 1), torch.cat([cache.values, v], 1)
            cache.keys, cache.values = keys, values
            rows = torch.arange(q.shape[1], device=q.device)[:, None] + past
            mask = torch.arange(keys.shape[1], device=q.device)[None, :] <= rows  # [r, past + r]
        elif self.mode == "speculate":  # one speculative query: every real entry and this chain's earlier steps
            cache.spec_keys.append(k)
            cache.spec_values.append(v)
            keys = torch.cat([cache.keys, *cache.spec_keys], 1)
            values = torch.cat([cache.values, *cache.spec_values], 1)
            mask = None
        else:  # tree: a layer of nodes, each seeing the real entries, its processed ancestors and itself
            spec_before = sum(key.shape[1] for key in cache.spec_keys)
            cache.spec_keys.append(k)
            cache.spec_values.append(v)
            keys = torch.cat([cache.keys, *cache.spec_keys], 1)
            values = torch.cat([cache.values, *cache.spec_values], 1)
            spec = torch.zeros(q.shape[1], spec_before + q.shape[1], dtype=torch.bool)  # built on the host: one copy
            for row, visible in enumerate(self.visible):
                spec[row, visible] = True
                spec[row, spec_before + row] = True
            real = torch.ones(q.shape[1], cache.keys.shape[1], dtype=torch.bool, device=q.device)
            mask = torch.cat([real, spec.to(q.device, non_blocking=True)], 1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=groups > 1)


class DraftRunner:
    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.device = draft.fc.weight.device
        self.dtype = draft.fc.weight.dtype
        self.used = draft_target_ids(draft)
        self.used_host = self.used.tolist()  # the same map on the host: tree building reads it without device syncs
        self.reset()

    def reset(self) -> None:
        config = self.draft.config
        empty = torch.zeros(config.num_key_value_heads, 0, config.head_dim, device=self.device, dtype=self.dtype)
        self.caches = [_LayerCache(empty, empty.clone()) for _ in range(config.num_hidden_layers)]

    def _attends(self, mode: str, visible: list[list[int]] | None = None) -> list[_DraftAttention]:
        return [_DraftAttention(cache, mode, visible) for cache in self.caches]

    def _clear_speculation(self) -> None:
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
        returns the last position's hidden [H] and draft logits [Vd]. Clears the speculative chain."""
        self._clear_speculation()
        start = self.length
        positions = torch.arange(start, start + len(tokens), device=self.device)
        cos, sin = self._rope(positions)
        hidden = self.draft.fuse(aux.to(self.dtype))
        hidden, logits = self.draft.step(torch.tensor(tokens, device=self.device), hidden, cos, sin, self._attends("extend"))
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

    def crop(self, length: int) -> None:
        for cache in self.caches:
            cache.keys, cache.values = cache.keys[:, :length], cache.values[:, :length]
        self._clear_speculation()

    @decode_step
    def expand_tree(self, root_token: int, hidden: torch.Tensor, logits: torch.Tensor, topk: int, depth: int,
                    budget: int) -> Tree:
        """EAGLE-2 dynamic tree: expand the ``topk`` best nodes of each layer by their ``topk`` best
        children (scores = cumulative draft log-probabilities), then keep the ``budget`` best nodes overall.
        Level L's nodes run at RoPE position root + L - 1 and see their ancestors' entries, as in training
        and as SGLang drafts trees."""
        self._clear_speculation()
        # candidate columns: target token, parent candidate (-1 = root), depth, score, input hidden, spec entry
        tokens, parents, depths, scores, entries = [], [], [], [], []
        inputs: list[torch.Tensor] = []
        width = min(topk, logits.shape[-1])
        top = torch.log_softmax(logits.float(), -1).topk(width)
        layer = []
        for value, index in zip(top.values.tolist(), top.indices.tolist()):
            layer.append(len(tokens))
            tokens.append(self.used_host[index])
            parents.append(-1)
            depths.append(1)
            scores.append(value)
            inputs.append(hidden)
            entries.append(None)
        spec_count = 0
        for level in range(2, depth + 1):
            frontier = sorted(layer, key=lambda c: -scores[c])[:topk]
            visible = []
            for candidate in frontier:
                chain, node = [], parents[candidate]
                while node >= 0:
                    chain.append(entries[node])
                    node = parents[node]
                visible.append(chain)
            ids = torch.tensor([tokens[c] for c in frontier]).to(self.device, non_blocking=True)
            cos, sin = self._rope(torch.tensor([self.length - 1 + level - 1], device=self.device))
            out_hidden, out_logits = self.draft.step(
                ids, torch.stack([inputs[c] for c in frontier]),
                cos.expand(len(frontier), -1), sin.expand(len(frontier), -1), self._attends("tree", visible))
            best = torch.log_softmax(out_logits.float(), -1).topk(width, dim=-1)  # [F, k]: one host read per level
            layer = []
            for row, (candidate, values, indices) in enumerate(zip(frontier, best.values.tolist(), best.indices.tolist())):
                entries[candidate] = spec_count + row
                for value, index in zip(values, indices):
                    layer.append(len(tokens))
                    tokens.append(self.used_host[index])
                    parents.append(candidate)
                    depths.append(level)
                    scores.append(scores[candidate] + value)
                    inputs.append(out_hidden[row])
                    entries.append(None)
            spec_count += len(frontier)
        chosen = set(sorted(range(len(tokens)), key=lambda c: (-scores[c], c))[:budget])
        for candidate in list(chosen):  # parents are always at least as likely; keep the set closed anyway
            node = parents[candidate]
            while node >= 0 and node not in chosen:
                chosen.add(node)
                node = parents[node]
        order = sorted(chosen, key=lambda c: (depths[c], -scores[c], c))
        position = {candidate: index + 1 for index, candidate in enumerate(order)}
        return Tree(tokens=[root_token] + [tokens[c] for c in order],
                    parents=[-1] + [position.get(parents[c], 0) if parents[c] >= 0 else 0 for c in order],
                    depths=[0] + [depths[c] for c in order])

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


def _greedy_chain_round(target: TargetRunner, draft: DraftRunner, last: int, hidden: torch.Tensor,
                        draft_logits: torch.Tensor, depth: int) -> tuple[list[int], int, int, torch.Tensor]:
    """Draft d_1..d_D and verify them, keeping every token on the device until one host read at the end
    (a 135M target is launch-bound: each host sync would stall the queue). Returns (proposals,
    accepted count, the target's correction or bonus token, the verify pass's aux features)."""
    proposals = []  # each [1], target ids
    for step in range(depth):
        if step:
            hidden, draft_logits = draft.speculate(proposals[-1], hidden)
        proposals.append(draft.used[draft_logits.argmax(-1, keepdim=True)])
    drafted = torch.cat(proposals)  # [D]
    verify_logits, verify_aux = target.forward(torch.cat([torch.tensor([last], device=target.device), drafted]))
    choices = verify_logits.argmax(-1)  # [D+1]: the target's token after out[-1], d_1, ..., d_D
    accepted = (choices[:depth] == drafted).int().cumprod(0).sum()
    host = torch.cat([choices, accepted[None], drafted]).tolist()
    accepted = host[depth + 1]
    return host[depth + 2:], accepted, host[accepted], verify_aux


def _sampled_chain_round(target: TargetRunner, draft: DraftRunner, last: int, hidden: torch.Tensor,
                         draft_logits: torch.Tensor, depth: int, vocab: int, sampling: Sampling,
                         generator: torch.Generator | None) -> tuple[list[int], int, int, torch.Tensor]:
    """The same round with rejection sampling: each draft token drawn from the draft's distribution,
    accepted with min(1, p/q), the first rejection resampled from the residual."""
    proposals, proposal_probs = [], []
    for step in range(depth):
        if step:
            hidden, draft_logits = draft.speculate(proposals[-1], hidden)
        full = draft.to_target_logits(draft_logits, vocab)
        proposals.append(sampling.pick(full, generator))
        proposal_probs.append(sampling.probs(full))
    verify_logits, verify_aux = target.forward([last] + proposals)  # [D+1, V], [D+1, 3, H]
    accepted, correction = 0, None
    for index, token in enumerate(proposals):
        ok, choice = accept_or_resample(sampling.probs(verify_logits[index]), proposal_probs[index], token, generator)
        if not ok:
            correction = choice
            break
        accepted += 1
    if correction is None:
        correction = sampling.pick(verify_logits[depth], generator)
    return proposals, accepted, correction, verify_aux


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
        base = target.length  # position of out[-1]
        if sampling.greedy:
            proposals, accepted, correction, verify_aux = _greedy_chain_round(target, draft, out[-1], hidden,
                                                                              draft_logits, depth)
        else:
            proposals, accepted, correction, verify_aux = _sampled_chain_round(target, draft, out[-1], hidden,
                                                                               draft_logits, depth, vocab, sampling,
                                                                               generator)
        new_tokens = proposals[:accepted] + [correction]
        accepted_counts.append(accepted)
        out.extend(new_tokens)
        target.crop(base + accepted + 1)  # keep out[-1-len(new)] .. d_a; the correction is not in the cache yet
        draft.crop(base)
        hidden, draft_logits = draft.extend(new_tokens, verify_aux[: accepted + 1])
    _sync(target.device)
    return DecodeResult(_finish(out, stop_ids, max_new)[0], accepted_counts, time.perf_counter() - started)


def tree_decode(target: TargetRunner, draft: DraftRunner, prompt: list[int], max_new: int, depth: int, topk: int,
                budget: int, stop_ids: set[int], sampling: Sampling = Sampling(),
                generator: torch.Generator | None = None) -> DecodeResult:
    """Speculative decoding over an EAGLE-2 dynamic tree, verified in one target forward with a tree
    attention mask; the accepted path's cache entries are kept, the rest dropped. Greedy: follow the
    target's argmax down the tree. Sampling: at each node walk its children with ``walk_candidates``
    (lossless for the deterministic top-k children the tree holds)."""
    _sync(target.device)
    started = time.perf_counter()
    target.reset()
    draft.reset()
    logits, aux = target.forward(prompt)
    out = [sampling.pick(logits[-1], generator)]
    hidden, draft_logits = draft.extend(prompt[1:] + [out[-1]], aux)
    accepted_counts: list[int] = []
    while not _finish(out, stop_ids, max_new)[1]:
        tree = draft.expand_tree(out[-1], hidden, draft_logits, topk, depth, budget)
        base = target.length
        verify_logits, verify_aux = target.forward(tree.tokens, tree=tree)
        choices = verify_logits.argmax(-1).tolist() if sampling.greedy else None  # one host read per round
        path, node = [], 0
        while True:
            children = tree.children(node)
            if choices is not None:
                correction = choices[node]
                chosen = next((c for c in children if tree.tokens[c] == correction), None)
            else:
                index, correction = walk_candidates(sampling.probs(verify_logits[node]),
                                                    [tree.tokens[c] for c in children], generator)
                chosen = None if index is None else children[index]
            if chosen is None:
                break
            path.append(chosen)
            node = chosen
        new_tokens = [tree.tokens[i] for i in path] + [correction]
        accepted_counts.append(len(path))
        out.extend(new_tokens)
        kept = torch.cat([torch.arange(base), base + torch.tensor([0] + path)]).to(target.device)
        target.keep(kept)
        draft.crop(base)
        hidden, draft_logits = draft.extend(new_tokens, verify_aux[[0] + path])
    _sync(target.device)
    return DecodeResult(_finish(out, stop_ids, max_new)[0], accepted_counts, time.perf_counter() - started)
