"""The `eaglet` command: one typer app; each subcommand is a thin call into a stage module."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from .. import __version__
from ..config import (
    BenchConfig,
    EvalConfig,
    ExportConfig,
    ExtractConfig,
    PrepareConfig,
    RegenerateConfig,
    SynthesizeConfig,
    TrainConfig,
)
from ..errors import SIGNAL_EXIT_BASE, EagletError, Interrupted
from .console import err_console, out_console
from .stage_options import StageOptions, stage_command

app = typer.Typer(
    name="eaglet",
    help="Train EAGLE-3 draft models for any Hugging Face causal LM and hand them to vLLM and SGLang.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
target_app = typer.Typer(help="Inspect targets.", no_args_is_help=True)
app.add_typer(target_app, name="target")
store_app = typer.Typer(help="Inspect and verify hidden-state stores.", no_args_is_help=True)
app.add_typer(store_app, name="store")

TARGET_HELP = "'embedded' (SmolLM2-135M-Instruct), an HF model directory, a .gguf file or a hub id"
INTERRUPTED_EXIT = Interrupted.exit_code
INTERRUPTED_LINE = (
    "interrupted; run the same command again: regenerate, synthesize, extract, train and run go on from where they "
    "stopped"
)
DISK_BOUND_SHARE = 0.2  # extract warns when more than this share of its time went to waiting on writes


def _version(value: bool) -> None:
    if value:
        out_console.print(f"eaglet {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="print the version"),
) -> None:
    """eaglet: conversations -> prepared tokens -> hidden states -> EAGLE-3 draft -> vLLM / SGLang."""


# ---------------------------------------------------------------------------------------------
# target


@target_app.command("info")
def target_info_cmd(
    target: str = typer.Option("embedded", "--target", "-t", help=TARGET_HELP),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    trust_remote_code: bool = typer.Option(False, help="allow the model's own Python code (off by default)"),
) -> None:
    """Describe a target without loading its weights: architecture, sizes, template, aux layer ids."""
    from ..model.target import resolve_target, target_info

    info = target_info(resolve_target(target, trust_remote_code))
    if as_json:
        out_console.print_json(json.dumps(info.as_dict()))
        return
    table = Table(title=f"target {info.name}", show_header=False)
    rows = [
        ("path", info.path),
        ("architecture", f"{info.architecture} ({info.model_type})"),
        ("decoder layers", str(info.num_layers)),
        ("hidden size", str(info.hidden_size)),
        ("vocab size", f"{info.vocab_size:,}"),
        ("parameters", f"{info.num_parameters:,}"),
        ("dtype", info.dtype),
        ("chat template", "yes" if info.has_chat_template else "no (pass --chat-template to prepare)"),
        ("default aux layer ids", f"{list(info.aux_layer_ids)} (input of decoder layer i = HF hidden_states[i])"),
        ("config hash", info.config_hash[:16]),
        ("tokenizer hash", info.tokenizer_hash[:16]),
    ]
    for key, value in rows:
        table.add_row(key, escape(value))
    out_console.print(table)


# ---------------------------------------------------------------------------------------------
# prepare


@stage_command(app, PrepareConfig, "prepare", arguments=("inputs",), short={"out": "-o", "target": "-t"})
def prepare(options: StageOptions) -> None:
    """Conversations -> token ids + assistant loss masks + draft vocabulary."""
    from ..data.prepare import run_prepare

    cfg = options.build()
    result = run_prepare(cfg, err_console)
    m = result.manifest
    table = Table(title=f"prepared {result.out}", show_header=False)
    table.add_row("samples", f"{m['counts']['samples']:,}")
    table.add_row("tokens (assistant)", f"{m['tokens']['total']:,} ({m['tokens']['assistant']:,})")
    table.add_row("mean / max length", f"{m['tokens']['length']['mean']} / {m['tokens']['length']['max']}")
    table.add_row("truncated to --max-len", str(m["counts"]["truncated_to_max_len"]))
    table.add_row("skipped rows", str(len(m["skipped_rows"])))
    table.add_row("draft vocab", f"{m['draft_vocab']['size']:,} tokens, coverage {m['draft_vocab']['coverage']:.2%}")
    table.add_row("seconds", str(m["seconds"]))
    out_console.print(table)


# ---------------------------------------------------------------------------------------------
# synthesize


@stage_command(app, SynthesizeConfig, "synthesize", short={"out": "-o", "target": "-t"})
def synthesize(options: StageOptions) -> None:
    """Prompts written by the target itself from its chat template's user turn (Magpie), deduplicated."""
    from ..data.synthesize import run_synthesize

    cfg = options.build()
    result = run_synthesize(cfg, err_console)
    counts = result.manifest.get("counts", {})
    dropped = ", ".join(f"{n} {reason}" for reason, n in counts.get("dropped", {}).items() if n) or "none"
    out_console.print(
        f"wrote {result.kept} prompts to {result.out} ({counts.get('heldout', 0)} held out) from {result.generated} "
        f"generated (dropped: {dropped}) in {result.seconds:.1f} s; answer them with `eaglet regenerate {result.out}`"
    )


