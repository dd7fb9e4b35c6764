"""What a target costs, from its config.json alone: weight memory per GPU for a placement, activation memory of a
forward at a token budget, and whether a layout fits a machine — so a run that cannot fit is refused before any
weight loads, with what to change.

Parameter counts come from the model transformers would build, instantiated on the meta device (no memory, no
weights): exact for every architecture transformers knows, MoE and MLA included. Bytes per parameter follow the
checkpoint's ``quantization_config`` (compressed-tensors groups and their ``ignore`` list, FP8 blocks, MXFP4,
bitsandbytes, GPTQ/AWQ) — the footprint of the weights as loaded compressed. Activations are a per-token upper
bound of one layer's live tensors (layers run one after another under inference mode).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import EagletError
from ..formats.draft_config import attention_head_dim
from ..formats.store_manifest import TOP_BYTES
from ..fsio import GIB

BF16_BYTES = 2
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "bf16": 2, "fp32": 4, "fp16": 2}
# model_type aliases for configs whose own code is remote: the architecture transformers has built in
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3", "kimi_k25": "deepseek_v3"}
CONFIG_ONLY_KEYS = ("model_type", "quantization_config", "auto_map", "architectures", "transformers_version")
# live tensors of one layer's forward, per token: hidden-width copies (residual, norm, attention and MLP in/out)
HIDDEN_COPIES = 6
# the features a forward leaves per token until they are encoded: 3 aux + last, captured and encoded (bf16)
FEATURE_COPIES = 8
CUDA_CONTEXT_BYTES = 2 * GIB  # CUDA context, allocator slack and kernels' workspaces per GPU
FP8_BLOCK = 128 * 128  # FP8 block quantization: one float32 scale per 128 x 128 block
MXFP4_GROUP = 32  # one 8-bit scale per 32 4-bit values


# transformers turns compressed-tensors weights back into the compute dtype: at load (``dequantize``, the default)
# or on the first forward (its quantizer's docstring); either way a forward holds them dense. Measured: a tiny INT4
# checkpoint of 302 KB occupies 745 KB once loaded.
HF_DEQUANTIZES = ("compressed-tensors",)
# what vLLM keeps whole on every tensor-parallel rank (vllm/model_executor/models/deepseek_v2.py: MLA's q_a_proj and
# kv_a_proj_with_mqa are ReplicatedLinear, fused as fused_qkv_a_proj; the MoE router is a GateLinear, unsplit);
# one-dimensional parameters (norms, the router's score bias) are whole too
VLLM_REPLICATED = re.compile(r"\.(q_a_proj|kv_a_proj_with_mqa)\.|\.mlp\.gate\.weight$")


@dataclass(frozen=True)
class Weights:
    """A target's parameters, what they occupy as transformers loads them, and what its checkpoint holds."""

    parameters: int
    active_parameters: int  # per token: everything but the routed experts, plus top-k of them
    bytes: int  # in memory, as loaded
    bytes_by_format: dict[str, int] = field(default_factory=dict)  # storage format -> bytes
    tp_sharded_bytes: int = 0  # of ``bytes``, what the architecture's tensor-parallel plan splits over the ranks
    checkpoint_bytes: int = 0  # on disk (what a load reads)
    vllm_replicated_bytes: int = 0  # of ``checkpoint_bytes``, what vLLM keeps whole on every tensor-parallel rank

    @property
    def stored_bytes(self) -> int:
        """What the checkpoint holds (what a load reads, and what vLLM keeps: INT4 stays INT4); the loaded bytes
        where the checkpoint's are unknown."""
        return self.checkpoint_bytes or self.bytes

    def per_rank(self, tp_size: int) -> int:
        """Bytes one rank holds under tensor parallelism: what the plan splits, over the ranks; the rest whole."""
        return self.bytes - self.tp_sharded_bytes + -(-self.tp_sharded_bytes // max(1, tp_size))

    def vllm_per_rank(self, tp_size: int) -> int:
        """Bytes one vLLM rank holds: the checkpoint as stored, what vLLM replicates whole, the rest over the ranks."""
        sharded = self.stored_bytes - self.vllm_replicated_bytes
        return self.vllm_replicated_bytes + -(-sharded // max(1, tp_size))


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields (a multimodal wrapper keeps them under ``text_config``)."""
    text = config.get("text_config") or config
    quantization = config.get("quantization_config") or text.get("quantization_config")
    return text | ({"quantization_config": quantization} if quantization else {})


def meta_model(config: dict[str, Any]) -> Any:
    """The language model transformers builds from ``config`` (a wrapper's text part), on the meta device:
    its modules and shapes, no memory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    text = text_config(config)
    model_type = MODEL_TYPE_ALIASES.get(str(text.get("model_type")), str(text.get("model_type")))
    fields = {key: value for key, value in text.items() if key not in CONFIG_ONLY_KEYS}
    try:
        hf_config = AutoConfig.for_model(model_type, **fields)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError, TypeError) as exc:
        raise EagletError(
            f"target architecture {model_type!r}: transformers cannot build it from config.json "
            f"({str(exc).splitlines()[0]})"
        ) from None


def meta_parameters(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...], bool, bool]]:
    """(name, shape, whether it is a linear layer's weight, whether the tensor-parallel plan splits it) for every
    parameter of the model transformers builds from ``config``, on the meta device."""
    import torch

    model = meta_model(config)
    hf_config = model.config
    linear_weights = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    plan = [f"{model.base_model_prefix}.{key}" for key in (type(hf_config).base_model_tp_plan or {})]
    plan += list(getattr(type(model), "_tp_plan", None) or {})  # the head's (lm_head), named from the top
    return [
        (
            name,
            tuple(parameter.shape),
            name in linear_weights or _is_experts(name, parameter.ndim),
            _in_plan(plan, name),
        )
        for name, parameter in model.named_parameters()
    ]


