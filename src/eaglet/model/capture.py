"""Capture EAGLE-3 features from a target's forward pass: ``aux`` (three layer inputs) and ``last``.

``aux[:, k]`` is the hidden state entering decoder layer ``layer_ids[k]`` (= HF ``hidden_states[i]``)
and ``last`` is the base model's final-normed output (= ``last_hidden_state``), so the teacher's
logits are ``lm_head(last)``. Forward pre-hooks grab the three tensors as they pass; ``output_hidden_states`` does
not run (no other layer's activations stay alive) and the forward's LM head sees one position only: the target's
argmax at every token (``target_argmax``) is taken from ``last`` a chunk at a time.
"""

from __future__ import annotations

import inspect
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from ..errors import EagletError
from .placement import full, input_device

LAST = -1  # where the base model's output is kept among the captured tensors


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
    """Run the model once and return ``aux`` [B, S, 3, H] and ``last`` [B, S, H].

    The whole model is called (its own pre-forward hooks run: compressed-tensors decompresses a quantized checkpoint
    on the first call), with the LM head on one position only where the architecture allows (``logits_to_keep``);
    ``last`` is the base model's output, taken by a forward hook.

    Calls are serialised: the hooks sit on the shared model, so two concurrent forwards (online training's prefetch
    thread and the held-out evaluation) would each capture the other's tensors."""

    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...]):
        self.model = model
        self.base = base_model_of(model)
        self.layers = decoder_layers(model)
        self.input_device = input_device(model)  # where input ids go; the features come back on the last layer's
        self.layer_ids = tuple(layer_ids)
        if max(self.layer_ids) >= len(self.layers) or min(self.layer_ids) < 0:
            raise EagletError(f"aux layer ids {list(layer_ids)} out of range for {len(self.layers)} decoder layers")
        takes = inspect.signature(model.forward).parameters
        self.head_kwargs = {"logits_to_keep": 1} if "logits_to_keep" in takes else {}
        self.forward_lock = threading.Lock()

    @contextmanager
    def hooks(self, captured: dict[int, torch.Tensor]) -> Iterator[None]:
        """While active, every forward of the model leaves the aux layers' inputs in ``captured[slot]``; holds the
        capture's lock, so one forward at a time fills one dict."""

        def grab(slot: int):
            def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
                captured[slot] = args[0] if args else kwargs["hidden_states"]

            return hook

        with self.forward_lock:
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

        def base_output(module: nn.Module, args: tuple, output: Any) -> None:
            captured[LAST] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

        with self.hooks(captured):
            handle = self.base.register_forward_hook(base_output)
            try:
                self.model(
                    input_ids=input_ids.to(self.input_device),
                    attention_mask=attention_mask,
                    use_cache=False,
                    **self.head_kwargs,
                )
            finally:
                handle.remove()
        last = full(captured[LAST])  # [B, S, H]
        # a split target's aux layers sit on earlier devices: gathered where ``last`` is
        aux = torch.stack([full(captured[slot]).to(last.device) for slot in range(len(self.layer_ids))], dim=2)
        return aux, last  # [B, S, 3, H], [B, S, H]


def teacher_logits(model: nn.Module, last: torch.Tensor) -> torch.Tensor:
    """The target's logits from its final-normed hidden state: ``lm_head(last)``, soft-capped where the
    architecture caps (Gemma 2/3), exactly as the model's own forward does."""
    logits = model.get_output_embeddings()(last)
    config = getattr(model.config, "text_config", None) or model.config
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


ARGMAX_CHUNK_TOKENS = 1024  # tokens whose full-vocabulary logits are alive at once (1024 x 128k bf16: 256 MB)


@torch.inference_mode()
def target_argmax(model: nn.Module, last: torch.Tensor) -> torch.Tensor:
    """last [T, H] -> the target's argmax token over its whole vocabulary at each position [T] int32, its logits made
    a chunk of tokens at a time. Stored by extraction, it spares every training step the LM head over the whole
    vocabulary (the draft-vocabulary logits are a quarter of it at a 128k vocabulary)."""
    return torch.cat([teacher_logits(model, chunk).argmax(-1).int() for chunk in last.split(ARGMAX_CHUNK_TOKENS)])


def right_padded(tokens_of: Callable[[int], np.ndarray], lengths: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """The token ids of a length bucket ([len(batch), longest] int64, zeros after each sample's end): sample
    ``index`` of ``batch`` is ``tokens_of(index)`` cut to ``lengths[index]``. Causal attention keeps the padding out
    of every real token's features."""
    padded = np.zeros((len(batch), int(lengths[batch].max())), dtype=np.int64)
    for row, index in enumerate(batch.tolist()):
        padded[row, : lengths[index]] = tokens_of(index)[: lengths[index]]
    return padded


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
