"""Stage checks: config, target metadata, layer ids, manifests, disk, memory, output directory, data.

No model weights are loaded: sizes come from safetensors headers and manifests. Each check returns
pass / warn / fail with the fix for anything that is not a pass.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from ..errors import EagletError
from ..fsio import free_disk_bytes
from ..model.sizing import GIB, available_memory

PASS, WARN, FAIL = "pass", "warn", "fail"
DATA_ROWS_CHECKED = 100
ACTIVATION_FACTOR = 12  # bytes of live activations per (token x hidden) in a bf16 forward, rough upper bound
OPTIMIZER_COPIES = 4  # fp32 weights + grads + two AdamW moments
DISK_WARN_SHARE = 0.8  # warn when a stage would fill more than this share of the free disk
MEMORY_WARN_SHARE = 0.9


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    def refusal(self, stage: str) -> str:
        """The one line a failed check stops STAGE with (`eaglet preflight STAGE ...` lists every check)."""
        return f"preflight failed for {stage}: {self.name}: {self.detail}" + (f" ({self.fix})" if self.fix else "")


def guarded(name: str, fn: Callable[[], Check | list[Check]]) -> list[Check]:
    """Run one check; a user error becomes a failed check instead of an exception."""
    try:
        result = fn()
    except EagletError as exc:
        return [Check(name, FAIL, exc.message)]  # eaglet's errors carry their fix
    return result if isinstance(result, list) else [result]


# ---------------------------------------------------------------------------------------------
# Reusable checks


def check_target(spec: str, need_template: bool, trust_remote_code: bool = False) -> tuple[list[Check], Any]:
    """Target resolves, its config and tokenizer read, a chat template exists when the stage needs one."""
    from ..model.target import load_tokenizer, resolve_target, target_info

    try:
        resolved = resolve_target(spec, trust_remote_code)
        info = target_info(resolved, load_tokenizer(resolved.path, trust_remote_code))
    except EagletError as exc:
        return [Check("target", FAIL, exc.message)], None
    checks = [
        Check(
            "target",
            PASS,
            f"{info.name}: {info.architecture}, {info.num_layers} layers, hidden {info.hidden_size}, "
            f"vocab {info.vocab_size:,}, {info.num_parameters:,} parameters",
        )
    ]
    if need_template:
        checks.append(
            Check("chat template", PASS, "present")
            if info.has_chat_template
            else Check(
                "chat template",
                FAIL,
                "the target has no chat template",
                "pass --chat-template FILE.jinja with the template it is served with",
            )
        )
    return checks, (resolved, info)


def check_stage_target(cfg: Any, need_template: bool) -> tuple[list[Check], Any]:
    """check_target for the stage's --target, or the target its input records when none is given."""
    from ..formats.target_record import stage_target

    try:
        spec = stage_target(cfg)
    except EagletError as exc:
        return [Check("target", FAIL, exc.message)], None
    checks, found = check_target(spec, need_template, cfg.trust_remote_code)
    if not cfg.target and found:
        checks[0] = Check("target", checks[0].status, f"{checks[0].detail} (recorded by the input: {spec})")
    return checks, found


