"""Drafts made elsewhere: an EAGLE-3 directory in vLLM's and SGLang's layout (``LlamaForCausalLMEagle3``: EAGLE's own
releases, SpecForge's) or a speculators save (``Eagle3Speculator``), read as eaglet's ``DraftConfig`` so that `eaglet
eval` measures it and `eaglet train --init-from` starts from it.

Each setting is read the way the serving engines read it (vLLM's ``llama_eagle3`` and its speculators converter):
sizes from the layer config (``transformer_layer_config`` in a speculators save); aux layer ids from the top level
(vLLM's convention, eaglet's: the input of layer i), else ``eagle_config``'s plus one (SGLang's), else the target's
defaults; ``norm_before_residual`` absent means False in vLLM's layout and True in a speculators save (vLLM's
converter); the EAGLE 3.1 norms where stated. What eaglet's draft cannot run (another layer type, biases, another
activation) is refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import EagletError
from .layers import default_aux_layer_ids

SPECULATORS_MARK = "speculators_config"  # only a speculators save has it (what vLLM recognises the format by)
FOREIGN_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator", "Eagle3DraftModel")
EAGLET_MARK = "aux_layer_convention"  # eaglet's own draft config has it
NORM_BEFORE_RESIDUAL_ABSENT = {"vllm": False, "speculators": True}  # as vLLM reads each layout


def exported_format_name(fields: dict[str, Any]) -> str:
    """The format a draft directory's config.json is in, as an engine recognises it (vLLM and SGLang read one)."""
    return "speculators" if SPECULATORS_MARK in fields else "vllm"


def is_made_elsewhere(fields: dict[str, Any]) -> bool:
    architectures = fields.get("architectures")
    named = isinstance(architectures, list) and any(name in FOREIGN_ARCHITECTURES for name in architectures)
    return EAGLET_MARK not in fields and (named or fields.get("speculators_model_type") == "eagle3")


def _verifier_name(fields: dict[str, Any]) -> str | None:
    speculators = fields.get(SPECULATORS_MARK)
    verifier = speculators.get("verifier") if isinstance(speculators, dict) else None
    name = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    return name if isinstance(name, str) and name else None


def _aux_layer_ids(fields: dict[str, Any], target_layers: int | None, config_file: Path) -> list[int]:
    ids = fields.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        nested = fields.get("eagle_config")
        sglang_ids = nested.get("eagle_aux_hidden_state_layer_ids") if isinstance(nested, dict) else None
        if isinstance(sglang_ids, list) and sglang_ids and all(type(i) is int for i in sglang_ids):
            ids = [i + 1 for i in sglang_ids]  # SGLang captures the output of layer i: the input of layer i + 1
    if not ids:
        if target_layers is None:
            raise EagletError(
                f"{config_file}: names no aux layer ids (the engines take the target's defaults); pass --target "
                "so eaglet takes the same"
            )
        return list(default_aux_layer_ids(target_layers))
    if not (isinstance(ids, list) and all(type(i) is int for i in ids)):
        raise EagletError(f"{config_file}: eagle_aux_hidden_state_layer_ids {ids!r} is not a list of integers")
    return ids


def _rope(layer: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers 4's fields or 5's ``rope_parameters``."""
    parameters = layer.get("rope_parameters") if isinstance(layer.get("rope_parameters"), dict) else {}
    theta = layer.get("rope_theta") or parameters.get("rope_theta") or 10000.0
    scaling = layer.get("rope_scaling")
    if not scaling and parameters.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
    return float(theta), dict(scaling) if scaling else None


def foreign_draft_fields(fields: dict[str, Any], config_file: Path, target_layers: int | None) -> dict[str, Any]:
    """The ``DraftConfig`` fields of a draft made elsewhere (validated by the caller, as every draft config is)."""
    layer = fields.get("transformer_layer_config", fields)
    if not isinstance(layer, dict):
        raise EagletError(f"{config_file}: 'transformer_layer_config' is not an object")
    layer_type = layer.get("model_type", "llama")
    if layer_type != "llama":
        raise EagletError(
            f"{config_file}: a draft of {layer_type} layers; eaglet's draft (and vLLM's llama_eagle3) is Llama's layer"
        )
    unsupported = [key for key in ("attention_bias", "mlp_bias") if layer.get(key)]
    if unsupported or layer.get("hidden_act", "silu") != "silu":
        found = unsupported[0] if unsupported else f"hidden_act {layer.get('hidden_act')!r}"
        raise EagletError(f"{config_file}: {found}; eaglet's draft has no biases and a SiLU MLP")
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in layer]
    if missing:
        raise EagletError(f"{config_file}: no {missing[0]!r} (every engine builds the draft's layers from it)")
    fmt = exported_format_name(fields)
    hidden, heads = layer["hidden_size"], layer["num_attention_heads"]
    theta, scaling = _rope(layer)
    verifier = _verifier_name(fields)
    nested = fields.get("eagle_config") if isinstance(fields.get("eagle_config"), dict) else {}
    target: dict[str, Any] = {"name": verifier or "?", "made_elsewhere": fmt}
    if verifier:
        target["hub_id"] = verifier
    if target_layers is not None:
        target["num_layers"] = target_layers
    return {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": layer.get("num_key_value_heads") or heads,
        "head_dim": layer.get("head_dim") or (hidden // heads if type(hidden) is int and type(heads) is int else 0),
        "intermediate_size": layer["intermediate_size"],
        "vocab_size": layer["vocab_size"],
        "draft_vocab_size": fields.get("draft_vocab_size") or layer["vocab_size"],
        "target_hidden_size": fields.get("target_hidden_size") or hidden,
        "eagle_aux_hidden_state_layer_ids": _aux_layer_ids(fields, target_layers, config_file),
        "rms_norm_eps": float(layer.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": layer.get("max_position_embeddings", 4096),
        "num_hidden_layers": layer.get("num_hidden_layers", 1),
        "norm_before_residual": fields.get("norm_before_residual", NORM_BEFORE_RESIDUAL_ABSENT[fmt]),
        "fc_norm": bool(fields.get("fc_norm") or fields.get("use_aux_norm")),  # SGLang's older name
        "norm_before_fc": bool(nested.get("norm_before_fc", fields.get("norm_before_fc", False))),
        "norm_output": bool(fields.get("norm_output", False)),
        "target": target,
    }
