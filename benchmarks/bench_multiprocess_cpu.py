"""Several processes under torchrun against one, on the CPU (gloo): what a machine without several GPUs can show.

- extraction: `eaglet extract` in one process and under `torchrun --nproc-per-node K`: the stores' shard files
  compared byte for byte, and tokens/s (the same cores split over K processes: OMP threads = cores / K each);
- training: `torchrun --nproc-per-node K eaglet train --parallel ddp|fsdp2` against one process with
  `--grad-accum K` on the same store: the loss per step (largest relative difference) and the final weights.

    python benchmarks/bench_multiprocess_cpu.py --out results/multiprocess_cpu.json [--processes 2] [--steps 8]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_online import conversations  # noqa: E402  (the same multi-turn data)


def eaglet(args: list[str], processes: int, threads: int, port: int) -> float:
    """Run an eaglet command (under torchrun when ``processes`` > 1); returns its wall seconds."""
    launcher = (
        [sys.executable, "-m", "eaglet.cli"]
        if processes == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(processes),
            "--master-port",
            str(port),
            "-m",
            "eaglet.cli",
        ]
    )
    started = time.perf_counter()
    done = subprocess.run(
        [*launcher, *args], capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": str(threads)}
    )
    if done.returncode != 0:
        raise SystemExit(f"eaglet {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def same_shards(a: Path, b: Path) -> tuple[int, bool]:
    shards = sorted(p.name for p in a.glob("*.safetensors"))
    same = shards == sorted(p.name for p in b.glob("*.safetensors")) and all(
        filecmp.cmp(a / name, b / name, shallow=False) for name in shards
    )
    return len(shards), same


def losses(run: Path) -> list[float]:
    return [
        row["loss"]
        for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if row["kind"] == "train"
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    cores = os.cpu_count() or 1
    k = args.processes
    work = Path(tempfile.mkdtemp(prefix="eaglet-multiprocess-"))
    data = conversations(work / "conversations.jsonl", args.conversations, turns=2)
    prepared = work / "prepared"
    eaglet(
        ["prepare", str(data), "--out", str(prepared), "--target", args.target, "--draft-vocab", "4096"], 1, cores, 0
    )
    tokens = json.loads((prepared / "manifest.json").read_text())["tokens"]["total"]
    extract = [
        "--prepared",
        str(prepared),
        "--target",
        args.target,
        "--device",
        "cpu",
        "--reserve-gb",
        "0",
        "--shard-mb",
        "8",
    ]
    one_s = eaglet(["extract", *extract, "--out", str(work / "store_1")], 1, cores, 0)
    many_s = eaglet(["extract", *extract, "--out", str(work / f"store_{k}")], k, max(1, cores // k), 29611)
    shards, identical = same_shards(work / "store_1", work / f"store_{k}")
    report = {
        "extract": {
            "tokens": tokens,
            "shards": shards,
            "byte_identical": identical,
            "one_process_tok_s": round(tokens / one_s, 1),
            f"{k}_processes_tok_s": round(tokens / many_s, 1),
            "scaling_efficiency": round(one_s / many_s, 3),
            "seconds": [round(one_s, 1), round(many_s, 1)],
        }
    }

    store = work / "store_1"
    train = [
        "train",
        "--store",
        str(store),
        "--target",
        args.target,
        "--device",
        "cpu",
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
        "--set",
        "eval_fraction=0",
    ]
    reference = work / "grad_accum"
    accum_s = eaglet([*train, "--out", str(reference), "--grad-accum", str(k)], 1, cores, 0)
    report["train"] = {"one_process_grad_accum": {"seconds": round(accum_s, 1), "losses": losses(reference)}}
    from safetensors.torch import load_file

    weights = load_file(str(reference / "model.safetensors"))
    for index, parallel in enumerate(("ddp", "fsdp2")):
        run = work / parallel
        seconds = eaglet([*train, "--out", str(run), "--parallel", parallel], k, max(1, cores // k), 29621 + index)
        got = losses(run)
        other = load_file(str(run / "model.safetensors"))
        report["train"][parallel] = {
            "seconds": round(seconds, 1),
            "losses": got,
            "max_relative_loss_difference": max(abs(a - b) / abs(b) for a, b in zip(got, losses(reference))),
            "max_abs_weight_difference": max(
                float((other[name].float() - weights[name].float()).abs().max()) for name in weights
            ),
        }
    report |= {
        "processes": k,
        "cores": cores,
        "target": args.target,
        "python": platform.python_version(),
        "torch": __import__("torch").__version__,
        "machine": platform.machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(
        json.dumps(
            {
                "extract": report["extract"],
                **{p: {k_: v for k_, v in report["train"][p].items() if k_ != "losses"} for p in ("ddp", "fsdp2")},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
