"""Training metrics: JSONL (always), TensorBoard (when installed), PNG plots, FLOPs for MFU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..formats.files import METRICS_FILE
from ..fsio import write_bytes_atomic

H200_BF16_DENSE_FLOPS = 989.4e12  # the MFU denominator used by every eaglet benchmark


class MetricsLog:
    """``metrics.jsonl`` of a run. Opened at ``resumed_step`` (the checkpoint a run continues from, 0 for a fresh
    run), it first drops the rows logged after that step: the resumed run logs those steps again."""

    def __init__(self, run: Path, enabled: bool, tensorboard: bool = True, resumed_step: int = 0):
        self.path = run / METRICS_FILE
        self.enabled = enabled
        self.writer = None
        if enabled and self.path.is_file():
            kept = [
                line
                for line in self.path.read_text(encoding="utf-8").splitlines()
                if line.strip() and _step_of(line) <= resumed_step
            ]
            write_bytes_atomic(self.path, "".join(line + "\n" for line in kept).encode("utf-8"))
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(run / "tensorboard"))
            except ImportError:  # tensorboard is optional: `pip install eaglet[tensorboard]`
                self.writer = None

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.writer.add_scalar(key, value, record["step"])
                elif isinstance(value, list):
                    for index, item in enumerate(value):
                        self.writer.add_scalar(f"{key}/{index}", item, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _step_of(line: str) -> float:
    """The step a metrics row was logged at (a row cut short by a kill counts as after every checkpoint)."""
    try:
        return json.loads(line).get("step", float("inf"))
    except json.JSONDecodeError:
        return float("inf")


def read_metrics(run: Path) -> list[dict[str, Any]]:
    """The complete rows of ``metrics.jsonl``. A row counts once its newline is written: the text after the last
    newline is a row being appended now, or one a kill cut short, and is left out."""
    path = run / METRICS_FILE
    if not path.is_file():
        return []
    complete = path.read_text(encoding="utf-8").split("\n")[:-1]
    return [json.loads(line) for line in complete if line.strip()]


def _line_plot(path: Path, series: dict[str, tuple[list, list]], xlabel: str, ylabel: str, title: str) -> Path:
    """One PNG with a line per series (label -> (x, y))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, label=label, marker="o" if len(xs) < 30 else None)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1 or next(iter(series)):
        ax.legend(ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


MIN_PLOT_POINTS = 2  # a line of one point shows nothing: its figure is not drawn


def plot_run(run: Path) -> list[Path]:
    """loss.png, accuracy.png (per TTT step) and tau.png (held-out τ vs training tokens), each drawn once
    it has two points (the console and metrics.jsonl already say a lone value)."""
    records = read_metrics(run)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval" and r.get("acceptance_length") is not None]
    written = []
    if len(train) >= MIN_PLOT_POINTS:
        written.append(
            _line_plot(
                run / "loss.png",
                {"total (Σ decay^k loss_k)": ([r["step"] for r in train], [r["loss"] for r in train])},
                "optimizer step",
                "loss",
                "training loss",
            )
        )
    if len(evals) >= MIN_PLOT_POINTS:
        steps = [r["step"] for r in evals]
        accuracy = {f"step {k}": (steps, [r["acc"][k] for r in evals]) for k in range(len(evals[-1]["acc"]))}
        written.append(
            _line_plot(
                run / "accuracy.png", accuracy, "optimizer step", "held-out top-1 accuracy", "accuracy per TTT step"
            )
        )
        written.append(
            _line_plot(
                run / "tau.png",
                {"": ([r["tokens"] for r in evals], [r["acceptance_length"] for r in evals])},
                "training tokens",
                "τ: tokens per target forward (1 + accepted)",
                f"held-out τ of a {len(evals[-1]['acc'])}-token chain, from per-step accuracy",
            )
        )
    return written