def _in_plan(plan: list[str], name: str) -> bool:
    """Whether a parameter lies in a module a tensor-parallel plan names (``layers.*.mlp.gate_proj``: any layer)."""
    module = name.rsplit(".", 1)[0]
    for key in plan:
        pattern = re.escape(key).replace(r"\*", r"\d+")
        if re.fullmatch(pattern + r"(\..+)?", module) or re.fullmatch(pattern, name):
            return True
    return False


def _is_experts(name: str, ndim: int) -> bool:
    """A fused expert weight [experts, out, in]: on disk it is one linear layer per expert."""
    return ndim == 3 and ".experts." in name


def _disk_name(name: str) -> str:
    """A fused expert parameter as the checkpoint names its first expert's linear layer (what ``ignore`` lists and
    ``targets`` regexes are written against): ``mlp.experts.gate_up_proj`` -> ``mlp.experts.0.gate_up_proj``."""
    head, _, tail = name.rpartition(".experts.")
    return f"{head}.experts.0.{tail.removesuffix('.weight')}" if head else name.removesuffix(".weight")


def _matches(patterns: list[str], name: str) -> bool:
    """compressed-tensors' target/ignore matching: exact names, suffixes, or ``re:`` regexes."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False


def loaded_bytes_per_parameter(
    quantization: dict[str, Any] | None, name: str, is_linear: bool, dense_bytes: int
) -> tuple[str, float]:
    """(format, bytes per parameter) of one parameter once transformers has loaded it."""
    kind, stored = _bytes_per_parameter(quantization, name, is_linear, dense_bytes)
    if quantization and str(quantization.get("quant_method")) in HF_DEQUANTIZES and stored != dense_bytes:
        return f"{kind} on disk, dense once loaded", float(dense_bytes)
    return kind, stored


def _bytes_per_parameter(
    quantization: dict[str, Any] | None, name: str, is_linear: bool, dense_bytes: int
) -> tuple[str, float]:
    """(format, bytes per parameter) of one parameter under the checkpoint's quantization."""
    dense = ("bf16" if dense_bytes == BF16_BYTES else f"{dense_bytes * 8}-bit float", float(dense_bytes))
    if not quantization or not is_linear:
        return dense
    method = str(quantization.get("quant_method", ""))
    disk_name = _disk_name(name)
    if method == "compressed-tensors":
        if _matches(list(quantization.get("ignore") or []), disk_name):
            return dense
        for group in (quantization.get("config_groups") or {}).values():
            targets = list(group.get("targets") or [])
            if "Linear" in targets or _matches(targets, disk_name):
                weights = group.get("weights") or {}
                bits = int(weights.get("num_bits", 8))
                per_group = int(weights.get("group_size") or 0)
                scales = BF16_BYTES / per_group if weights.get("strategy") == "group" and per_group else 0.0
                if not weights.get("symmetric", True):
                    scales *= 2  # a zero point beside each scale
                kind = "int" if weights.get("type", "int") == "int" else "float"
                suffix = f" group {per_group}" if scales else ""
                return f"{kind}{bits}{suffix}", bits / 8 + scales
        return dense
    if method == "fp8":
        if _matches(list(quantization.get("modules_to_not_convert") or []), disk_name) or disk_name == "lm_head":
            return dense
        return "fp8 block", 1 + 4 / FP8_BLOCK
    if method == "mxfp4":
        return ("mxfp4", 0.5 + 1 / MXFP4_GROUP) if ".experts." in name else dense
    if method == "bitsandbytes":
        four = quantization.get("load_in_4bit")
        return ("bnb nf4", 0.5 + 4 / 64) if four else ("bnb int8", 1.0 + 4 / 4096)
    if method in ("gptq", "awq"):
        bits = int(quantization.get("bits", 4))
        return f"{method} int{bits}", bits / 8 + 2 * BF16_BYTES / int(quantization.get("group_size", 128))
    return dense


