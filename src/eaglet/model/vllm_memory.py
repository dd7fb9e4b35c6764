"""vLLM's memory on each GPU, counted as its worker counts it at engine start (vllm/v1/worker/gpu_worker.py,
``determine_available_memory``), from config.json alone.

Of ``gpu_memory_utilization`` x the GPU's memory, vLLM takes: the weights as stored (INT4 stays INT4; what it
replicates whole on every rank, the rest over the ranks; the vision tower unless ``language_model_only``), the peak
activation of its profiling forward (``max_num_batched_tokens`` tokens, or its sampler on ``max_num_seqs`` rows of
logits, whichever is larger), memory outside torch (cuBLAS, NCCL), and its CUDA graphs. The rest is KV cache, which
must hold one request of ``max_model_len`` tokens or vLLM refuses to start. Checked against vLLM's own counts on
the H100 (benchmarks/RESULTS.md, "Kimi through vLLM").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ..fsio import GIB
from .sizing import BF16_BYTES, Machine, Weights, activation_bytes_per_token, text_config

# hidden-width tensors live in one layer of vLLM's forward beside attention's and the MLP's: the residual, the
# normed input, attention's output and the MLP's (no features kept, unlike eaglet's own forward)
VLLM_HIDDEN_COPIES = 4
LOGITS_BYTES_PER_ENTRY = 2 + 4 + 4  # the sampler's profile: logits in the model dtype, then float32 logits and probs
# vLLM's engine defaults for the LLM class (vllm/engine/arg_utils.py): GPUs of >= 70 GiB (not A100) and the rest
LARGE_GPU_BYTES = 70 * GIB
DEFAULT_BATCHED_TOKENS = {True: 16384, False: 8192}
DEFAULT_MAX_SEQS = {True: 1024, False: 256}
# memory vLLM's worker counts outside torch, and its CUDA graphs' pool (FULL_AND_PIECEWISE, 51 sizes up to 512):
# the tiny Kimi-K2.5 on the H100 with vLLM 0.25.1, rounded up (RESULTS "Kimi through vLLM")
NON_TORCH_BYTES = int(0.6 * GIB)
CUDA_GRAPH_BYTES = int(0.5 * GIB)
NCCL_BYTES_PER_RANK = int(0.5 * GIB)  # tensor parallelism's communicators and custom all-reduce buffers (assumed)
ROPE_CACHE_BYTES_PER_ENTRY = 4  # vLLM's cos/sin cache, float32 for DeepSeek's yarn (the upper bound)


def vision_tower_parameters(config: dict[str, Any]) -> int:
    """Parameters of a multimodal wrapper's vision tower and projector, from its ``vision_config`` (Kimi's MoonViT
    names them ``vt_*``): attention and MLP per layer, patch and position embeddings, the patch merger's two linear
    layers; norms and biases left out (under 0.1%). 0 for a text model."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return 0
    width = int(vision.get("vt_hidden_size") or vision.get("hidden_size") or 0)
    inner = int(vision.get("vt_intermediate_size") or vision.get("intermediate_size") or 4 * width)
    layers = int(vision.get("vt_num_hidden_layers") or vision.get("num_hidden_layers") or vision.get("depth") or 0)
    patch = int(vision.get("patch_size") or 14)
    positions = int(vision.get("init_pos_emb_height") or 0) * int(vision.get("init_pos_emb_width") or 0)
    merged = width * math.prod(vision.get("merge_kernel_size") or [1])
    text_hidden = int(vision.get("text_hidden_size") or text_config(config).get("hidden_size") or 0)
    tower = layers * (4 * width * width + 2 * width * inner) + 3 * patch * patch * width + positions * width
    return tower + merged * merged + merged * text_hidden


