"""The checks each stage runs before it loads anything heavy (and `eaglet preflight STAGE` runs alone)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from ..config import DEFAULT_DRAFT_VOCAB_CAP, SIZE_IT, served_model_len
from ..errors import EagletError
from ..export import FORMATS
from ..formats.draft_config import (
    DEFAULT_EAGLE_VERSION,
    EAGLE_VARIANTS,
    SERVED_BY_VLLM,
    DraftConfig,
    read_draft_config,
    require_export,
    require_fits_target,
)
from ..formats.files import MANIFEST_FILE, VOCAB_FILE
from ..formats.layers import default_aux_layer_ids, resolve_aux_layer_ids
from ..formats.start_draft import read_start_draft
from ..formats.store_manifest import keeps_target_top, prepared_path, read_manifest
from ..model.sizing import (
    PROMPT_TOKENS_GUESS,
    STAGED_BATCHES,
    draft_parameters,
    generation_batch_bytes,
    staged_batch_bytes,
    train_step_bytes,
)
from ..model.support import compiles_draft_round, draft_compile_problem, static_cache_problem, uses_static_cache
from .checks import (
    ACTIVATION_FACTOR,
    FAIL,
    GIB,
    OPTIMIZER_COPIES,
    PASS,
    WARN,
    Check,
    check_device,
    check_disk,
    check_fit,
    check_layers,
    check_library_api,
    check_max_len,
    check_memory,
    check_output_dir,
    check_prepared_lengths,
    check_rows,
    check_stage_target,
    check_target,
    check_vllm_backend,
    guarded,
)

BYTES_PER_GENERATED_TOKEN = 8  # JSON text of an answer, generously
EVAL_FORWARD_TOKENS = 128  # the largest verification forward eval runs (a tree's budget + 1, padded)
# share of the measured matrix-multiply rate a CPU training step reaches: 85.8 s for a 4,096-token step of the
# embedded target's draft (benchmarks/results/online_cpu.json) where 1024^3 products ran at 187 GFLOP/s
CPU_TRAIN_EFFICIENCY = 0.28
CPU_STEP_WARN_S = 10.0  # a CPU training step slower than this gets a warning with what makes it faster
CPU_TOKEN_BUDGET, CPU_DRAFT_VOCAB = 1024, 4096  # the CPU demo's settings (resources/demo_cpu.yaml)
PREPARED_BYTES_PER_INPUT_BYTE = 1.0  # parquet (zstd) of ids + masks is smaller than the JSON it came from


SERVER_PROBE_TIMEOUT_S = 3.0


def check_server(base_url: str) -> Check:
    """The OpenAI-compatible server answers (GET /models) before thousands of requests are queued."""
    import httpx

    try:
        response = httpx.get(base_url.rstrip("/") + "/models", timeout=SERVER_PROBE_TIMEOUT_S)
    except httpx.InvalidURL as exc:
        return Check("server", FAIL, f"--base-url {base_url}: not a URL ({exc})", "give it as http://HOST:PORT/v1")
    except httpx.HTTPError as exc:
        return Check(
            "server",
            FAIL,
            f"{base_url}: not reachable ({type(exc).__name__})",
            "start the server (vLLM, SGLang, llama.cpp) or fix --base-url",
        )
    return Check(
        "server",
        PASS if response.status_code == 200 else WARN,
        f"{base_url}/models: HTTP {response.status_code}",
        "" if response.status_code == 200 else "the server does not list models; requests may still work",
    )


BYTES_PER_DTYPE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _device_bytes(device: str, dtype: str = "auto") -> tuple[str, int]:
    """The device a stage will use and the bytes per weight it loads the target with (as ``pick_dtype``)."""
    from ..model.target import pick_device

    resolved = pick_device(device)
    if dtype in BYTES_PER_DTYPE:
        return resolved, BYTES_PER_DTYPE[dtype]
    return resolved, 2 if resolved.startswith("cuda") else 4


def prepare_checks(cfg: Any) -> list[Check]:
    checks = [Check("config", PASS, "valid")]
    target_checks, found = check_target(
        cfg.target, need_template=cfg.chat_template is None, trust_remote_code=cfg.trust_remote_code
    )
    checks += target_checks
    if found and "max_len" in cfg.model_fields_set:
        checks.append(check_max_len(found[0].path, cfg.max_len))
    if cfg.chat_template is not None:
        checks += guarded("chat template", lambda: _chat_template_check(Path(cfg.chat_template)))
    checks.append(check_rows(cfg.inputs, need_assistant=True, skip_bad=cfg.on_bad_row == "skip"))
    checks.append(check_output_dir(Path(cfg.out), cfg.overwrite, resumable=False))
    size = sum(Path(p).stat().st_size for p in cfg.inputs if Path(p).is_file())
    checks.append(check_disk(Path(cfg.out), int(size * PREPARED_BYTES_PER_INPUT_BYTE), "prepared set"))
    return checks


def _chat_template_check(path: Path) -> list[Check]:
    from ..data.prepare import read_chat_template

    read_chat_template(path)
    return [Check("chat template", PASS, str(path))]


def _jsonl_output(out: Path, when_there: str) -> Check:
    if out.suffix != ".jsonl":
        return Check("output", FAIL, f"{out} is not a .jsonl file", "--out must end in .jsonl")
    return Check("output", PASS, f"{out}: {when_there if out.exists() else 'will be created'}")


def _writing_target_checks(cfg: Any) -> tuple[list[Check], Any]:
    """A target that writes text in this process (regenerate's hf backend, synthesize): its device, its chat
    template, transformers' API, and its weights plus a batch's KV cache fitting here. Also the target found
    (``check_stage_target``'s), or None."""
    from ..config import CPU_GENERATE_BATCH, GPU_GENERATE_BATCH
    from ..model.target import read_config

    checks = [check_device(cfg.device)]
    if checks[-1].status == FAIL:
        return checks, None
    target_checks, found = check_stage_target(cfg, need_template=True)
    checks += target_checks
    if found:
        checks.append(check_library_api())
        device, dtype_bytes = _device_bytes(cfg.device, cfg.dtype)
        batch = cfg.batch_size or (GPU_GENERATE_BATCH if device.startswith("cuda") else CPU_GENERATE_BATCH)
        checks += check_fit(
            found[0].path, cfg, device, dtype_bytes, batch, batch * (PROMPT_TOKENS_GUESS + cfg.max_new_tokens)
        )
        if not device.startswith("cuda"):  # a GPU's: check_fit's cached tokens above
            cache = generation_batch_bytes(read_config(found[0].path), batch, cfg.max_new_tokens, dtype_bytes)
            weights = found[1].num_parameters * dtype_bytes
            what = f"target weights + a {batch:,}-row batch's KV cache"
            checks.append(check_memory(device, weights + cache, what, "lower --batch-size, or use a bigger device"))
        checks += guarded("hf engine", lambda: check_hf_engine(found[0].path, cfg, device))
    return checks, found


def check_hf_engine(target_path: Path, cfg: Any, device: str) -> Check:
    """Which engine writes the text (``--hf-engine``), from the config alone: the static one needs one device, full
    attention and, on a GPU, a target a CUDA graph can capture (no host-routed experts)."""
    from transformers import AutoConfig

    if cfg.hf_engine == "generate":
        return Check("hf engine", PASS, "transformers' generate (--hf-engine generate)")
    if cfg.hf_engine == "auto" and not device.startswith("cuda"):
        return Check("hf engine", PASS, "transformers' generate (auto on a CPU)")
    problem = "the target is split over devices (--placement)" if cfg.placement != "one" else None
    config = AutoConfig.from_pretrained(target_path, trust_remote_code=cfg.trust_remote_code)
    problem = problem or static_cache_problem(config, device.startswith("cuda"))
    if problem is None:
        return Check("hf engine", PASS, "static: a preallocated KV cache, each new token one CUDA graph on a GPU")
    if cfg.hf_engine == "static":
        return Check("hf engine", FAIL, f"--hf-engine static: {problem}", "use --hf-engine generate (or auto)")
    return Check("hf engine", PASS, f"transformers' generate ({problem})")


def synthesize_checks(cfg: Any) -> list[Check]:
    """The target has a chat template with a user turn to start, fits here, and --out is a .jsonl that is new or
    an earlier synthesis (it is replaced whole)."""
    from ..data.synthesize import foreign_output_problem

    out = Path(cfg.out)
    output = _jsonl_output(out, "an earlier synthesis, written again")
    problem = output.status != FAIL and foreign_output_problem(out)
    if problem:
        output = Check("output", FAIL, problem)
    return [Check("config", PASS, "valid"), output] + _writing_target_checks(cfg)[0]


def regenerate_checks(cfg: Any) -> list[Check]:
    from ..resources import resolve_input

    checks = [Check("config", PASS, "valid")]
    prompts = [resolve_input(p) for p in cfg.prompts]
    checks.append(check_rows(prompts, need_assistant=False, skip_bad=cfg.on_bad_row == "skip"))
    out = Path(cfg.out)
    checks.append(_jsonl_output(out, "exists, finished prompts are skipped"))
    if cfg.backend == "openai":
        checks.append(check_server(cfg.base_url))
    if cfg.backend == "hf":
        target_checks, found = _writing_target_checks(cfg)
        checks += target_checks
        if target_checks[0].status == FAIL:  # the device: nothing else is asked
            return checks
    if cfg.backend == "vllm":
        target_checks, found = check_stage_target(cfg, need_template=True)
        checks += target_checks
        if found:
            checks += check_vllm_backend(found[0].path, cfg, captures=False)
    if cfg.backend != "openai" and found:
        checks += guarded("prompt lengths", lambda: _prompt_length_check(cfg, found[0].path))
    rows = cfg.max_prompts or 1000
    checks.append(
        check_disk(
            out.parent if out.parent.exists() else Path("."),
            rows * cfg.n * cfg.max_new_tokens * BYTES_PER_GENERATED_TOKEN,
            "answers",
        )
    )
    return checks


def _prompt_length_check(cfg: Any, target_path: Path) -> Check:
    """Every selected prompt and --max-new-tokens inside the target's context (tokenized, no weights)."""
    from rich.console import Console

    from ..data.regenerate import plan_requests, too_long_prompts

    requests = plan_requests(cfg, Console(quiet=True))
    bad = too_long_prompts(cfg, requests, target_path)
    if not bad:
        return Check("prompt lengths", PASS, f"{len({r.prompt_id for r in requests}):,} prompts fit the context")
    if cfg.on_bad_row == "skip":
        return Check("prompt lengths", WARN, f"{len(bad)} prompt(s) too long, skipped; first: {bad[0]}")
    return Check("prompt lengths", FAIL, str(bad[0]), f"{len(bad)} prompt(s) too long; or pass --on-bad-row skip")


def extract_checks(cfg: Any) -> list[Check]:
    from ..config import CPU_BATCH_TOKENS, GPU_BATCH_TOKENS
    from ..formats.prepared import load_prepared
    from ..formats.store_manifest import bytes_per_token, planned_target_top
    from ..model.vllm_engine import GENERATED_TOKENS

    checks = [Check("config", PASS, "valid"), check_device(cfg.device)]
    if checks[-1].status == FAIL:
        return checks
    try:
        prepared = load_prepared(cfg.prepared, cfg.max_samples)
    except EagletError as exc:
        return checks + [Check("prepared set", FAIL, exc.message)]
    checks.append(Check("prepared set", PASS, f"{len(prepared):,} samples, {int(prepared.lengths.sum()):,} tokens"))
    target_checks, found = check_stage_target(cfg, need_template=False)
    checks += target_checks
    if not found:
        return checks
    resolved, info = found
    if cfg.backend == "vllm":  # the engine extraction opens: sized to the longest sample (extract.extractor)
        longest = int(prepared.lengths.max()) + GENERATED_TOKENS
        if cfg.max_model_len is not None and cfg.max_model_len < longest:
            return checks + [
                Check(
                    "max model len",
                    FAIL,
                    f"--max-model-len {cfg.max_model_len}: the prepared set's longest sample needs {longest:,}",
                    "leave --max-model-len out (extraction sizes it) or raise it",
                )
            ]
        batched = max(cfg.batch_tokens or GPU_BATCH_TOKENS, longest)
        checks += check_vllm_backend(resolved.path, cfg, max_model_len=longest, max_num_batched_tokens=batched)
    else:
        checks.append(check_library_api())
    checks.append(
        _target_check(
            "tokenizer",
            info,
            prepared.manifest["target"],
            "prepared with",
            f"prepared with {prepared.manifest['target']['name']}'s tokenizer",
            "prepare again with this --target",
            tokenizer_only=True,
        )
    )
    checks.append(check_prepared_lengths(resolved.path, int(prepared.lengths.max())))
    checks.append(check_layers(cfg.layers, info.num_layers))
    store = Path(cfg.out)
    if (store / MANIFEST_FILE).is_file():
        checks += guarded("output", lambda: _resume_check(cfg, info, prepared, store))
    else:
        checks.append(check_output_dir(store, overwrite=False, resumable=True))
    per_token = bytes_per_token(info.hidden_size, cfg.storage_dtype, planned_target_top(store, cfg.backend))
    needed = int(prepared.lengths.sum()) * per_token
    checks.append(check_disk(store, int(needed + cfg.reserve_gb * GIB), f"store ({cfg.storage_dtype}) + reserve"))
    if cfg.backend == "vllm":  # its fit is vLLM's own (check_vllm_backend): transformers' does not apply
        return checks + [_spool_check(cfg, store, prepared, per_token)]
    device, dtype_bytes = _device_bytes(cfg.device, cfg.dtype)
    batch_tokens = cfg.batch_tokens or (GPU_BATCH_TOKENS if device.startswith("cuda") else CPU_BATCH_TOKENS)
    checks += check_fit(resolved.path, cfg, device, dtype_bytes, batch_tokens)
    if not device.startswith("cuda"):
        activations = batch_tokens * info.hidden_size * ACTIVATION_FACTOR * 4  # + the three captured inputs
        checks.append(
            check_memory(
                device,
                info.num_parameters * dtype_bytes + activations,
                f"target weights + a {batch_tokens:,}-token batch",
            )
        )
    return checks


def _spool_check(cfg: Any, store: Path, prepared: Any, per_token: int) -> Check:
    """The vllm backend's spool folder holds the shards vLLM's worker fills (``formats.spool``)."""
    from ..formats.spool import spool_dir, spool_problem
    from ..formats.store_manifest import plan_shards, shard_tokens

    spool = spool_dir(cfg.spool_dir, store)
    plans = plan_shards(prepared.lengths, shard_tokens(cfg.shard_mb, per_token))
    problem = spool_problem(spool, store, [plan.tokens * per_token for plan in plans])
    if problem:
        return Check("spool", FAIL, problem)
    return Check("spool", PASS, f"{spool}" + ("" if cfg.spool_dir else " (beside the store, removed at the end)"))


def _target_check(
    name: str,
    info: Any,
    recorded: dict[str, Any],
    made: str,
    detail: str,
    fix: str,
    *,
    tokenizer_only: bool = False,
    config_only: bool = False,
) -> Check:
    """An input's recorded target against the stage's (``TargetIdentity.mismatches``), as one check."""
    findings = info.identity.mismatches(recorded, made, tokenizer_only=tokenizer_only, config_only=config_only)
    if findings:
        return Check(name, FAIL, "; ".join(findings), fix)
    return Check(name, PASS, detail)


def train_checks(cfg: Any) -> list[Check]:
    from ..formats.prepared import load_prepared
    from ..model.target import read_config

    checks = [Check("config", PASS, "valid"), check_device(cfg.device)]
    if checks[-1].status == FAIL:
        return checks
    if (cfg.store is None) == (cfg.prepared is None):
        return checks + [
            Check("input", FAIL, "needs exactly one of --store and --prepared", "offline: --store; online: --prepared")
        ]
    target_checks, found = check_stage_target(cfg, need_template=False)
    checks += target_checks
    if not found:
        return checks
    resolved, info = found
    if cfg.store:
        try:
            manifest = read_manifest(Path(cfg.store))
        except EagletError as exc:
            return checks + [Check("store", FAIL, exc.message)]
        findings = info.identity.mismatches(manifest["target"], "extracted from")
        complete = manifest["complete"]
        checks.append(
            Check(
                "store",
                PASS if complete and not findings else FAIL,
                f"{manifest['totals']['tokens']:,} tokens from {manifest['target']['name']}, layers "
                f"{manifest['aux_layer_ids']} ({manifest['aux_convention']})"
                + "".join(f"; {finding}" for finding in findings)
                + ("" if complete else ", extraction incomplete"),
                "extract with this --target"
                if findings
                else ""
                if complete
                else "rerun the same `eaglet extract` to finish it",
            )
        )
        if cfg.layers and list(cfg.layers) != list(manifest["aux_layer_ids"]):
            checks.append(
                Check(
                    "aux layer ids",
                    FAIL,
                    f"--layers {cfg.layers}, the store holds {manifest['aux_layer_ids']}",
                    "drop --layers (training uses the store's), or extract again with --layers",
                )
            )
        prepared_dir = prepared_path(Path(cfg.store), manifest)
    else:
        manifest = None
        try:
            prepared = load_prepared(cfg.prepared)
        except EagletError as exc:
            return checks + [Check("prepared set", FAIL, exc.message)]
        checks.append(
            _target_check(
                "prepared set",
                info,
                prepared.manifest["target"],
                "prepared with",
                f"{len(prepared):,} samples",
                "prepare again with this --target",
                tokenizer_only=True,
            )
        )
        checks.append(check_layers(cfg.layers, info.num_layers))
        checks.append(check_library_api())  # online: the target is loaded and driven through transformers
        if cfg.placement == "tp":
            checks.append(
                Check(
                    "placement",
                    FAIL,
                    "online training cannot run a tensor-parallel target",
                    "extract a store under torchrun with --placement tp and train on it, or use --placement split",
                )
            )
        else:
            online_device, online_bytes = _device_bytes(cfg.device)
            checks += check_fit(resolved.path, cfg, online_device, online_bytes, cfg.online_forward_tokens)
        prepared_dir = Path(cfg.prepared)
    vocab_file = Path(cfg.draft_vocab_file or prepared_dir / VOCAB_FILE)
    checks.append(
        Check("draft vocab", PASS, str(vocab_file))
        if vocab_file.is_file()
        else Check(
            "draft vocab",
            FAIL,
            f"{vocab_file}: no draft vocabulary here",
            "prepare again (or pass --set draft_vocab_file=PATH when the prepared set moved)",
        )
    )
    checks.append(check_output_dir(Path(cfg.out), overwrite=False, resumable=True))
    # sized for this target (a vocabulary of another target's is refused above; it must not break the sizing)
    draft = DraftConfig.from_target(
        read_config(resolved.path),
        min(_draft_vocab_size(vocab_file, info.vocab_size), info.vocab_size),
        default_aux_layer_ids(info.num_layers),
        num_layers=cfg.draft_layers,
        norms=EAGLE_VARIANTS[cfg.eagle_version or DEFAULT_EAGLE_VERSION],
    )
    if cfg.init_from is not None:
        checks += guarded("init from", lambda: _start_draft_check(cfg, info, manifest, draft.draft_vocab_size))
    draft_params = draft_parameters(info.hidden_size, draft.draft_vocab_size)
    checks.append(check_disk(Path(cfg.out), draft_params * 4 * (1 + 3 * (cfg.keep_last + 1)), "draft + checkpoints"))
    device, dtype_bytes = _device_bytes(cfg.device)
    online = info.num_parameters * dtype_bytes if cfg.prepared else 0
    checks.append(check_memory(device, *train_memory(cfg, device, dtype_bytes, draft, info.vocab_size, online)))
    if cfg.max_steps:  # otherwise the run's length is known once its epochs are packed (train warns then)
        problem = cfg.warmup_problem(cfg.max_steps)
        checks.append(Check("schedule", WARN, *problem) if problem else Check("schedule", PASS, "warm-up fits the run"))
    if not device.startswith("cuda"):
        checks.append(_cpu_step_time(cfg, draft, info))
    return checks


def _start_draft_check(cfg: Any, info: Any, manifest: dict[str, Any] | None, draft_vocab_size: int) -> Check:
    """--init-from by the run's own rule (``read_start_draft``), on this run's layers, vocabulary size and depth."""
    layer_ids = tuple(manifest["aux_layer_ids"]) if manifest else resolve_aux_layer_ids(cfg.layers, info.num_layers)
    start = read_start_draft(cfg.init_from, info, layer_ids, draft_vocab_size, cfg.draft_layers, cfg.eagle_version)
    return Check("init from", PASS, f"an EAGLE {start.config.eagle_version} draft of this run's layers and vocabulary")


def train_memory(
    cfg: Any, device: str, dtype_bytes: int, draft: Any, target_vocab: int, online: int
) -> tuple[int, str]:
    """(bytes, what they hold) of `eaglet train` on ``device``: the draft and AdamW's copies, the teacher head, one
    step, and where the step is recorded its companions; ``online`` the target's weights (online training)."""
    # the head's draft-vocabulary rows, and the whole head unless every store read keeps the target's argmax
    teacher = (draft.draft_vocab_size + (0 if argmax_stored(cfg) else target_vocab)) * draft.hidden_size * dtype_bytes
    step = train_step_bytes(draft, cfg.token_budget, cfg.ttt_steps, dense_attention=not device.startswith("cuda"))
    # a recorded step keeps its memory in its graph's pool: held-out forwards need their own beside it
    recorded = cfg.records_step(device, 1)
    beside = step if recorded and (cfg.eval_store or cfg.eval_fraction > 0) else 0
    # a recorded step's next batches wait on the device (train.graphed.Stager)
    staged = STAGED_BATCHES * staged_batch_bytes(cfg.token_budget, draft.hidden_size) if recorded else 0
    draft_params = draft_parameters(draft.hidden_size, draft.draft_vocab_size)
    return (
        draft_params * 4 * OPTIMIZER_COPIES + teacher + step + beside + staged + online,
        f"draft + optimizer + teacher head + a {cfg.token_budget:,}-token step"
        + (" + held-out forwards beside the recorded step" if beside else "")
        + (f" + {STAGED_BATCHES} batches copied ahead" if staged else "")
        + (" + target" if online else ""),
    )


def _draft_vocab_size(vocab_file: Path, target_vocab: int) -> int:
    """The prepared draft vocabulary's size (its d2t's length), read from the file's header."""
    from safetensors import safe_open

    try:
        with safe_open(str(vocab_file), framework="numpy") as handle:
            return int(handle.get_slice("d2t").get_shape()[0])
    except Exception:  # noqa: BLE001 - the draft vocab check above reports the file itself
        return min(DEFAULT_DRAFT_VOCAB_CAP, target_vocab)


def _keeps_target_top(store: Path) -> bool:
    try:
        return keeps_target_top(store)
    except EagletError:  # the store's own check names a broken manifest
        return False


def argmax_stored(cfg: Any) -> bool:
    """Training reads the target's argmax from every store it reads (``train.setup.Setup.argmax_stored``)."""
    stores = [store for store in (cfg.store, cfg.eval_store) if store]
    return bool(cfg.store) and all(_keeps_target_top(Path(store)) for store in stores)


def _cpu_step_time(cfg: Any, draft: Any, info: Any) -> Check:
    """On a CPU a step's FLOPs decide everything: the estimate from this CPU's measured rate, and what cuts it."""
    from ..model.sizing import measured_cpu_flops, train_flops_per_token

    keeps_top = argmax_stored(cfg)  # the teacher's head: the draft vocabulary's rows, else all of them

    def seconds(tokens: int, vocab: int) -> float:
        config = dataclasses.replace(draft, draft_vocab_size=vocab)
        teacher_rows = vocab if keeps_top else info.vocab_size
        flops = tokens * train_flops_per_token(config, cfg.ttt_steps, tokens / 2, teacher_rows)
        return flops / (rate * CPU_TRAIN_EFFICIENCY)

    rate = measured_cpu_flops()
    step = seconds(cfg.token_budget, draft.draft_vocab_size)
    detail = f"~{step:,.0f} s per step on this CPU ({rate / 1e9:,.0f} GFLOP/s measured)"
    if cfg.max_steps:
        detail += f", ~{step * cfg.max_steps / 60:,.0f} min for {cfg.max_steps} steps"
    if step <= CPU_STEP_WARN_S:
        return Check("step time", PASS, detail)
    small = seconds(min(cfg.token_budget, CPU_TOKEN_BUDGET), min(draft.draft_vocab_size, CPU_DRAFT_VOCAB))
    return Check(
        "step time",
        WARN,
        detail,
        f"--token-budget {CPU_TOKEN_BUDGET} and `eaglet prepare --draft-vocab "
        f"{CPU_DRAFT_VOCAB}` (the CPU demo's): ~{small:,.1f} s per step; or a GPU",
    )


def eval_checks(cfg: Any) -> list[Check]:
    problem = cfg.decoding_problem()
    checks = [Check("config", FAIL, problem) if problem else Check("config", PASS, "valid"), check_device(cfg.device)]
    if checks[-1].status == FAIL:
        return checks
    decoded, found, selected = _draft_and_prompt_checks(cfg)
    checks += decoded
    if found and cfg.backend == "vllm":  # vLLM holds the target its own way: transformers' load and fit do not apply
        return checks + _served_checks(cfg, found, selected)
    if found:
        checks.append(check_library_api())
        device, dtype_bytes = _device_bytes(cfg.device, cfg.dtype)
        checks += check_fit(
            found[0].path, cfg, device, dtype_bytes, EVAL_FORWARD_TOKENS, PROMPT_TOKENS_GUESS + cfg.max_new_tokens
        )
        if not device.startswith("cuda"):
            checks.append(check_memory(device, found[1].num_parameters * dtype_bytes, "target weights"))
        if cfg.placement == "one" and uses_static_cache(cfg.cuda_graphs, cfg.batch_size, device):
            checks.append(
                check_static_cache(found[0].path, cfg.cuda_graphs, device.startswith("cuda"), cfg.trust_remote_code)
            )
            if compiles_draft_round(cfg.compile_draft, True, cfg.temperature == 0, device):
                checks.append(check_draft_compile(cfg.compile_draft, device))
    return checks


def bench_checks(cfg: Any) -> list[Check]:
    """`eaglet bench`: eval's checks of the draft, target and prompts, and of vLLM serving them."""
    checks, found, selected = _draft_and_prompt_checks(cfg)
    return [Check("config", PASS, "valid"), *checks, *(_served_checks(cfg, found, selected) if found else [])]


def _draft_and_prompt_checks(cfg: Any) -> tuple[list[Check], Any, list[Any]]:
    """The target, the draft against it and the prompts decoded (eval's and bench's): (checks, the target found or
    None, the prompts selected)."""
    from ..resources import resolve_input

    checks: list[Check] = []
    target_checks, found = check_stage_target(cfg, need_template=True)
    checks += target_checks
    target_layers = found[1].num_layers if found else None
    try:
        stored = read_draft_config(Path(cfg.draft), target_layers)
        if cfg.backend == "vllm":
            require_export(cfg.draft, SERVED_BY_VLLM, target_layers)
        if found and stored.made_elsewhere:  # no target record: the stage's own size check
            info = found[1]
            require_fits_target(stored.config, info.name, info.vocab_size, info.hidden_size, str(cfg.draft))
            checks.append(
                Check("draft", PASS, f"made elsewhere ({stored.export_format} layout), its sizes fit {info.name}")
            )
    except EagletError as exc:
        checks.append(Check("draft", FAIL, exc.message))
        stored = None
    if stored is not None and found and not stored.made_elsewhere:
        recorded = stored.config.target or {}
        checks.append(
            _target_check(
                "draft",
                found[1],
                recorded,
                "trained for",
                f"trained for {recorded.get('name', '?')}, layers {stored.config.eagle_aux_hidden_state_layer_ids}",
                "pass the draft's --target",
                config_only=True,
            )
        )
    checks.append(check_rows([resolve_input(p) for p in cfg.prompts], need_assistant=False))
    selected: list[Any] = []  # the prompts eval decodes, selected once: their check, then vLLM's context
    if found and checks[-1].status != FAIL:
        checks += guarded("prompts", lambda: _evaluated_prompts_check(cfg, found[0].path, selected))
    return checks, found, selected


def _served_checks(cfg: Any, found: Any, selected: list[Any]) -> list[Check]:
    """vLLM serving the target with the draft: its context for the prompts, its release and start, its CPU build."""
    from ..model.vllm_engine import installed_cpu_draft_problem

    served, too_short = served_model_len(cfg, max(len(row.ids) for row in selected)) if selected else (None, None)
    if too_short:
        return [Check("max model len", FAIL, too_short, SIZE_IT)]
    checks = check_vllm_backend(found[0].path, cfg, captures=False, max_model_len=served)
    problem = installed_cpu_draft_problem(found[0].path)
    return checks + ([Check("vllm cpu draft", FAIL, problem)] if problem else [])


def eval_early_checks(cfg: Any) -> list[Check]:
    """What eval's preflight can check before `eaglet run` trains its draft: the target, and the prompt files that
    exist already (the run's own synthesized prompts come later) against its context."""
    from ..resources import resolve_input

    ready = [p for p in cfg.prompts if Path(resolve_input(p)).is_file()]
    planned = _planned_only(cfg.target)
    if planned:
        return [planned]
    checks, found = check_stage_target(cfg, need_template=True)
    if found and ready:
        ready_config = cfg.model_copy(update={"prompts": ready})
        checks += guarded("prompts", lambda: _evaluated_prompts_check(ready_config, found[0].path))
    return checks


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")


def _planned_only(target: str | None) -> Check | None:
    """A WARN for a target directory holding config.json alone (planned with --plan on another machine, as the
    shipped Kimi example is): its tokenizer and prompts are checked by preflight where the target is; else None."""
    if not target or not (Path(target) / "config.json").is_file():
        return None
    from ..model.weight_files import weight_files

    if any((Path(target) / name).is_file() for name in TOKENIZER_FILES) or weight_files(Path(target)):
        return None
    return Check(
        "target",
        WARN,
        f"{target}: config.json only (no tokenizer or weights here): planned from it; its tokenizer, template and "
        "prompts are checked by `eaglet preflight` where the target is",
    )


def _resume_check(cfg: Any, info: Any, prepared: Any, store: Path) -> Check:
    """The store at --out is the one this extraction would make (the stage's own rule), so it resumes."""
    from ..formats.store_manifest import planned_identity, resume_problem
    from ..model.target import dtype_name

    model_dtype = dtype_name(cfg.dtype, _device_bytes(cfg.device)[0])
    problem = resume_problem(store, planned_identity(cfg, info, prepared, store, model_dtype))
    if problem:
        return Check("output", FAIL, problem)
    return Check("output", PASS, f"{store} exists; missing shards are computed")


def _evaluated_prompts_check(cfg: Any, target_path: Path, selected: list[Any] | None = None) -> Check:
    """The prompts eval selects: each file has some of the split, and each fits the target's context (kept in
    ``selected`` for the checks after this one)."""
    from ..data.eval_prompts import evaluated_prompts

    rows = evaluated_prompts(cfg, target_path)
    if selected is not None:
        selected.extend(rows)
    return Check("prompts", PASS, f"{len(rows):,} prompts of the {cfg.split} split, each inside the context")


def check_draft_compile(mode: str, device: str) -> Check:
    """eval's compiled draft rounds can be built here."""
    problem = draft_compile_problem(device)
    if problem is None:
        return Check("draft compile", PASS, "the draft's rounds can go through torch.compile")
    if mode == "on":
        return Check("draft compile", FAIL, problem, "pass --compile-draft off (or auto, which falls back)")
    return Check("draft compile", WARN, f"{problem}: eval runs the draft's rounds uncompiled (slower on GPU)", "")


def check_static_cache(target_path: Any, mode: str, graphs: bool, trust_remote_code: bool) -> Check:
    """eval's static-cache / CUDA-graph path suits the target (from its config alone, no weights)."""
    from transformers import AutoConfig

    problem = static_cache_problem(AutoConfig.from_pretrained(target_path, trust_remote_code=trust_remote_code), graphs)
    if problem is None:
        return Check("static cache", PASS, "the target's forwards can be replayed as CUDA graphs")
    if mode == "on":
        return Check("static cache", FAIL, problem, "pass --cuda-graphs off (or auto, which falls back)")
    return Check("static cache", WARN, f"{problem}: eval falls back to dynamic caches (slower on GPU)", "")


def check_engine_coverage(fmt: str, declared: list[str]) -> list[Check]:
    """Each engine release the export will meet (installed here, or declared with --engine) is one whose
    loader eaglet's readers were made from; warn for any other."""
    from ..consumers.fixtures import covered_versions
    from ..export import ENGINES
    from ..export.speculators import VERSION as SPECULATORS_VERSION
    from ..packages import installed_version

    engines = FORMATS[fmt].engines
    wanted: dict[str, set[str]] = {}
    for spec in declared:
        engine, _, version = spec.partition("==")
        if engine not in ENGINES or not version:
            return [
                Check(
                    "engines",
                    FAIL,
                    f"--engine {spec!r}: expected ENGINE==VERSION with ENGINE one of {', '.join(ENGINES)}",
                    "e.g. --engine vllm==0.33.0",
                )
            ]
        wanted.setdefault(engine, set()).add(version)
    for engine in engines:
        version = installed_version(engine)
        if version is not None:
            wanted.setdefault(engine, set()).add(version)
    checks = []
    for engine in engines:
        covered = [SPECULATORS_VERSION] if engine == "speculators" else covered_versions(engine)
        for version in sorted(wanted.get(engine, ())):
            if version in covered:
                checks.append(Check("engines", PASS, f"{engine} {version}: its loader is one eaglet reads"))
            else:
                fix = (
                    f"run scripts/refresh_consumer_fixtures.py --{engine} {version}, then `eaglet export --check`"
                    if engine != "speculators"
                    else f"check the export with speculators {version} (eaglet's test "
                    "extra pins the release it was checked against)"
                )
                checks.append(
                    Check("engines", WARN, f"{engine} {version}: eaglet's readers cover {', '.join(covered)} only", fix)
                )
    return checks or [
        Check(
            "engines",
            PASS,
            "covered: "
            + "; ".join(
                f"{e} {', '.join([SPECULATORS_VERSION] if e == 'speculators' else covered_versions(e))}"
                for e in engines
            ),
        )
    ]


def export_checks(cfg: Any) -> list[Check]:
    checks = [Check("config", PASS, "valid")]
    try:
        recorded = read_draft_config(Path(cfg.draft)).config.target or {}
    except EagletError as exc:
        return checks + [Check("draft", FAIL, exc.message)]
    checks.append(Check("draft", PASS, f"trained for {recorded.get('name', '?')}"))
    if FORMATS[cfg.format].carries_embedding:
        spec = cfg.target or recorded.get("spec")
        if not spec:
            checks.append(
                Check(
                    "target",
                    FAIL,
                    "the speculators format carries the target's embedding; this draft does not record its target",
                    "pass --target",
                )
            )
        else:
            target_checks, _ = check_target(spec, need_template=False)
            checks += target_checks
    checks.append(check_output_dir(Path(cfg.out), cfg.overwrite, resumable=False))
    checks += check_engine_coverage(cfg.format, cfg.engines)
    return checks


STAGE_CHECKS: dict[str, Callable[[Any], list[Check]]] = {
    "synthesize": synthesize_checks,
    "prepare": prepare_checks,
    "regenerate": regenerate_checks,
    "extract": extract_checks,
    "train": train_checks,
    "eval": eval_checks,
    "export": export_checks,
    "bench": bench_checks,
}


def run_checks(stage: str, cfg: Any) -> list[Check]:
    return guarded(stage, lambda: STAGE_CHECKS[stage](cfg))


def worst(checks: list[Check]) -> str:
    statuses = {c.status for c in checks}
    return FAIL if FAIL in statuses else WARN if WARN in statuses else PASS