def weights_of(config: dict[str, Any], dtype_bytes: int | None = None) -> Weights:
    """Parameters and their bytes as loaded; ``dtype_bytes``: the compute dtype of unquantized weights (default:
    the checkpoint's ``torch_dtype``)."""
    text = text_config(config)
    dense_bytes = dtype_bytes or DTYPE_BYTES.get(
        str(text.get("torch_dtype") or text.get("dtype") or "bfloat16"), BF16_BYTES
    )
    quantization = text.get("quantization_config")
    experts = int(text.get("n_routed_experts") or text.get("num_experts") or text.get("num_local_experts") or 0)
    top_k = int(text.get("num_experts_per_tok") or 0)
    total = active = 0
    size = sharded = on_disk = replicated = 0.0
    by_format: dict[str, int] = {}
    for name, shape, is_linear, in_plan in meta_parameters(config):
        count = 1
        for dim in shape:
            count *= dim
        total += count
        routed = ".experts." in name and experts and len(shape) == 3
        active += count * top_k // experts if routed else count
        kind, per_parameter = loaded_bytes_per_parameter(quantization, name, is_linear, dense_bytes)
        size += count * per_parameter
        sharded += count * per_parameter if in_plan else 0
        stored = count * _bytes_per_parameter(quantization, name, is_linear, dense_bytes)[1]
        on_disk += stored
        replicated += stored if len(shape) == 1 or VLLM_REPLICATED.search(name) else 0
        by_format[kind] = by_format.get(kind, 0) + int(count * per_parameter)
    return Weights(total, active, int(size), by_format, int(sharded), int(on_disk), int(replicated))


