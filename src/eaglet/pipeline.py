"""`eaglet run CONFIG.yaml`: the stages in order, each skipped when its output is complete and was made
from the same settings and the same inputs (manifest hashes), re-run when not; a killed run resumes.

Run directory::

    RUN/run.json             what ran: per stage its fingerprint, output hash, seconds and result
    RUN/regenerated.jsonl    answers by the target (when `regenerate` is configured)
    RUN/prepared/  RUN/store/ (offline)  RUN/draft/  RUN/export/{vllm,sglang,speculators}/  RUN/eval/
    RUN/heldout.jsonl  RUN/prepared_heldout/  RUN/store_heldout/   (with `heldout:`: what training evaluates on)

A stage's fingerprint hashes its validated settings and the output hashes of the stages it reads, so a
change anywhere re-runs exactly what depends on it.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import Field, ValidationError
from rich.console import Console

from .config import (CPU_BATCH_TOKENS, DEFAULT_DRAFT_VOCAB_CAP, GPU_BATCH_TOKENS, GPU_GENERATE_BATCH, EvalConfig, ExportFormat,
                     ExtractConfig, PrepareConfig, RegenerateConfig, StrictModel, TrainConfig, describe_validation_error, read_yaml)
from .errors import EagletError
from .export import FORMAT_NAMES, FORMATS, verifier_reference
from .formats.files import (DRAFT_CONFIG_FILE, DRAFT_WEIGHTS_FILE, EXPORTED_DRAFT_CONFIG_FILE, MANIFEST_FILE,
                            REPORT_FILE, RUN_FILE, RUN_SCHEMA, answers_manifest)
from .formats.records import RunRecord, parse_record
from .fsio import check_output_dir, load_json_file, output_lock, read_json, sha256_file, write_json_atomic

BYTES_PER_ANSWER_TOKEN = 8  # JSON text
# Rough rates for --plan's time column (measured: benchmarks/RESULTS.md; CPU = this project's 2-core machine)
RATES = {"cpu": {"generate_tok_s": 66, "extract_tok_s": 600, "decode_tok_s": 15},
         "cuda": {"generate_tok_s": 2750, "extract_tok_s": 245_000, "decode_tok_s": 230}}  # decode: the H200 demo eval
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


class ExportSection(StrictModel):
    formats: list[ExportFormat] = Field(default_factory=lambda: list(FORMAT_NAMES))
    speculative_tokens: int = Field(default=3, ge=1, le=16)


class HeldOutSection(StrictModel):
    """The target's greedy answers to the held-out split of the regenerated prompts, extracted beside the
    training store: training then reports its simulated acceptance on prompts it never saw (instead of
    on a sample of its own training answers, which share their prompts with the rest)."""

    max_prompts: int | None = Field(default=None, ge=1, description="only N held-out prompts")


class MachineSection(StrictModel):
    """The machine the run is planned for (`--plan` on a laptop for a GPU server); default: this one."""

    gpus: int = Field(ge=0, description="GPUs the stages may use (torchrun's world for --placement tp)")
    gpu_memory: str = Field(description="memory per GPU, e.g. 141GiB")
    name: str = Field(default="GPU", description="e.g. H200: sets the peak FLOPs time estimates scale from")
    extract_tokens_per_s: float | None = Field(default=None, gt=0, description="measured extraction rate (default: "
                                               "estimated from the target's active parameters)")
    generate_tokens_per_s: float | None = Field(default=None, gt=0, description="measured regeneration rate")


class RunConfig(StrictModel):
    """One YAML, a section per stage. Paths between stages are set by the run, not by the sections."""

    out: str = Field(default="eaglet-run", description="run directory")
    target: str = "embedded"
    trust_remote_code: bool = False
    regenerate: dict[str, Any] | None = Field(default=None, description="RegenerateConfig keys; absent = no regeneration")
    prepare: dict[str, Any] = Field(default_factory=dict, description="PrepareConfig keys (inputs default to the regenerated answers)")
    extract: dict[str, Any] | None = Field(default_factory=dict, description="ExtractConfig keys; null = train online")
    train: dict[str, Any] = Field(default_factory=dict, description="TrainConfig keys")
    export: ExportSection = Field(default_factory=ExportSection)
    heldout: HeldOutSection | None = Field(default=None, description="also regenerate, prepare and extract the held-out prompts; train evaluates on them")
    eval: dict[str, Any] | None = Field(default_factory=dict, description="EvalConfig keys; null = no evaluation")
    machine: MachineSection | None = Field(default=None, description="plan for this machine instead of the one here")


def load_run_config(path: Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    data = read_yaml(path) | (overrides or {})
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise EagletError(describe_validation_error(exc, f"config {path}")) from None


@dataclass(frozen=True)
class StageKind:
    """What a stage of `eaglet run` is, whatever the run's settings: where its output goes, what it reads, which of
    its files identify its output, how its settings are made from the run's and how it runs."""

    name: str
    output: str  # under the run directory
    heldout_output: str | None  # the held-out twin's output (with `heldout:`)
    reads: tuple[str, ...]  # upstream stages, nearest first: the first the run has is the one read
    identifying: Callable[[Path, "RunConfig"], list[Path]]  # an output's files that make its output hash
    present: Callable[["RunConfig"], bool]
    configure: Callable[["Pipeline"], tuple[Any, Any]]  # (settings, the held-out twin's settings or None)
    execute: Callable[["Pipeline", "Stage"], str]  # does the work, returns the one-line result
    preflight: bool = True  # `eaglet preflight` checks its settings before it runs


