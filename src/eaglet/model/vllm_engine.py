"""vLLM's public offline route to a target's hidden states, for `eaglet extract --backend vllm`.

``LLM`` with the ``extract_hidden_states`` speculative method captures the states entering the requested decoder
layers into a cache-only attention layer (vLLM's layer ids are eaglet's, ``formats.layers``), and vLLM's own
``ExampleHiddenStatesConnector`` writes each finished request's ``hidden_states`` [tokens, layers, H] and
``token_ids`` to a safetensors file in a spool folder, guarded by a lock file until the write is done. vLLM loads the
checkpoint natively (compressed-tensors INT4, FP8, MoE experts) and splits it over ``tensor_parallel_size`` GPUs
itself; only its rank 0 writes.

Layer id ``num_layers`` is the last decoder layer's output before the final norm: eaglet's ``last`` is that
passed through the target's own norm (``model.final_norm``), as the hf backend's ``last_hidden_state`` is.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import EagletError

CONNECTOR = "ExampleHiddenStatesConnector"  # vLLM's connector for the extract_hidden_states method
TESTED_VLLM = ("0.24.0", "0.33.0")  # releases whose source eaglet's calls are checked against (tests/)
GENERATED_TOKENS = 1  # a request runs its prefill and samples one token: the prompt's states are the product
SPOOL_WAIT_S = 600.0  # longest wait for the connector to write one finished request's file
SPOOL_POLL_S = 0.005


def captured_layers(aux_layer_ids: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """The layer ids vLLM is asked for: the aux ids ascending (vLLM appends its captures in layer order, whatever
    order the config lists them in), then ``num_layers``, the last layer's un-normed output."""
    if len(set(aux_layer_ids)) != len(aux_layer_ids):
        raise EagletError(f"aux layer ids {list(aux_layer_ids)} repeat a layer; give distinct ids")
    return (*sorted(aux_layer_ids), num_layers)


def aux_columns(aux_layer_ids: tuple[int, ...]) -> list[int]:
    """Where each aux id (in eaglet's order) sits among the captured columns ``captured_layers`` asks for."""
    ascending = sorted(aux_layer_ids)
    return [ascending.index(layer) for layer in aux_layer_ids]


@dataclass(frozen=True)
class EngineSettings:
    """What the vLLM engine is opened with; every field is one of ``LLM``'s (checked by ``eaglet preflight``)."""

    model: str
    aux_layer_ids: tuple[int, ...]
    num_layers: int
    spool: Path
    tensor_parallel_size: int
    dtype: str
    max_model_len: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    trust_remote_code: bool
    seed: int = 0
    enforce_eager: bool = False  # compiled and CUDA-graphed, as vLLM serves


# vLLM's DeepseekV2/V3 (and Kimi-K2's) MoE gate has the routing score-correction bias only when config.json says
# `"topk_method": "noaux_tc"` (vllm/model_executor/models/deepseek_v2.py); transformers' config does not write it
ROUTER_BIAS_SUFFIX = "mlp.gate.e_score_correction_bias"
ROUTER_BIAS_METHOD = "noaux_tc"


def config_problem(target_path: Path) -> str | None:
    """What vLLM's loader would refuse in this checkpoint, known from config.json and the weights' names (seconds,
    before an engine starts), or None."""
    from .sizing import text_config
    from .target import read_config, weight_locations

    config = text_config(read_config(target_path))
    if config.get("topk_method") == ROUTER_BIAS_METHOD:
        return None
    if not any(name.endswith(ROUTER_BIAS_SUFFIX) for name in weight_locations(target_path)):
        return None
    return (
        f"target {target_path}: its checkpoint has the MoE router's {ROUTER_BIAS_SUFFIX} but config.json does not "
        f'say "topk_method": "{ROUTER_BIAS_METHOD}", so vLLM builds the router without it and refuses the load '
        f'(KeyError); add "topk_method": "{ROUTER_BIAS_METHOD}" to config.json (DeepSeek-V3\'s and Kimi-K2\'s have it)'
    )


