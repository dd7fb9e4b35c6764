"""Online training against offline training: seconds per step, peak memory, and one target forward for scale.

Makes multi-turn conversations, prepares them for the target, extracts a store, then trains the same steps three
ways, each in its own process (so each peak resident size is its own): offline on the store, online with the
feature cache (the default), and online recomputing features every epoch (``online_cache_gb=0``). A step's time is
read from metrics.jsonl (tokens / tokens_per_s at --log-every 1); the first step (loads, warm-up) is reported apart.

    python benchmarks/bench_online.py --out results/online_cpu.json [--steps 6] [--token-budget 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = (
    "the draft model proposes tokens and the target verifies them in one forward pass while the store keeps "
    "hidden states of three layers for every sample of the prepared set"
).split()


def conversations(path: Path, count: int, turns: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        messages = []
        for _ in range(turns):
            messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(40, 120)))})
            messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(150, 300)))})
        rows.append({"id": f"c{index}", "messages": messages})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def eaglet(*args: str) -> dict:
    """Run an eaglet command in its own process; returns its wall time and peak resident size."""
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "eaglet.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _, status, usage = os.wait4(process.pid, 0)
    stdout, stderr = process.communicate()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"eaglet {' '.join(args)} failed:\n{stderr[-2000:]}")
    return {"seconds": round(time.perf_counter() - started, 2), "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2)}


def step_seconds(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if row["kind"] == "train"]
    previous, seconds = 0, []
    for row in train:
        seconds.append((row["tokens"] - previous) / row["tokens_per_s"])
        previous = row["tokens"]
    return seconds


def target_forward_seconds(target: str, prepared: Path, tokens: int, device: str) -> float:
    """One capture forward of ``tokens`` tokens (the prepared set's first sample, repeated), median of three."""
    import torch

    from eaglet.formats.layers import default_aux_layer_ids
    from eaglet.formats.prepared import load_prepared
    from eaglet.model.capture import FeatureCapture
    from eaglet.model.target import load_model, resolve_target

    resolved = resolve_target(target)
    model = load_model(resolved.path, device)
    capture = FeatureCapture(model, default_aux_layer_ids(model.config.num_hidden_layers))
    ids = torch.from_numpy(load_prepared(prepared).sample(0)[0].astype("int64"))
    batch = ids.repeat(-(-tokens // len(ids)))[:tokens][None]
    times = []
    for _ in range(3):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        capture(batch)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="eaglet-online-"))
    work.mkdir(parents=True, exist_ok=True)
    data = conversations(work / "conversations.jsonl", args.conversations, args.turns)
    prepared, store = work / "prepared", work / "store"
    timings = {
        "prepare": eaglet("prepare", str(data), "--out", str(prepared), "--target", args.target, "--overwrite"),
        "extract": eaglet(
            "extract",
            "--prepared",
            str(prepared),
            "--out",
            str(store),
            "--target",
            args.target,
            "--device",
            args.device,
            "--reserve-gb",
            "0",
        ),
    }
    common = [
        "--max-steps",
        str(args.steps),
        "--token-budget",
        str(args.token_budget),
        "--log-every",
        "1",
        "--eval-every",
        str(10 * args.steps),
        "--save-every",
        str(10 * args.steps),
        "--target",
        args.target,
        "--device",
        args.device,
        "--set",
        "eval_fraction=0",
    ]
    variants = {
        "offline": ["--store", str(store)],
        "online_cached": ["--prepared", str(prepared)],
        "online_recomputed": ["--prepared", str(prepared), "--set", "online_cache_gb=0"],
    }
    runs = {}
    for name, source in variants.items():
        out = work / name
        usage = eaglet("train", *source, "--out", str(out), *common)
        steps = step_seconds(out)
        runs[name] = usage | {
            "first_step_s": round(steps[0], 2),
            "median_step_s": round(statistics.median(steps[1:]), 2) if len(steps) > 1 else None,
            "steps_s": [round(s, 2) for s in steps],
        }
        print(name, json.dumps(runs[name]), flush=True)
    forward = target_forward_seconds(
        args.target,
        prepared,
        args.token_budget,
        "cuda" if args.device == "auto" and _has_cuda() else ("cpu" if args.device == "auto" else args.device),
    )
    manifest = json.loads((prepared / "manifest.json").read_text())
    offline, cached = runs["offline"]["median_step_s"], runs["online_cached"]["median_step_s"]
    report = {
        "target": args.target,
        "token_budget": args.token_budget,
        "steps": args.steps,
        "samples": manifest["counts"]["samples"],
        "tokens": manifest["tokens"]["total"],
        "prepare_extract": timings,
        "runs": runs,
        "target_forward_s": round(forward, 3),
        "online_cached_over_offline": round(cached / offline, 3) if offline and cached else None,
        "goal_online_le_2x_offline_plus_forward": bool(cached and offline and cached <= 2 * offline + forward),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