@dataclass
class Stage:
    """A stage as this run has it: its kind with validated settings and paths."""

    kind: StageKind
    config: Any  # the stage's validated config (the export section for export)
    reads: tuple[str, ...]
    output: Path
    heldout: Any = None  # the same stage's config for the held-out prompts (RunConfig.heldout), or None
    heldout_output: Path | None = None

    @property
    def name(self) -> str:
        return self.kind.name

    def outputs(self) -> list[Path]:
        return [self.output] + ([self.heldout_output] if self.heldout_output is not None else [])


@dataclass
class StagePlan:
    name: str
    action: str  # "run" or "skip"
    reason: str
    disk_bytes: int = 0
    seconds: float = 0.0
    memory: str = ""  # where the target goes and what it takes per GPU (stages that run it)
    refusal: str = ""  # set when the stage's layout does not fit: what to change


@dataclass
class StageOutcome:
    name: str
    status: str  # "ran", "skipped"
    seconds: float
    result: str


@dataclass
class RunResult:
    out: Path
    outcomes: list[StageOutcome] = field(default_factory=list)
    report: dict[str, Any] | None = None
    serve: dict[str, str] = field(default_factory=dict)  # export format -> the command that serves it


class Pipeline:
    def __init__(self, config: RunConfig, config_path: Path | None, console: Console):
        self.config = config
        self.config_path = config_path
        self.console = console
        self.out = Path(config.out)
        self.stages = self._build_stages()

    # ------------------------------------------------------------------ stage configs

    def _section(self, cls: type, name: str, section: dict[str, Any], fixed: dict[str, Any],
                 defaults: dict[str, Any] | None = None) -> Any:
        """Validate a section; the keys the run sets are refused there (one source of truth for paths)."""
        clash = sorted(set(section) & set(fixed))
        if clash:
            raise EagletError(f"config {self.config_path}: {name}.{clash[0]} is set by `eaglet run` "
                              f"({fixed[clash[0]]}); remove it from the '{name}' section")
        try:
            return cls.model_validate((defaults or {}) | section | fixed)
        except ValidationError as exc:
            raise EagletError(describe_validation_error(exc, f"config {self.config_path} section '{name}'")) from None

    def _build_stages(self) -> list[Stage]:
        cfg = self.config
        if cfg.heldout is not None and (cfg.regenerate is None or cfg.extract is None):
            raise EagletError(f"config {self.config_path}: 'heldout' needs a 'regenerate' section (the held-out split of "
                              "its prompts) and offline training (an 'extract' section); remove 'heldout' or add them")
        stages: list[Stage] = []
        for kind in STAGE_KINDS:
            if not kind.present(cfg):
                continue
            config, heldout = kind.configure(self)
            upstream = next(([name] for name in kind.reads if name in {s.name for s in stages}), [])
            stages.append(Stage(kind, config, tuple(upstream), self.out / kind.output, heldout,
                                self.out / kind.heldout_output if heldout is not None and kind.heldout_output else None))
        return stages

    def common(self) -> dict[str, Any]:
        """The keys every stage takes from the run itself."""
        return {"target": self.config.target, "trust_remote_code": self.config.trust_remote_code}

    def path(self, name: str) -> Path:
        """The output of stage ``name`` (or its held-out twin, ``name`` + '_heldout') in this run."""
        kind = STAGE_KINDS_BY_NAME[name.removesuffix("_heldout")]
        return self.out / (kind.heldout_output if name.endswith("_heldout") else kind.output)  # type: ignore[operator]

    def current_report(self) -> Path | None:
        """The eval report, when it was made from the draft being exported (so cards quote its τ)."""
        state = self._state()
        evaluation = next((s for s in self.stages if s.name == "eval"), None)
        if evaluation is not None and state.get("eval", {}).get("complete") and \
                self._fingerprint_matches(evaluation, state, state["eval"]):
            return evaluation.output / REPORT_FILE
        return None

    # ------------------------------------------------------------------ state

    def _state(self) -> dict[str, Any]:
        path = self.out / RUN_FILE
        if not path.is_file():
            return {}
        fix = f"delete {path} to run every stage again"
        return parse_record(RunRecord, load_json_file(path, fix), path, fix).stages

    def _save_state(self, stages: dict[str, Any]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.out / RUN_FILE, {"schema": RUN_SCHEMA, "config": self.config.model_dump(),
                                                "config_file": str(self.config_path), "stages": stages})

    def _fingerprint_matches(self, stage: Stage, state: dict[str, Any], record: dict[str, Any] | None) -> bool:
        """The record was made from this stage's settings and inputs."""
        recorded = (record or {}).get("fingerprint")
        return recorded is not None and recorded == self._fingerprint(stage, state)

    def _fingerprint(self, stage: Stage, state: dict[str, Any]) -> str | None:
        """None while an upstream stage has no output yet. Paths inside the run directory count relative to
        it, so a run directory moved (or copied to another machine) keeps its finished stages."""
        upstream = []
        for name in stage.reads:
            if name not in {s.name for s in self.stages}:
                continue
            record = state.get(name)
            if record is None or not record.get("complete"):
                return None
            upstream.append(record["output_hash"])
        settings = _run_relative(stage.config.model_dump(mode="json"), self.out) if stage.config is not None else None
        fields = {"stage": stage.name, "settings": settings, "upstream": upstream}
        if stage.heldout is not None:
            fields["heldout"] = _run_relative(stage.heldout.model_dump(mode="json"), self.out)
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def _outputs(self, stage: Stage) -> list[Path]:
        """Everything a stage writes (regenerate's answers keep their manifest beside them)."""
        if stage.name == "regenerate":
            return [p for output in stage.outputs() for p in (output, answers_manifest(output))]
        return stage.outputs()

    def _output_hash(self, stage: Stage) -> str | None:
        """A hash of the files identifying the stage's output (what downstream fingerprints include)."""
        candidates = [path for output in stage.outputs() for path in stage.kind.identifying(output, self.config)]
        if not all(p.is_file() for p in candidates):
            return None
        digest = hashlib.sha256()
        for path in candidates:
            digest.update(sha256_file(path).encode())
        return digest.hexdigest()

    def plan(self, from_stage: str | None = None, only: str | None = None) -> list[StagePlan]:
        names = [s.name for s in self.stages]
        for requested in (from_stage, only):
            if requested is not None and requested not in names:
                raise EagletError(f"no stage {requested!r} in this run; stages: {', '.join(names)}")
        state = self._state()
        plans = []
        forced = False
        rerunning: set[str] = set()
        for stage in self.stages:
            forced = forced or stage.name == from_stage
            record = state.get(stage.name)
            fingerprint = self._fingerprint(stage, state)
            upstream = [name for name in stage.reads if name in rerunning]
            if only is not None:
                plan = StagePlan(stage.name, "run", "--only") if stage.name == only else StagePlan(stage.name, "skip", "not --only")
            elif forced:
                plan = StagePlan(stage.name, "run", f"--from {from_stage}")
            elif record is None:
                plan = StagePlan(stage.name, "run", "not run yet")
            elif upstream:
                plan = StagePlan(stage.name, "run", f"after {upstream[0]} (if its output changes)")
            elif fingerprint is None:
                plan = StagePlan(stage.name, "run", "after its inputs")
            elif not self._fingerprint_matches(stage, state, record):
                plan = StagePlan(stage.name, "run", "settings or inputs changed")
            elif not record.get("complete"):
                plan = StagePlan(stage.name, "run", "interrupted: resumes")
            elif self._output_hash(stage) != record.get("output_hash"):
                plan = StagePlan(stage.name, "run", "output missing or changed")
            else:
                plan = StagePlan(stage.name, "skip", "done, same settings and inputs")
            if plan.action == "run":
                rerunning.add(stage.name)
            plans.append(plan)
        return self._estimate(plans)

    def machine(self) -> Any:
        """The machine planned for: the config's `machine` section, else this one."""
        from .placement import parse_memory
        from .sizing import Machine, this_machine

        section = self.config.machine
        if section is None:
            return this_machine()
        return Machine(section.gpus, parse_memory(section.gpu_memory, "machine.gpu_memory"), section.name)

    def _estimate(self, plans: list[StagePlan]) -> list[StagePlan]:
        from .formats.store import bytes_per_token
        from .sizing import draft_parameters
        from .target import read_config, resolve_target

        machine = self.machine()
        rates = RATES["cuda" if machine.gpus else "cpu"]
        by_name = {s.name: s for s in self.stages}
        answer_tokens = 0
        if "regenerate" in by_name:
            stage = by_name["regenerate"]
            for config in (stage.config, stage.heldout):  # the training prompts, then the held-out ones
                if config is not None:
                    prompts = min(config.max_prompts or math.inf, _count_rows(config.prompts, config.split))
                    answer_tokens += int(prompts * config.n * config.max_new_tokens * TOKENS_PER_ANSWER_GUESS)
        prepared_tokens = (_prepared_tokens(self.out / "prepared") or answer_tokens * 2  # prompt + answer
                           or _input_tokens(by_name["prepare"].config.inputs))
        target_config = read_config(resolve_target(self.config.target, self.config.trust_remote_code).path)
        hidden = int(target_config.get("hidden_size", 4096))
        draft_vocab = int(by_name["prepare"].config.draft_vocab
                          or min(DEFAULT_DRAFT_VOCAB_CAP, target_config.get("vocab_size", DEFAULT_DRAFT_VOCAB_CAP)))
        draft_params = draft_parameters(hidden, draft_vocab)
        sizing = _TargetSizing(target_config, machine)
        for plan in plans:
            if plan.action != "run":
                continue
            stage = by_name[plan.name]
            if plan.name == "regenerate":
                plan.disk_bytes = answer_tokens * BYTES_PER_ANSWER_TOKEN
                rate = (self.config.machine and self.config.machine.generate_tokens_per_s) or rates["generate_tok_s"]
                plan.seconds = answer_tokens / rate
                if stage.config.backend == "hf":
                    batch = stage.config.batch_size or GPU_GENERATE_BATCH
                    sizing.place(plan, stage.config, batch, batch * (PROMPT_TOKENS_GUESS + stage.config.max_new_tokens))
            elif plan.name == "prepare":
                plan.disk_bytes = prepared_tokens * 5
                plan.seconds = 10 + prepared_tokens / 200_000
            elif plan.name == "extract":
                per_token = bytes_per_token(hidden, stage.config.storage_dtype)
                plan.disk_bytes = prepared_tokens * per_token
                batch_tokens = stage.config.batch_tokens or (GPU_BATCH_TOKENS if machine.gpus else CPU_BATCH_TOKENS)
                gpus = sizing.place(plan, stage.config, batch_tokens)
                stated = self.config.machine and self.config.machine.extract_tokens_per_s
                rate = stated or (sizing.extract_rate(gpus, stage.config.placement, per_token) if machine.gpus
                                  else rates["extract_tok_s"])
                plan.seconds = sizing.load_seconds() + prepared_tokens / rate
                if prepared_tokens:
                    samples = _prepared_samples(self.out / "prepared") or _samples_guess(prepared_tokens)
                    store_line = f"store {per_token * prepared_tokens / samples / 1e6:,.2f} MB per sample"
                    plan.memory = f"{plan.memory}; {store_line}" if plan.memory else store_line
            elif plan.name == "train":
                train = stage.config
                plan.seconds = train.max_minutes * 60 if train.max_minutes else float("nan")
                # fp32 weights + 2 AdamW moments per checkpoint kept, and the saved draft
                plan.disk_bytes = draft_params * FP32_BYTES * (1 + 3 * (train.keep_last + 1))
                if train.prepared is not None:  # online: the target runs in training
                    sizing.place(plan, train, train.online_forward_tokens)
            elif plan.name == "export":
                plan.disk_bytes = draft_params * BF16_BYTES * len(self.config.export.formats)
            elif plan.name == "eval":
                evaluation = stage.config
                prompts = evaluation.max_prompts or HELD_OUT_PROMPTS_GUESS
                gpus = sizing.place(plan, evaluation, EVAL_FORWARD_TOKENS, PROMPT_TOKENS_GUESS + evaluation.max_new_tokens)
                step = sizing.decode_step(gpus, 1 / rates["decode_tok_s"]) if machine.gpus else 1 / rates["decode_tok_s"]
                plan.seconds = sizing.load_seconds() + 2 * prompts * evaluation.max_new_tokens * step  # baseline + spec
                problem = evaluation.decoding_problem()
                if problem:  # known from the settings: refused before training, not after
                    plan.refusal = plan.refusal or f"eval: {problem}"
        return plans

    # ------------------------------------------------------------------ running

    def run(self, from_stage: str | None = None, only: str | None = None) -> RunResult:
        """The stages in order (each skipped when done from the same settings and inputs); one run at a time."""
        check_output_dir(self.out)
        with output_lock(self.out):
            return self._run(from_stage, only)

    def _run(self, from_stage: str | None, only: str | None) -> RunResult:
        from .preflight.stages import FAIL, run_checks

        plans = {p.name: p for p in self.plan(from_stage, only)}
        refused = next((p.refusal for p in plans.values() if p.action == "run" and p.refusal), None)
        if refused:  # before any stage runs or any weight loads
            raise EagletError(refused)
        state = self._state()
        result = RunResult(self.out)
        for stage in self.stages:
            plan = plans[stage.name]
            record = state.get(stage.name)
            fingerprint = self._fingerprint(stage, state)  # now, with the upstream outputs of this run
            if plan.reason.startswith("after "):  # decided now that its inputs exist: did they change?
                must_run = fingerprint is None or not self._fingerprint_matches(stage, state, record) \
                    or not record.get("complete") or self._output_hash(stage) != record.get("output_hash")
            else:
                must_run = plan.action == "run"
            if not must_run:
                result.outcomes.append(StageOutcome(stage.name, "skipped", 0.0, (record or {}).get("result", "")))
                continue
            if fingerprint is None:
                raise EagletError(f"stage {stage.name} needs {', '.join(stage.reads)} first; run without --only")
            if not self._fingerprint_matches(stage, state, record) or from_stage is not None:
                for path in self._outputs(stage):  # made from other settings or inputs: start that stage over
                    _remove(path)
            if stage.kind.preflight:
                checks = run_checks(stage.name, stage.config)
                failed = [c for c in checks if c.status == FAIL]
                if failed:
                    raise EagletError(f"preflight failed for {stage.name}: {failed[0].name}: {failed[0].detail}"
                                      + (f" ({failed[0].fix})" if failed[0].fix else ""))
            state[stage.name] = {"fingerprint": fingerprint, "complete": False}
            self._save_state(state)
            self.console.print(f"[bold]== {stage.name}[/] ({plan.reason})")
            started = time.perf_counter()
            outcome = stage.kind.execute(self, stage)
            seconds = time.perf_counter() - started
            state[stage.name] = {"fingerprint": fingerprint, "complete": True, "output_hash": self._output_hash(stage),
                                 "seconds": round(seconds, 1), "result": outcome}
            self._save_state(state)
            result.outcomes.append(StageOutcome(stage.name, "ran", seconds, outcome))
        report = self.out / "eval" / "report.json"
        result.report = read_json(report) if report.is_file() else None
        result.serve = self.serve_commands()
        return result

    def serve_commands(self) -> dict[str, str]:
        """How to serve each exported draft, with its real path and the verifier its config names."""
        commands = {}
        for fmt in self.config.export.formats:
            directory = self.out / "export" / fmt
            if (directory / EXPORTED_DRAFT_CONFIG_FILE).is_file():
                verifier, _ = verifier_reference(read_json(directory / EXPORTED_DRAFT_CONFIG_FILE))
                commands[fmt] = FORMATS[fmt].serve_command(verifier, self.config.export.speculative_tokens,
                                                           str(directory))
        return commands