def activation_bytes_per_token(
    config: dict[str, Any],
    tp_size: int = 1,
    dtype_bytes: int = BF16_BYTES,
    hidden_copies: int = HIDDEN_COPIES + FEATURE_COPIES,
) -> int:
    """Upper bound of one layer's live activations per token in a feature forward (no KV cache), on one GPU;
    ``hidden_copies``: hidden-width tensors live beside attention's and the MLP's (eaglet's forward keeps its
    features too)."""
    text = text_config(config)
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    if text.get("kv_lora_rank"):  # MLA: per head, queries and keys of nope + rope dims, values of v_head_dim
        qk = int(text.get("qk_nope_head_dim", 0)) + int(text.get("qk_rope_head_dim", 0))
        attention = heads * (2 * qk + 2 * int(text.get("v_head_dim", qk)))
    else:
        kv_heads = int(text.get("num_key_value_heads") or heads)
        attention = 2 * (heads + kv_heads) * attention_head_dim(text)
    top_k = int(text.get("num_experts_per_tok") or 0)
    moe_width = int(text.get("moe_intermediate_size") or 0)
    dense_width = int(text.get("intermediate_size") or 4 * hidden)
    shared = int(text.get("n_shared_experts") or 0)
    mlp = 3 * max(dense_width, (top_k + shared) * moe_width if moe_width else 0)
    return dtype_bytes * (hidden_copies * hidden + (attention + mlp) // tp_size)


@dataclass(frozen=True)
class Machine:
    """Where a stage runs: GPUs of one memory size (or the CPU: ``gpus`` 0)."""

    gpus: int
    gpu_memory: int  # bytes per GPU
    name: str = "GPU"


@dataclass(frozen=True)
class Layout:
    placement: str
    gpus: int  # GPUs the target spreads over
    weights_per_gpu: int
    activations_per_gpu: int
    capacity_per_gpu: int  # usable: memory less CUDA_CONTEXT_BYTES

    @property
    def needed_per_gpu(self) -> int:
        return self.weights_per_gpu + self.activations_per_gpu

    @property
    def fits(self) -> bool:
        return self.needed_per_gpu <= self.capacity_per_gpu


def kv_bytes_per_token(config: dict[str, Any], tp_size: int = 1, dtype_bytes: int = BF16_BYTES) -> int:
    """KV cache per token over all layers (decoding), on one GPU: transformers caches per-head keys and values
    (MLA too: its keys are nope + rope dims, its values v_head_dim)."""
    text = text_config(config)
    heads = int(text["num_attention_heads"])
    if text.get("kv_lora_rank"):
        width = heads * (
            int(text.get("qk_nope_head_dim", 0)) + int(text.get("qk_rope_head_dim", 0)) + int(text.get("v_head_dim", 0))
        )
    else:
        width = 2 * int(text.get("num_key_value_heads") or heads) * attention_head_dim(text)
    return dtype_bytes * int(text["num_hidden_layers"]) * width // tp_size


def layout(
    config: dict[str, Any],
    weights: Weights,
    machine: Machine,
    placement: str,
    forward_tokens: int,
    gpus: int | None = None,
    cached_tokens: int = 0,
) -> Layout:
    """Per-GPU memory of a target placed ``one`` (one GPU), ``split`` (weights spread over ``gpus``, the forward
    on one at a time) or ``tp`` (weights and the layer's width split over ``gpus``), running forwards of
    ``forward_tokens`` tokens with ``cached_tokens`` tokens in its KV cache (decoding)."""
    used = 1 if placement == "one" else (gpus or machine.gpus)
    tp = used if placement == "tp" else 1
    live = activation_bytes_per_token(config, tp) * forward_tokens
    cache = kv_bytes_per_token(config, tp) * cached_tokens // (1 if placement != "split" else used)
    per_gpu = weights.per_rank(tp) if placement == "tp" else -(-weights.bytes // used)
    return Layout(placement, used, per_gpu, live + cache, max(0, machine.gpu_memory - CUDA_CONTEXT_BYTES))


MAX_GPUS_ADVISED = 1024
# config.json sizes a tensor-parallel plan splits across ranks (heads, MLP width, vocabulary)
TP_SPLIT_SIZES = (
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "vocab_size",
)


def tp_divides(config: dict[str, Any], tp_size: int) -> str | None:
    """None when every size a tensor-parallel plan splits divides by ``tp_size``, else the first that does not."""
    text = text_config(config)
    return next((key for key in TP_SPLIT_SIZES if isinstance(text.get(key), int) and text[key] % tp_size), None)


def fit_advice(
    config: dict[str, Any],
    weights: Weights,
    machine: Machine,
    chosen: Layout,
    batch_tokens: int,
    cached_tokens: int = 0,
    forward_option: tuple[str, int] | None = ("--batch-tokens {}", 256),
) -> str:
    """What to change when ``chosen`` does not fit: the fewest GPUs that hold it, a smaller forward that fits
    (``forward_option``: the stage's option, as a format and the step its value is rounded down to), or both."""
    capacity = max(1, chosen.capacity_per_gpu)
    advice = []
    placement = chosen.placement if chosen.placement != "one" else "split"
    for gpus in range(max(2, chosen.gpus + 1), MAX_GPUS_ADVISED + 1):
        if placement == "tp" and tp_divides(config, gpus):
            continue
        if layout(config, weights, machine, placement, batch_tokens, gpus, cached_tokens).fits:
            flag = "torchrun --nproc-per-node" if placement == "tp" else "--max-memory over"
            advice.append(f"{gpus} GPUs of {machine.gpu_memory / GIB:.0f} GiB ({flag} {gpus}, --placement {placement})")
            break
    if forward_option is not None and chosen.weights_per_gpu < capacity:
        option, step = forward_option
        per_token = chosen.activations_per_gpu / max(1, batch_tokens)  # per row where the forward counts rows
        tokens = int((capacity - chosen.weights_per_gpu) / max(per_token, 1))
        if tokens >= step:
            advice.append(f"{option.format(tokens // step * step)} (of {batch_tokens})")
    return " or ".join(advice) if advice else "a machine with more GPU memory"


def describe_weights(weights: Weights) -> str:
    formats = ", ".join(
        f"{kind} {size / GIB:,.1f} GiB"
        for kind, size in sorted(weights.bytes_by_format.items(), key=lambda item: -item[1])
    )
    return (
        f"{weights.parameters / 1e9:,.1f} B parameters ({weights.active_parameters / 1e9:,.1f} B active per token)"
        f", {weights.bytes / GIB:,.1f} GiB as loaded ({formats})"
    )


def this_machine() -> Machine:
    """The GPUs torch sees here (``gpus`` 0 on a CPU-only machine)."""
    import torch

    if not torch.cuda.is_available():
        return Machine(0, 0, "CPU")
    properties = torch.cuda.get_device_properties(0)
    return Machine(torch.cuda.device_count(), int(properties.total_memory), properties.name)


# Throughput, for time estimates when the user states none
PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "B200": 2250e12, "A100": 312e12}
DEFAULT_PEAK_BF16_FLOPS = 989.4e12
EXTRACT_MFU = 0.43  # `eaglet extract` of an 8B-shaped target on one H200 (benchmarks/RESULTS.md)
STORE_WRITE_BYTES_PER_S = 1.0e9  # that run was disk-bound at ~1 GB/s of shards written


def peak_flops(machine: Machine) -> float:
    return next(
        (flops for name, flops in PEAK_BF16_FLOPS.items() if name in machine.name.upper()), DEFAULT_PEAK_BF16_FLOPS
    )


def extract_tokens_per_s(weights: Weights, machine: Machine, gpus: int, store_bytes_per_token: int) -> float:
    """Extraction rate: the measured MFU over the GPUs the target runs on (a forward is 2 FLOPs per active
    parameter per token), or the store's disk rate when that is lower."""
    compute = EXTRACT_MFU * peak_flops(machine) * gpus / (2 * max(1, weights.active_parameters))
    return min(compute, STORE_WRITE_BYTES_PER_S / store_bytes_per_token)


WEIGHT_LOAD_BYTES_PER_S = 2.0e9  # reading a checkpoint from local NVMe into GPU memory (an assumption: state yours)
DECODE_HBM_SHARE = 0.5  # share of HBM bandwidth a batch-1 decoding step reaches
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "B200": 8.0e12, "A100": 2.0e12}
DEFAULT_HBM_BYTES_PER_S = 3.35e12


