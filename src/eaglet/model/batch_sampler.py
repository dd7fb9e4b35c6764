"""Generation for a batch of prompts on a static KV cache, each new token one CUDA graph: how `regenerate` and
`synthesize` write text with an in-process target on a GPU (``data/generation.py`` picks it over ``generate``).

Why not ``model.generate``: at 2,048 prompts a step of SmolLM2-135M's ``generate`` takes ~80 ms on an H100
(benchmarks/RESULTS.md) where its weights and KV cache take a few ms to read: the dynamic cache grows by
concatenation, SDPA under a padding mask copies every key head once per query head it serves (``repeat_kv``) and
tiles 64 queries for the one a step has, and each step's ~600 kernels are issued from Python. Here:
- the cache is preallocated ([rows, Hkv, max_len, d] per layer) and a step writes its one entry in place;
- the query heads sharing a key head are folded into that head's query rows (``folded_attention``), so each key
  and value is read once per step, without copies, and a step reads only the keys written so far (rounded up to
  ``key_bucket``: one graph per key length), under an additive mask built once per step;
- a step — forward, temperature, nucleus, the draw, the stop check, the next input — is one graph replayed, and
  the host reads whether every row has stopped once per ``STOP_CHECK_EVERY`` steps.

Rows are left-padded prompts; positions count a row's own tokens, so a row decodes as it would alone. The draw is
the exponential race (argmax of p / Exp(1), distributed as p), which needs no host read. On CPU the same step runs
eagerly (graphs are a CUDA feature); the tests compare it with ``generate``.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from .graphs import capture
from .sampling import Sampling
from .support import cache_kwarg, static_cache_problem

FOLDED_ATTENTION = "eaglet_folded_sdpa"  # the name the folded attention is registered under in transformers
STOP_CHECK_EVERY = 16  # steps between the host's reads of "has every row stopped" (each read waits for the GPU)
CACHE_LENGTH_STEP = 256  # cache lengths are rounded up to this, so batches of similar prompts share the graphs
KEY_BUCKET = 128  # a step attends to the first multiple of this many keys that holds every key written so far
FIT_FRACTION = 0.8  # the cache and the step's sampling buffers take at most this share of the free GPU memory
SAMPLING_BYTES_PER_LOGIT = 32  # per row per token: sorted logits, int64 order, float32 probabilities, sums, race


def folded_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, Hq, T, d], key [B, Hkv, S, d], value [B, Hkv, S, dv], attention_mask
    [B, 1, T or 1, S' <= S] (bool, True: attend, or additive) -> [B, T, Hq, dv]. Query head h uses key head h // G (G = Hq / Hkv, as
    ``repeat_kv``), so the G heads of one key head are its [G*T] query rows and SDPA reads each key head once. Only
    the first S' keys are read: the mask's length says how many the cache holds so far."""
    batch, heads, tokens, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    folded = query.reshape(batch, kv_heads, groups * tokens, dim)
    mask = attention_mask
    if mask is not None:
        key, value = key[:, :, : mask.shape[-1]], value[:, :, : mask.shape[-1]]
        if (
            groups > 1 and mask.shape[2] > 1
        ):  # one row per query: repeated for each folded head (a single row broadcasts)
            mask = mask.repeat(1, 1, groups, 1)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, tokens, value.shape[-1]).transpose(1, 2), None  # MLA: values' dim differs


@contextmanager
def folded_attention_set(model: torch.nn.Module) -> Iterator[bool]:
    """The model attends through ``folded_attention`` inside the block (its own implementation after); yields
    whether it took it (a model that does not dispatch through transformers' attention interface keeps its own)."""
    from transformers import AttentionInterface

    AttentionInterface.register(FOLDED_ATTENTION, folded_attention)
    before = model.config._attn_implementation
    model.set_attn_implementation(FOLDED_ATTENTION)
    try:
        yield model.config._attn_implementation == FOLDED_ATTENTION
    finally:
        model.set_attn_implementation(before)


