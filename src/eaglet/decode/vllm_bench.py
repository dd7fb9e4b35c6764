"""`eaglet bench --engine vllm`: the exported draft in the engine that serves it, at the concurrency it will serve.

vLLM holds the target twice, one engine after the other: alone, then with the draft (``speculative_config``, method
``eagle3``, ``--depth`` tokens a round). Each engine decodes the same requests for every (temperature, concurrency)
cell: the prompts, cycled to a multiple of the concurrency, submitted ``concurrency`` at a time (vLLM runs those
together). Per cell, from vLLM's own clocks and counters:

- tokens per second: the cell's output tokens over its wall time, with and without the draft, and their ratio;
- time per output token: each submission's wall time over its longest output (what the slowest stream waits a
  token), averaged over the cell's submissions;
- τ = 1 + Σ accepted / Σ drafts and acceptance by draft position (vLLM's counters' change over the cell), pooled.

Written as bench.json and bench.png; the serve command printed is the shape measured (``--depth``).
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

from rich.console import Console

from .. import __version__
from ..config import SIZE_IT, BenchConfig, served_model_len
from ..data.eval_prompts import EvalPrompt, select_prompts
from ..errors import EagletError
from ..export import FORMATS, verifier_reference
from ..formats.target_record import stage_target
from ..fsio import check_output_apart, check_output_dir, write_json_atomic
from ..progress import progress_bar
from .evaluate import draft_for, stop_ids
from .vllm_serving import Counters, ServingEngine

BENCH_FILE, BENCH_PLOT = "bench.json", "bench.png"


def requests_of(prompts: list[EvalPrompt], concurrency: int) -> list[list[EvalPrompt]]:
    """The prompts cycled to a multiple of ``concurrency`` (at least one submission), in submissions of that many."""
    count = -(-max(len(prompts), concurrency) // concurrency) * concurrency
    cycled = [prompts[i % len(prompts)] for i in range(count)]
    return [cycled[start : start + concurrency] for start in range(0, count, concurrency)]


def _cell(engine: ServingEngine, config: BenchConfig, prompts, concurrency, temperature, stop, drafting) -> dict:
    """One engine's numbers for one (temperature, concurrency) cell."""
    before = Counters.read(engine.llm) if drafting else Counters()
    tokens, seconds, per_token = 0, 0.0, []
    for submission in requests_of(prompts, concurrency):
        run = engine.decode(submission, stop, temperature)
        tokens += sum(len(t) for t in run.tokens)
        seconds += run.seconds
        per_token.append(run.seconds / max(1, max(len(t) for t in run.tokens)))
    counters = Counters.read(engine.llm) - before if drafting else Counters()
    positions = counters.by_position + [0] * (config.depth - len(counters.by_position))
    return {
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
        "ms_per_output_token": round(1000 * sum(per_token) / len(per_token), 3),
        "acceptance_length": counters.acceptance_length() if drafting else None,
        "acceptance_by_position": (
            [round(count / max(1, counters.drafts), 4) for count in positions[: config.depth]] if drafting else None
        ),
    }


def _engine_cells(config, target, dtype, speculative, prompts, stop, max_model_len, console) -> dict:
    """Every cell on one engine (warmed up first at each temperature: compiles and graphs are not timed)."""
    engine = ServingEngine(config, target, dtype, speculative, max_model_len)
    label = "bench (vllm, draft)" if speculative else "bench (vllm, target alone)"
    cells = {}
    try:
        with progress_bar("cells", console) as progress:
            task = progress.add_task(label, total=len(config.temperatures) * len(config.concurrency))
            for temperature in config.temperatures:
                engine.decode(prompts[:1], stop, temperature)
                for concurrency in config.concurrency:
                    cell = _cell(engine, config, prompts, concurrency, temperature, stop, speculative is not None)
                    cells[(temperature, concurrency)] = cell
                    progress.advance(task)
    finally:
        engine.close()
    return cells