# ---------------------------------------------------------------------------------------------
# regenerate


@stage_command(app, RegenerateConfig, "regenerate", arguments=("prompts",), short={"out": "-o", "target": "-t"})
def regenerate(options: StageOptions) -> None:
    """The target writes the assistant answers (self-distillation), resumable after a kill."""
    from ..data.regenerate import run_regenerate
    from ..resources import resolve_input

    if options.values["prompts"]:
        options.values["prompts"] = [resolve_input(p) for p in options.values["prompts"]]
    cfg = options.build()
    result = run_regenerate(cfg, err_console)
    rate = f"{result.new_tokens / result.seconds:,.1f} tok/s" if result.seconds > 0 and result.new_tokens else "-"
    out_console.print(
        f"wrote {result.written} answers to {result.out} ({result.skipped_done} already there), "
        f"{result.new_tokens:,} new tokens in {result.seconds:.1f} s ({rate})"
    )


# ---------------------------------------------------------------------------------------------
# extract and store


@stage_command(app, ExtractConfig, "extract", short={"prepared": "-p", "out": "-o", "target": "-t"})
def extract(options: StageOptions) -> None:
    """Target hidden states (aux layers + final-normed last) for a prepared set, into a crash-safe store."""
    from ..extract.extractor import run_extract

    cfg = options.build()
    result = run_extract(cfg, err_console)
    totals = result.manifest["totals"]
    rate = (
        f"{result.tokens_computed / result.seconds:,.0f} tok/s"
        if result.seconds > 0 and result.tokens_computed
        else "-"
    )
    out_console.print(
        f"store {result.out}: {len(result.manifest['shards'])}/{result.manifest['num_shards']} shards, "
        f"{totals['samples']:,} samples, {totals['tokens']:,} tokens, {totals['bytes'] / 1e6:,.1f} MB; "
        f"computed {result.shards_computed} shard(s) this run ({rate})"
    )
    if result.seconds > 0 and result.writer_stall_s > DISK_BOUND_SHARE * result.seconds:
        err_console.print(
            f"[yellow]note:[/] the target waited {result.writer_stall_s:.1f} s of {result.seconds:.1f} s on the disk; "
            "--storage-dtype fp8-aux writes 0.63x the bytes (fp8 0.5x), a faster disk removes the wait"
        )