def check_fit(
    target_path: Path, cfg: Any, device: str, dtype_bytes: int, forward_tokens: int, cached_tokens: int = 0
) -> list[Check]:
    """From config.json, before any weight loads: the quantization format is one this transformers reads here, the
    architecture has a tensor-parallel plan when asked for one, and the placement fits the GPUs (weights per GPU +
    activations at ``forward_tokens`` + KV cache of ``cached_tokens``); a failure names what to change."""
    import os

    from ..model.placement import causal_lm_problem, check_tp_plan, device_key, offload_problem
    from ..model.sizing import describe_weights, fit_advice, layout, this_machine, weights_of
    from ..model.target import check_quantization, read_config

    config = read_config(target_path)
    checks = []
    try:
        method = check_quantization(config, str(target_path))
    except EagletError as exc:
        return [Check("quantization", FAIL, exc.message)]
    if method:
        checks.append(Check("quantization", PASS, f"{method}: this transformers reads it here"))
    loader = causal_lm_problem(target_path, bool(getattr(cfg, "trust_remote_code", False)))
    if loader:
        return checks + [Check("loader", FAIL, loader)]
    offload = offload_problem(config, cfg)
    if offload:
        return checks + [Check("offload", FAIL, offload)]
    placement = getattr(cfg, "placement", "one")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if placement == "tp":
        try:
            if world < 2:
                raise EagletError(
                    "--placement tp runs under torchrun with 2 or more processes "
                    "(torchrun --nproc-per-node N -m eaglet.cli ...)"
                )
            check_tp_plan(config, world)
        except EagletError as exc:
            return checks + [Check("tensor parallel", FAIL, exc.message)]
    machine = this_machine()
    if machine.gpus == 0 or (not device.startswith("cuda") and placement == "one"):
        return checks  # the CPU's memory: check_memory covers it
    gpus = (
        {"tp": world, "one": 1}.get(placement)
        or sum(isinstance(device_key(name), int) for name in (getattr(cfg, "max_memory", None) or {}))
        or machine.gpus
    )
    weights = weights_of(config, dtype_bytes)
    plan = layout(config, weights, machine, placement, forward_tokens, gpus, cached_tokens)
    detail = (
        f"{placement} over {plan.gpus} x {machine.name}: {plan.weights_per_gpu / GIB:.1f} GiB weights + "
        f"{plan.activations_per_gpu / GIB:.1f} GiB activations per GPU of "
        f"{plan.capacity_per_gpu / GIB:.1f} GiB usable; {describe_weights(weights)}"
    )
    checks.append(
        Check(
            "layout",
            PASS if plan.fits else FAIL,
            detail,
            ""
            if plan.fits
            else "use "
            + fit_advice(config, weights, machine, plan, forward_tokens, cached_tokens, type(cfg).FORWARD_OPTION),
        )
    )
    return checks


def check_max_len(target_path: Path, max_len: int) -> Check:
    """A --max-len given past the target's context: prepare cuts samples at the context instead."""
    from ..model.target import context_length

    context = context_length(target_path)
    if context is not None and max_len > context:
        return Check(
            "context", WARN, f"--max-len {max_len:,} is past the target's context: samples are cut at {context:,}", ""
        )
    return Check("context", PASS, f"--max-len {max_len:,} within the target's context ({context or 'unsaid'})")


def check_prepared_lengths(target_path: Path, longest: int) -> Check:
    """A prepared set's samples within the target's context: past it the target computes features at positions it
    was never trained on, and the draft would learn them (the engine serving it never goes there). `eaglet prepare`
    cuts samples at the context; a set prepared for another target of the same tokenizer may be longer."""
    from ..model.target import context_length

    context = context_length(target_path)
    detail = f"the longest sample is {longest:,} tokens"
    if context is not None and longest > context:
        return Check(
            "context",
            FAIL,
            f"{detail}, past the target's context of {context:,}",
            f"prepare again with this --target: it cuts samples at {context:,} tokens",
        )
    return Check("context", PASS, f"{detail}, within the target's context ({context or 'unsaid'})")


def check_device(requested: str) -> Check:
    """The device exists for this torch (a CPU build has no cuda; tpu is not one eaglet runs on)."""
    from ..model.target import pick_device

    try:
        return Check("device", PASS, pick_device(requested))
    except EagletError as exc:
        return Check("device", FAIL, exc.message)


def check_layers(layers: list[int] | None, num_layers: int) -> Check:
    from ..formats.layers import resolve_aux_layer_ids

    try:
        ids = resolve_aux_layer_ids(layers, num_layers)
    except EagletError as exc:
        return Check("aux layer ids", FAIL, exc.message, f"choose three increasing ids in 1..{num_layers - 1}")
    return Check("aux layer ids", PASS, f"{list(ids)} (input of decoder layer i) of {num_layers}")


def check_rows(paths: Iterable[str], need_assistant: bool, skip_bad: bool = False) -> Check:
    from ..data.readers import BadRow, read_conversations

    checked = 0
    try:
        for item in read_conversations(list(paths)):
            problem = (
                str(item)
                if isinstance(item, BadRow)
                else (f"{item.source}: no assistant turn" if need_assistant and not item.has_assistant else None)
            )
            if problem and skip_bad:
                return Check("data", WARN, problem + " (skipped: --on-bad-row skip)", "")
            if problem:
                return Check("data", FAIL, problem, "fix the row, or pass --on-bad-row skip")
            checked += 1
            if checked >= DATA_ROWS_CHECKED:
                break
    except EagletError as exc:
        return Check("data", FAIL, exc.message)
    return Check("data", PASS, f"first {checked} rows parse")