def run_bench(config: BenchConfig, console: Console | None = None) -> dict[str, Any]:
    from ..model.target import context_length, load_tokenizer, pick_dtype, resolve_target, target_info
    from ..model.vllm_engine import installed_cpu_draft_problem, start_problem, vllm_runs_on, vllm_version

    console = console or Console(stderr=True)
    check_output_dir(config.out)
    check_output_apart(config.out, [config.draft, *config.prompts, config.target])
    resolved = resolve_target(stage_target(config), config.trust_remote_code)
    tokenizer = load_tokenizer(resolved.path, config.trust_remote_code)
    info = target_info(resolved, tokenizer)
    draft = draft_for(config, info, resolved.path, console)
    prompts = select_prompts(config, tokenizer, context_length(resolved.path))
    problem = start_problem(resolved.path, config) or installed_cpu_draft_problem(resolved.path)
    if problem:
        raise EagletError(problem)
    from ..model.target import generation_eos

    stop = stop_ids(tokenizer, generation_eos(resolved.path))
    dtype = str(pick_dtype(config.dtype, vllm_runs_on() or "cuda")).removeprefix("torch.")
    max_model_len, too_short = served_model_len(config, max(len(row.ids) for row in prompts))
    if too_short:
        raise EagletError(f"{too_short}; {SIZE_IT}")
    speculative = {
        "method": "eagle3",
        "model": str(Path(config.draft).resolve()),
        "num_speculative_tokens": config.depth,
    }
    alone = _engine_cells(config, resolved.path, dtype, None, prompts, stop, max_model_len, console)
    drafted = _engine_cells(config, resolved.path, dtype, speculative, prompts, stop, max_model_len, console)
    cells = []
    for (temperature, concurrency), with_draft in drafted.items():
        without = alone[(temperature, concurrency)]
        cells.append(
            {
                "temperature": temperature,
                "concurrency": concurrency,
                "tokens_per_s": with_draft["tokens_per_s"],
                "baseline_tokens_per_s": without["tokens_per_s"],
                "speedup": round(without["seconds"] / with_draft["seconds"], 4) if with_draft["seconds"] else None,
                "ms_per_output_token": with_draft["ms_per_output_token"],
                "baseline_ms_per_output_token": without["ms_per_output_token"],
                "acceptance_length": with_draft["acceptance_length"],
                "acceptance_by_position": with_draft["acceptance_by_position"],
                "tokens": with_draft["tokens"],
                "baseline_tokens": without["tokens"],
            }
        )
    verifier, _ = verifier_reference(draft.to_dict())
    report = {
        "engine": "vllm",
        "cells": cells,
        "serve_command": FORMATS["vllm"].serve_command(verifier, config.depth, str(config.draft)),
        "prompts": len(prompts),
        "settings": {
            "target": info.name,
            "draft": config.draft,
            "eagle_version": draft.eagle_version,
            "depth": config.depth,
            "max_new_tokens": config.max_new_tokens,
            "top_p": config.top_p,
            "seed": config.seed,
            "dtype": dtype,
            "max_model_len": max_model_len,
            "tensor_parallel_size": config.tensor_parallel_size,
            "device": vllm_runs_on(),
        },
        "versions": {"eaglet": __version__, "vllm": vllm_version(), "python": platform.python_version()},
    }
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / BENCH_FILE, report)
    plot_bench(report, out / BENCH_PLOT)
    return report


def plot_bench(report: dict[str, Any], path: Path) -> Path:
    """Tokens per second against concurrency, with and without the draft, a line per temperature; τ beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, tau) = plt.subplots(1, 2, figsize=(11, 4))
    for temperature in sorted({cell["temperature"] for cell in report["cells"]}):
        rows = sorted((c for c in report["cells"] if c["temperature"] == temperature), key=lambda c: c["concurrency"])
        levels = [c["concurrency"] for c in rows]
        line = speed.plot(levels, [c["tokens_per_s"] for c in rows], marker="o", label=f"draft, T={temperature:g}")
        speed.plot(
            levels,
            [c["baseline_tokens_per_s"] for c in rows],
            marker="x",
            linestyle="--",
            color=line[0].get_color(),
            label=f"target alone, T={temperature:g}",
        )
        tau.plot(levels, [c["acceptance_length"] for c in rows], marker="o", label=f"T={temperature:g}")
    levels = sorted({cell["concurrency"] for cell in report["cells"]})
    for axis, label in ((speed, "output tokens / s"), (tau, "τ (1 + accepted per round)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(level) for level in levels])
        axis.set_xlabel("requests in flight")
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
    settings = report["settings"]
    fig.suptitle(f"{settings['target']}: EAGLE {settings['eagle_version']} draft, k={settings['depth']}, vLLM")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