class _TargetSizing:
    """Per-GPU memory of the target under each stage's placement, from config.json (weights counted once)."""

    def __init__(self, target_config: dict[str, Any], machine: Any):
        self.target_config = target_config
        self.machine = machine
        self._weights = None

    def weights(self) -> Any:
        from .sizing import weights_of

        if self._weights is None:
            self._weights = weights_of(self.target_config)
        return self._weights

    def place(self, plan: StagePlan, config: Any, forward_tokens: int, cached_tokens: int = 0) -> int:
        """Fill ``plan.memory`` (and ``plan.refusal`` when it does not fit); returns the GPUs the target spans."""
        from .placement import device_key
        from .sizing import GIB, fit_advice, layout

        if not self.machine.gpus:
            return 0
        gpus = {"one": 1, "tp": self.machine.gpus}.get(config.placement) or sum(
            isinstance(device_key(name), int) for name in config.max_memory) or self.machine.gpus
        weights = self.weights()
        chosen = layout(self.target_config, weights, self.machine, config.placement, forward_tokens, gpus,
                        cached_tokens)
        plan.memory = (f"{config.placement} x{chosen.gpus}: {chosen.weights_per_gpu / GIB:,.1f} + "
                       f"{chosen.activations_per_gpu / GIB:,.1f} GiB of {chosen.capacity_per_gpu / GIB:,.0f}")
        if not chosen.fits:
            cached = f", {cached_tokens:,} in the KV cache" if cached_tokens else ""
            plan.refusal = (f"{plan.name}: the target needs {chosen.needed_per_gpu / GIB:,.1f} GiB per GPU "
                            f"(--placement {config.placement} over {chosen.gpus} x {self.machine.name}: "
                            f"{chosen.weights_per_gpu / GIB:,.1f} GiB weights + {chosen.activations_per_gpu / GIB:,.1f}"
                            f" GiB at {forward_tokens:,} tokens a forward{cached}) of {chosen.capacity_per_gpu / GIB:,.1f}"
                            " GiB usable; "
                            "use " + fit_advice(self.target_config, weights, self.machine, chosen, forward_tokens,
                                                cached_tokens, type(config).FORWARD_OPTION))
        return chosen.gpus

    def load_seconds(self) -> float:
        """Reading the weights (GPU plans; a CPU plan's targets load in seconds)."""
        from .sizing import load_seconds

        return load_seconds(self.weights()) if self.machine.gpus else LOAD_SECONDS_CPU

    def decode_step(self, gpus: int, measured_step_s: float) -> float:
        from .sizing import decode_seconds_per_token

        return decode_seconds_per_token(self.weights(), self.machine, max(1, gpus), measured_step_s,
                                        MEASURED_DECODE_LAYERS, int(self.target_config["num_hidden_layers"]))

    def extract_rate(self, gpus: int, placement: str, store_bytes_per_token: int) -> float:
        from .sizing import extract_tokens_per_s

        computing = gpus if placement == "tp" else 1  # a split runs one GPU at a time
        return extract_tokens_per_s(self.weights(), self.machine, computing, store_bytes_per_token)


