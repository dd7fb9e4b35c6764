"""`eaglet export`: a trained draft as the directory vLLM, SGLang or speculators load.

Every format is ``config.json`` + ``model.safetensors`` (bf16 weights; ``d2t`` int64, ``t2d`` bool)
under the serving names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), plus a
``README.md`` model card. What differs is the config, each written for the loader it names:

- vllm: ``LlamaForCausalLMEagle3`` read by vllm/model_executor/models/llama_eagle3.py
  (``Eagle3LlamaForCausalLM``; vLLM main as of 2026-11: ``midlayer.`` -> ``layers.0.``, ``d2t`` ->
  ``draft_id_to_target_id``, ``t2d`` skipped, embedding shared with the target when absent; deeper drafts'
  ``layers.{i}`` for i >= 1 are plain Llama layers over the hidden state, as vLLM 0.33 builds them). Aux ids
  top-level as ``eagle_aux_hidden_state_layer_ids`` in vLLM's convention (= eaglet's: input of layer i).
- sglang: the same architecture for sglang/srt/models/llama_eagle3.py; SGLang captures the output of
  layer ``j`` for an explicit id ``j`` (it adds one), so ids are written as ``i - 1`` under ``eagle_config``.
- speculators: ``speculators_model_type: eagle3`` with ``transformer_layer_config``, ``speculators_config``
  (proposal methods with ``speculative_tokens``, the verifier), as vllm/transformers_utils/configs/
  speculators/base.py reads it (``norm_before_residual`` defaults to true there, so it is always written).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .draft import DRAFT_CONFIG_FILE, DRAFT_WEIGHTS_FILE
from .errors import EagletError
from .fsio import atomic_directory, read_json, write_json_atomic
from .layers import to_sglang_layer_ids

FORMATS = ("vllm", "sglang", "speculators")
SERVING_DTYPE = torch.bfloat16
SPECULATORS_VERSION = "0.9.0"
DEFAULT_SPECULATIVE_TOKENS = 3


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
    if fmt == "vllm":
        return {"architectures": ["LlamaForCausalLMEagle3"], **_llama_fields(config), **eagle3,
                "eagle_aux_hidden_state_layer_ids": ids}
    if fmt == "sglang":
        return {"architectures": ["LlamaForCausalLMEagle3"], **_llama_fields(config), **eagle3,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(to_sglang_layer_ids(tuple(ids))),
                                 "use_aux_hidden_state": True}}
    if fmt == "speculators":
        return {
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
    raise EagletError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")


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


def model_card(fmt: str, config: dict[str, Any], verifier: str, speculative_tokens: int, report: dict | None) -> str:
    measured = "not measured yet (run `eaglet eval`)"
    if report:
        measured = (f"τ = {report['acceptance_length']:.2f} accepted tokens per target forward, speedup "
                    f"{report['speedup']:.2f}× ({report['settings']['mode']}, measured by `eaglet eval` on "
                    f"{report['settings']['device']})")
    serve = serve_command(fmt, verifier, speculative_tokens)
    ids = config["eagle_aux_hidden_state_layer_ids"]
    return f"""# EAGLE-3 draft for {verifier} ({fmt} format)

Trained with eaglet. One Llama-style decoder layer over the target's aux hidden states
(eaglet/vLLM layer ids {ids}: the inputs of those decoder layers), draft vocabulary of
{config['draft_vocab_size']:,} of the target's {config['vocab_size']:,} tokens.

Acceptance: {measured}.

## Serve

```bash
{serve}
```
"""


def export_draft(draft_dir: str | Path, fmt: str, out: str | Path, verifier: str | None = None,
                 speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS, report_path: str | Path | None = None,
                 overwrite: bool = False) -> Path:
    from safetensors.torch import load_file, save_file

    draft_dir, out = Path(draft_dir), Path(out)
    if fmt not in FORMATS:
        raise EagletError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if not (draft_dir / DRAFT_CONFIG_FILE).is_file() or not (draft_dir / DRAFT_WEIGHTS_FILE).is_file():
        raise EagletError(f"{draft_dir}: not a draft (needs {DRAFT_CONFIG_FILE} and {DRAFT_WEIGHTS_FILE}); run `eaglet train`")
    if out.exists() and not overwrite:
        raise EagletError(f"{out}: already exists; pass --overwrite or choose another --out")
    config = read_json(draft_dir / DRAFT_CONFIG_FILE)
    if fmt == "sglang" and config.get("num_hidden_layers", 1) > 1:
        raise EagletError(f"{draft_dir}: a {config['num_hidden_layers']}-layer draft; SGLang's llama_eagle3 loads one "
                          "decoder layer (midlayer) only: export --format vllm or speculators, or train with --draft-layers 1")
    verifier = verifier or config.get("target", {}).get("name") or "TARGET"
    report = read_json(report_path) if report_path and Path(report_path).is_file() else None
    weights = load_file(str(draft_dir / DRAFT_WEIGHTS_FILE))
    serving = {k: (v.to(SERVING_DTYPE) if v.is_floating_point() else v) for k, v in weights.items()}
    with atomic_directory(out, overwrite=overwrite) as tmp:
        save_file(serving, str(tmp / DRAFT_WEIGHTS_FILE), metadata={"format": "pt"})
        write_json_atomic(tmp / DRAFT_CONFIG_FILE, serving_config(config, fmt, verifier, speculative_tokens))
        (tmp / "README.md").write_text(model_card(fmt, config, verifier, speculative_tokens, report), encoding="utf-8")
        write_json_atomic(tmp / "eaglet_draft.json", config)  # eaglet's own config, for round trips
    return out