def draw(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """logits [rows, V] (the model's dtype) -> tokens [rows]: greedy, or one draw from ``sampling``'s distribution by
    the exponential race (the default generator's stream, so a graph replays it). With a nucleus the race runs in
    ``Sampling.sorted_nucleus``'s order, its winner mapped back through the sort: no scatter back, no renormalising
    (the race's argmax needs neither)."""
    if sampling.greedy:
        return logits.argmax(-1)
    if sampling.top_p >= 1.0:
        probs = sampling.probs(logits)
        return (probs / torch.empty_like(probs).exponential_()).argmax(-1)
    kept, order = sampling.sorted_nucleus(logits)  # [rows, V] each
    return order.gather(-1, (kept / torch.empty_like(kept).exponential_()).argmax(-1, keepdim=True)).squeeze(-1)


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [rows, longest] with every prompt ending at the last column, and which entries are real [same, bool]."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    real = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, row in enumerate(prompts):
        ids[i, width - len(row) :] = torch.tensor(row)
        real[i, width - len(row) :] = True
    return ids, real


def cache_bytes_per_position(config: Any, dtype: torch.dtype) -> int:
    """Bytes one cache position of one row takes over all layers: keys and values of every key head. For MLA, keys
    and values at their full widths: an upper bound (transformers 5.19 caches DeepseekV3's compressed latent, less)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if getattr(text, "qk_rope_head_dim", None) and getattr(text, "v_head_dim", None):  # MLA (DeepseekV3)
        widths = text.qk_nope_head_dim + text.qk_rope_head_dim + text.v_head_dim
    else:
        widths = 2 * (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    return text.num_hidden_layers * heads * widths * dtype.itemsize


def cache_length(width: int, max_new: int) -> int:
    """Cache positions for prompts padded to ``width`` plus ``max_new`` tokens, rounded up to CACHE_LENGTH_STEP."""
    return -(-(width + max_new) // CACHE_LENGTH_STEP) * CACHE_LENGTH_STEP


def static_sampling_problem(model: torch.nn.Module, rows: int, max_len: int) -> str | None:
    """Why ``model`` cannot generate here at ``rows`` x ``max_len`` (then ``generate`` does), or None."""
    devices = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    if len(devices) > 1:
        return "the target is split over devices"
    problem = static_cache_problem(model.config, graphs=next(model.parameters()).is_cuda)
    if problem:
        return problem
    if not getattr(model, "_can_set_attn_implementation", lambda: False)():
        return f"{type(model).__name__} does not dispatch attention through transformers' attention interface"
    device = next(model.parameters()).device
    if device.type == "cuda":
        cache_bytes = rows * max_len * cache_bytes_per_position(model.config, model.dtype)
        vocab = model.get_output_embeddings().weight.shape[0]
        need = cache_bytes + rows * vocab * SAMPLING_BYTES_PER_LOGIT
        free, _ = torch.cuda.mem_get_info(device)
        if need > FIT_FRACTION * free:
            return f"its static cache and sampling need {need / 2**30:.1f} GiB of {free / 2**30:.1f} GiB free"
    return None


class BatchSampler:
    """``rows`` prompts at once on a cache of ``max_len`` positions, each step one CUDA graph when ``graphs``.
    Build it inside ``folded_attention_set(model)``; ``generate`` reuses it for every batch that fits."""

    def __init__(
        self,
        model: torch.nn.Module,
        rows: int,
        max_len: int,
        max_new: int,
        sampling: Sampling,
        stop_ids: list[int],
        pad_id: int,
        graphs: bool | None = None,
        key_bucket: int = KEY_BUCKET,
    ):
        from transformers import StaticCache

        self.model, self.rows, self.max_len, self.max_new = model, rows, max_len, max_new
        self.key_lengths = sorted(
            {min(length, max_len) for length in range(key_bucket, max_len + key_bucket, key_bucket)}
        )
        self.sampling, self.pad_id = sampling, pad_id
        self.device = device = next(model.parameters()).device
        self.graphs = device.type == "cuda" if graphs is None else graphs
        # Each layer's tensors are made at its first write, shaped as its keys and values are (MLA's differ).
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.cache_kwarg = cache_kwarg(model)
        long = dict(dtype=torch.long, device=device)
        self.stop_ids = torch.tensor(stop_ids, **long)
        self.key_index = torch.arange(max_len, **long)  # [max_len]
        # The step's inputs and state, rewritten in place (a graph reads and writes these addresses):
        self.token = torch.zeros(rows, 1, **long)  # [rows, 1] the newest token, its entry not yet in the cache
        self.position = torch.zeros(rows, 1, **long)  # [rows, 1] its position in its own row
        self.write_at = torch.zeros((), **long)  # the cache index its entry goes to (the same for every row)
        self.first_new = torch.zeros((), **long)  # the cache index of the first new token (the padded prompt's end)
        self.prompt_keys = torch.zeros(rows, max_len, dtype=torch.bool, device=device)  # [rows, max_len] real prompt
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)  # [rows] stopped
        self.step = torch.zeros((), **long)  # which new token the step writes
        self.out = torch.full((rows, max_new), pad_id, **long)  # [rows, max_new] the new tokens
        self.step_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # key length -> its step's graph
        if self.graphs:  # the captures' runs write cache entries and tokens that each batch's start overwrites
            pool = None  # one memory pool for all: the graphs replay one at a time
            with torch.inference_mode():
                for length in self.key_lengths:
                    graph = capture(device, lambda: self._step(length), "use --hf-engine generate", pool)[0]
                    self.step_graphs[length], pool = graph, graph.pool()

    def fits(self, width: int, max_new: int) -> bool:
        return width + max_new <= self.max_len and max_new <= self.max_new

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids/positions [rows, n], mask [rows, 1, n or 1, keys] (the first ``keys`` cache positions) -> the last
        position's logits [rows, V] in the model's dtype."""
        for layer in self.cache.layers:  # where this forward's entries go (StaticCache appends at it)
            layer.cumulative_length.copy_(self.write_at)
        extra = {"logits_to_keep": 1} if self.keeps_logits else {}
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            **{self.cache_kwarg: self.cache},
            **extra,
        )
        return out.logits[:, -1]

    def key_length(self, write_at: int) -> int:
        """The keys a step writing at cache index ``write_at`` attends to: the first key length past it."""
        return next(length for length in self.key_lengths if length > write_at)

    def _step(self, keys: int) -> None:
        """One new token for every row, attending to the first ``keys`` cache positions (no host reads: a graph
        captures it)."""
        index = self.key_index[:keys]
        new = (index >= self.first_new) & (index <= self.write_at)  # [keys]
        visible = self.prompt_keys[:, :keys] | new  # [rows, keys]
        bias = torch.zeros(visible.shape, dtype=self.model.dtype, device=self.device).masked_fill_(~visible, -torch.inf)
        token = draw(self._forward(self.token, self.position, bias[:, None, None, :]), self.sampling)
        token = torch.where(self.done, self.pad_id, token)
        self.out.index_copy_(1, self.step.clamp(max=self.max_new - 1).view(1), token[:, None])
        self.done |= torch.isin(token, self.stop_ids)
        self.token.copy_(token[:, None])
        self.position.add_(1)
        self.write_at.add_(1)
        self.step.add_(1)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new: int, seed: int) -> list[list[int]]:
        """Each prompt's new tokens: ``max_new`` of them, or fewer where every row stopped early (pad after a row's
        stop token). Deterministic given ``seed`` and the batch."""
        count, width = len(prompts), max(map(len, prompts))
        assert count <= self.rows and self.fits(width, max_new), "a batch this sampler was not built for"
        rows = prompts + [[self.pad_id]] * (self.rows - count)  # spare rows: stopped from the start
        ids, real = (tensor.to(self.device) for tensor in left_padded(rows, self.pad_id))
        positions = (real.cumsum(-1) - 1).clamp(min=0)  # [rows, width]
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        # A padding query sees itself (a row of no keys would make NaNs that reach the cache's values).
        prompt_mask = (causal[None] & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=self.device)
        mask = prompt_mask[:, None]  # [rows, 1, width, width]: the prompt's keys only
        torch.manual_seed(seed)
        self.write_at.fill_(0)
        first = draw(self._forward(ids, positions, mask), self.sampling)
        self.done.copy_(torch.isin(first, self.stop_ids))
        self.done[count:] = True
        self.out.fill_(self.pad_id)
        self.out[:, 0] = first
        self.token.copy_(first[:, None])
        self.position.copy_(positions[:, -1:] + 1)
        self.prompt_keys.zero_()
        self.prompt_keys[:, :width] = real
        self.first_new.fill_(width)
        self.write_at.fill_(width)
        self.step.fill_(1)
        made = 1
        while made < max_new:
            if made % STOP_CHECK_EVERY == 0 and bool(self.done.all()):
                break
            keys = self.key_length(width + made - 1)  # the step writes token made - 1's entry at width + made - 1
            self.step_graphs[keys].replay() if self.graphs else self._step(keys)
            made += 1
        return self.out[:count, :made].tolist()