def check_output_dir(out: Path, overwrite: bool, resumable: bool) -> Check:
    if not out.exists():
        parent = out.parent if out.parent.exists() else Path(".")
        if not os.access(parent, os.W_OK):
            return Check("output", FAIL, f"{parent} is not writable", "choose another --out")
        return Check("output", PASS, f"{out} will be created")
    if resumable:
        return Check("output", PASS, f"{out} exists: the run resumes it if its settings match")
    if overwrite:
        return Check("output", WARN, f"{out} exists and will be replaced (--overwrite)", "")
    return Check("output", FAIL, f"{out} already exists", "pass --overwrite or choose another --out")


def _capacity(name: str, needed: int, available: int, detail: str, warn_share: float, fix: str, warn_fix: str) -> Check:
    """Fail when ``needed`` exceeds ``available``, warn above ``warn_share`` of it."""
    if needed > available:
        return Check(name, FAIL, detail, fix)
    if needed > warn_share * available:
        return Check(name, WARN, detail, warn_fix)
    return Check(name, PASS, detail)


def check_disk(out: Path, needed: int, what: str) -> Check:
    free = free_disk_bytes(out)
    return _capacity(
        "disk",
        needed,
        free,
        f"{what}: ~{needed / GIB:.2f} GiB needed, {free / GIB:.1f} GiB free",
        DISK_WARN_SHARE,
        "free space, choose another --out, or shrink the run",
        "the disk will be nearly full afterwards",
    )


MEMORY_FIX = "use a bigger device, fewer --batch-tokens / --token-budget, or fp8"


def check_memory(device: str, needed: int, what: str, fix: str = MEMORY_FIX) -> Check:
    available, measured = available_memory(device)
    return _capacity(
        "memory",
        needed,
        available,
        f"{what}: ~{needed / GIB:,.2f} GiB needed, {available / GIB:.1f} GiB {measured}",
        MEMORY_WARN_SHARE,
        fix,
        "little headroom left",
    )


def check_vllm_backend(
    target_path: Path,
    config: Any,
    captures: bool = True,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> list[Check]:
    """The checkpoint is one vLLM's loader takes as the stage asks it to hold it (``config``: its ``VllmFields``),
    vLLM is installed, eaglet's calls into it bind to its source, its model for the target captures the layers eaglet
    extracts (``captures``: the extract route, not generation), and the GPUs it would split the target over exist and
    hold it (``max_model_len`` and ``max_num_batched_tokens``: what the stage asks of the engine beyond ``config``;
    None: the config's, else vLLM's default): all before ``import vllm`` (seconds) and its model load (minutes)."""
    from ..model.sizing import this_machine, weights_of
    from ..model.target import raw_config, read_config
    from ..model.vllm_engine import (
        hold_problem,
        installed_cpu_attention_problem,
        vllm_runs_on,
        vllm_version,
    )
    from ..model.vllm_memory import VllmAsk, vllm_layout
    from ..model.vllm_processor import installed_processor_problem
    from ..model.vllm_releases import release_verdict

    tensor_parallel_size = config.tensor_parallel_size

    problem = hold_problem(target_path, config)
    checks = [
        Check("vllm load", FAIL, problem) if problem else Check("vllm load", PASS, "config.json as vLLM reads it")
    ]
    version = vllm_version()
    if version is None:
        return checks + [
            Check(
                "vllm",
                FAIL,
                "--backend vllm: vLLM is not installed",
                "pip install vllm (README, 'GPU checks', stages it on a machine without network), or --backend hf",
            )
        ]
    on_cpu = vllm_runs_on() == "cpu"
    tested, words = release_verdict(version, on_cpu)
    checks += [
        Check(
            "vllm",
            PASS if tested else WARN,
            words,
            "" if tested else "the API check below says whether eaglet's calls still bind",
        ),
        check_library_api("vllm"),
        check_vllm_internals(),
    ]
    if captures:
        checks.append(check_vllm_capture(target_path, version))
    problem = installed_processor_problem(target_path, config.trust_remote_code)
    if problem:
        checks.append(Check("vllm image processor", FAIL, problem))
    if on_cpu:
        problem = installed_cpu_attention_problem(target_path)
        return checks + [
            Check("vllm cpu attention", FAIL, problem)
            if problem
            else Check("vllm cpu attention", PASS, "its CPU attention runs the target's head size"),
            check_vllm_on_cpu(weights_of(read_config(target_path))),
        ]
    machine = this_machine()
    if machine.gpus < tensor_parallel_size:
        return checks + [
            Check(
                "GPUs",
                FAIL,
                f"{machine.gpus} visible, vLLM splits the target over {tensor_parallel_size}",
                "lower --tensor-parallel-size or run where the GPUs are",
            )
        ]
    ask = VllmAsk.of(config, max_model_len or config.max_model_len, max_num_batched_tokens)
    fit = vllm_layout(raw_config(target_path), weights_of(read_config(target_path)), machine, ask)
    checks.append(Check("fit", FAIL if fit.problems else PASS, "; ".join((fit.describe(), *fit.problems))))
    return checks


def check_vllm_on_cpu(weights: Any) -> Check:
    """vLLM's CPU build: the checkpoint and vLLM's caches in this machine's free memory."""
    from ..model.vllm_engine import CPU_CACHE_GIB

    cache_gib = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or CPU_CACHE_GIB)
    stored = weights.stored_bytes
    free, measured = available_memory("cpu")
    detail = (
        f"vLLM's CPU build: {stored / GIB:,.2f} GiB of weights + {cache_gib:g} GiB for its caches "
        f"(VLLM_CPU_KVCACHE_SPACE) of {free / GIB:,.1f} GiB ({measured})"
    )
    if stored + cache_gib * GIB > free:
        return Check("fit", FAIL, detail, "free memory, or set VLLM_CPU_KVCACHE_SPACE lower (GiB)")
    return Check("fit", PASS, detail)


