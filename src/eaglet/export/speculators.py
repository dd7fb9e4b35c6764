"""The speculators format: ``Eagle3Speculator`` with the speculators library's own parameter names (``layers.0.*``
for the first decoder layer) and the target's embedding (``embed_tokens.weight``: its model has no other source),
plus ``speculators_config`` naming the verifier and the proposal method (vLLM serves it directly)."""

from __future__ import annotations

from typing import Any

from .spec import ExportFormat, eagle3_fields, llama_fields

VERSION = "0.9.0"  # the speculators release whose config format this writes
EMBEDDING_NAME = "embed_tokens.weight"


def serving_config(config: dict[str, Any], verifier: str, speculative_tokens: int) -> dict[str, Any]:
    return {  # no top-level model_type: vLLM recognises the format by `speculators_config` only without one
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": VERSION,
        **eagle3_fields(config),
        "eagle_aux_hidden_state_layer_ids": list(config["eagle_aux_hidden_state_layer_ids"]),
        "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **llama_fields(config)},
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {"name_or_path": verifier, "architectures": config.get("target", {}).get("architectures", [])},
        },
    }


def serve_command(verifier: str, speculative_tokens: int, path: str) -> str:
    return f"vllm serve {path}   # vLLM reads the verifier and the proposal method from config.json"


FORMAT = ExportFormat(
    name="speculators",
    engines=("vllm", "speculators"),
    readers=("vllm",),
    serving_config=serving_config,
    serve_command=serve_command,
    first_layer_prefix="layers.0.",
    carries_embedding=True,
    library_check="speculators",
)