# ---------------------------------------------------------------------------------------------- the stages


def _configure_regenerate(pipeline: Pipeline) -> tuple[RegenerateConfig, RegenerateConfig | None]:
    cfg = pipeline.config
    regenerate = pipeline._section(RegenerateConfig, "regenerate", cfg.regenerate or {},
                                   {"out": str(pipeline.path("regenerate")), **pipeline.common()},
                                   {"prompts": ["demo"], "split": "train"})
    if cfg.heldout is None:
        return regenerate, None
    if regenerate.split != "train":
        raise EagletError(f"config {pipeline.config_path}: 'heldout' needs regenerate.split: train (got "
                          f"{regenerate.split!r}): the held-out prompts must not be trained on")
    return regenerate, regenerate.model_copy(update={  # greedy: what `eaglet eval` decodes
        "out": str(pipeline.path("regenerate_heldout")), "split": "heldout", "temperature": 0.0, "top_p": 1.0, "n": 1,
        "max_prompts": cfg.heldout.max_prompts})


def _run_regenerate(pipeline: Pipeline, stage: Stage) -> str:
    from .data.regenerate import run_regenerate

    counts = run_regenerate(stage.config, pipeline.console).manifest["counts"]["requests"]
    if stage.heldout is None:
        return f"{counts} answers by the target"
    held = run_regenerate(stage.heldout, pipeline.console).manifest["counts"]["requests"]
    return f"{counts} answers by the target, {held} held-out"


