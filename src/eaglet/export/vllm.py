"""The vLLM format: ``LlamaForCausalLMEagle3`` under the serving names (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``), served with ``--speculative-config``."""

from __future__ import annotations

from .spec import ExportFormat, llama_eagle3_config


def serve_command(verifier: str, speculative_tokens: int, path: str) -> str:
    return (
        f'vllm serve {verifier} \\\n  --speculative-config \'{{"method": "eagle3", "model": "{path}", '
        f'"num_speculative_tokens": {speculative_tokens}}}\''
    )


FORMAT = ExportFormat(
    name="vllm",
    engines=("vllm",),
    readers=("vllm", "sglang"),  # the directory is the SGLang one too: both engines' loaders are run on it
    serving_config=llama_eagle3_config,
    serve_command=serve_command,
)
