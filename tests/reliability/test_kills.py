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
    assert _temporaries(out) == []  # what the killed runs were writing, swept by the next


def _temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith((".tmp", ".partial")))


def test_sigterm_stops_extract_cleanly_and_the_same_command_resumes(tmp_path, tiny_store, tiny_prepared, tiny_target):
    """SIGTERM (what `timeout`, Slurm and `docker stop` send) mid-extraction: the shard being written is removed as
    Ctrl-C removes it, the exit code says SIGTERM (143), and the same command finishes the same store."""
    out = tmp_path / "store"
    cmd = [sys.executable, "-m", "eaglet.cli", *map(str, extract_args(tiny_prepared, out, tiny_target))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not list(out.glob("shard-*.json")):
        time.sleep(0.002)
    assert proc.poll() is None, "extract ended before a shard landed: nothing to stop"
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in err and "Traceback" not in err, err
    assert _temporaries(out) == []
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


def test_an_export_killed_mid_write_leaves_nothing_the_next_write_keeps(tmp_path):
    """SIGKILL runs no handler: the export directory it was filling stays behind, named for its process. The next
    write beside it removes it once that process is gone; a live process's, another host's and a user's own hidden
    files are kept."""
    from eaglet.fsio import atomic_directory, new_sibling

    out = tmp_path / "export"
    cmd = [
        sys.executable,
        "-c",
        "import time; from pathlib import Path; from eaglet.fsio import new_sibling; "
        f"print(new_sibling(Path({str(out)!r}), '.partial', directory=True), flush=True); time.sleep(60)",
    ]
    writer = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    left = Path(writer.stdout.readline().strip())
    live = new_sibling(tmp_path / "other", ".partial", directory=True)  # this process's: alive
    foreign = tmp_path / ".export.elsewhere-1-00000000.partial"  # another host's
    mine = tmp_path / ".export.notes.tmp"  # a user's own hidden file: not a temporary of eaglet's form
    foreign.mkdir()
    mine.write_text("kept")
    with atomic_directory(tmp_path / "first") as tmp:  # the writer still runs: its directory is kept
        (tmp / "a").write_text("a")
    assert left.is_dir()
    writer.kill()
    writer.wait()
    with atomic_directory(out) as tmp:
        (tmp / "config.json").write_text("{}")
    assert not left.exists() and live.is_dir() and foreign.is_dir() and mine.read_text() == "kept"