def _configure_prepare(pipeline: Pipeline) -> tuple[PrepareConfig, PrepareConfig | None]:
    cfg = pipeline.config
    fixed = {"out": str(pipeline.path("prepare")), "overwrite": True, **pipeline.common()}
    if cfg.regenerate is not None:
        fixed["inputs"] = [str(pipeline.path("regenerate"))]
    elif "inputs" not in cfg.prepare:
        raise EagletError(f"config {pipeline.config_path}: prepare.inputs is required without a 'regenerate' section; "
                          "list conversation files, or add `regenerate:` to have the target answer prompts")
    prepare = pipeline._section(PrepareConfig, "prepare", cfg.prepare, fixed)
    heldout = None if cfg.heldout is None else prepare.model_copy(
        update={"inputs": [str(pipeline.path("regenerate_heldout"))], "out": str(pipeline.path("prepare_heldout"))})
    return prepare, heldout


def _run_prepare(pipeline: Pipeline, stage: Stage) -> str:
    from .data.prepare import run_prepare

    manifest = run_prepare(stage.config, pipeline.console).manifest
    if stage.heldout is not None:
        run_prepare(stage.heldout, pipeline.console)
    return (f"{manifest['counts']['samples']:,} samples, {manifest['tokens']['total']:,} tokens, "
            f"draft vocab coverage {manifest['draft_vocab']['coverage']:.1%}")