def vllm_version() -> str | None:
    """The installed vLLM's version, read from its metadata (no import: ``import vllm`` takes seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


class HiddenStateEngine:
    """A vLLM engine that turns token sequences into their captured hidden states."""

    def __init__(self, settings: EngineSettings):
        try:
            from vllm import LLM, SamplingParams
            from vllm.config import KVTransferConfig
        except ImportError as exc:
            raise EagletError(
                f"--backend vllm: vLLM does not import here ({exc}); install vllm (README, 'GPU checks')"
            ) from None
        self.settings = settings
        # eaglet has touched CUDA by now (the final norm, the device): vLLM's engine process must not be forked
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        transfer = KVTransferConfig(
            kv_connector=CONNECTOR,
            kv_role="kv_producer",
            kv_connector_extra_config={"shared_storage_path": str(settings.spool)},
        )
        try:
            self.llm = LLM(
                model=settings.model,
                skip_tokenizer_init=True,  # eaglet sends token ids; vLLM never tokenizes or detokenizes
                trust_remote_code=settings.trust_remote_code,
                tensor_parallel_size=settings.tensor_parallel_size,
                dtype=settings.dtype,
                seed=settings.seed,
                gpu_memory_utilization=settings.gpu_memory_utilization,
                enforce_eager=settings.enforce_eager,
                max_model_len=settings.max_model_len,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                enable_prefix_caching=False,  # every token's states are computed, none reused from another request
                enable_chunked_prefill=False,  # the connector saves a request whose prompt ran in one step
                speculative_config={
                    "method": "extract_hidden_states",
                    "num_speculative_tokens": 1,
                    "draft_model_config": {
                        "hf_config": {
                            "eagle_aux_hidden_state_layer_ids": list(
                                captured_layers(settings.aux_layer_ids, settings.num_layers)
                            )
                        }
                    },
                },
                kv_transfer_config=transfer,
            )
        except (ValueError, RuntimeError, OSError) as exc:  # vLLM's own refusals: a length, a kernel, memory
            said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise EagletError(f"vLLM could not start on {settings.model}: {said}") from None
        self.sampling = SamplingParams(max_tokens=GENERATED_TOKENS, temperature=0.0, detokenize=False)

    def run(self, token_lists: list[list[int]]) -> list[Path]:
        """Every sequence through the target (vLLM batches them); the spool file of each, in input order."""
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in token_lists], self.sampling, use_tqdm=False)
        paths = []
        for output in outputs:
            params: dict[str, Any] = output.kv_transfer_params or {}
            if "hidden_states_path" not in params:
                raise EagletError(
                    f"vLLM returned no hidden-states file for request {output.request_id}; "
                    f"its {CONNECTOR} did not run (check the vLLM version: {', '.join(TESTED_VLLM)} are tested)"
                )
            paths.append(Path(params["hidden_states_path"]))
        return paths


def wait_for_spool(path: Path, timeout_s: float = SPOOL_WAIT_S) -> None:
    """Block until vLLM's writer has released ``path`` (its ``.lock`` file, the connector's protocol), or refuse.

    The connector writes a finished request's file on a later engine step; an engine that stops stepping (its
    engine core run in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) would leave the lock held forever."""
    lock = path.with_name(path.name + ".lock")
    deadline = time.monotonic() + timeout_s
    with open(lock) if lock.exists() else contextlib.nullcontext() as handle:
        while handle is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(handle, fcntl.LOCK_UN)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EagletError(
                        f"{path}: vLLM's connector has not finished writing it after {timeout_s:.0f} s; run vLLM's "
                        "engine core in its own process (unset VLLM_ENABLE_V1_MULTIPROCESSING) and extract again"
                    ) from None
                time.sleep(SPOOL_POLL_S)


def read_spooled(path: Path, token_ids: Any) -> torch.Tensor:
    """One request's captured states [tokens, layers, H], once vLLM's writer released the file; the file is removed.
    Its token ids must be the ones sent: a file of another request is refused, not stored."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    wait_for_spool(path)
    data = load_hidden_states(str(path))
    cleanup_hidden_states(str(path))
    sent = torch.as_tensor(token_ids, dtype=torch.long)
    got = data["token_ids"].long()
    if got.shape != sent.shape or not torch.equal(got, sent):
        raise EagletError(f"{path}: vLLM's hidden states are for other tokens than the request's; extract again")
    return data["hidden_states"]
