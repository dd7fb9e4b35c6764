"""The EAGLE-3 draft: one Llama-style decoder layer over fused target features, predicting the draft vocab.

Parameter names are the serving names vLLM and SGLang load (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``), so export is a copy plus a config. ``embed_tokens`` is the target's
embedding, frozen and not saved (engines share the target's).

Per position ``t`` (shapes for one packed sequence of T tokens)::

    h      = fc(cat(aux_t))                                    [T, H]    (step 0; later steps: the layer's own output)
             EAGLE 3.1: fc(cat(fc_norm_i(aux_t,i))), one norm per aux feature (or input_norm over the concatenation)
    x      = cat(input_layernorm(embed(token)), hidden_norm(h)) [T, 2H]
    h'     = h + o_proj(attn(q/k/v_proj(x)))                   residual is the un-normed h
    h'     = h' + mlp(post_attention_layernorm(h'))
    logits = lm_head(norm(h'))                                  [T, Vd]

The next step is fed ``h'`` (EAGLE-3) or ``norm(h')`` (``norm_output``, EAGLE 3.1), as vLLM and SGLang feed it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import EagletError
from ..export import export_format
from ..formats.draft_config import (
    AUX_FEATURES,
    EMBEDDING_TENSOR,
    FIRST_LAYER_PREFIX,
    DraftConfig,
    StoredDraft,
    read_draft_config,
    weight_problems,
)
from ..formats.files import DRAFT_CONFIG_FILE, DRAFT_WEIGHTS_FILE
from .shared_linear import SharedLinear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalised in float32, cast back to x's dtype, then scaled."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_frequencies(config: DraftConfig, device: torch.device) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (float32) and attention scaling of the target's RoPE. Scaled types
    (linear, llama3, yarn, ...) come from transformers' own initialisers — the ones vLLM's and SGLang's
    ``get_rope`` reproduce when they serve the draft with the ``rope_scaling`` its config carries."""
    scaling = dict(config.rope_scaling or {})
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        exponents = torch.arange(0, config.head_dim, 2, device=device, dtype=torch.float32) / config.head_dim
        return 1.0 / (config.rope_theta**exponents), 1.0
    import transformers
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise EagletError(
            f"the target's RoPE type {rope_type!r} is not one transformers {transformers.__version__} "
            f"computes ({', '.join(sorted(ROPE_INIT_FUNCTIONS))}); upgrade transformers"
        )
    llama = LlamaConfig(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
        rope_scaling=scaling,
    )
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](llama, device)
    return inv_freq.to(device, torch.float32), float(attention_scaling)