def _configure_extract(pipeline: Pipeline) -> tuple[ExtractConfig, ExtractConfig | None]:
    extract = pipeline._section(ExtractConfig, "extract", pipeline.config.extract or {},
                                {"prepared": str(pipeline.path("prepare")), "out": str(pipeline.path("extract")),
                                 **pipeline.common()})
    heldout = None if pipeline.config.heldout is None else extract.model_copy(
        update={"prepared": str(pipeline.path("prepare_heldout")), "out": str(pipeline.path("extract_heldout"))})
    return extract, heldout


def _run_extract(pipeline: Pipeline, stage: Stage) -> str:
    from .extract import run_extract

    totals = run_extract(stage.config, pipeline.console).manifest["totals"]
    if stage.heldout is not None:
        run_extract(stage.heldout, pipeline.console)
    return f"{totals['tokens']:,} tokens, {totals['bytes'] / 1e9:.2f} GB"


def _configure_train(pipeline: Pipeline) -> tuple[TrainConfig, None]:
    cfg = pipeline.config
    source = {"store": str(pipeline.path("extract"))} if cfg.extract is not None \
        else {"prepared": str(pipeline.path("prepare"))}
    if cfg.heldout is not None:
        source["eval_store"] = str(pipeline.path("extract_heldout"))
    return pipeline._section(TrainConfig, "train", cfg.train,
                             {"out": str(pipeline.path("train")), **source, **pipeline.common()}), None


