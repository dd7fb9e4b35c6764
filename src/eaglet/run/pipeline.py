"""`eaglet run CONFIG.yaml`: the stages in order, each skipped when its output is complete and was made
from the same settings and the same inputs (manifest hashes), re-run when not; a killed run resumes.

Run directory::

    RUN/run.json             what ran: per stage its fingerprint, output hash, seconds and result
    RUN/regenerated.jsonl    answers by the target (when `regenerate` is configured)
    RUN/prepared/  RUN/store/ (offline)  RUN/draft/  RUN/export/{vllm,sglang,speculators}/  RUN/eval/
    RUN/heldout.jsonl  RUN/prepared_heldout/  RUN/store_heldout/   (with `heldout:`: what training evaluates on)

A stage's fingerprint hashes its validated settings, the content of the user's files it reads (``user_files``), the
target's config, tokenizer and weights (a sample of them: ``model.weight_files``) and the output hashes of the stages
it reads, so a change anywhere re-runs exactly what depends on it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console

from ..config import describe_validation_error
from ..errors import EagletError
from ..export import FORMATS, verifier_reference
from ..formats.files import EXPORTED_DRAFT_CONFIG_FILE, REPORT_FILE, RUN_FILE, RUN_SCHEMA, answers_manifest
from ..formats.records import RunRecord, parse_record
from ..fsio import check_output_dir, load_json_file, output_lock, read_json, sha256_file, write_json_atomic
from .plan import StagePlan, estimate
from .run_config import RunConfig
from .stage_kinds import STAGE_KINDS, STAGE_KINDS_BY_NAME, Stage
from .user_files import changed, digests, named_files


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
        self._file_memo: dict[tuple, str] = {}  # (file, size, mtime) -> sha256, read once per process
        self._target_memo: dict[str, str | None] | None = None  # ``_target_hashes``, read once per process

    # ------------------------------------------------------------------ stage configs

    def _section(
        self,
        cls: type,
        name: str,
        section: dict[str, Any],
        fixed: dict[str, Any],
        defaults: dict[str, Any] | None = None,
    ) -> Any:
        """Validate a section; the keys the run sets are refused there (one source of truth for paths)."""
        clash = sorted(set(section) & set(fixed))
        if clash:
            raise EagletError(
                f"config {self.config_path}: {name}.{clash[0]} is set by `eaglet run` "
                f"({fixed[clash[0]]}); remove it from the '{name}' section"
            )
        try:
            return cls.model_validate((defaults or {}) | section | fixed)
        except ValidationError as exc:
            raise EagletError(
                describe_validation_error(exc, f"config {self.config_path} section '{name}'", cls)
            ) from None

    def _build_stages(self) -> list[Stage]:
        cfg = self.config
        if cfg.heldout is not None and (cfg.regenerate is None or cfg.extract is None):
            raise EagletError(
                f"config {self.config_path}: 'heldout' needs a 'regenerate' section (the held-out split of "
                "its prompts) and offline training (an 'extract' section); remove 'heldout' or add them"
            )
        stages: list[Stage] = []
        for kind in STAGE_KINDS:
            if not kind.present(cfg):
                continue
            config, heldout = kind.configure(self)
            upstream = next(([name] for name in kind.reads if name in {s.name for s in stages}), [])
            stages.append(
                Stage(
                    kind,
                    config,
                    tuple(upstream),
                    self.out / kind.output,
                    heldout,
                    self.out / kind.heldout_output if heldout is not None and kind.heldout_output else None,
                )
            )
        return stages

    def common(self) -> dict[str, Any]:
        """The keys every stage takes from the run itself."""
        return {"target": self.config.target, "trust_remote_code": self.config.trust_remote_code}

    def path(self, name: str) -> Path:
        """The output of stage ``name`` (or its held-out twin, ``name`` + '_heldout') in this run."""
        kind = STAGE_KINDS_BY_NAME[name.removesuffix("_heldout")]
        return self.out / (kind.heldout_output if name.endswith("_heldout") else kind.output)  # type: ignore[operator]

    def speculative_tokens(self) -> int:
        """The draft tokens a round the exports record and the serve commands print: the export section's, else the
        chain the run's eval measures (so the cards' τ is the printed command's), else export's default."""
        from ..export.write import DEFAULT_SPECULATIVE_TOKENS

        if self.config.export.speculative_tokens is not None:
            return self.config.export.speculative_tokens
        evaluation = next((s for s in self.stages if s.name == "eval"), None)
        if evaluation is not None and evaluation.config.mode == "chain":
            return evaluation.config.depth
        return DEFAULT_SPECULATIVE_TOKENS

    def current_report(self) -> Path | None:
        """The eval report, when it was made from the draft being exported (so cards quote its τ)."""
        state = self._state()
        evaluation = next((s for s in self.stages if s.name == "eval"), None)
        if (
            evaluation is not None
            and state.get("eval", {}).get("complete")
            and self._fingerprint_matches(evaluation, state, state["eval"])
        ):
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
        write_json_atomic(
            self.out / RUN_FILE,
            {
                "schema": RUN_SCHEMA,
                "config": self.config.model_dump(),
                "config_file": str(self.config_path),
                "stages": stages,
            },
        )

    def _fingerprint_matches(self, stage: Stage, state: dict[str, Any], record: dict[str, Any] | None) -> bool:
        """The record was made from this stage's settings and inputs."""
        recorded = (record or {}).get("fingerprint")
        # a stage recorded before the target's hashes were part of fingerprints is judged as it was then, so an
        # upgrade does not delete and redo a finished extraction
        with_target = "target" in (record or {})
        return recorded is not None and recorded == self._fingerprint(stage, state, with_target)

    def _fingerprint(self, stage: Stage, state: dict[str, Any], with_target: bool = True) -> str | None:
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
        files = self._user_files(stage, state.get(stage.name))
        if files:
            fields["files"] = {path: digest["sha256"] for path, digest in files.items()}
        if with_target:
            fields["target"] = self._target_hashes()
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def _user_files(self, stage: Stage, record: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
        """The user's files the stage reads: path -> {sha256, size, mtime_ns} (``user_files``)."""
        sections = [c.model_dump(mode="json") for c in (stage.config, stage.heldout) if c is not None]
        recorded = (record or {}).get("files")
        return digests(named_files(sections, self.out), recorded if isinstance(recorded, dict) else {}, self._file_memo)

    def _target_hashes(self) -> dict[str, str | None]:
        """What decides every stage's output about the run's target: its config, tokenizer and a sample of its
        weights, so a target directory rewritten in place (a new fine-tune at the same path) re-runs the stages
        instead of reading as done. A run directory copied with its target to another machine keeps them."""
        if self._target_memo is None:
            from ..model.target import resolve_target, target_info

            resolved = resolve_target(self.config.target, self.config.trust_remote_code)
            try:
                identity = target_info(resolved).identity
                self._target_memo = {key: getattr(identity, key) for key in TARGET_HASHES}
            except EagletError:  # one the stages' preflight refuses (a config.json alone, planned with --plan)
                self._target_memo = dict.fromkeys(TARGET_HASHES)
        return self._target_memo

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

    def _check_out_is_a_run(self) -> None:
        """Refuse an --out that already holds something under a name the run writes but is no eaglet run (no
        run.json): a stage starts by deleting its output, so the user's own eval/ or export/ would be lost."""
        if not self.out.is_dir() or (self.out / RUN_FILE).is_file():
            return
        taken = [path.name for stage in self.stages for path in self._outputs(stage) if path.exists()]
        if taken:
            raise EagletError(
                f"--out {self.out}: holds {taken[0]}, which this run would replace, and is not an eaglet run "
                f"directory (no {RUN_FILE}); choose a new or empty --out"
            )

    def plan(self, from_stage: str | None = None, only: str | None = None) -> list[StagePlan]:
        self._check_out_is_a_run()
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
                plan = (
                    StagePlan(stage.name, "run", "--only")
                    if stage.name == only
                    else StagePlan(stage.name, "skip", "not --only")
                )
            elif forced:
                plan = StagePlan(stage.name, "run", f"--from {from_stage}")
            elif record is None:
                plan = StagePlan(stage.name, "run", "not run yet")
            elif upstream:
                plan = StagePlan(stage.name, "run", f"after {upstream[0]} (if its output changes)")
            elif fingerprint is None:
                plan = StagePlan(stage.name, "run", "after its inputs")
            elif not self._fingerprint_matches(stage, state, record):
                plan = StagePlan(stage.name, "run", self._what_changed(stage, record))
            elif not record.get("complete"):
                plan = StagePlan(stage.name, "run", "interrupted: resumes")
            elif self._output_hash(stage) != record.get("output_hash"):
                plan = StagePlan(stage.name, "run", "output missing or changed")
            else:
                plan = StagePlan(stage.name, "skip", "done, same settings and inputs")
            if plan.action == "run":
                rerunning.add(stage.name)
            plans.append(plan)
        return [self._early_refusal(stage, plan) for stage, plan in zip(self.stages, estimate(self, plans))]

    def _what_changed(self, stage: Stage, record: dict[str, Any]) -> str:
        """Why a stage's fingerprint no longer matches its record, as --plan says it."""
        edited = changed(self._user_files(stage, record), record["files"]) if "files" in record else None
        if edited:
            return f"{edited} changed"
        recorded = record.get("target")
        differs = (
            [key for key in TARGET_HASHES if recorded.get(key) != self._target_hashes()[key]]
            if isinstance(recorded, dict)
            else []
        )
        if differs:
            return f"target {self.config.target} changed ({differs[0].removesuffix('_hash')})"
        return "settings or inputs changed"

    def _early_refusal(self, stage: Stage, plan: StagePlan) -> StagePlan:
        """``plan`` refused by the first failed check the stage can have before the run's first stage (eval's prompts
        against the target's context), so a run does not train for an eval that will refuse."""
        if plan.action != "run" or plan.refusal or stage.kind.early_checks is None:
            return plan
        from ..preflight.stages import FAIL

        failed = next((c for c in stage.kind.early_checks(stage.config) if c.status == FAIL), None)
        if failed is None:
            return plan
        return dataclasses.replace(plan, refusal=failed.refusal(stage.name))

    # ------------------------------------------------------------------ running

    def run(self, from_stage: str | None = None, only: str | None = None) -> RunResult:
        """The stages in order (each skipped when done from the same settings and inputs); one run at a time."""
        check_output_dir(self.out)
        with output_lock(self.out):
            return self._run(from_stage, only)

    def _run(self, from_stage: str | None, only: str | None) -> RunResult:
        from ..preflight.stages import FAIL, run_checks

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
                must_run = (
                    fingerprint is None
                    or not self._fingerprint_matches(stage, state, record)
                    or not record.get("complete")
                    or self._output_hash(stage) != record.get("output_hash")
                )
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
                failed = next((c for c in checks if c.status == FAIL), None)
                if failed is not None:
                    raise EagletError(failed.refusal(stage.name))
            files = self._user_files(stage, record)
            target = {"target": self._target_hashes()}
            state[stage.name] = {
                "fingerprint": fingerprint,
                "complete": False,
                **target,
                **({"files": files} if files else {}),
            }
            self._save_state(state)
            self.console.print(f"[bold]== {stage.name}[/] ({plan.reason})")
            started = time.perf_counter()
            outcome = stage.kind.execute(self, stage)
            seconds = time.perf_counter() - started
            state[stage.name] = {
                "fingerprint": fingerprint,
                "complete": True,
                "output_hash": self._output_hash(stage),
                "seconds": round(seconds, 1),
                "result": outcome,
                **target,
                **({"files": files} if files else {}),
            }
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
                commands[fmt] = FORMATS[fmt].serve_command(verifier, self.speculative_tokens(), str(directory))
        return commands


TARGET_HASHES = ("config_hash", "tokenizer_hash", "weights_hash")  # of the run's target, in every fingerprint


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
