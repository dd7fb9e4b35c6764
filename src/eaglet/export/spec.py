"""What an export format is, as data: every list of formats (the config's choices, preflight's engines, the
check's readers, the run's serve commands) is read from the registry of these, ``eaglet.export.FORMATS``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ..formats.draft_config import EAGLE_VARIANTS
from ..formats.layers import to_sglang_layer_ids

ServingConfig = Callable[[dict[str, Any], str, int], dict[str, Any]]  # (eaglet's config, verifier, k) -> config.json


@dataclass(frozen=True)
class ExportFormat:
    name: str
    engines: tuple[str, ...]  # the releases preflight asks about (`--engine`, installed packages)
    readers: tuple[str, ...]  # the engine loaders `eaglet export --check` runs on the directory
    serving_config: ServingConfig
    serve_command: Callable[[str, int, str], str]  # (verifier, speculative tokens, directory) -> shell command
    first_layer_prefix: str = "midlayer."  # what this format calls the draft's decoder layer 0
    carries_embedding: bool = False  # the target's input embedding ships with the draft
    max_draft_layers: int | None = None  # the decoder layers its engine loads; None: any
    library_check: str | None = None  # a Python library that loads the directory for real (consumers/)

    def serving_name(self, name: str, eaglet_prefix: str) -> str:
        """eaglet's tensor name -> this format's (only the first layer's prefix differs between formats)."""
        if name.startswith(eaglet_prefix):
            return self.first_layer_prefix + name[len(eaglet_prefix) :]
        return name

    def eaglet_name(self, name: str, eaglet_prefix: str) -> str:
        """This format's tensor name -> eaglet's: ``serving_name`` undone."""
        if name.startswith(self.first_layer_prefix):
            return eaglet_prefix + name[len(self.first_layer_prefix) :]
        return name


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``factor`` times (transformers' and vLLM's formula)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """The cos/sin scale transformers' YaRN gives (and eaglet's draft trains with): ``attention_factor`` when stated,
    else DeepSeek's ratio of ``mscale`` to ``mscale_all_dim`` when both are there, else the plain correction."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


def serving_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """The draft's ``rope_scaling`` as every engine reads it the way eaglet trained it. A YaRN scaling carries its
    cos/sin scale outright: ``attention_factor`` (transformers', vLLM >= 0.27's) and ``attn_factor`` (vLLM <= 0.26's
    YaRN, which ignores DeepSeek's ``mscale``/``mscale_all_dim`` and multiplies ``yarn_mscale(factor)`` by it):
    Kimi-K2's scaling (factor 64, mscale = mscale_all_dim = 1) trains at 1.0 and served by vLLM 0.25 without it at
    1.416, its attention logits twice as sharp."""
    if not scaling or (scaling.get("rope_type") or scaling.get("type")) != "yarn":
        return scaling
    attention = yarn_attention_factor(scaling)
    return scaling | {"attention_factor": attention, "attn_factor": attention / yarn_mscale(float(scaling["factor"]))}


def llama_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The Llama decoder settings every format's config carries, from eaglet's draft config."""
    return {
        "model_type": "llama",
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config["num_key_value_heads"],
        "head_dim": config["head_dim"],
        "num_hidden_layers": config["num_hidden_layers"],
        "hidden_act": config["hidden_act"],
        "rms_norm_eps": config["rms_norm_eps"],
        "rope_theta": config["rope_theta"],
        "rope_scaling": serving_rope_scaling(config["rope_scaling"]),
        "max_position_embeddings": config["max_position_embeddings"],
        "vocab_size": config["vocab_size"],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }


def eagle3_fields(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "draft_vocab_size": config["draft_vocab_size"],
        "target_hidden_size": config["target_hidden_size"],
        "norm_before_residual": config["norm_before_residual"],
        # EAGLE 3.1's settings under the names vLLM (top level, and speculators' converter), SGLang and speculators read
        **{name: config[name] for name in EAGLE_VARIANTS["3"]},
    }


def llama_eagle3_config(config: dict[str, Any], verifier: str, speculative_tokens: int) -> dict[str, Any]:
    """``LlamaForCausalLMEagle3``, read by vLLM and SGLang alike. The engines read the aux layer ids from different
    fields and count them differently: vLLM takes the top-level ``eagle_aux_hidden_state_layer_ids`` (before
    ``eagle_config``) as the inputs of those layers, SGLang takes only ``eagle_config``'s and adds one. The
    directory carries both, so either engine captures the layers the draft was trained on."""
    ids = list(config["eagle_aux_hidden_state_layer_ids"])
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **llama_fields(config),
        **eagle3_fields(config),
        "eagle_aux_hidden_state_layer_ids": ids,  # vLLM reads this first (input of layer i)
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(to_sglang_layer_ids(tuple(ids))),
            "use_aux_hidden_state": True,
        },
    }  # SGLang reads only this, and adds one
