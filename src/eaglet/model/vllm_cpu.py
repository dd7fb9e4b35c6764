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