def load_seconds(weights: Weights) -> float:
    return weights.stored_bytes / WEIGHT_LOAD_BYTES_PER_S


def decode_seconds_per_token(
    weights: Weights, machine: Machine, gpus: int, measured_step_s: float, measured_layers: int, layers: int
) -> float:
    """A batch-1 decoding step: the measured step of a small target scaled by depth (the per-layer launch cost),
    plus reading this target's active weights on ``gpus`` GPUs at DECODE_HBM_SHARE of their bandwidth."""
    bandwidth = next(
        (rate for name, rate in HBM_BYTES_PER_S.items() if name in machine.name.upper()), DEFAULT_HBM_BYTES_PER_S
    )
    active_bytes = weights.bytes * weights.active_parameters / max(1, weights.parameters)
    return measured_step_s * layers / measured_layers + active_bytes / (gpus * bandwidth * DECODE_HBM_SHARE)


DRAFT_LAYER_PARAMS_PER_H2 = 15  # fc (3H^2) + one decoder layer (~12H^2), besides the head (H x Vd)


def draft_parameters(hidden: int, draft_vocab: int) -> int:
    """A one-layer EAGLE-3 draft's trainable parameters, from the target's hidden size and the draft vocabulary."""
    return DRAFT_LAYER_PARAMS_PER_H2 * hidden**2 + hidden * draft_vocab


def draft_train_flops_per_token(config: Any, steps: int, mean_context: float, head_trainable: bool = True) -> float:
    """Forward + backward (3x forward) FLOPs per token for a TTT unroll of ``steps``; a frozen head
    skips its weight gradient (one forward's worth)."""
    hidden, heads, kv_heads, head_dim = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    projections = 2 * hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * config.intermediate_size
    head = hidden * config.draft_vocab_size
    attention = 2 * heads * head_dim * mean_context  # QK^T and AV over the causal context
    per_step = 2 * (projections + mlp + head) + 2 * attention
    fuse = 2 * 3 * config.target_hidden_size * hidden
    skipped = 0 if head_trainable else steps * 2 * head
    return 3 * (fuse + steps * per_step) - skipped


