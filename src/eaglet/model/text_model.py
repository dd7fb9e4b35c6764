"""A multimodal wrapper's language model, loaded alone by transformers.

Kimi-K2.5 ships as ``KimiK25ForConditionalGeneration`` (model_type ``kimi_k25``): a vision tower and projector
beside a DeepseekV3 language model whose weights sit under ``language_model.``. transformers has no class for the
wrapper (only the model's own code does), but it has one for the language model, which is all eaglet runs (draft
features are text features). So where the wrapper's model_type has no causal-LM class here, its ``text_config``
names a class transformers has, and the checkpoint keeps that model's weights under one prefix, eaglet loads that
class from ``text_config`` with the prefix mapped away (``from_pretrained(key_mapping=...)``); the vision weights are
left unread. The engine's own route (vLLM) loads the wrapper language-only instead (``model.vllm_engine``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EMBEDDING_SUFFIX = "model.embed_tokens.weight"  # the language model's embedding, under the wrapper's prefix
NOT_CLASS_FIELDS = ("architectures", "model_type", "auto_map")  # config.json's fields no config class takes


@dataclass(frozen=True)
class WrappedLanguageModel:
    """The language model inside a wrapper checkpoint: transformers' class for it and the prefix of its weights."""

    architecture: str  # the text_config's class, e.g. DeepseekV3ForCausalLM
    prefix: str | None  # e.g. "language_model."; None: not known yet (a config.json without weights, planned)

    def key_mapping(self) -> dict[str, str]:
        """``from_pretrained``'s renaming: the checkpoint's ``{prefix}model.*`` become the class's ``model.*``."""
        assert self.prefix is not None, "a target without weights is planned, never loaded"
        return {f"^{re.escape(self.prefix)}": ""}

    def config(self, text_config: dict[str, Any]) -> Any:
        """The class's config from the wrapper's ``text_config`` (as ``read_config`` flattens it, its quantization
        config included)."""
        import transformers

        cls = getattr(transformers, self.architecture)
        return cls.config_class(**{key: value for key, value in text_config.items() if key not in NOT_CLASS_FIELDS})

    def model_class(self) -> Any:
        import transformers

        return getattr(transformers, self.architecture)


def wrapped_language_model(raw_config: dict[str, Any], weight_names: list[str] | None) -> WrappedLanguageModel | None:
    """The wrapper's language model transformers loads alone (``raw_config``: config.json as written), or None when
    the config is no wrapper, its text class is not one of transformers', or its weights are not under one prefix
    (``weight_names`` None: a config.json alone, whose weights are judged when they are there)."""
    import transformers

    text = raw_config.get("text_config")
    if not isinstance(text, dict):
        return None
    architecture = next(iter(text.get("architectures") or []), None)
    if not isinstance(architecture, str) or not hasattr(transformers, architecture):
        return None
    if weight_names is None:
        return WrappedLanguageModel(architecture, None)
    prefixes = {name[: -len(EMBEDDING_SUFFIX)] for name in weight_names if name.endswith(EMBEDDING_SUFFIX)}
    if len(prefixes) != 1:
        return None
    prefix = prefixes.pop()
    return WrappedLanguageModel(architecture, prefix) if prefix else None


def target_language_model(target_path: Path) -> WrappedLanguageModel | None:
    """``wrapped_language_model`` of a target directory (its config.json and weight names; no weights read)."""
    from .target import raw_config, weight_locations

    has_weights = any(target_path.glob("*.safetensors"))
    return wrapped_language_model(raw_config(target_path), list(weight_locations(target_path)) if has_weights else None)