@store_app.command("verify")
def store_verify(
    store: Path = typer.Argument(..., help="store directory"),
    repair: bool = typer.Option(False, "--repair", help="re-extract only the bad shards"),
    no_prepared: bool = typer.Option(False, "--no-prepared", help="skip the token check against the prepared set"),
    target: Optional[str] = typer.Option(
        None,
        "--target",
        "-t",
        help="--repair: the target to re-extract with "
        "(default: the one the store records; it must be the one extracted from)",
    ),
    trust_remote_code: bool = typer.Option(
        False, help="--repair: allow the target's own Python code (never taken from the store)"
    ),
) -> None:
    """Check checksums, shapes, dtypes, finite values and token ids of every shard; name each bad one."""
    from ..extract.store_verify import repair_store, verify_store

    problems = verify_store(store, check_prepared=not no_prepared, console=err_console)
    for problem in problems:
        err_console.print(
            f"[red]bad shard[/] {escape(str(store / problem.file))}: {escape(problem.reason)}", highlight=False
        )
    if problems and repair:
        repair_store(store, problems, err_console, target, trust_remote_code)
        problems = verify_store(store, check_prepared=not no_prepared, console=err_console)
        if not problems:
            out_console.print(f"store {store}: repaired; all shards verify")
            return
    if problems:
        raise EagletError(f"{store}: {len(problems)} bad shard(s); run `eaglet store verify {store} --repair`")
    out_console.print(f"store {store}: all shards verify")