def _run_train(pipeline: Pipeline, stage: Stage) -> str:
    from .train import run_train

    result = run_train(stage.config, pipeline.console)
    tau = result.final_eval.get("tau")
    return f"step {result.steps}" + (f", held-out simulated acceptance {tau:.2f}" if tau is not None else "")


def _export_all(pipeline: Pipeline, report: Path | None) -> str:
    from .export.write import export_draft

    section = pipeline.config.export
    for fmt in section.formats:
        export_draft(pipeline.path("train"), fmt, pipeline.path("export") / fmt,
                     speculative_tokens=section.speculative_tokens, report_path=report, overwrite=True,
                     target=pipeline.config.target)
    return ", ".join(str(pipeline.path("export") / fmt) for fmt in section.formats)


def _run_export(pipeline: Pipeline, stage: Stage) -> str:
    return _export_all(pipeline, pipeline.current_report())


def _configure_eval(pipeline: Pipeline) -> tuple[EvalConfig, None]:
    return pipeline._section(EvalConfig, "eval", pipeline.config.eval or {},
                             {"draft": str(pipeline.path("train")), "out": str(pipeline.path("eval")),
                              **pipeline.common()}), None


def _run_eval(pipeline: Pipeline, stage: Stage) -> str:
    from .decode.evaluate import run_eval

    report = run_eval(stage.config, pipeline.console)
    _export_all(pipeline, stage.output / REPORT_FILE)  # the model cards quote the measured τ
    return (f"τ {report['acceptance_length']:.2f}, speedup {report['speedup']:.2f}x, "
            f"lossless {report['lossless']}")