def kv_cache_bytes_per_token(config: dict[str, Any], tp_size: int, kv_cache_dtype: str) -> int:
    """vLLM's KV cache per token on one rank: MLA caches its latent (kv_lora_rank + rope dims) once per layer, whole
    on every rank; other attention its key/value heads, split over the ranks (replicated where fewer than them)."""
    text = text_config(config)
    element = 1 if kv_cache_dtype.startswith("fp8") else BF16_BYTES
    layers = int(text["num_hidden_layers"])
    if text.get("kv_lora_rank"):
        return element * layers * (int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim", 0)))
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    return element * layers * 2 * max(1, kv_heads // tp_size) * head_dim


def rope_cache_bytes(config: dict[str, Any]) -> int:
    """vLLM's cos/sin cache: one row per position (yarn: the original length x the factor), the rotary width wide."""
    text = text_config(config)
    scaling = text.get("rope_scaling") or {}
    positions = int(text.get("max_position_embeddings") or 0)
    if scaling.get("original_max_position_embeddings") and scaling.get("factor"):
        positions = max(positions, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    heads = int(text.get("num_attention_heads") or 1)
    rotary = int(text.get("qk_rope_head_dim") or text.get("head_dim") or int(text.get("hidden_size", 0)) // heads)
    return positions * rotary * ROPE_CACHE_BYTES_PER_ENTRY


@dataclass(frozen=True)
class VllmAsk:
    """What a stage asks of vLLM that sets its memory (None: vLLM's default)."""

    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    language_model_only: bool = True
    max_model_len: int | None = None  # None: the model's own
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    kv_cache_dtype: str = "auto"

    @classmethod
    def of(cls, config: Any, max_model_len: int | None = None, max_num_batched_tokens: int | None = None):
        """From a stage's ``VllmFields``."""
        return cls(
            tensor_parallel_size=config.tensor_parallel_size,
            gpu_memory_utilization=config.gpu_memory_utilization,
            language_model_only=config.language_model_only,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            kv_cache_dtype=config.kv_cache_dtype,
        )


@dataclass(frozen=True)
class VllmLayout:
    """vLLM's hold on a target, per GPU, in bytes; ``problems`` empty: it starts."""

    tensor_parallel_size: int
    weights_per_gpu: int
    activations_per_gpu: int
    runtime_per_gpu: int  # outside torch, NCCL and CUDA graphs
    share_per_gpu: int
    kv_bytes_per_token: int
    max_model_len: int
    problems: tuple[str, ...]

    @property
    def kv_cache_per_gpu(self) -> int:
        return self.share_per_gpu - self.weights_per_gpu - self.activations_per_gpu - self.runtime_per_gpu

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_cache_per_gpu) // max(1, self.kv_bytes_per_token)

    def describe(self) -> str:
        return (
            f"vllm tp x{self.tensor_parallel_size}: {self.weights_per_gpu / GIB:,.1f} GiB weights + "
            f"{self.activations_per_gpu / GIB:,.1f} activations + {self.runtime_per_gpu / GIB:,.1f} runtime of "
            f"{self.share_per_gpu / GIB:,.1f}; KV cache {self.kv_cache_per_gpu / GIB:,.1f} ({self.kv_tokens:,} tokens)"
        )


def vllm_layout(config: dict[str, Any], weights: Weights, machine: Machine, ask: VllmAsk) -> VllmLayout:
    """What vLLM takes of each GPU for the target (``config``: config.json as written, a wrapper's included), and
    what would stop it: more ranks than GPUs, weights over the share, no room for one ``max_model_len`` request."""
    tp = ask.tensor_parallel_size
    text = text_config(config)
    large = machine.gpu_memory >= LARGE_GPU_BYTES
    batched = ask.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS[large]
    sequences = min(ask.max_num_seqs or DEFAULT_MAX_SEQS[large], batched)
    vision = 0 if ask.language_model_only else vision_tower_parameters(config) * BF16_BYTES
    weights_per_gpu = weights.vllm_per_rank(tp) + vision + rope_cache_bytes(config)
    forward = activation_bytes_per_token(config, tp, hidden_copies=VLLM_HIDDEN_COPIES) * batched
    vocab = int(text.get("vocab_size") or 0)
    sampler = sequences * -(-vocab // tp) * LOGITS_BYTES_PER_ENTRY
    runtime = NON_TORCH_BYTES + CUDA_GRAPH_BYTES + (NCCL_BYTES_PER_RANK if tp > 1 else 0)
    share = int(machine.gpu_memory * ask.gpu_memory_utilization)
    max_model_len = ask.max_model_len or int(text.get("max_position_embeddings") or 0)
    chosen = VllmLayout(
        tp,
        weights_per_gpu,
        max(forward, sampler),
        runtime,
        share,
        kv_cache_bytes_per_token(config, tp, ask.kv_cache_dtype),
        max_model_len,
        (),
    )
    problems = []
    flag = f"--gpu-memory-utilization {ask.gpu_memory_utilization:g}"
    if tp > machine.gpus:
        problems.append(f"--tensor-parallel-size {tp} but the machine has {machine.gpus} GPUs")
    if chosen.kv_cache_per_gpu <= 0:
        problems.append(
            f"{(share - chosen.kv_cache_per_gpu) / GIB:,.1f} GiB per GPU before any KV cache "
            f"({chosen.describe()}), over {share / GIB:,.1f} GiB ({flag}); " + _more_room(tp, machine)
        )
    elif chosen.kv_tokens < max_model_len:
        problems.append(
            f"{chosen.kv_cache_per_gpu / GIB:,.1f} GiB of KV cache per GPU holds {chosen.kv_tokens:,} tokens, not one "
            f"request of max_model_len {max_model_len:,} ({chosen.kv_bytes_per_token:,} bytes a token; vLLM refuses "
            f"to start); {_more_room(tp, machine)}, or raise {flag.split()[0]}"
        )
    return replace(chosen, problems=tuple(problems))


def _more_room(tp: int, machine: Machine) -> str:
    """Advice the machine can follow: more of its GPUs while it has them, else a bigger machine or smaller weights."""
    if tp < machine.gpus:
        return f"raise --tensor-parallel-size (up to {machine.gpus} GPUs here)"
    return (
        f"all {machine.gpus} GPUs of this machine are in use: run on GPUs with more memory or more of them, or a "
        "checkpoint quantized smaller"
    )


def smallest_vllm_layout(config: dict[str, Any], weights: Weights, machine: Machine, ask: VllmAsk) -> VllmLayout | None:
    """The fewest GPUs (a power of two) over which vLLM holds the target as ``ask`` asks, or None: not here."""
    tp = 1
    while tp <= machine.gpus:
        chosen = vllm_layout(config, weights, machine, replace(ask, tensor_parallel_size=tp))
        if not chosen.problems:
            return chosen
        tp *= 2
    return None
