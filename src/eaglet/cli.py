"""The `eaglet` command: one typer app; each subcommand is a thin call into a stage module."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__
from .errors import EagletError

app = typer.Typer(
    name="eaglet",
    help="Train EAGLE-3 draft models for any Hugging Face causal LM and hand them to vLLM and SGLang.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
target_app = typer.Typer(help="Inspect targets.", no_args_is_help=True)
app.add_typer(target_app, name="target")

out_console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

TARGET_HELP = "'embedded' (SmolLM2-135M-Instruct), an HF model directory, a .gguf file or a hub id"
CONFIG_HELP = "YAML config file (flat, or with a section named after the stage)"
SET_HELP = "override a config key: --set key=value (repeatable)"


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
    from .target import resolve_target, target_info

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


@app.command()
def prepare(
    inputs: List[str] = typer.Argument(..., help="conversation files (.jsonl/.json/.parquet)"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="output directory (written atomically)"),
    target: Optional[str] = typer.Option(None, "--target", "-t", help=TARGET_HELP),
    max_len: Optional[int] = typer.Option(None, help="tokens per sample (default: 2048); longer ones are truncated"),
    draft_vocab: Optional[int] = typer.Option(None, help="draft vocabulary size (default: min(32000, V))"),
    on_bad_row: Optional[str] = typer.Option(None, help="error (default) or skip: skipped rows are listed in the manifest"),
    chat_template: Optional[str] = typer.Option(None, help="a .jinja chat template replacing the target's"),
    overwrite: Optional[bool] = typer.Option(None, "--overwrite", help="replace an existing --out"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    overrides: List[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Conversations -> token ids + assistant loss masks + draft vocabulary."""
    from .config import PrepareConfig, build_config
    from .data.prepare import run_prepare

    cfg = build_config(
        PrepareConfig,
        "prepare",
        config,
        dict(inputs=inputs, out=out, target=target, max_len=max_len, draft_vocab=draft_vocab,
             on_bad_row=on_bad_row, chat_template=chat_template, overwrite=overwrite),
        overrides,
    )
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
# regenerate


@app.command()
def regenerate(
    prompts: List[str] = typer.Argument(..., help="prompt or conversation files; 'demo' = the shipped demo prompts"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="output .jsonl (resumable)"),
    target: Optional[str] = typer.Option(None, "--target", "-t", help=TARGET_HELP),
    backend: Optional[str] = typer.Option(None, help="hf (in process) or openai (an OpenAI-compatible server)"),
    max_new_tokens: Optional[int] = typer.Option(None, help="(default: 256)"),
    temperature: Optional[float] = typer.Option(None, help="0 = greedy (default: 0)"),
    top_p: Optional[float] = typer.Option(None, help="(default: 1.0)"),
    n: Optional[int] = typer.Option(None, "--n", help="answers per prompt (default: 1)"),
    seed: Optional[int] = typer.Option(None, help="(default: 0)"),
    batch_size: Optional[int] = typer.Option(None, help="hf: prompts per batch (default: 64 GPU / 8 CPU)"),
    max_prompts: Optional[int] = typer.Option(None, help="only the first N selected prompts"),
    split: Optional[str] = typer.Option(None, help="all, train or heldout: rows whose `split` matches (default: all)"),
    device: Optional[str] = typer.Option(None, help="hf: auto, cpu, cuda, cuda:1 ..."),
    base_url: Optional[str] = typer.Option(None, help="openai: server URL (default: http://127.0.0.1:8000/v1)"),
    model: Optional[str] = typer.Option(None, help="openai: model name sent to the server"),
    concurrency: Optional[int] = typer.Option(None, help="openai: requests in flight (default: 16)"),
    timeout_s: Optional[float] = typer.Option(None, help="openai: seconds per request (default: 120)"),
    max_retries: Optional[int] = typer.Option(None, help="openai: retries on timeouts/429/5xx (default: 5)"),
    on_bad_row: Optional[str] = typer.Option(None, help="error (default) or skip"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    overrides: List[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """The target writes the assistant answers (self-distillation), resumable after a kill."""
    from .config import RegenerateConfig, build_config
    from .data.regenerate import run_regenerate
    from .resources import resolve_input

    cfg = build_config(
        RegenerateConfig,
        "regenerate",
        config,
        dict(prompts=[resolve_input(p) for p in prompts], out=out, target=target, backend=backend,
             max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, n=n, seed=seed,
             batch_size=batch_size, max_prompts=max_prompts, split=split, device=device, base_url=base_url,
             model=model, concurrency=concurrency, timeout_s=timeout_s, max_retries=max_retries,
             on_bad_row=on_bad_row),
        overrides,
    )
    result = run_regenerate(cfg, err_console)
    rate = f"{result.new_tokens / result.seconds:,.1f} tok/s" if result.seconds > 0 and result.new_tokens else "-"
    out_console.print(
        f"wrote {result.written} answers to {result.out} ({result.skipped_done} already there), "
        f"{result.new_tokens:,} new tokens in {result.seconds:.1f} s ({rate})"
    )


# ---------------------------------------------------------------------------------------------
# demo


@app.command()
def demo(
    out: Path = typer.Option(Path("eaglet-demo"), "--out", "-o", help="run directory"),
    prompts: int = typer.Option(64, help="demo prompts the target answers (train split)"),
    max_new_tokens: int = typer.Option(96, help="tokens per answer"),
) -> None:
    """The main job on the embedded target, with the stages that exist today: regenerate -> prepare."""
    from .config import PrepareConfig, RegenerateConfig
    from .data.prepare import run_prepare
    from .data.regenerate import run_regenerate
    from .resources import demo_prompts_path

    out.mkdir(parents=True, exist_ok=True)
    answers = out / "regenerated.jsonl"
    regen = run_regenerate(
        RegenerateConfig(prompts=[str(demo_prompts_path())], out=str(answers), split="train",
                         max_prompts=prompts, max_new_tokens=max_new_tokens),
        err_console,
    )
    prepared = run_prepare(PrepareConfig(inputs=[str(answers)], out=str(out / "prepared"), overwrite=True), err_console)
    m = prepared.manifest
    table = Table(title="eaglet demo", show_header=True)
    table.add_column("stage")
    table.add_column("result")
    table.add_row("regenerate", f"{regen.written + regen.skipped_done} answers by the target -> {answers}")
    table.add_row("prepare", f"{m['counts']['samples']} samples, {m['tokens']['assistant']:,} assistant tokens -> {prepared.out}")
    table.add_row("draft vocab", f"{m['draft_vocab']['size']:,} tokens, coverage {m['draft_vocab']['coverage']:.2%}")
    out_console.print(table)


def main() -> None:
    """Console entry point: user errors become one line and a non-zero exit code, never a traceback."""
    try:
        app()
    except EagletError as exc:
        err_console.print(f"[bold red]error:[/] {exc.message}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        sys.exit(130)


if __name__ == "__main__":
    main()