def train_flops_per_token(config: Any, steps: int, mean_context: float, teacher_rows: int) -> float:
    """A training step's FLOPs per token: the draft's TTT unroll (``draft_train_flops_per_token``) and the teacher
    head's forward over ``teacher_rows`` of the target's vocabulary."""
    return draft_train_flops_per_token(config, steps, mean_context) + 2 * config.target_hidden_size * teacher_rows


def train_step_bytes(config: Any, tokens: int, steps: int, dense_attention: bool) -> int:
    """Peak memory of one TTT step of ``tokens`` tokens (config: the draft's): the fused loss keeps each step's
    logit gradient [T, Vd] (float32; deferred, the LM head's weight gradient reads them where they are), the teacher's
    logits and probabilities, the draft's activations, the output gradients the other shared layers keep for their one
    weight-gradient matmul (``model.shared_linear``: each layer's K calls, at most its bound plus one call), and on the
    dense path (CPU) one step's [heads, T, T] attention weights while they are computed."""
    from .shared_linear import KEPT_GRAD_BYTES

    float_bytes = 4
    loss = steps * tokens * config.draft_vocab_size * float_bytes
    teacher = 2 * tokens * config.draft_vocab_size * float_bytes
    activations = steps * tokens * (16 * config.hidden_size + 3 * config.intermediate_size) * float_bytes
    attention = 3 * config.num_attention_heads * tokens * tokens * float_bytes if dense_attention else 0
    q_out, kv_out = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    layer_outputs = [q_out, kv_out, kv_out, config.hidden_size, config.intermediate_size, config.intermediate_size,
                     config.hidden_size] * config.num_hidden_layers  # fmt: skip
    kept = sum(
        min(steps * tokens * out * float_bytes, KEPT_GRAD_BYTES + tokens * out * float_bytes) for out in layer_outputs
    )
    return loss + teacher + activations + attention + kept


PREFETCH_STEPS = 2  # optimizer steps' worth of micro-batches `eaglet train` prepares ahead (train.loop)
STAGED_BATCHES = PREFETCH_STEPS + 1  # on the device ahead of a recorded step: the queue's and the one being made
INDEX_BYTES = 8  # int64: input ids, and the three document tensors per token


def staged_batch_bytes(tokens: int, hidden_size: int, feature_bytes: int = 2) -> int:
    """One padded micro-batch on the device (``train.step.DeviceBatch``): ids, loss mask, aux [T, 3, H] and last
    [T, H] in the store's dtype (bf16 at most), the target's argmax (int32) and the document ids, positions and
    ends."""
    return tokens * (INDEX_BYTES + 1 + 4 * hidden_size * feature_bytes + TOP_BYTES + 3 * INDEX_BYTES)


PROBE_SIZE = 1024  # the matrix multiply that measures this CPU's float32 rate
PROBE_REPEATS = 3


def measured_cpu_flops() -> float:
    """This CPU's float32 matrix-multiply rate (FLOP/s), from a few 1024^3 products (~0.1 s)."""
    import time

    import torch

    a = torch.randn(PROBE_SIZE, PROBE_SIZE)
    a @ a  # warm-up
    started = time.perf_counter()
    for _ in range(PROBE_REPEATS):
        a @ a
    return PROBE_REPEATS * 2 * PROBE_SIZE**3 / (time.perf_counter() - started)


# a prompt's tokens, for KV cache estimates before the prompts are rendered
PROMPT_TOKENS_GUESS = 512
FLOAT32_BYTES = 4


def generation_batch_bytes(config: dict[str, Any], rows: int, max_new_tokens: int, dtype_bytes: int) -> int:
    """Memory a batch of ``rows`` answers of up to ``max_new_tokens`` holds while it is written (each after a prompt
    of PROMPT_TOKENS_GUESS): their KV cache, and one position's float32 logits per row."""
    vocab = int(text_config(config)["vocab_size"])
    per_token = kv_bytes_per_token(config, dtype_bytes=dtype_bytes)
    return rows * (per_token * (PROMPT_TOKENS_GUESS + max_new_tokens) + FLOAT32_BYTES * vocab)


def available_memory(device: str) -> tuple[int, str]:
    """(bytes available, what was measured) on the device a stage will use."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        index = int(device.split(":")[1]) if ":" in device else 0
        free, _ = torch.cuda.mem_get_info(index)
        return free, f"GPU {index} free"
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "CPU MemAvailable"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "CPU available pages"
