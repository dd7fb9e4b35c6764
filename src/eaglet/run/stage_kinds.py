"""The stages of `eaglet run` as data: each one's output, inputs, identifying files, settings and work."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..config import EvalConfig, ExtractConfig, PrepareConfig, RegenerateConfig, SynthesizeConfig, TrainConfig
from ..errors import EagletError, Interrupted
from ..formats.draft_config import SERVED_BY_VLLM
from ..formats.files import DRAFT_CONFIG_FILE, DRAFT_WEIGHTS_FILE, MANIFEST_FILE, REPORT_FILE, answers_manifest
from .run_config import RunConfig

if TYPE_CHECKING:
    from .pipeline import Pipeline


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
    # the checks of its settings that need nothing an earlier stage makes, run before the run's first stage
    early_checks: Callable[[Any], list[Any]] | None = None


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


def _configure_synthesize(pipeline: Pipeline) -> tuple[SynthesizeConfig, None]:
    cfg = pipeline.config
    if cfg.regenerate is None:
        raise EagletError(
            f"config {pipeline.config_path}: 'synthesize' writes prompts for `regenerate` to answer; add a "
            "'regenerate' section or remove 'synthesize'"
        )
    fixed = {"out": str(pipeline.path("synthesize")), **pipeline.common()}
    return pipeline._section(SynthesizeConfig, "synthesize", cfg.synthesize or {}, fixed), None


def _run_synthesize(pipeline: Pipeline, stage: Stage) -> str:
    from ..data.synthesize import run_synthesize

    result = run_synthesize(stage.config, pipeline.console)
    return f"{result.kept} prompts by the target ({result.manifest['counts']['heldout']} held out)"


def _configure_regenerate(pipeline: Pipeline) -> tuple[RegenerateConfig, RegenerateConfig | None]:
    cfg = pipeline.config
    regenerate = pipeline._section(
        RegenerateConfig,
        "regenerate",
        cfg.regenerate or {},
        {"out": str(pipeline.path("regenerate")), **pipeline.common()},
        {"prompts": ["demo"], "split": "train"},
    )
    if cfg.synthesize is not None:  # the target's own prompts beside the given ones, split as they were written
        regenerate = regenerate.model_copy(update={"prompts": [*regenerate.prompts, str(pipeline.path("synthesize"))]})
    if cfg.heldout is None:
        return regenerate, None
    if regenerate.split != "train":
        raise EagletError(
            f"config {pipeline.config_path}: 'heldout' needs regenerate.split: train (got "
            f"{regenerate.split!r}): the held-out prompts must not be trained on"
        )
    return regenerate, regenerate.model_copy(
        update={  # greedy: what `eaglet eval` decodes
            "out": str(pipeline.path("regenerate_heldout")),
            "split": "heldout",
            "temperature": 0.0,
            "top_p": 1.0,
            "n": 1,
            "max_prompts": cfg.heldout.max_prompts,
        }
    )


def _run_regenerate(pipeline: Pipeline, stage: Stage) -> str:
    from ..data.regenerate import run_regenerate

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
        raise EagletError(
            f"config {pipeline.config_path}: prepare.inputs is required without a 'regenerate' section; "
            "list conversation files, or add `regenerate:` to have the target answer prompts"
        )
    prepare = pipeline._section(PrepareConfig, "prepare", cfg.prepare, fixed)
    heldout = (
        None
        if cfg.heldout is None
        else prepare.model_copy(
            update={
                "inputs": [str(pipeline.path("regenerate_heldout"))],
                "out": str(pipeline.path("prepare_heldout")),
                "split": "heldout",
            }
        )
    )
    return prepare, heldout


def _run_prepare(pipeline: Pipeline, stage: Stage) -> str:
    from ..data.prepare import run_prepare

    manifest = run_prepare(stage.config, pipeline.console).manifest
    if stage.heldout is not None:
        run_prepare(stage.heldout, pipeline.console)
    return (
        f"{manifest['counts']['samples']:,} samples, {manifest['tokens']['total']:,} tokens, "
        f"draft vocab coverage {manifest['draft_vocab']['coverage']:.1%}"
    )


def _configure_extract(pipeline: Pipeline) -> tuple[ExtractConfig, ExtractConfig | None]:
    extract = pipeline._section(
        ExtractConfig,
        "extract",
        pipeline.config.extract or {},
        {"prepared": str(pipeline.path("prepare")), "out": str(pipeline.path("extract")), **pipeline.common()},
    )
    heldout = (
        None
        if pipeline.config.heldout is None
        else extract.model_copy(
            update={"prepared": str(pipeline.path("prepare_heldout")), "out": str(pipeline.path("extract_heldout"))}
        )
    )
    return extract, heldout


def _run_extract(pipeline: Pipeline, stage: Stage) -> str:
    from ..extract.extractor import run_extract

    totals = run_extract(stage.config, pipeline.console).manifest["totals"]
    if stage.heldout is not None:
        run_extract(stage.heldout, pipeline.console)
    return f"{totals['tokens']:,} tokens, {totals['bytes'] / 1e9:.2f} GB"


def _configure_train(pipeline: Pipeline) -> tuple[TrainConfig, None]:
    cfg = pipeline.config
    source = (
        {"store": str(pipeline.path("extract"))}
        if cfg.extract is not None
        else {"prepared": str(pipeline.path("prepare"))}
    )
    if cfg.heldout is not None:
        source["eval_store"] = str(pipeline.path("extract_heldout"))
    return pipeline._section(
        TrainConfig, "train", cfg.train, {"out": str(pipeline.path("train")), **source, **pipeline.common()}
    ), None


def _run_train(pipeline: Pipeline, stage: Stage) -> str:
    from ..train import run_train
    from ..train.heldout import held_out_tau

    result = run_train(stage.config, pipeline.console)
    if result.interrupted_by:  # not complete: the next run resumes the checkpoint instead of exporting this draft
        stopped = result.interruption()
        raise Interrupted(f"train {stopped.message}", stopped.exit_code)
    evaluation = result.final_eval
    return f"step {result.steps}" + (
        f", {held_out_tau(evaluation)}" if evaluation.get("acceptance_length") is not None else ""
    )


def _export_all(pipeline: Pipeline, report: Path | None) -> str:
    from ..export.write import export_draft

    section = pipeline.config.export
    for fmt in section.formats:
        export_draft(
            pipeline.path("train"),
            fmt,
            pipeline.path("export") / fmt,
            speculative_tokens=pipeline.speculative_tokens(),
            report_path=report,
            overwrite=True,
            target=pipeline.config.target,
        )
    return ", ".join(str(pipeline.path("export") / fmt) for fmt in section.formats)


def _run_export(pipeline: Pipeline, stage: Stage) -> str:
    return _export_all(pipeline, pipeline.current_report())


def _configure_eval(pipeline: Pipeline) -> tuple[EvalConfig, None]:
    evaluate = pipeline._section(
        EvalConfig,
        "eval",
        pipeline.config.eval or {},
        {"draft": str(pipeline.path("train")), "out": str(pipeline.path("eval")), **pipeline.common()},
    )
    if pipeline.config.synthesize is not None:  # judged on the target's own prompts too: those training never saw
        held_out = _configure_synthesize(pipeline)[0].heldout_fraction > 0
        if held_out or evaluate.split != "heldout":
            evaluate = evaluate.model_copy(update={"prompts": [*evaluate.prompts, str(pipeline.path("synthesize"))]})
    if evaluate.backend == "vllm":  # vLLM serves the export the run writes before eval, as a user would serve it
        served = SERVED_BY_VLLM.exported
        if served not in pipeline.config.export.formats:
            raise EagletError(
                f"config {pipeline.config_path}: eval.backend vllm serves the {served} export; add {served} to "
                "export.formats"
            )
        evaluate = evaluate.model_copy(update={"draft": str(pipeline.path("export") / served)})
    return evaluate, None


def _early_eval_checks(config: EvalConfig) -> list[Any]:
    from ..preflight.stages import eval_early_checks

    return eval_early_checks(config)


def _run_eval(pipeline: Pipeline, stage: Stage) -> str:
    from ..decode.evaluate import run_eval

    report = run_eval(stage.config, pipeline.console)
    _export_all(pipeline, stage.output / REPORT_FILE)  # the model cards quote the measured τ
    return f"τ {report['acceptance_length']:.2f}, speedup {report['speedup']:.2f}x, lossless {report['lossless']}"


STAGE_KINDS = (
    StageKind(
        "synthesize",
        "synthesized.jsonl",
        None,
        (),
        lambda output, run: [output],
        lambda run: run.synthesize is not None,
        _configure_synthesize,
        _run_synthesize,
    ),
    StageKind(
        "regenerate",
        "regenerated.jsonl",
        "heldout.jsonl",
        ("synthesize",),
        lambda output, run: [answers_manifest(output)],
        lambda run: run.regenerate is not None,
        _configure_regenerate,
        _run_regenerate,
    ),
    StageKind(
        "prepare",
        "prepared",
        "prepared_heldout",
        ("regenerate",),
        lambda output, run: [output / MANIFEST_FILE],
        lambda run: True,
        _configure_prepare,
        _run_prepare,
    ),
    StageKind(
        "extract",
        "store",
        "store_heldout",
        ("prepare",),
        lambda output, run: [output / MANIFEST_FILE],
        lambda run: run.extract is not None,
        _configure_extract,
        _run_extract,
    ),
    StageKind(
        "train",
        "draft",
        None,
        ("extract", "prepare"),
        lambda output, run: [output / DRAFT_WEIGHTS_FILE, output / DRAFT_CONFIG_FILE],
        lambda run: True,
        _configure_train,
        _run_train,
    ),
    StageKind(
        "export",
        "export",
        None,
        ("train",),
        lambda output, run: [output / fmt / DRAFT_WEIGHTS_FILE for fmt in run.export.formats],
        lambda run: True,
        lambda pipeline: (pipeline.config.export, None),
        _run_export,
        preflight=False,
    ),
    StageKind(
        "eval",
        "eval",
        None,
        ("train",),
        lambda output, run: [output / REPORT_FILE],
        lambda run: run.eval is not None,
        _configure_eval,
        _run_eval,
        early_checks=_early_eval_checks,
    ),
)
STAGE_KINDS_BY_NAME = {kind.name: kind for kind in STAGE_KINDS}
