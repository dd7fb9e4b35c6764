"""Does the storage format change what the draft learns? One draft per format, everything else equal.

Extracts the training and held-out prepared sets once per storage format (bf16, fp8, fp8-aux), trains a draft on
each with the same seed, steps and schedule, and reports the store size, the loss curve's distance from bf16's and
the held-out accuracy per TTT step and simulated acceptance (τ) at the end. Usage:
  python benchmarks/bench_storage_training.py --prepared DIR --heldout DIR [--target embedded] [--steps 60]
      [--token-budget 1024] [--out FILE.json]
(`eaglet demo` leaves both sets in eaglet-demo/prepared and eaglet-demo/prepared_heldout.)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepared", required=True)
    parser.add_argument("--heldout", required=True)
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from rich.console import Console

    from eaglet.config import ExtractConfig, TrainConfig
    from eaglet.extract.extractor import run_extract
    from eaglet.formats.store_manifest import STORAGE_FORMATS, read_manifest
    from eaglet.train import run_train
    from eaglet.train.metrics import read_metrics

    quiet = Console(stderr=True, quiet=True)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for storage in STORAGE_FORMATS:
            stores = {}
            for name, prepared in (("train", args.prepared), ("heldout", args.heldout)):
                stores[name] = Path(tmp) / storage / name
                run_extract(
                    ExtractConfig(
                        prepared=prepared,
                        out=str(stores[name]),
                        target=args.target,
                        storage_dtype=storage,
                        reserve_gb=0,
                    ),
                    quiet,
                )
            draft = Path(tmp) / storage / "draft"
            result = run_train(
                TrainConfig(
                    out=str(draft),
                    store=str(stores["train"]),
                    eval_store=str(stores["heldout"]),
                    target=args.target,
                    token_budget=args.token_budget,
                    max_steps=args.steps,
                    lr=args.lr,
                    log_every=1,
                    eval_every=args.steps,
                    seed=0,
                ),
                quiet,
            )
            losses = [r["loss"] for r in read_metrics(draft) if r["kind"] == "train"]
            runs[storage] = {
                "store_bytes": read_manifest(stores["train"])["totals"]["bytes"],
                "losses": losses,
                "final_eval": result.final_eval,
                "train_seconds": round(result.seconds, 1),
            }
            print(
                f"{storage}: store {runs[storage]['store_bytes'] / 1e6:.1f} MB, last loss {losses[-1]:.4f}, "
                f"held-out τ {result.final_eval.get('acceptance_length')}",
                flush=True,
            )
    reference = runs["bf16"]
    for storage, run in runs.items():
        gaps = [abs(a - b) / b for a, b in zip(run["losses"], reference["losses"])]
        run["size_vs_bf16"] = round(run["store_bytes"] / reference["store_bytes"], 4)
        run["loss_rel_diff_vs_bf16"] = {"max": round(max(gaps), 5), "mean": round(sum(gaps) / len(gaps), 5)}
    record = {
        "benchmark": "storage_training",
        "target": args.target,
        "steps": args.steps,
        "token_budget": args.token_budget,
        "lr": args.lr,
        "runs": runs,
    }
    print(json.dumps({k: {key: v for key, v in run.items() if key != "losses"} for k, run in runs.items()}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
