"""`eaglet demo`: the whole path on the embedded target with a small CPU-sized budget.

regenerate (the target answers demo prompts) -> prepare -> extract -> train -> export (vLLM) -> eval
on held-out prompts. Every stage is the real one; a second run resumes what is done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from .config import EvalConfig, ExtractConfig, PrepareConfig, RegenerateConfig, TrainConfig
from .resources import demo_prompts_path


@dataclass(frozen=True)
class DemoBudget:
    """Sized for a 2-core laptop CPU (about 8 minutes end to end)."""

    prompts: int = 64
    max_new_tokens: int = 96
    draft_vocab: int = 4096
    token_budget: int = 1024
    train_minutes: float = 3.0
    train_steps: int = 300
    lr: float = 1e-3
    eval_prompts: int = 8
    eval_new_tokens: int = 64
    depth: int = 3


@dataclass
class StageRecord:
    name: str
    seconds: float
    result: str


def run_demo(out: Path, budget: DemoBudget, console: Console) -> tuple[list[StageRecord], dict[str, Any]]:
    from .data.prepare import run_prepare
    from .data.regenerate import run_regenerate
    from .decode.evaluate import run_eval
    from .export import export_draft
    from .extract import run_extract
    from .train import run_train

    out.mkdir(parents=True, exist_ok=True)
    records: list[StageRecord] = []

    def stage(name: str, action: Callable[[], str]) -> None:
        console.print(f"[bold]== {name}[/]")
        started = time.perf_counter()
        result = action()
        records.append(StageRecord(name, time.perf_counter() - started, result))

    answers = out / "regenerated.jsonl"
    stage("regenerate", lambda: "{} answers by the target".format(run_regenerate(
        RegenerateConfig(prompts=[str(demo_prompts_path())], out=str(answers), split="train",
                         max_prompts=budget.prompts, max_new_tokens=budget.max_new_tokens), console).manifest["counts"]["requests"]))
    stage("prepare", lambda: "{samples} samples, draft vocab coverage {cov:.1%}".format(**(lambda m: {
        "samples": m["counts"]["samples"], "cov": m["draft_vocab"]["coverage"]})(run_prepare(
            PrepareConfig(inputs=[str(answers)], out=str(out / "prepared"), draft_vocab=budget.draft_vocab,
                          overwrite=True), console).manifest)))
    stage("extract", lambda: "{:,} tokens".format(run_extract(
        ExtractConfig(prepared=str(out / "prepared"), out=str(out / "store"), reserve_gb=0.5), console).manifest["totals"]["tokens"]))
    trained = {}

    def train() -> str:
        result = run_train(TrainConfig(out=str(out / "draft"), store=str(out / "store"), token_budget=budget.token_budget,
                                       max_steps=budget.train_steps, max_minutes=budget.train_minutes, lr=budget.lr,
                                       eval_every=50, log_every=10, save_every=50), console)
        trained.update(result.final_eval)
        tau = result.final_eval.get("tau")
        measured = f"held-out simulated acceptance {tau:.2f} draft tokens per forward" if tau is not None else "no held-out samples"
        return f"step {result.steps}; {measured}"

    stage("train", train)
    stage("export", lambda: str(export_draft(out / "draft", "vllm", out / "export" / "vllm", overwrite=True)))
    report: dict[str, Any] = {}

    def evaluate() -> str:
        report.update(run_eval(EvalConfig(draft=str(out / "draft"), out=str(out / "eval"), max_prompts=budget.eval_prompts,
                                          max_new_tokens=budget.eval_new_tokens, depth=budget.depth), console))
        return (f"τ {report['acceptance_length']:.2f}, speedup {report['speedup']:.2f}x, "
                f"lossless {report['lossless']}")

    stage("eval", evaluate)
    return records, report