@store_app.command("info")
def store_info(
    store: Path = typer.Argument(..., help="store directory"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Summarise a store: target, aux layers, dtype, shards, samples, tokens, size."""
    from ..extract.store_verify import store_summary

    summary = store_summary(store)
    if as_json:
        out_console.print_json(json.dumps(summary))
        return
    table = Table(title=f"store {store}", show_header=False)
    for key, value in summary.items():
        table.add_row(
            key, escape(f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value))
        )
    out_console.print(table)


# ---------------------------------------------------------------------------------------------
# train


@stage_command(app, TrainConfig, "train", short={"out": "-o", "target": "-t"})
def train(options: StageOptions) -> None:
    """Train the EAGLE-3 draft (training-time test) on a store or online; resumable; torchrun for DDP or FSDP2."""
    from ..train import run_train
    from ..train.heldout import held_out_tau

    cfg = options.build()
    result = run_train(cfg, err_console)
    evaluation = result.final_eval
    if evaluation.get("acceptance_length") is not None:
        tau = f", {held_out_tau(evaluation)} (accuracy by step {evaluation['acc']})"
    elif evaluation:
        tau = ", no held-out samples to evaluate (use --eval-store, or more data)"
    else:
        tau = ""
    out_console.print(f"draft {result.out}: step {result.steps} in {result.seconds:.1f} s{tau}")
    if result.interrupted_by == signal.SIGINT:
        raise result.interruption()
    if result.interrupted_by:  # a scheduler's SIGTERM: a clean stop, exit 0
        err_console.print(f"[yellow]{escape(result.interruption().message)}[/]", highlight=False)


# ---------------------------------------------------------------------------------------------
# export and eval


@stage_command(
    app,
    ExportConfig,
    "export",
    short={"draft": "-d", "format": "-f", "out": "-o", "target": "-t"},
    renamed={"engines": "--engine"},
)
def export(
    options: StageOptions,
    check: Optional[Path] = typer.Option(
        None, "--check", help="check an export directory against each engine's released loader instead of writing one"
    ),
    as_json: bool = typer.Option(False, "--json", help="with --check: print JSON"),
) -> None:
    """Write a draft as the directory vLLM, SGLang or speculators load (config.json + model.safetensors + README)."""
    if check is not None:
        _export_check(check, as_json)
        return
    from ..export.write import export_draft

    cfg = options.build()
    path = export_draft(
        cfg.draft, cfg.format, cfg.out, cfg.verifier, cfg.speculative_tokens, cfg.report, cfg.overwrite, cfg.target
    )
    out_console.print(
        f"exported {cfg.draft} as {cfg.format} -> {path} (serve it as its README.md shows; "
        f"`eaglet export --check {path}` checks it against each engine)"
    )


def _export_check(directory: Path, as_json: bool) -> None:
    """Each consumer's verdict on an export directory: a table (or JSON); exit 2 when one fails."""
    from ..consumers.export_check import FAIL, check_export

    results = check_export(directory)
    if as_json:
        out_console.print_json(json.dumps({"directory": str(directory), "results": [r.as_dict() for r in results]}))
    else:
        styles = {"pass": "green", "unverified": "yellow", "fail": "bold red"}
        table = Table(title=f"export check {directory}")
        for column in ("consumer", "status", "findings"):
            table.add_column(column)
        for result in results:
            table.add_row(
                result.consumer, f"[{styles[result.status]}]{result.status}[/]", escape("\n".join(result.findings))
            )
        out_console.print(table)
    failed = [r for r in results if r.status == FAIL]
    if failed:
        raise EagletError(f"{directory}: {failed[0].consumer} would not serve it as trained: {failed[0].findings[0]}")


@stage_command(app, EvalConfig, "eval", short={"draft": "-d", "out": "-o", "target": "-t"})
def eval_cmd(options: StageOptions) -> None:
    """Speculative decoding with the draft: τ, speedup over the same engine without it, lossless check."""
    from ..decode.evaluate import run_eval

    cfg = options.build()
    report = run_eval(cfg, err_console)
    out_console.print(
        f"τ {report['acceptance_length']:.2f}, {report['tokens_per_s']} tok/s vs {report['baseline_tokens_per_s']} "
        f"without the draft: speedup {report['speedup']:.2f}x, lossless {report['lossless']} -> {cfg.out}/report.md"
    )


@stage_command(app, BenchConfig, "bench", short={"draft": "-d", "out": "-o", "target": "-t"})
def bench(options: StageOptions) -> None:
    """The target served by vLLM with and without the draft at each concurrency and temperature: tok/s, time per
    output token, τ and acceptance by position from vLLM's counters (bench.json, bench.png)."""
    from ..decode.vllm_bench import BENCH_FILE, run_bench

    cfg = options.build()
    report = run_bench(cfg, err_console)
    table = Table("T", "in flight", "tok/s", "alone", "speedup", "ms/token", "τ", "by position")
    for cell in report["cells"]:
        table.add_row(
            f"{cell['temperature']:g}",
            str(cell["concurrency"]),
            f"{cell['tokens_per_s']:.1f}",
            f"{cell['baseline_tokens_per_s']:.1f}",
            f"{cell['speedup']:.2f}x",
            f"{cell['ms_per_output_token']:.2f}",
            f"{cell['acceptance_length']:.2f}" if cell["acceptance_length"] else "-",
            " / ".join(f"{p:.2f}" for p in cell["acceptance_by_position"] or []),
        )
    out_console.print(table)
    out_console.print(f"measured as served by:\n{report['serve_command']}\n-> {cfg.out}/{BENCH_FILE}, bench.png")


# ---------------------------------------------------------------------------------------------
# preflight


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def preflight(
    ctx: typer.Context,
    stage: str = typer.Argument(
        ..., help="prepare, regenerate, extract, train, export, eval, bench; calls (API check of your code); self"
    ),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
    strict: bool = typer.Option(False, "--strict", help="exit 1 on warnings"),
) -> None:
    """Run a stage's checks alone (same options as the stage), in seconds, loading no weights.

    Exit code: 0 pass, 1 warnings with --strict, 2 failure."""
    from ..preflight.stages import STAGE_CHECKS

    if stage in ("calls", "self"):
        command = typer.main.get_command(app).commands[f"preflight-{stage}"]
        sub_context = command.make_context(
            f"preflight {stage}",
            list(ctx.args) + (["--json"] if as_json else []) + (["--strict"] if strict else []),
            parent=ctx,
        )
        command.invoke(sub_context)
        return
    if stage not in STAGE_CHECKS:
        raise EagletError(f"preflight: unknown stage {stage!r}; choose one of {', '.join(STAGE_CHECKS)}, calls, self")
    command = typer.main.get_command(app).commands[stage]
    sub_context = command.make_context(stage, list(ctx.args), parent=ctx)
    sub_context.obj = {"only": True, "json": as_json, "strict": strict}
    command.invoke(sub_context)


def _split_spec(spec: str) -> tuple[str, str | None]:
    name, _, version = spec.partition("==")
    return name.strip(), (version.strip() or None)


def _calls_report(paths: list[Path], against: str, site_packages: Optional[Path], wheel: Optional[Path]):
    from ..apicheck.check import check_calls, library_roots

    package, wanted = _split_spec(against)
    roots, source = library_roots(package, site_packages, wheel)
    report = check_calls(paths, package, roots, source)
    if wanted and report.version not in (wanted, "unknown"):
        raise EagletError(
            f"--against {against}: {source} holds {package} {report.version}; point --site-packages/--wheel at {wanted}"
        )
    return report


def _print_calls(report, output_format: str, strict: bool) -> None:
    from ..apicheck.report import as_sarif, as_text

    if output_format == "json":
        out_console.print_json(json.dumps(report.as_json()))
    elif output_format == "sarif":
        out_console.print_json(json.dumps(as_sarif(report)))
    else:
        out_console.print(as_text(report), highlight=False, soft_wrap=True)
    raise typer.Exit(2 if report.errors else 1 if report.warnings and strict else 0)


@app.command("preflight-calls", hidden=True)
def preflight_calls(
    paths: List[Path] = typer.Argument(..., help="files or directories of the calling code"),
    against: str = typer.Option(
        ..., "--against", help="the library: PKG or PKG==VERSION (the old one in upgrade mode)"
    ),
    site_packages: Optional[Path] = typer.Option(None, "--site-packages", help="read PKG from this directory"),
    wheel: Optional[Path] = typer.Option(None, "--wheel", help="read PKG from this wheel"),
    to: Optional[str] = typer.Option(None, "--to", help="upgrade mode: PKG==VERSION to compare with --against"),
    to_site_packages: Optional[Path] = typer.Option(
        None, "--to-site-packages", help="upgrade mode: the new version's directory"
    ),
    to_wheel: Optional[Path] = typer.Option(None, "--to-wheel", help="upgrade mode: the new version's wheel"),
    output_format: str = typer.Option("text", "--format", help="text, json or sarif"),
    as_json: bool = typer.Option(False, "--json", help="same as --format json"),
    strict: bool = typer.Option(False, "--strict", help="exit 1 on warnings"),
) -> None:
    """`eaglet preflight calls PATH... --against PKG`: bind every call into PKG to its signatures, statically."""
    from ..apicheck.check import upgrade_report

    output_format = "json" if as_json else output_format
    if output_format not in ("text", "json", "sarif"):
        raise EagletError(f"--format {output_format}: choose text, json or sarif")
    report = _calls_report(paths, against, site_packages, wheel)
    if to is not None:
        if _split_spec(to)[0] != _split_spec(against)[0]:
            raise EagletError(
                f"--to {to}: upgrade mode compares two versions of one package ({_split_spec(against)[0]})"
            )
        if to_site_packages is None and to_wheel is None:
            raise EagletError("--to needs --to-site-packages DIR or --to-wheel FILE holding the new version")
        report = upgrade_report(report, _calls_report(paths, to, to_site_packages, to_wheel))
    _print_calls(report, output_format, strict)


@app.command("preflight-self", hidden=True)
def preflight_self(
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
    strict: bool = typer.Option(False, "--strict", help="exit 1 on warnings"),
) -> None:
    """eaglet's own calls into transformers, checked against the installed version (before any model load)."""
    report = _calls_report([Path(__file__).parents[1]], "transformers", None, None)
    _print_calls(report, "json" if as_json else "text", strict)


# ---------------------------------------------------------------------------------------------
# demo


def _human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def _plan_table(plans: list, out: Path) -> Table:
    from ..fsio import free_disk_bytes

    needed = sum(p.disk_bytes for p in plans if p.action == "run")
    free = free_disk_bytes(out)
    caption = f"needs ~{_human_bytes(needed)}; {_human_bytes(free)} free at {out}"
    if needed > free:
        caption = f"[bold red]{caption}: not enough disk[/]"
    sources = [f"{plan.name} time at {plan.rate_source}" for plan in plans if plan.action == "run" and plan.rate_source]
    caption = "\n".join([caption, *map(escape, sources)])
    table = Table(title="eaglet run --plan (nothing runs)", caption=caption)
    placed = any(plan.memory for plan in plans)  # GPU plans: where the target goes, per GPU
    for column in ("stage", "action", "why", "disk (est.)", "time (est.)") + (
        ("target per GPU: weights + activations",) if placed else ()
    ):
        table.add_column(column)
    for plan in plans:
        disk = _human_bytes(plan.disk_bytes) if plan.action == "run" and plan.disk_bytes else "-"
        seconds = (
            "-"
            if plan.action != "run" or plan.seconds != plan.seconds or not plan.seconds
            else f"{plan.seconds / 60:.1f} min"
        )
        memory = (f"[bold red]{escape(plan.memory)}: refused[/]" if plan.refusal else escape(plan.memory)) or "-"
        table.add_row(plan.name, plan.action, plan.reason, disk, seconds, *((memory,) if placed else ()))
    return table


def _run_summary(result) -> None:
    """The final table, where the drafts are, how to serve them."""
    table = Table(title=f"eaglet run: {result.out}")
    for column, justify in (("stage", "left"), ("status", "left"), ("seconds", "right"), ("result", "left")):
        table.add_column(column, justify=justify)
    for outcome in result.outcomes:
        table.add_row(
            outcome.name,
            outcome.status,
            f"{outcome.seconds:.1f}" if outcome.status == "ran" else "-",
            escape(outcome.result),
        )
    out_console.print(table)
    for fmt, command in result.serve.items():
        out_console.print(
            f"# {fmt}: {result.out / 'export' / fmt} (model card: README.md there)\n{command}", highlight=False
        )
    if result.report is not None:
        report = result.report
        out_console.print(
            f"τ {report['acceptance_length']:.2f} tokens per target forward, speedup {report['speedup']:.2f}x over the "
            f"same engine without a draft, lossless {report['lossless']} (report: {result.out / 'eval' / 'report.md'})",
            highlight=False,
        )


@app.command()
def run(
    config: Path = typer.Argument(..., help="run config: one YAML with a section per stage"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="run directory (overrides the config's `out`)"),
    from_stage: Optional[str] = typer.Option(None, "--from", help="re-run from this stage on"),
    only: Optional[str] = typer.Option(None, "--only", help="run only this stage"),
    plan: bool = typer.Option(False, "--plan", help="print what would run, with estimated disk and time; run nothing"),
    sets: list[str] = typer.Option(
        [], "--set", help="override a key of the config: --set train.lr=1e-4 (section.key=value, repeatable)"
    ),
) -> None:
    """The whole path from one YAML: regenerate -> prepare -> extract (or online) -> train -> export -> eval.

    Stages whose output is complete and made from the same settings and inputs are skipped; a killed
    run resumes with the same command."""
    from ..run import Pipeline, load_run_config

    cfg = load_run_config(config, {"out": _run_directory(out)} if out is not None else None, sets)
    pipeline = Pipeline(cfg, config, err_console)
    if plan:
        _print_plan(pipeline, pipeline.plan(from_stage, only))
        return
    _run_summary(pipeline.run(from_stage, only))


def _run_directory(out: str) -> str:
    """--out of run and demo: an empty value (an unset shell variable) is refused, not taken as the current directory
    or the config's."""
    if not out.strip():
        raise EagletError("--out is empty; give the run directory")
    return out


def _print_plan(pipeline, plans: list) -> None:
    """The plan's table, then the first refusal of a stage to run as the error the run itself would stop with; a
    run directory that cannot be one (a file) is refused before the table, which would size a run that cannot start."""
    from ..fsio import check_output_dir

    check_output_dir(pipeline.out)
    out_console.print(_plan_table(plans, pipeline.out))
    refused = next((p.refusal for p in plans if p.action == "run" and p.refusal), None)
    if refused:
        raise EagletError(refused)


@app.command()
def demo(
    out: str = typer.Option("eaglet-demo", "--out", "-o", help="run directory"),
    scale: str = typer.Option(
        "auto", help="cpu (a laptop, ~8 min), gpu (one H200, ~10 min) or auto (gpu when CUDA is there)"
    ),
    plan: bool = typer.Option(False, "--plan", help="print what would run; run nothing"),
) -> None:
    """`eaglet run` with a built-in config on the embedded target and the shipped demo prompts."""
    from ..resources import demo_config_path
    from ..run import Pipeline, load_run_config

    if scale not in ("auto", "cpu", "gpu"):
        raise EagletError(f"--scale {scale}: choose cpu, gpu or auto")
    import torch

    if scale == "auto":
        scale = "gpu" if torch.cuda.is_available() else "cpu"
    elif scale == "gpu" and not torch.cuda.is_available():  # its sizes on a CPU would run for hours
        raise EagletError(
            f"--scale gpu: torch {torch.__version__} sees no CUDA GPU here; run `eaglet demo --scale cpu` (~8 min), "
            "or on a machine with one"
        )
    config = demo_config_path(scale)
    pipeline = Pipeline(load_run_config(config, {"out": _run_directory(out)}), config, err_console)
    if plan:
        _print_plan(pipeline, pipeline.plan())
        return
    _run_summary(pipeline.run())


def _print_error(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM (`timeout`, Slurm, `docker stop`) raised where the program is, as Ctrl-C's KeyboardInterrupt is: the
    code that keeps a stage's work and removes its temporaries on Ctrl-C does so on SIGTERM too (before, SIGTERM's
    default ended the process where it stood and left them behind)."""


def _stop_on_sigterm(received: list[int]) -> None:
    """SIGTERM raises Terminated in the main thread; ``received`` records that it came (click turns any
    KeyboardInterrupt into its own Abort, losing which signal it was). ``train`` installs its own handler for its
    run (a checkpoint at the next step) and puts this one back after."""

    def handle(number: int, frame: object) -> None:
        received.append(number)
        raise Terminated()

    signal.signal(signal.SIGTERM, handle)


def main() -> None:
    """Console entry point: user errors become one line and a non-zero exit code, never a traceback."""
    terminated: list[int] = []
    _stop_on_sigterm(terminated)
    try:
        code = app(
            prog_name="eaglet", standalone_mode=False
        )  # click's refusals come here as exceptions, not boxes on stderr
    except typer.TyperException as exc:  # an unknown option or command, an option's value click cannot parse
        message, context = exc.format_message(), getattr(exc, "ctx", None)
        if not message:  # a group called without a command: its help, as click shows it
            exc.show()
            sys.exit(exc.exit_code)
        where = context.command_path if context is not None else "eaglet"
        _print_error(f"{where}: {message.rstrip('.')}; see `{where} --help`")
        sys.exit(exc.exit_code)
    except Interrupted as exc:
        err_console.print(f"[yellow]{escape(exc.message)}[/]", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except EagletError as exc:
        _print_error(exc.message)
        sys.exit(exc.exit_code)
    except OSError as exc:  # the system refused a write or read (disk full, read-only, file-size limit...)
        from ..fsio import os_error_line

        _print_error(os_error_line(exc))
        sys.exit(EagletError.exit_code)
    except KeyboardInterrupt:  # before typer's own handling (which returns its exit code, below)
        code = INTERRUPTED_EXIT
    if code == INTERRUPTED_EXIT and terminated:
        err_console.print(f"[yellow]stopped by SIGTERM; {INTERRUPTED_LINE}[/]", highlight=False, soft_wrap=True)
        sys.exit(SIGNAL_EXIT_BASE + signal.SIGTERM)
    if code == INTERRUPTED_EXIT:
        err_console.print(f"[yellow]{INTERRUPTED_LINE}[/]", highlight=False, soft_wrap=True)
    if isinstance(code, int) and code:  # typer.Exit(code) of a command
        sys.exit(code)
