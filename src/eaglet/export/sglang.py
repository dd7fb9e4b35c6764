"""The SGLang format: the vLLM directory (SGLang reads ``eagle_config``'s layer ids), served by
``sglang.launch_server --speculative-algorithm EAGLE3``; its ``llama_eagle3`` loads one decoder layer."""

from __future__ import annotations

from .spec import ExportFormat, llama_eagle3_config


def serve_command(verifier: str, speculative_tokens: int, path: str) -> str:
    return (
        f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 \\\n"
        f"  --speculative-draft-model-path {path} --speculative-num-steps {speculative_tokens} \\\n"
        f"  --speculative-eagle-topk 1 --speculative-num-draft-tokens {speculative_tokens + 1}"
    )


FORMAT = ExportFormat(
    name="sglang",
    engines=("sglang",),
    readers=("vllm", "sglang"),
    serving_config=llama_eagle3_config,
    serve_command=serve_command,
    max_draft_layers=1,
)
