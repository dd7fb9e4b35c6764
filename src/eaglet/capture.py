"""Capture EAGLE-3 features from a target's forward pass: ``aux`` (three layer inputs) and ``last``.

``aux[:, k]`` is the hidden state entering decoder layer ``layer_ids[k]`` (= HF ``hidden_states[i]``)
and ``last`` is the base model's final-normed output (= ``last_hidden_state``), so the teacher's
logits are ``lm_head(last)``. Forward pre-hooks grab the three tensors as they pass; neither the LM
head nor ``output_hidden_states`` runs, so no other layer's activations stay alive.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from .errors import EagletError


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of any transformers decoder-only model, found generically.

    It is the ``ModuleList`` under the base model whose length is ``config.num_hidden_layers``
    (Llama, Qwen2/3, Gemma, Mistral, Phi, Qwen3-MoE, DeepSeek: ``model.model.layers``).
    """
    config = getattr(model, "config", None)
    text_config = getattr(config, "text_config", None) or config
    expected = getattr(text_config, "num_hidden_layers", None)
    base = getattr(model, "base_model", model)
    candidates = [m for m in base.modules() if isinstance(m, nn.ModuleList) and len(m) == expected]
    if not candidates:
        raise EagletError(
            f"{type(model).__name__}: found no list of {expected} decoder layers; this architecture is not supported"
        )
    return candidates[0]


def base_model_of(model: nn.Module) -> nn.Module:
    """The transformer without the LM head (its output is final-normed)."""
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        raise EagletError(f"{type(model).__name__}: no base model under the LM head")
    return base


class FeatureCapture:
    """Run the base model once and return ``aux`` [B, S, 3, H] and ``last`` [B, S, H]."""

    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...]):
        self.model = model
        self.base = base_model_of(model)
        self.layers = decoder_layers(model)
        self.layer_ids = tuple(layer_ids)
        if max(self.layer_ids) >= len(self.layers) or min(self.layer_ids) < 0:
            raise EagletError(f"aux layer ids {list(layer_ids)} out of range for {len(self.layers)} decoder layers")

    @contextmanager
    def hooks(self, captured: dict[int, torch.Tensor]) -> Iterator[None]:
        """While active, every forward of the model leaves the aux layers' inputs in ``captured[slot]``."""
        def grab(slot: int):
            def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
                captured[slot] = args[0] if args else kwargs["hidden_states"]

            return hook

        handles = [
            self.layers[layer].register_forward_pre_hook(grab(slot), with_kwargs=True)
            for slot, layer in enumerate(self.layer_ids)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        captured: dict[int, torch.Tensor] = {}
        with self.hooks(captured):
            output = self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        aux = torch.stack([captured[slot] for slot in range(len(self.layer_ids))], dim=2)  # [B, S, 3, H]
        return aux, output.last_hidden_state  # [B, S, H]


def teacher_logits(model: nn.Module, last: torch.Tensor) -> torch.Tensor:
    """The target's logits from its final-normed hidden state: ``lm_head(last)``, soft-capped where the
    architecture caps (Gemma 2/3), exactly as the model's own forward does."""
    logits = model.get_output_embeddings()(last)
    config = getattr(model.config, "text_config", None) or model.config
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def batches_by_length(lengths: np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Sample indices, longest first, grouped so each batch's padded size stays within ``batch_tokens``."""
    order = np.argsort(-lengths, kind="stable")
    batches, current, width = [], [], 0
    for index in order.tolist():
        width = width or int(lengths[index])  # the first (longest) sample fixes the padded width
        if current and (len(current) + 1) * width > batch_tokens:
            batches.append(np.asarray(current))
            current, width = [], int(lengths[index])
        current.append(index)
    if current:
        batches.append(np.asarray(current))
    return batches