STAGE_KINDS = (
    StageKind("regenerate", "regenerated.jsonl", "heldout.jsonl", (),
              lambda output, run: [answers_manifest(output)],
              lambda run: run.regenerate is not None, _configure_regenerate, _run_regenerate),
    StageKind("prepare", "prepared", "prepared_heldout", ("regenerate",),
              lambda output, run: [output / MANIFEST_FILE],
              lambda run: True, _configure_prepare, _run_prepare),
    StageKind("extract", "store", "store_heldout", ("prepare",),
              lambda output, run: [output / MANIFEST_FILE],
              lambda run: run.extract is not None, _configure_extract, _run_extract),
    StageKind("train", "draft", None, ("extract", "prepare"),
              lambda output, run: [output / DRAFT_WEIGHTS_FILE, output / DRAFT_CONFIG_FILE],
              lambda run: True, _configure_train, _run_train),
    StageKind("export", "export", None, ("train",),
              lambda output, run: [output / fmt / DRAFT_WEIGHTS_FILE for fmt in run.export.formats],
              lambda run: True, lambda pipeline: (pipeline.config.export, None), _run_export, preflight=False),
    StageKind("eval", "eval", None, ("train",),
              lambda output, run: [output / REPORT_FILE],
              lambda run: run.eval is not None, _configure_eval, _run_eval),
)
STAGE_KINDS_BY_NAME = {kind.name: kind for kind in STAGE_KINDS}


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)  # a file, or nothing yet


def _run_relative(value: Any, run: Path) -> Any:
    """``value`` (a stage's settings) with every path inside ``run`` written as '<run>/relative/path'."""
    if isinstance(value, dict):
        return {key: _run_relative(item, run) for key, item in value.items()}
    if isinstance(value, list):
        return [_run_relative(item, run) for item in value]
    if isinstance(value, str):
        try:
            return "<run>/" + Path(value).relative_to(run).as_posix()
        except ValueError:
            return value
    return value


def _count_rows(files: list[str], split: str = "all") -> int:
    """Rows of the .jsonl prompt files that `regenerate` would select (rows without `split` count as train)."""
    from .resources import resolve_input

    total = 0
    for name in files:
        path = Path(resolve_input(name))
        if path.suffix != ".jsonl":
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
    manifest = prepared / MANIFEST_FILE
    return int(read_json(manifest).get("counts", {}).get("samples", 0)) if manifest.is_file() else 0


def _prepared_tokens(prepared: Path) -> int:
    manifest = prepared / MANIFEST_FILE
    if not manifest.is_file():
        return 0
    return int(read_json(manifest).get("tokens", {}).get("total", 0))
