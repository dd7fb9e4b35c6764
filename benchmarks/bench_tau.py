"""Simulated acceptance τ of a draft trained by eaglet on the embedded target's own answers, and τ vs tokens.

The pipeline, each stage through the real CLI (resumable, so it can be split across machine sessions):
  regenerate  the target answers the demo prompts (train split, n samples each; held-out split greedily)
  prepare     both answer sets -> tokens + masks (+ draft vocab from the train set)
  extract     both -> stores
  train       TTT (K=7) for --train-minutes, evaluating on the held-out store every --eval-every steps
  eval        `eaglet eval` on the held-out demo prompts, chain and tree (τ, speedup, lossless)
Writes WORKDIR/tau.json with the τ-vs-training-tokens curve, the eval reports and the stage timings.
Usage: python benchmarks/bench_tau.py --workdir DIR [--stages regenerate,prepare,extract,train] [--train-minutes 10]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

STAGES = ("regenerate", "prepare", "extract", "train", "eval")


def eaglet(*args: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "eaglet.cli", *args], check=True)
    return round(time.perf_counter() - started, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--n", type=int, default=2, help="answers per train prompt (greedy + sampled)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--train-minutes", type=float, default=10.0)
    parser.add_argument("--max-steps", type=int, default=100000)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--max-prompts", type=int, default=None)
    parser.add_argument("--eval-prompts", type=int, default=None, help="only the first N held-out prompts")
    parser.add_argument("--eval-new-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    stages = args.stages.split(",")
    timings_file = work / "timings.json"
    timings = json.loads(timings_file.read_text()) if timings_file.exists() else {}
    limit = ["--max-prompts", str(args.max_prompts)] if args.max_prompts else []
    if "regenerate" in stages:
        timings["regenerate_greedy"] = eaglet(
            "regenerate",
            "demo",
            "--split",
            "train",
            "--target",
            args.target,
            "--out",
            str(work / "train_greedy.jsonl"),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--batch-size",
            str(args.batch_size),
            *limit,
        )
        if args.n > 1:
            timings["regenerate_sampled"] = eaglet(
                "regenerate",
                "demo",
                "--split",
                "train",
                "--target",
                args.target,
                "--out",
                str(work / "train_sampled.jsonl"),
                "--temperature",
                "0.7",
                "--top-p",
                "0.95",
                "--n",
                str(args.n - 1),
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--batch-size",
                str(args.batch_size),
                *limit,
            )
        timings["regenerate_heldout"] = eaglet(
            "regenerate",
            "demo",
            "--split",
            "heldout",
            "--target",
            args.target,
            "--out",
            str(work / "heldout.jsonl"),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--batch-size",
            str(args.batch_size),
        )
    if "prepare" in stages:
        train_files = [str(p) for p in (work / "train_greedy.jsonl", work / "train_sampled.jsonl") if p.exists()]
        timings["prepare"] = eaglet(
            "prepare",
            *train_files,
            "--target",
            args.target,
            "--out",
            str(work / "prepared"),
            "--overwrite",
            "--on-bad-row",
            "skip",
        )
        timings["prepare_heldout"] = eaglet(
            "prepare",
            str(work / "heldout.jsonl"),
            "--target",
            args.target,
            "--out",
            str(work / "prepared_heldout"),
            "--overwrite",
            "--on-bad-row",
            "skip",
        )
    if "extract" in stages:
        timings["extract"] = eaglet(
            "extract", "--prepared", str(work / "prepared"), "--target", args.target, "--out", str(work / "store")
        )
        timings["extract_heldout"] = eaglet(
            "extract",
            "--prepared",
            str(work / "prepared_heldout"),
            "--target",
            args.target,
            "--out",
            str(work / "store_heldout"),
        )
    if "train" in stages:
        timings["train"] = eaglet(
            "train",
            "--store",
            str(work / "store"),
            "--eval-store",
            str(work / "store_heldout"),
            "--target",
            args.target,
            "--out",
            str(work / "draft"),
            "--max-steps",
            str(args.max_steps),
            "--max-minutes",
            str(args.train_minutes),
            "--eval-every",
            str(args.eval_every),
            "--token-budget",
            str(args.token_budget),
            "--lr",
            str(args.lr),
            "--log-every",
            "20",
            "--set",
            f"draft_vocab_file={work / 'prepared' / 'vocab.safetensors'}",
        )
    if "eval" in stages:
        subset = ["--max-prompts", str(args.eval_prompts)] if args.eval_prompts else []
        for mode, extra in (
            ("chain", ["--depth", "5", "--hf-generate-baseline"]),
            ("tree", ["--depth", "6", "--topk", "8", "--budget", "48"]),
        ):
            timings[f"eval_{mode}"] = eaglet(
                "eval",
                "--draft",
                str(work / "draft"),
                "--target",
                args.target,
                "--out",
                str(work / f"eval_{mode}"),
                "--mode",
                mode,
                "--split",
                "heldout",
                "--max-new-tokens",
                str(args.eval_new_tokens),
                *subset,
                *extra,
            )
    timings_file.write_text(json.dumps(timings, indent=2))
    metrics = work / "draft" / "metrics.jsonl"
    curve = []
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if record["kind"] == "eval":
                curve.append(
                    {
                        "step": record["step"],
                        "tokens": record["tokens"],
                        "acceptance_length": record["acceptance_length"],
                        "acc": record["acc"],
                    }
                )
    reports = {}
    for mode in ("chain", "tree"):
        report = work / f"eval_{mode}" / "report.json"
        if report.exists():
            data = json.loads(report.read_text())
            reports[mode] = {
                k: data[k]
                for k in (
                    "acceptance_length",
                    "speedup",
                    "tokens_per_s",
                    "baseline_tokens_per_s",
                    "lossless",
                    "acceptance_by_position",
                    "per_category",
                )
            }
            reports[mode]["hf_generate_tokens_per_s"] = data.get("hf_generate_tokens_per_s")
    result = {
        "benchmark": "tau_embedded",
        "timings_s": timings,
        "curve": curve,
        "final_acceptance_length": curve[-1]["acceptance_length"] if curve else None,
        "eval": reports,
    }
    (work / "tau.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