def check_vllm_capture(target_path: Path, version: str) -> Check:
    """vLLM's model for the target captures the last layer's output (read from the installed vLLM's source)."""
    from ..model.vllm_capture import installed_capture

    verdict = installed_capture(target_path, version)
    if verdict is None:
        return Check("vllm capture", WARN, "the installed vLLM's source was not found; vLLM will say at load")
    if verdict.problem:
        return Check("vllm capture", FAIL, verdict.problem)
    return Check("vllm capture", PASS, "vLLM's model captures the aux layers and the last layer's output")


def _supported_release(package: str) -> str:
    """What to install: eaglet's pin for its dependencies, the tested releases for vLLM (not a dependency)."""
    if package == "vllm":
        from ..model.vllm_releases import install_advice

        return install_advice()
    return f"install the {package} version eaglet supports (pyproject.toml)"


def check_vllm_internals() -> Check:
    """The attributes eaglet reads off vLLM's objects (model/vllm_internals.py), found in the installed vLLM's
    source: what the API check of calls cannot see, before any model load."""
    import importlib.util

    from ..model.vllm_internals import READS, missing_reads

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return Check("vllm internals", WARN, "vLLM's source not found: not checked")
    missing = missing_reads(Path(list(spec.submodule_search_locations)[0]).parent)
    if missing:
        return Check(
            "vllm internals",
            FAIL,
            f"{len(missing)} of the {len(READS)} attributes eaglet reads off vLLM's objects are gone: {missing[0]}",
            _supported_release("vllm") + ", or report it",
        )
    return Check("vllm internals", PASS, f"the {len(READS)} attributes eaglet reads off vLLM's objects are there")


@functools.lru_cache(maxsize=None)
def check_library_api(package: str = "transformers") -> Check:
    """eaglet's own calls into ``package``, bound statically against the installed version: an upgrade
    that breaks them is reported here, before the model load, not after it. Once per process (the
    installed version does not change while `eaglet run` goes from stage to stage)."""
    name = f"{package} API"
    try:
        from ..apicheck.check import check_calls, library_roots
    except ImportError as exc:  # a broken install: the stage itself may still work, so warn, do not stop
        return Check(name, WARN, f"not checked: {exc}", "reinstall eaglet with its dependencies (pip install eaglet)")
    roots, source = library_roots(package)
    report = check_calls([Path(__file__).parent.parent], package, roots, source)
    if report.errors:
        first = report.errors[0]
        return Check(
            name,
            FAIL,
            f"{len(report.errors)} of eaglet's calls break on {package} {report.version}: "
            f"{Path(first.path).name}:{first.line} {first.target}: {first.message}",
            _supported_release(package) + ", or report it",
        )
    return Check(
        name,
        PASS,
        f"{report.call_sites} calls bind to {package} {report.version} "
        f"({sum(report.unverified.values())} not statically checkable)",
    )
