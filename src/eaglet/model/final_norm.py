"""The target's final norm alone, as transformers builds it: for features that arrive un-normed.

eaglet's ``last`` feature is the base model's final-normed output (``formats.layers``). A backend that hands over
the last decoder layer's raw output (vLLM's hidden-state capture) gets the same feature by passing it through this
module: the architecture's own norm class (Gemma's ``1 + w``, epsilons, dtype handling included) with the
checkpoint's weights, so the two backends differ only by their kernels' rounding.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import EagletError
from .capture import base_model_of
from .sizing import meta_model
from .target import FINAL_NORM_NAMES, read_config, read_weight, weight_locations


def load_final_norm(path: Path, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """The target's final norm (``base_model.norm``) with its weights from ``path``'s safetensors."""
    model = meta_model(read_config(path))
    norm = getattr(base_model_of(model), "norm", None)
    if not isinstance(norm, nn.Module):
        raise EagletError(
            f"target {path}: {type(model).__name__} has no final norm at base_model.norm; "
            "the vllm backend cannot form its last feature (use --backend hf)"
        )
    locations = weight_locations(path)
    stems = [name.removesuffix(".weight") for name in FINAL_NORM_NAMES]
    state = {}
    for name in norm.state_dict():
        key = next((f"{stem}.{name}" for stem in stems if f"{stem}.{name}" in locations), None)
        if key is None:
            raise EagletError(
                f"target {path}: no final-norm tensor '{name}' in its safetensors "
                f"(looked for {', '.join(f'{stem}.{name}' for stem in stems)})"
            )
        state[name] = read_weight(path, locations, key)
    norm = norm.to_empty(device=device)
    norm.load_state_dict(state)
    return norm.to(dtype).eval().requires_grad_(False)
