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
store_app = typer.Typer(help="Inspect and verify hidden-state stores.", no_args_is_help=True)
app.add_typer(store_app, name="store")

out_console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

TARGET_HELP = "'embedded' (SmolLM2-135M-Instruct), an HF model directory, a .gguf file or a hub id"
CONFIG_HELP = "YAML config file (flat, or with a section named after the stage)"
SKIP_HELP = "skip the preflight checks (problems then surface after the model load)"
DISK_BOUND_SHARE = 0.2  # extract warns when more than this share of its time went to waiting on writes
SET_HELP = "override a config key: --set key=value (repeatable)"
# where the target's weights go (every stage that runs the target takes these four)
PLACEMENT_HELP = ("one (default: one device), split (layers over devices by --max-memory, one process) or tp "
                  "(tensor parallel over the torchrun world)")
MAX_MEMORY_HELP = "split: memory per device, e.g. cuda:0=60GiB,cuda:1=60GiB,cpu=200GiB (default: all GPUs, then CPU)"
OFFLOAD_HELP = "split: directory for the weights past --max-memory (memory-mapped from disk)"
REPLICA_HELP = "tp: this torchrun job is replica r of R (data parallel over TP groups), e.g. 0/2"


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
    ctx: typer.Context,
    inputs: List[str] = typer.Argument(..., help="conversation files (.jsonl/.json/.parquet)"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="output directory (written atomically)"),
    target: Optional[str] = typer.Option(None, "--target", "-t", help=TARGET_HELP),
    max_len: Optional[int] = typer.Option(None, help="tokens per sample (default: 2048); longer ones are truncated"),
    draft_vocab: Optional[int] = typer.Option(None, help="draft vocabulary size (default: min(32000, V))"),
    on_bad_row: Optional[str] = typer.Option(None, help="error (default) or skip: skipped rows are listed in the manifest"),
    chat_template: Optional[str] = typer.Option(None, help="a .jinja chat template replacing the target's"),
    overwrite: Optional[bool] = typer.Option(None, "--overwrite", help="replace an existing --out"),
    skip_preflight: bool = typer.Option(False, "--skip-preflight", help=SKIP_HELP),
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
    _preflight(ctx, "prepare", cfg, skip_preflight)
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
    ctx: typer.Context,
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
    placement: Optional[str] = typer.Option(None, help=PLACEMENT_HELP),
    max_memory: Optional[str] = typer.Option(None, help=MAX_MEMORY_HELP),
    offload_dir: Optional[str] = typer.Option(None, help=OFFLOAD_HELP),
    replica: Optional[str] = typer.Option(None, help=REPLICA_HELP),
    skip_preflight: bool = typer.Option(False, "--skip-preflight", help=SKIP_HELP),
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
             on_bad_row=on_bad_row, **_placement(placement, max_memory, offload_dir, replica)),
        overrides,
    )
    _preflight(ctx, "regenerate", cfg, skip_preflight)
    result = run_regenerate(cfg, err_console)
    rate = f"{result.new_tokens / result.seconds:,.1f} tok/s" if result.seconds > 0 and result.new_tokens else "-"
    out_console.print(
        f"wrote {result.written} answers to {result.out} ({result.skipped_done} already there), "
        f"{result.new_tokens:,} new tokens in {result.seconds:.1f} s ({rate})"
    )


# ---------------------------------------------------------------------------------------------
# extract and store