class DraftRope:
    """cos/sin tables of the target's RoPE for the draft, its frequencies made once per device in float32:
    kept apart from the module's tensors, so casting the draft to bf16 does not round them."""

    def __init__(self, config: DraftConfig):
        self.config = config
        self._frequencies: dict[torch.device, tuple[torch.Tensor, float]] = {}

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, head_dim] float32 for integer positions [T] (Llama's rotate-half layout)."""
        if positions.device not in self._frequencies:
            self._frequencies[positions.device] = rope_frequencies(self.config, positions.device)
        inv_freq, attention_scaling = self._frequencies[positions.device]
        angles = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat([angles, angles], dim=-1)
        if attention_scaling == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast gives matmul inputs here (None outside autocast): the pointwise pieces below cast
    their outputs to it themselves, fused, instead of leaving a float32 tensor for the next matmul to cast."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _cast(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return x if dtype is None else x.to(dtype)


# The draft layer's elementwise work between its matmuls, as pure functions: eager by default, compiled (each
# into a few fused kernels, backward included) by ``Eagle3Draft.compile_pointwise``. Matmuls stay outside, so
# autocast casts each weight once per training step, not once per call of a compiled region.
def _input_mix(
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    embed_norm: torch.Tensor,
    hidden_norm: torch.Tensor,
    eps: float,
    norm_before_residual: bool,
    cast: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """embeds [T, H], hidden [T, H] -> (cat(norm(embeds), norm(hidden)) [T, 2H], the residual [T, H])."""
    normed_hidden = rms_norm(hidden, hidden_norm, eps)
    residual = normed_hidden if norm_before_residual else hidden
    return _cast(torch.cat([rms_norm(embeds, embed_norm, eps), normed_hidden], dim=-1), cast), residual


def _rope_pair(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _residual_norm(
    residual: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float, cast: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = residual + update, norm(h)): the attention's residual and the MLP's input."""
    h = residual + update
    return h, _cast(rms_norm(h, weight, eps), cast)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cast: torch.dtype | None) -> torch.Tensor:
    return _cast(rms_norm(x, weight, eps), cast)


class Pointwise(NamedTuple):
    input_mix: Callable
    rope_pair: Callable
    residual_norm: Callable
    swiglu: Callable
    norm: Callable


EAGER_POINTWISE = Pointwise(_input_mix, _rope_pair, _residual_norm, _swiglu, _norm)


@functools.cache
def compiled_pointwise(backend: str = "inductor") -> Pointwise:
    """The same functions through torch.compile (fixed shapes: training pads batches to the token budget)."""
    return Pointwise(*(torch.compile(fn, dynamic=False, backend=backend) for fn in EAGER_POINTWISE))


# attention(q [Hq,T,d], k [Hkv,T,d], v [Hkv,T,d], step) -> [Hq,T,d]; the TTT module supplies it
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DraftAttention(nn.Module):
    def __init__(self, config: DraftConfig, input_size: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.q_proj = SharedLinear(input_size, self.heads * self.head_dim)
        self.k_proj = SharedLinear(input_size, self.kv_heads * self.head_dim)
        self.v_proj = SharedLinear(input_size, self.kv_heads * self.head_dim)
        self.o_proj = SharedLinear(self.heads * self.head_dim, config.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: AttentionFn,
        pointwise: Pointwise = EAGER_POINTWISE,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.heads, self.head_dim).transpose(0, 1)  # [Hq, T, d]
        k = self.k_proj(x).view(tokens, self.kv_heads, self.head_dim).transpose(0, 1)  # [Hkv, T, d]
        v = self.v_proj(x).view(tokens, self.kv_heads, self.head_dim).transpose(0, 1)
        q, k = pointwise.rope_pair(q, k, cos, sin)
        out = attend(q, k, v)  # [Hq, T, d]
        return self.o_proj(out.transpose(0, 1).reshape(tokens, self.heads * self.head_dim))


class DraftMLP(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.gate_proj = SharedLinear(config.hidden_size, config.intermediate_size)
        self.up_proj = SharedLinear(config.hidden_size, config.intermediate_size)
        self.down_proj = SharedLinear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor, pointwise: Pointwise = EAGER_POINTWISE) -> torch.Tensor:
        return self.down_proj(pointwise.swiglu(self.gate_proj(x), self.up_proj(x)))


class DraftLayer(nn.Module):
    """The EAGLE-3 midlayer: attention over [normed embedding ; normed hidden] (2H wide)."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config, 2 * config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)
        self.norm_before_residual = config.norm_before_residual
        self.pointwise = EAGER_POINTWISE

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttentionFn
    ) -> torch.Tensor:
        cast, eps, fns = autocast_dtype(hidden.device.type), self.hidden_norm.eps, self.pointwise
        x, residual = fns.input_mix(
            embeds, hidden, self.input_layernorm.weight, self.hidden_norm.weight, eps, self.norm_before_residual, cast
        )  # x [T, 2H]; the residual is the un-normed h
        h, normed = fns.residual_norm(
            residual, self.self_attn(x, cos, sin, attend, fns), self.post_attention_layernorm.weight, eps, cast
        )
        return h + self.mlp(normed, fns)


class DraftStackLayer(nn.Module):
    """Decoder layers 1..n-1 of a deeper draft: a plain pre-norm Llama layer over the hidden state
    (vLLM's llama_eagle3 ``layers.{i}`` for i >= 1, which see no embeddings)."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config, config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)
        self.pointwise = EAGER_POINTWISE

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttentionFn) -> torch.Tensor:
        cast, eps, fns = autocast_dtype(hidden.device.type), self.input_layernorm.eps, self.pointwise
        x = fns.norm(hidden, self.input_layernorm.weight, eps, cast)
        h, normed = fns.residual_norm(
            hidden, self.self_attn(x, cos, sin, attend, fns), self.post_attention_layernorm.weight, eps, cast
        )
        return h + self.mlp(normed, fns)


FROZEN_PREFIX = "embed_tokens"  # the target's embedding: copied in, never trained, never saved


class Eagle3Draft(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        if config.num_hidden_layers < 1:
            raise EagletError(f"num_hidden_layers must be at least 1, got {config.num_hidden_layers}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        aux_size = config.target_hidden_size
        self.fc = nn.Linear(AUX_FEATURES * aux_size, config.hidden_size, bias=False)
        if config.fc_norm:  # EAGLE 3.1: one norm per aux feature
            self.fc_norm = nn.ModuleList(RMSNorm(aux_size, config.rms_norm_eps) for _ in range(AUX_FEATURES))
        if config.norm_before_fc:  # one norm over the three together
            self.input_norm = RMSNorm(AUX_FEATURES * aux_size, config.rms_norm_eps)
        self.midlayer = DraftLayer(config)  # layer 0 (serving name); deeper drafts add layers.1 ...
        self.layers = nn.ModuleDict({str(i): DraftStackLayer(config) for i in range(1, config.num_hidden_layers)})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = SharedLinear(config.hidden_size, config.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rope = DraftRope(config)  # positions -> cos/sin, the target's rotary embedding
        self.pointwise = EAGER_POINTWISE  # compile_pointwise() swaps in the compiled functions

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [T, 3, H_target] -> [T, H]."""
        if self.config.fc_norm:
            aux = torch.stack([norm(aux[:, index]) for index, norm in enumerate(self.fc_norm)], dim=1)
        fused = aux.flatten(1)  # [T, 3 * H_target]
        if self.config.norm_before_fc:
            fused = self.input_norm(fused)
        return self.fc(fused)

    def step(self, *inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step from ``advance``'s inputs: (new hidden [T, H], draft-vocab logits [T, Vd])."""
        hidden, normed = self.advance(*inputs)
        return hidden, self.lm_head(normed)

    def advance(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attends: Sequence[AttentionFn],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step up to its LM head: (new hidden [T, H], the head's input [T, H]); ``attends``: one per layer,
        each keeping that layer's keys across steps. ``step`` adds the head; training applies it with its loss
        (``train.loss.head_soft_cross_entropy``)."""
        hidden = self.midlayer(self.embed_tokens(input_ids), hidden, cos, sin, attends[0])
        for index, layer in enumerate(self.layers.values(), start=1):
            hidden = layer(hidden, cos, sin, attends[index])
        normed = self.pointwise.norm(hidden, self.norm.weight, self.norm.eps, autocast_dtype(hidden.device.type))
        return (normed if self.config.norm_output else hidden), normed

    def compile_pointwise(self, backend: str = "inductor") -> None:
        """Run the elementwise work between the matmuls (norms, RoPE, SwiGLU, residuals) through torch.compile:
        each piece becomes a few fused kernels, where eager runs one kernel (and one memory pass) per op."""
        fns = compiled_pointwise(backend)
        self.pointwise = fns
        for layer in [self.midlayer, *self.layers.values()]:
            layer.pointwise = fns

    def init_from_target(
        self,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        d2t: torch.Tensor,
        t2d: torch.Tensor,
        final_norm: torch.Tensor | None = None,
    ) -> None:
        """Copy the target's embedding, its lm_head rows for the draft vocabulary and (when given) its
        final norm: the draft's output starts in the geometry the target's head reads."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed)
            used = torch.arange(len(d2t)) + d2t
            self.lm_head.weight.copy_(lm_head[used])
            if final_norm is not None:
                self.norm.weight.copy_(final_norm)
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)

    def serving_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the (shared, frozen) embedding, under the serving names."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith(FROZEN_PREFIX)}


def save_draft(config: DraftConfig, weights: dict[str, torch.Tensor], directory: str | Path) -> None:
    """The draft as serving engines and ``load_draft`` read it: ``weights`` is ``serving_state_dict()``
    (or the same gathered from sharded training)."""
    from ..fsio import atomic_file, write_json_atomic
    from .shards import write_safetensors

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with atomic_file(directory / DRAFT_WEIGHTS_FILE) as tmp:
        write_safetensors(tmp, weights)
    write_json_atomic(directory / DRAFT_CONFIG_FILE, config.to_dict())


def _eaglet_names(state: dict[str, torch.Tensor], stored: StoredDraft) -> dict[str, torch.Tensor]:
    """Tensors of any eaglet export under eaglet's names (formats name the first layer their own way)."""
    if stored.export_format is None:
        return state
    fmt = export_format(stored.export_format, f"{stored.config_file}: export_format")
    return {fmt.eaglet_name(name, FIRST_LAYER_PREFIX): tensor for name, tensor in state.items()}


def vocab_mapping_problem(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int) -> str | None:
    """Why a draft vocabulary's mapping cannot be served, or None: ``d2t`` (draft id + d2t = its target id) must
    give distinct target ids inside the vocabulary, and ``t2d`` mark exactly those (vLLM reads d2t, SGLang and
    speculators' training read t2d: two stories of one vocabulary would serve another draft than was trained)."""
    if d2t.is_floating_point():
        return "d2t: not integer"
    used = torch.arange(len(d2t)) + d2t.long()  # the target id of each draft id
    if int(used.min()) < 0 or int(used.max()) >= vocab_size:
        return "d2t: maps draft ids outside the target's vocabulary"
    if len(torch.unique(used)) != len(used):
        return "d2t: maps two draft ids to one target id"
    if t2d is not None:
        marked = torch.zeros(vocab_size, dtype=torch.bool)
        marked[used] = True
        if t2d.dtype != torch.bool or not torch.equal(t2d, marked):
            return f"t2d: marks other target ids than d2t maps to ({int(t2d.bool().sum())} marked, {len(d2t)} mapped)"
    return None


def read_draft_weights(directory: str | Path, stored: StoredDraft | None = None) -> dict[str, torch.Tensor]:
    """A draft directory's tensors under eaglet's names, refused in one line unless they are exactly the tensors
    and shapes its config needs (an export may add the target's embedding; one with the full vocabulary may carry
    or leave out ``d2t``/``t2d``)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    stored = stored or read_draft_config(directory)
    weights_file = directory / DRAFT_WEIGHTS_FILE
    try:
        raw = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise EagletError(
            f"{weights_file}: unreadable safetensors ({str(exc).splitlines()[0]}); train (or export) again"
        ) from None
    state = _eaglet_names(raw, stored)
    problems = weight_problems(stored.config, {name: tuple(tensor.shape) for name, tensor in state.items()})
    if not problems and "d2t" in state and len(state["d2t"]):  # of the config's shape: its values next
        problem = vocab_mapping_problem(state["d2t"], state.get("t2d"), stored.config.vocab_size)
        problems += [problem] if problem else []
    if problems:
        raise EagletError(
            f"{weights_file}: does not hold the draft {stored.config_file.name} describes "
            f"({problems[0]}{f'; {len(problems) - 1} more' if len(problems) > 1 else ''}); train "
            "(or export) again"
        )
    return state


def load_draft(
    directory: str | Path, embed: torch.Tensor | None = None, target_layers: int | None = None
) -> Eagle3Draft:
    """A draft from `eaglet train`'s output, any `eaglet export` directory or one made elsewhere (weights in
    float32). An export without ``d2t``/``t2d`` has the target's whole vocabulary (the identity mapping). ``embed``:
    the target's embedding, unless a draft made elsewhere carries its own (vLLM then runs that one too)."""
    directory = Path(directory)
    stored = read_draft_config(directory, target_layers)
    config = stored.config
    model = Eagle3Draft(config)
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in read_draft_weights(directory, stored).items()}
    missing, _ = model.load_state_dict(state, strict=False)  # read_draft_weights checked names and shapes
    full_vocab = not config.uses_vocab_mapping
    with torch.no_grad():
        if full_vocab and "t2d" in missing:
            model.t2d.fill_(True)  # d2t stays zeros: draft id i is target id i
        own_embedding = stored.made_elsewhere and EMBEDDING_TENSOR in state
        if embed is not None and not own_embedding:
            model.embed_tokens.weight.copy_(embed)
    return model
