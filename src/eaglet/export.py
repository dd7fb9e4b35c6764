"""`eaglet export`: a trained draft as the directory vLLM, SGLang or speculators load.

Every format is ``config.json`` + ``model.safetensors`` (bf16 weights) + a ``README.md`` model card, written
the way its consumer reads it (``eaglet export --check`` runs those readers, see ``eaglet.consumers``):

- vllm / sglang: ``LlamaForCausalLMEagle3`` under the serving names (``fc``, ``midlayer.*``, ``norm``,
  ``lm_head``, ``d2t``, ``t2d``). The two engines read the aux layer ids from different fields and count them
  differently: vLLM takes the top-level ``eagle_aux_hidden_state_layer_ids`` (before ``eagle_config``) as the
  inputs of those layers, SGLang takes only ``eagle_config``'s and adds one. Both directories carry both, so
  either engine pointed at either directory captures the layers the draft was trained on.
- speculators: ``Eagle3Speculator`` with the speculators library's own parameter names (``layers.0.*`` for the
  first decoder layer) and the target's embedding (``embed_tokens.weight``: its model has no other source),
  plus ``speculators_config`` naming the verifier and the proposal method (vLLM serves it directly).

``d2t``/``t2d`` are written only when the draft vocabulary is smaller than the target's: with equal vocabularies
vLLM and speculators build no mapping parameter, and a shipped one fails the load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .formats.draft import (EXPORT_FORMATS, FIRST_LAYER_PREFIX, SPECULATORS_FIRST_LAYER_PREFIX, SPECULATORS_VERSION,
                            read_draft_config)
from .draft import read_draft_weights
from .formats.files import DRAFT_CONFIG_FILE, DRAFT_WEIGHTS_FILE, EXPORTED_DRAFT_CONFIG_FILE, MODEL_CARD_FILE
from .errors import EagletError
from .fsio import atomic_directory, check_output_apart, check_output_dir, load_json_file, write_json_atomic
from .formats.layers import to_sglang_layer_ids

SERVING_DTYPE = torch.bfloat16
DEFAULT_SPECULATIVE_TOKENS = 3
EMBEDDING_NAME = "embed_tokens.weight"
VOCAB_MAPPINGS = ("d2t", "t2d")


def _llama_fields(config: dict[str, Any]) -> dict[str, Any]:
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
        "rope_scaling": config["rope_scaling"],
        "max_position_embeddings": config["max_position_embeddings"],
        "vocab_size": config["vocab_size"],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }


def serving_config(config: dict[str, Any], fmt: str, verifier: str, speculative_tokens: int) -> dict[str, Any]:
    """The config.json of one format, from eaglet's draft config."""
    ids = list(config["eagle_aux_hidden_state_layer_ids"])
    eagle3 = {
        "draft_vocab_size": config["draft_vocab_size"],
        "target_hidden_size": config["target_hidden_size"],
        "norm_before_residual": config["norm_before_residual"],
    }
    if fmt in ("vllm", "sglang"):
        return {"architectures": ["LlamaForCausalLMEagle3"], **_llama_fields(config), **eagle3,
                "eagle_aux_hidden_state_layer_ids": ids,  # vLLM reads this first (input of layer i)
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(to_sglang_layer_ids(tuple(ids))),
                                 "use_aux_hidden_state": True}}  # SGLang reads only this, and adds one
    if fmt == "speculators":
        return {  # no top-level model_type: vLLM recognises the format by `speculators_config` only without one
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            **eagle3,
            "eagle_aux_hidden_state_layer_ids": ids,
            "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **_llama_fields(config)},
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": verifier, "architectures": config.get("target", {}).get("architectures", [])},
            },
        }
    raise EagletError(f"unknown export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}")


