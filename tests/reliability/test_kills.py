"""Killed at random moments (SIGKILL: no handler runs) and started again with the same command, extract and train
end with exactly what an uninterrupted run writes: the same store bytes, the same draft bytes, and a metrics log
holding every step once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import extract_args, store_bytes

from eaglet.train.metrics import read_metrics

TRAIN = [
    "--token-budget",
    "128",
    "--max-steps",
    "24",
    "--save-every",
    "4",
    "--log-every",
    "1",
    "--eval-every",
    "8",
    "--lr",
    "3e-3",
    "--seed",
    "1",
]


def _kill_when(cmd: list[str], ready, rng: random.Random, timeout_s: float = 120) -> bool:
    """Start ``cmd``, SIGKILL it a random few milliseconds after ``ready()`` holds; whether it was killed mid-work."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        if ready():
            time.sleep(rng.uniform(0, 0.02))
            break
        time.sleep(0.002)
    killed = proc.poll() is None
    if killed:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return killed


def test_extract_killed_at_random_moments_ends_byte_identical(tmp_path, tiny_store, tiny_prepared, tiny_target):
    """Ten SIGKILLs: during start-up, between shards and mid-write."""
    out = tmp_path / "store"
    cmd = [sys.executable, "-m", "eaglet.cli", *map(str, extract_args(tiny_prepared, out, tiny_target))]
    rng = random.Random(1)
    shards_done = lambda: len(list(out.glob("shard-*.json"))) if out.exists() else 0  # noqa: E731
    kills = 0
    for _ in range(10):
        wait_for = shards_done() + rng.randint(1, 4)  # once a few more shards have landed
        kills += _kill_when(cmd, lambda: shards_done() >= wait_for, rng)
    assert kills >= 5
    final = subprocess.run(cmd, capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    assert store_bytes(out) == store_bytes(tiny_store)


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run) if r["kind"] == "train"]


def test_train_killed_at_random_moments_ends_byte_identical(tmp_path, tiny_store, tiny_target):
    """Three SIGKILLs between and during checkpoints; the draft and every logged step equal an uninterrupted run's."""

    def command(out: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "eaglet.cli",
            "train",
            "--store",
            str(tiny_store),
            "--out",
            str(out),
            "--target",
            str(tiny_target),
            *TRAIN,
        ]

    reference = tmp_path / "reference"
    assert subprocess.run(command(reference), capture_output=True).returncode == 0
    out = tmp_path / "run"
    rng = random.Random(3)
    kills = 0
    for _ in range(3):
        logged = len(_steps(out)) if (out / "metrics.jsonl").exists() else 0
        wait_for = logged + rng.randint(3, 7)
        kills += _kill_when(
            command(out), lambda: (out / "metrics.jsonl").exists() and len(_steps(out)) >= wait_for, rng
        )
    assert kills == 3
    final = subprocess.run(command(out), capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    assert _steps(out) == list(range(1, 25))  # each step once: rows after the resumed checkpoint were dropped
    assert (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    ours = [(r["step"], r["loss"]) for r in read_metrics(out) if r["kind"] == "train"]
    theirs = [(r["step"], r["loss"]) for r in read_metrics(reference) if r["kind"] == "train"]
    assert ours == theirs


def test_metrics_row_cut_by_a_kill_is_left_out_and_dropped_on_resume(tmp_path):
    """A kill mid-append leaves a row without its newline: readers (plots, reports, this test's own polling) see the
    complete rows only, and the resumed run drops it with the rows after its checkpoint."""
    from eaglet.train.metrics import MetricsLog

    log = tmp_path / "metrics.jsonl"
    log.write_text(
        '{"kind": "train", "step": 1, "loss": 2.0}\n{"kind": "train", "step": 2, "loss": 1.5}\n'
        '{"kind": "train", "step": 3, "l',
        encoding="utf-8",
    )
    assert _steps(tmp_path) == [1, 2]
    MetricsLog(tmp_path, enabled=True, tensorboard=False, resumed_step=1).log({"kind": "train", "step": 2, "loss": 1.4})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 2.0), (2, 1.4)]
