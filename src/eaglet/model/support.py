"""What this machine and this target support, asked by preflight before anything loads and by the decoder when it
picks its engine: static KV caches, CUDA graphs, and the draft's rounds through torch.compile. torch and
transformers are imported inside the questions, so asking costs nothing until it is asked."""

from __future__ import annotations

import os
import shutil
from typing import Any

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
STATIC_CACHE_PROBE_LENGTH = 64  # positions of the throwaway StaticCache a config is probed with


def cache_kwarg(model: Any) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x): the name this version's forward takes."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def uses_static_cache(cuda_graphs: str, batch_size: int, device: str) -> bool:
    """Whether eval decodes on static caches: batch 1, and ``--cuda-graphs on`` (any device) or ``auto`` on a
    GPU (graphs then replay the forwards; elsewhere the same functions run eagerly)."""
    return batch_size == 1 and (cuda_graphs == "on" or (cuda_graphs == "auto" and device.startswith("cuda")))


def static_cache_problem(config: Any, graphs: bool, cache: Any = None) -> str | None:
    """Why this target cannot decode on a movable static cache (or, with ``graphs``, be captured as a CUDA
    graph), or None. Needs only the config."""
    import transformers
    from transformers import StaticCache

    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if graphs and any(getattr(text_config, key, None) for key in EXPERT_COUNT_KEYS):
        return (
            f"{type(config).__name__} is a mixture of experts: transformers routes tokens with host-side "
            "reads (nonzero), which a CUDA graph cannot capture"
        )
    cache = cache if cache is not None else StaticCache(config=config, max_cache_len=STATIC_CACHE_PROBE_LENGTH)
    layers = getattr(cache, "layers", None)
    if not layers or not all(hasattr(layer, "cumulative_length") for layer in layers):
        return (
            f"transformers {transformers.__version__}'s StaticCache keeps no per-layer `cumulative_length`; "
            "static-cache decoding cannot position it"
        )
    if any(getattr(layer, "is_sliding", False) for layer in layers):
        return (
            f"{type(config).__name__} has sliding-window attention layers (a rolling cache that positions cannot "
            "be moved back in); static-cache decoding covers full-attention targets"
        )
    return None


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
    return (
        None if shutil.which(compiler) else f"torch.compile on CPU needs a C++ compiler ({compiler!r} is not on PATH)"
    )
