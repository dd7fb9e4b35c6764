"""Medians and spreads of `before_after_h200.sh`'s runs: one line per figure, before vs after, and their ratio.

Usage: python benchmarks/before_after_summary.py DIR [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# (benchmark, label, path into its JSON, higher is better)
FIGURES = (
    ("train_8b", "TTT step, 8B shape (ms)", ("variants", "one", "step_ms_median"), False),
    ("round_bf16", "chain round d5 (ms)", ("chain_5_compiled_round_ms",), False),
    ("round_bf16", "tree round 8/8/64 (ms)", ("tree_8_8_64_compiled_round_ms",), False),
    ("round_bf16", "chain decode (tok/s)", ("chain_5_compiled_tokens_per_s",), True),
    ("round_bf16", "tree decode 8/8/64 (tok/s)", ("tree_8_8_64_compiled_tokens_per_s",), True),
    ("extract_embedded", "extract, embedded target (tok/s)", ("eaglet_extract", "tokens_per_s"), True),
)


def value_at(record: dict, path: tuple[str, ...]) -> float | None:
    for key in path:
        if not isinstance(record, dict) or key not in record:
            return None
        record = record[key]
    return float(record) if isinstance(record, (int, float)) else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for bench, label, path, higher in FIGURES:
        runs = {}
        for tree in ("before", "after"):
            values = [
                value_at(json.loads(f.read_text()), path) for f in sorted(args.directory.glob(f"{tree}_{bench}_*.json"))
            ]
            runs[tree] = [v for v in values if v is not None]
        if not runs["before"] or not runs["after"]:
            continue
        before, after = statistics.median(runs["before"]), statistics.median(runs["after"])
        ratio = after / before if higher else before / after  # > 1: after is faster
        rows.append(
            {
                "figure": label,
                "before_median": before,
                "after_median": after,
                "before_runs": runs["before"],
                "after_runs": runs["after"],
                "after_speed_vs_before": round(ratio, 3),
            }
        )
        spread = lambda xs: f"{min(xs):g}..{max(xs):g}"  # noqa: E731
        print(
            f"{label:36s} before {before:10.3f} ({spread(runs['before'])})  after {after:10.3f} "
            f"({spread(runs['after'])})  after/before speed {ratio:.3f}"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