def serving_weights(weights: dict[str, torch.Tensor], config: dict[str, Any], fmt: str,
                    embedding: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The draft's tensors under the names ``fmt``'s consumer loads, floating point in bf16."""
    mapped = int(config["draft_vocab_size"]) != int(config["vocab_size"])  # DraftConfig.uses_vocab_mapping
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name in VOCAB_MAPPINGS and not mapped:
            continue
        if fmt == "speculators" and name.startswith(FIRST_LAYER_PREFIX):
            name = SPECULATORS_FIRST_LAYER_PREFIX + name[len(FIRST_LAYER_PREFIX):]
        out[name] = tensor.to(SERVING_DTYPE) if tensor.is_floating_point() else tensor
    if fmt == "speculators":
        if embedding is None:
            raise EagletError("the speculators format carries the target's embedding: the target is needed (--target)")
        out[EMBEDDING_NAME] = embedding.to(SERVING_DTYPE).contiguous()
    return out


def verifier_reference(config: dict[str, Any], override: str | None = None) -> tuple[str, str]:
    """How exported configs name the target: (name_or_path, how it was chosen). A hub id where one is known
    (portable); the local directory otherwise (works on this machine only)."""
    target = config.get("target", {})
    if override:
        return override, "given with --verifier"
    if target.get("hub_id"):
        return target["hub_id"], "the target's hub id"
    if target.get("path"):
        return target["path"], ("a local path: this export is not portable; re-export with --verifier ORG/NAME "
                                "(the hub id) to serve it elsewhere")
    return target.get("name") or "TARGET", "the target's name (no hub id or path recorded)"


def serve_command(fmt: str, verifier: str, speculative_tokens: int, path: str = "PATH/TO/THIS/DIR") -> str:
    """The shell command that serves an exported draft (``path``) with its verifier in the format's engine."""
    return {
        "vllm": (f"vllm serve {verifier} \\\n  --speculative-config '{{\"method\": \"eagle3\", \"model\": \"{path}\", "
                 f"\"num_speculative_tokens\": {speculative_tokens}}}'"),
        "speculators": f"vllm serve {path}   # vLLM reads the verifier and the proposal method from config.json",
        "sglang": (f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 \\\n"
                   f"  --speculative-draft-model-path {path} --speculative-num-steps {speculative_tokens} \\\n"
                   f"  --speculative-eagle-topk 1 --speculative-num-draft-tokens {speculative_tokens + 1}"),
    }[fmt]


def model_card(fmt: str, config: dict[str, Any], verifier: tuple[str, str], speculative_tokens: int,
               report: dict | None) -> str:
    measured = "not measured yet (run `eaglet eval`)"
    if report:
        measured = (f"τ = {report['acceptance_length']:.2f} accepted tokens per target forward, speedup "
                    f"{report['speedup']:.2f}× ({report['settings']['mode']}, measured by `eaglet eval` on "
                    f"{report['settings']['device']})")
    name, how = verifier
    serve = serve_command(fmt, name, speculative_tokens)
    ids = config["eagle_aux_hidden_state_layer_ids"]
    embedding = ("\nIt carries the target's embedding (`embed_tokens.weight`), which the speculators model needs.\n"
                 if fmt == "speculators" else "")
    source = config.get("target", {}).get("source")
    trained_on = f"\nTrained on the features of {source}.\n" if source else ""
    return f"""# EAGLE-3 draft for {name} ({fmt} format)

Trained with eaglet. One Llama-style decoder layer over the target's aux hidden states
(eaglet/vLLM layer ids {ids}: the inputs of those decoder layers), draft vocabulary of
{config['draft_vocab_size']:,} of the target's {config['vocab_size']:,} tokens.
{embedding}{trained_on}
Verifier: `{name}` ({how}).

Acceptance: {measured}.

## Serve

```bash
{serve}
```

`eaglet export --check PATH/TO/THIS/DIR` checks this directory against each engine's released loader.
"""


def _target_embedding(config: dict[str, Any], target: str | None) -> torch.Tensor:
    """The target's input embedding, from ``target`` or the target the draft recorded, checked to be that one."""
    from .target import config_identity, load_head_weights, read_config, resolve_target

    recorded = config.get("target", {})
    spec = target or recorded.get("spec")
    if not spec:
        raise EagletError("the speculators format carries the target's embedding and this draft does not record its "
                          "target: pass --target")
    resolved = resolve_target(spec)
    if recorded.get("config_hash") and config_identity(read_config(resolved.path)) != recorded["config_hash"]:
        raise EagletError(f"--target {spec}: not the target this draft was trained for ({recorded.get('name')}); "
                          "pass that target")
    return load_head_weights(resolved.path).embed


def export_draft(draft_dir: str | Path, fmt: str, out: str | Path, verifier: str | None = None,
                 speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS, report_path: str | Path | None = None,
                 overwrite: bool = False, target: str | None = None) -> Path:
    from .store import write_safetensors

    draft_dir, out = Path(draft_dir), Path(out)
    if fmt not in EXPORT_FORMATS:
        raise EagletError(f"unknown export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    check_output_apart(out, [draft_dir, report_path, target])
    check_output_dir(out)
    stored = read_draft_config(draft_dir)
    config = stored.config.to_dict()
    if out.exists() and not overwrite:
        raise EagletError(f"{out}: already exists; pass --overwrite or choose another --out")
    if fmt == "sglang" and config.get("num_hidden_layers", 1) > 1:
        raise EagletError(f"{draft_dir}: a {config['num_hidden_layers']}-layer draft; SGLang's llama_eagle3 loads one "
                          "decoder layer (midlayer) only: export --format vllm or speculators, or train with --draft-layers 1")
    reference = verifier_reference(config, verifier)
    report = load_json_file(report_path, "pass an `eaglet eval` report.json") if report_path else None
    embedding = _target_embedding(config, target) if fmt == "speculators" else None
    weights = serving_weights(read_draft_weights(draft_dir, stored), config, fmt, embedding)
    with atomic_directory(out, overwrite=overwrite) as tmp:
        write_safetensors(tmp / DRAFT_WEIGHTS_FILE, weights, metadata={"format": "pt"})
        write_json_atomic(tmp / DRAFT_CONFIG_FILE, serving_config(config, fmt, reference[0], speculative_tokens))
        (tmp / MODEL_CARD_FILE).write_text(model_card(fmt, config, reference, speculative_tokens, report), encoding="utf-8")
        write_json_atomic(tmp / EXPORTED_DRAFT_CONFIG_FILE, config | {"export_format": fmt})  # for round trips
    return out