@app.command()
def extract(
    ctx: typer.Context,
    prepared: Optional[str] = typer.Option(None, "--prepared", "-p", help="prepared set directory"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="store directory (resumed if it exists with the same settings)"),
    target: Optional[str] = typer.Option(None, "--target", "-t", help=TARGET_HELP),
    layers: Optional[str] = typer.Option(None, help="aux layer ids, e.g. 2,15,27 (default: 2,N//2,N-3)"),
    storage_dtype: Optional[str] = typer.Option(
        None, help="bf16 (default), fp8 (e4m3, per-token scales: 0.5x the disk) or fp8-aux (aux fp8, the teacher's last feature bf16: 0.63x the disk)"),
    shard_mb: Optional[float] = typer.Option(None, help="shard size on disk in MB (default: 512)"),
    batch_tokens: Optional[int] = typer.Option(None, help="tokens per forward pass (default: 32768 GPU / 4096 CPU)"),
    max_samples: Optional[int] = typer.Option(None, help="only the first N prepared samples"),
    device: Optional[str] = typer.Option(None, help="auto (this rank's GPU, else cpu), cpu, cuda:1 ..."),
    dtype: Optional[str] = typer.Option(None, help="compute dtype: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16"),
    reserve_gb: Optional[float] = typer.Option(None, help="free disk to keep beyond the store (default: 1)"),
    placement: Optional[str] = typer.Option(None, help=PLACEMENT_HELP),
    max_memory: Optional[str] = typer.Option(None, help=MAX_MEMORY_HELP),
    offload_dir: Optional[str] = typer.Option(None, help=OFFLOAD_HELP),
    replica: Optional[str] = typer.Option(None, help=REPLICA_HELP),
    skip_preflight: bool = typer.Option(False, "--skip-preflight", help=SKIP_HELP),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    overrides: List[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Target hidden states (aux layers + final-normed last) for a prepared set, into a crash-safe store."""
    from .config import ExtractConfig, build_config
    from .extract import run_extract

    cfg = build_config(
        ExtractConfig, "extract", config,
        dict(prepared=prepared, out=out, target=target, layers=_layer_ids(layers), storage_dtype=storage_dtype,
             shard_mb=shard_mb, batch_tokens=batch_tokens, max_samples=max_samples, device=device, dtype=dtype,
             reserve_gb=reserve_gb, **_placement(placement, max_memory, offload_dir, replica)),
        overrides,
    )
    _preflight(ctx, "extract", cfg, skip_preflight)
    result = run_extract(cfg, err_console)
    totals = result.manifest["totals"]
    rate = f"{result.tokens_computed / result.seconds:,.0f} tok/s" if result.seconds > 0 and result.tokens_computed else "-"
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
    target: Optional[str] = typer.Option(None, "--target", "-t", help="--repair: the target to re-extract with "
                                         "(default: the one the store records; it must be the one extracted from)"),
    trust_remote_code: bool = typer.Option(False, help="--repair: allow the target's own Python code (never taken "
                                           "from the store)"),
) -> None:
    """Check checksums, shapes, dtypes, finite values and token ids of every shard; name each bad one."""
    from .store_check import repair_store, verify_store

    problems = verify_store(store, check_prepared=not no_prepared, console=err_console)
    for problem in problems:
        err_console.print(f"[red]bad shard[/] {escape(str(store / problem.file))}: {escape(problem.reason)}",
                          highlight=False)
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
    from .store_check import store_summary

    summary = store_summary(store)
    if as_json:
        out_console.print_json(json.dumps(summary))
        return
    table = Table(title=f"store {store}", show_header=False)
    for key, value in summary.items():
        table.add_row(key, escape(f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)))
    out_console.print(table)


def _placement(placement: str | None, max_memory: str | None, offload_dir: str | None,
               replica: str | None) -> dict:
    """The placement options as config keys (``--max-memory cuda:0=60GiB,cpu=200GiB`` as a mapping)."""
    memory = None
    if max_memory is not None:
        try:
            memory = dict(item.split("=", 1) for item in max_memory.split(",") if item.strip())
        except ValueError:
            raise EagletError(f"--max-memory {max_memory!r}: expected DEVICE=SIZE pairs, e.g. "
                              "cuda:0=60GiB,cpu=200GiB") from None
        memory = {key.strip(): value.strip() for key, value in memory.items()}
    return dict(placement=placement, max_memory=memory, offload_dir=offload_dir, replica=replica)


def _layer_ids(text: str | None) -> list[int] | None:
    """--layers 2,15,27 as a list (None when not given)."""
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise EagletError(f"--layers {text!r}: expected comma-separated integers, e.g. 2,15,27") from None


# ---------------------------------------------------------------------------------------------
# train


@app.command()
def train(
    ctx: typer.Context,
    out: Optional[str] = typer.Option(None, "--out", "-o", help="run directory (resumed from its last checkpoint)"),
    store: Optional[str] = typer.Option(None, help="offline: a store from `eaglet extract`"),
    prepared: Optional[str] = typer.Option(None, help="online: a prepared set; the target computes features live"),
    target: Optional[str] = typer.Option(None, "--target", "-t", help=TARGET_HELP),
    ttt_steps: Optional[int] = typer.Option(None, help="training-time-test unroll K (default: 7)"),
    draft_layers: Optional[int] = typer.Option(None, help="decoder layers in the draft (default: 1, EAGLE-3's)"),
    layers: Optional[str] = typer.Option(None, help="online: aux layer ids, e.g. 2,15,27 (default: 2,N//2,N-3)"),
    token_budget: Optional[int] = typer.Option(None, help="tokens per packed micro-batch (default: 4096)"),
    grad_accum: Optional[int] = typer.Option(None, help="micro-batches per optimizer step and rank (default: 1)"),
    parallel: Optional[str] = typer.Option(None, help="under torchrun: ddp (default) or fsdp2 (shards weights and optimizer)"),
    lr: Optional[float] = typer.Option(None, help="peak learning rate (default: 3e-4)"),
    max_steps: Optional[int] = typer.Option(None, help="stop after N optimizer steps"),
    epochs: Optional[float] = typer.Option(None, help="stop after E epochs (default: 1)"),
    tokens: Optional[int] = typer.Option(None, help="stop after N training tokens"),
    max_minutes: Optional[float] = typer.Option(None, help="stop with a checkpoint after M minutes"),
    eval_store: Optional[str] = typer.Option(None, help="evaluate on this store (e.g. held-out prompts)"),
    seed: Optional[int] = typer.Option(None, help="data order, init and noise (default: 0)"),
    eval_every: Optional[int] = typer.Option(None, help="held-out evaluation every N steps (default: 100)"),
    log_every: Optional[int] = typer.Option(None, help="metrics every N steps (default: 10)"),
    save_every: Optional[int] = typer.Option(None, help="checkpoint every N steps (default: 200)"),
    device: Optional[str] = typer.Option(None, help="auto (this rank's GPU, else cpu), cpu, cuda:1 ..."),
    placement: Optional[str] = typer.Option(None, help=PLACEMENT_HELP),
    max_memory: Optional[str] = typer.Option(None, help=MAX_MEMORY_HELP),
    offload_dir: Optional[str] = typer.Option(None, help=OFFLOAD_HELP),
    replica: Optional[str] = typer.Option(None, help=REPLICA_HELP),
    skip_preflight: bool = typer.Option(False, "--skip-preflight", help=SKIP_HELP),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    overrides: List[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Train the EAGLE-3 draft (training-time test) on a store or online; resumable; torchrun for DDP or FSDP2."""
    from .config import TrainConfig, build_config
    from .train import run_train

    cfg = build_config(
        TrainConfig, "train", config,
        dict(out=out, store=store, prepared=prepared, target=target, ttt_steps=ttt_steps, draft_layers=draft_layers,
             layers=_layer_ids(layers), token_budget=token_budget,
             grad_accum=grad_accum, parallel=parallel, lr=lr, max_steps=max_steps, epochs=epochs, tokens=tokens, max_minutes=max_minutes,
             eval_store=eval_store, seed=seed,
             eval_every=eval_every, log_every=log_every, save_every=save_every, device=device,
             **_placement(placement, max_memory, offload_dir, replica)),
        overrides,
    )
    _preflight(ctx, "train", cfg, skip_preflight)
    result = run_train(cfg, err_console)
    evaluation = result.final_eval
    if evaluation.get("tau") is not None:
        tau = (f", held-out simulated acceptance {evaluation['tau']:.2f} draft tokens per forward "
               f"(accuracy by step {evaluation['acc']})")
    elif evaluation:
        tau = ", no held-out samples to evaluate (use --eval-store, or more data)"
    else:
        tau = ""
    out_console.print(f"draft {result.out}: step {result.steps} in {result.seconds:.1f} s{tau}")


# ---------------------------------------------------------------------------------------------
# export and eval


@app.command()
def export(
    ctx: typer.Context,
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="draft directory (`eaglet train` output)"),
    format: Optional[str] = typer.Option(None, "--format", "-f", help="vllm, sglang or speculators"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="output directory (written atomically)"),
    verifier: Optional[str] = typer.Option(None, help="how configs name the target (default: its hub id when known, "
                                           "else its local path)"),
    target: Optional[str] = typer.Option(None, "--target", "-t", help="the draft's target (default: the one it "
                                         "records); the speculators format carries its embedding"),
    speculative_tokens: Optional[int] = typer.Option(None, help="draft tokens per step recorded for serving (default: 3)"),
    report: Optional[str] = typer.Option(None, help="an `eaglet eval` report.json whose τ goes into the model card"),
    overwrite: Optional[bool] = typer.Option(None, "--overwrite", help="replace an existing --out"),
    engines: Optional[List[str]] = typer.Option(None, "--engine", help="an engine release the export will be served "
                                                "with, ENGINE==VERSION (repeatable): preflight warns when eaglet's "
                                                "readers of its loader do not cover it"),
    check: Optional[Path] = typer.Option(None, "--check", help="check an export directory against each engine's "
                                         "released loader instead of writing one"),
    as_json: bool = typer.Option(False, "--json", help="with --check: print JSON"),
    skip_preflight: bool = typer.Option(False, "--skip-preflight", help=SKIP_HELP),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    overrides: List[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Write a draft as the directory vLLM, SGLang or speculators load (config.json + model.safetensors + README)."""
    if check is not None:
        _export_check(check, as_json)
        return
    from .config import ExportConfig, build_config
    from .export import export_draft

    cfg = build_config(
        ExportConfig, "export", config,
        dict(draft=draft, format=format, out=out, verifier=verifier, target=target,
             speculative_tokens=speculative_tokens, report=report, overwrite=overwrite, engines=engines or None),
        overrides,
    )
    _preflight(ctx, "export", cfg, skip_preflight)
    path = export_draft(cfg.draft, cfg.format, cfg.out, cfg.verifier, cfg.speculative_tokens, cfg.report, cfg.overwrite,
                        cfg.target)
    out_console.print(f"exported {cfg.draft} as {cfg.format} -> {path} (serve it as its README.md shows; "
                      f"`eaglet export --check {path}` checks it against each engine)")


def _export_check(directory: Path, as_json: bool) -> None:
    """Each consumer's verdict on an export directory: a table (or JSON); exit 2 when one fails."""
    from .consumers.check import FAIL, check_export

    results = check_export(directory)
    if as_json:
        out_console.print_json(json.dumps({"directory": str(directory), "results": [r.as_dict() for r in results]}))
    else:
        styles = {"pass": "green", "unverified": "yellow", "fail": "bold red"}
        table = Table(title=f"export check {directory}")
        for column in ("consumer", "status", "findings"):
            table.add_column(column)
        for result in results:
            table.add_row(result.consumer, f"[{styles[result.status]}]{result.status}[/]",
                          escape("\n".join(result.findings)))
        out_console.print(table)
    failed = [r for r in results if r.status == FAIL]
    if failed:
        raise EagletError(f"{directory}: {failed[0].consumer} would not serve it as trained: {failed[0].findings[0]}")


@app.command("eval")
def eval_cmd(
    ctx: typer.Context,
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="draft directory (trained or exported)"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="report directory"),
    prompts: Optional[List[str]] = typer.Option(None, "--prompts", help="prompt files (default: demo)"),
    target: Optional[str] = typer.Option(None, "--target", "-t", help=TARGET_HELP),
    split: Optional[str] = typer.Option(None, help="all, train or heldout (default: heldout)"),
    max_prompts: Optional[int] = typer.Option(None, help="only N prompts, round-robin over categories"),
    mode: Optional[str] = typer.Option(None, help="chain (default) or tree (EAGLE-2 dynamic tree)"),
    depth: Optional[int] = typer.Option(None, help="draft steps per verification (default: 4)"),
    topk: Optional[int] = typer.Option(None, help="tree: children per node and nodes expanded per level (default: 8)"),
    budget: Optional[int] = typer.Option(None, help="tree: draft tokens per verification (default: 48)"),
    tune: Optional[bool] = typer.Option(None, "--tune", help="tree: time a few tree shapes (tune_trees) on a few "
                                        "prompts first, evaluate with the fastest"),
    temperature: Optional[float] = typer.Option(None, help="0 = greedy, checked lossless (default: 0)"),
    top_p: Optional[float] = typer.Option(None, help="(default: 1.0)"),
    max_new_tokens: Optional[int] = typer.Option(None, help="(default: 128)"),
    batch_size: Optional[int] = typer.Option(None, help="prompts decoded together; > 1: greedy chain (default: 1)"),
    seed: Optional[int] = typer.Option(None, help="sampling seed (default: 0)"),
    device: Optional[str] = typer.Option(None, help="auto, cpu, cuda, cuda:1 ..."),
    dtype: Optional[str] = typer.Option(None, help="float32 (default: the lossless check is exact), bfloat16, float16, auto"),
    hf_generate_baseline: Optional[bool] = typer.Option(None, "--hf-generate-baseline", help="also time plain HF generate"),
    cuda_graphs: Optional[str] = typer.Option(None, "--cuda-graphs", help="auto (default: on GPU at batch 1), on, off: "
                                              "target and draft on static caches, their forwards replayed as CUDA graphs"),
    compile_draft: Optional[str] = typer.Option(None, "--compile-draft", help="auto (default: on GPU), on, off: the "
                                                "draft's part of each greedy round through torch.compile"),
    placement: Optional[str] = typer.Option(None, help=PLACEMENT_HELP),
    max_memory: Optional[str] = typer.Option(None, help=MAX_MEMORY_HELP),
    offload_dir: Optional[str] = typer.Option(None, help=OFFLOAD_HELP),
    replica: Optional[str] = typer.Option(None, help=REPLICA_HELP),
    skip_preflight: bool = typer.Option(False, "--skip-preflight", help=SKIP_HELP),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    overrides: List[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Speculative decoding with the draft: τ, speedup over the same engine without it, lossless check."""
    from .config import EvalConfig, build_config
    from .decode.evaluate import run_eval

    cfg = build_config(
        EvalConfig, "eval", config,
        dict(draft=draft, out=out, prompts=prompts, target=target, split=split, max_prompts=max_prompts, mode=mode,
             depth=depth, topk=topk, budget=budget, tune=tune,
             temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed, device=device,
             batch_size=batch_size, dtype=dtype, hf_generate_baseline=hf_generate_baseline, cuda_graphs=cuda_graphs,
             compile_draft=compile_draft, **_placement(placement, max_memory, offload_dir, replica)),
        overrides,
    )
    _preflight(ctx, "eval", cfg, skip_preflight)
    report = run_eval(cfg, err_console)
    out_console.print(
        f"τ {report['acceptance_length']:.2f}, {report['tokens_per_s']} tok/s vs {report['baseline_tokens_per_s']} "
        f"without the draft: speedup {report['speedup']:.2f}x, lossless {report['lossless']} -> {cfg.out}/report.md"
    )


# ---------------------------------------------------------------------------------------------
# preflight


def _preflight(ctx: typer.Context, stage: str, cfg: object, skip: bool) -> None:
    """Run the stage's checks; under `eaglet preflight` print them and exit, otherwise stop on a failure."""
    import time

    from .preflight.stages import FAIL, WARN, run_checks, worst

    mode = ctx.obj if isinstance(ctx.obj, dict) else {}
    if skip and not mode.get("only"):
        err_console.print(f"[bold yellow]PREFLIGHT SKIPPED for {stage} (--skip-preflight): anything wrong surfaces "
                          "only after the expensive part starts[/]")
        return
    started = time.perf_counter()
    checks = run_checks(stage, cfg)
    status = worst(checks)
    seconds = time.perf_counter() - started
    if mode.get("only"):
        if mode.get("json"):
            out_console.print_json(json.dumps({"stage": stage, "status": status, "seconds": round(seconds, 3),
                                               "checks": [c.as_dict() for c in checks]}))
        else:
            out_console.print(_checks_table(stage, checks, seconds))
        raise typer.Exit(2 if status == FAIL else 1 if status == WARN and mode.get("strict") else 0)
    if status == FAIL:  # one line: the first failed check and its fix (`eaglet preflight STAGE ...` lists them all)
        first = next(c for c in checks if c.status == FAIL)
        raise EagletError(f"preflight failed for {stage}: {first.name}: {first.detail}" + (f" ({first.fix})" if first.fix else ""))
    for check in checks:
        if check.status == WARN:
            err_console.print(f"[yellow]preflight warning[/] {check.name}: {check.detail}", highlight=False)


def _checks_table(stage: str, checks: list, seconds: float) -> Table:
    styles = {"pass": "green", "warn": "yellow", "fail": "bold red"}
    table = Table(title=f"preflight {stage} ({seconds:.2f} s)")
    for column in ("check", "status", "detail", "fix"):
        table.add_column(column)
    for check in checks:
        table.add_row(check.name, f"[{styles[check.status]}]{check.status}[/]", escape(check.detail), escape(check.fix))
    return table


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def preflight(
    ctx: typer.Context,
    stage: str = typer.Argument(..., help="prepare, regenerate, extract, train, export, eval; calls (API check of your code); self"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
    strict: bool = typer.Option(False, "--strict", help="exit 1 on warnings"),
) -> None:
    """Run a stage's checks alone (same options as the stage), in seconds, loading no weights.

    Exit code: 0 pass, 1 warnings with --strict, 2 failure."""
    from .preflight.stages import STAGE_CHECKS

    if stage in ("calls", "self"):
        command = typer.main.get_command(app).commands[f"preflight-{stage}"]
        sub_context = command.make_context(f"preflight {stage}", list(ctx.args) + (["--json"] if as_json else [])
                                           + (["--strict"] if strict else []), parent=ctx)
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
    from .apicheck.check import check_calls, library_roots

    package, wanted = _split_spec(against)
    roots, source = library_roots(package, site_packages, wheel)
    report = check_calls(paths, package, roots, source)
    if wanted and report.version not in (wanted, "unknown"):
        raise EagletError(f"--against {against}: {source} holds {package} {report.version}; point --site-packages/--wheel at {wanted}")
    return report


def _print_calls(report, output_format: str, strict: bool) -> None:
    from .apicheck.report import as_sarif, as_text

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
    against: str = typer.Option(..., "--against", help="the library: PKG or PKG==VERSION (the old one in upgrade mode)"),
    site_packages: Optional[Path] = typer.Option(None, "--site-packages", help="read PKG from this directory"),
    wheel: Optional[Path] = typer.Option(None, "--wheel", help="read PKG from this wheel"),
    to: Optional[str] = typer.Option(None, "--to", help="upgrade mode: PKG==VERSION to compare with --against"),
    to_site_packages: Optional[Path] = typer.Option(None, "--to-site-packages", help="upgrade mode: the new version's directory"),
    to_wheel: Optional[Path] = typer.Option(None, "--to-wheel", help="upgrade mode: the new version's wheel"),
    output_format: str = typer.Option("text", "--format", help="text, json or sarif"),
    as_json: bool = typer.Option(False, "--json", help="same as --format json"),
    strict: bool = typer.Option(False, "--strict", help="exit 1 on warnings"),
) -> None:
    """`eaglet preflight calls PATH... --against PKG`: bind every call into PKG to its signatures, statically."""
    from .apicheck.check import upgrade_report

    output_format = "json" if as_json else output_format
    if output_format not in ("text", "json", "sarif"):
        raise EagletError(f"--format {output_format}: choose text, json or sarif")
    report = _calls_report(paths, against, site_packages, wheel)
    if to is not None:
        if _split_spec(to)[0] != _split_spec(against)[0]:
            raise EagletError(f"--to {to}: upgrade mode compares two versions of one package ({_split_spec(against)[0]})")
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
    report = _calls_report([Path(__file__).parent], "transformers", None, None)
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
    from .fsio import free_disk_bytes

    needed = sum(p.disk_bytes for p in plans if p.action == "run")
    free = free_disk_bytes(out)
    caption = f"needs ~{_human_bytes(needed)}; {_human_bytes(free)} free at {out}"
    if needed > free:
        caption = f"[bold red]{caption}: not enough disk[/]"
    table = Table(title="eaglet run --plan (nothing runs)", caption=caption)
    placed = any(plan.memory for plan in plans)  # GPU plans: where the target goes, per GPU
    for column in ("stage", "action", "why", "disk (est.)", "time (est.)") + (
            ("target per GPU: weights + activations",) if placed else ()):
        table.add_column(column)
    for plan in plans:
        disk = _human_bytes(plan.disk_bytes) if plan.action == "run" and plan.disk_bytes else "-"
        seconds = "-" if plan.action != "run" or plan.seconds != plan.seconds or not plan.seconds else f"{plan.seconds / 60:.1f} min"
        memory = (f"[bold red]{escape(plan.memory)}: does not fit[/]" if plan.refusal else escape(plan.memory)) or "-"
        table.add_row(plan.name, plan.action, plan.reason, disk, seconds, *((memory,) if placed else ()))
    return table


def _run_summary(result) -> None:
    """The final table, where the drafts are, how to serve them."""
    table = Table(title=f"eaglet run: {result.out}")
    for column, justify in (("stage", "left"), ("status", "left"), ("seconds", "right"), ("result", "left")):
        table.add_column(column, justify=justify)
    for outcome in result.outcomes:
        table.add_row(outcome.name, outcome.status, f"{outcome.seconds:.1f}" if outcome.status == "ran" else "-",
                      escape(outcome.result))
    out_console.print(table)
    for fmt, command in result.serve.items():
        out_console.print(f"# {fmt}: {result.out / 'export' / fmt} (model card: README.md there)\n{command}", highlight=False)
    if result.report is not None:
        report = result.report
        out_console.print(
            f"τ {report['acceptance_length']:.2f} tokens per target forward, speedup {report['speedup']:.2f}x over the "
            f"same engine without a draft, lossless {report['lossless']} (report: {result.out / 'eval' / 'report.md'})",
            highlight=False)


@app.command()
def run(
    config: Path = typer.Argument(..., help="run config: one YAML with a section per stage"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="run directory (overrides the config's `out`)"),
    from_stage: Optional[str] = typer.Option(None, "--from", help="re-run from this stage on"),
    only: Optional[str] = typer.Option(None, "--only", help="run only this stage"),
    plan: bool = typer.Option(False, "--plan", help="print what would run, with estimated disk and time; run nothing"),
) -> None:
    """The whole path from one YAML: regenerate -> prepare -> extract (or online) -> train -> export -> eval.

    Stages whose output is complete and made from the same settings and inputs are skipped; a killed
    run resumes with the same command."""
    from .pipeline import Pipeline, load_run_config

    cfg = load_run_config(config, {"out": out} if out else None)
    pipeline = Pipeline(cfg, config, err_console)
    if plan:
        plans = pipeline.plan(from_stage, only)
        out_console.print(_plan_table(plans, pipeline.out))
        refused = next((p.refusal for p in plans if p.action == "run" and p.refusal), None)
        if refused:
            raise EagletError(refused)
        return
    _run_summary(pipeline.run(from_stage, only))


@app.command()
def demo(
    out: Path = typer.Option(Path("eaglet-demo"), "--out", "-o", help="run directory"),
    scale: str = typer.Option("auto", help="cpu (a laptop, ~8 min), gpu (one H200, ~10 min) or auto (gpu when CUDA is there)"),
    plan: bool = typer.Option(False, "--plan", help="print what would run; run nothing"),
) -> None:
    """`eaglet run` with a built-in config on the embedded target and the shipped demo prompts."""
    from .pipeline import Pipeline, load_run_config
    from .resources import demo_config_path

    if scale not in ("auto", "cpu", "gpu"):
        raise EagletError(f"--scale {scale}: choose cpu, gpu or auto")
    if scale == "auto":
        import torch

        scale = "gpu" if torch.cuda.is_available() else "cpu"
    config = demo_config_path(scale)
    pipeline = Pipeline(load_run_config(config, {"out": str(out)}), config, err_console)
    if plan:
        out_console.print(_plan_table(pipeline.plan(), pipeline.out))
        return
    _run_summary(pipeline.run())


def _print_error(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def main() -> None:
    """Console entry point: user errors become one line and a non-zero exit code, never a traceback."""
    try:
        app()
    except EagletError as exc:
        _print_error(exc.message)
        sys.exit(exc.exit_code)
    except OSError as exc:  # the system refused a write or read (disk full, read-only, file-size limit...)
        from .fsio import os_error_line

        _print_error(os_error_line(exc))
        sys.exit(EagletError.exit_code)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        sys.exit(130)


if __name__ == "__main__":
    main()
