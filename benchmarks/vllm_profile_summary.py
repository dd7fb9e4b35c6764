"""Where a profiled vLLM run's time went, from the torch profiler traces its worker wrote (`vllm_extract_parity.py
... --profile DIR`). Prints one JSON object per trace that holds GPU activity:

    python benchmarks/vllm_profile_summary.py DIR [--gap-ms 0.5]

- ``gpu_span_ms``: first GPU activity to last; ``gpu_busy_ms``: the union of kernels, copies and sets over every
  stream; ``gpu_idle_ms`` the rest, and how much of it lies in gaps of at least ``--gap-ms`` (the host late);
- ``copies``: device-to-host / host-to-device / device-to-device time and GB;
- ``ranges``: total milliseconds, count and threads of the named ranges (eaglet's ``eaglet.save_rows`` on vLLM's step
  thread and ``eaglet.write_rows`` on its writer threads; vLLM's own annotations), the largest first.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
RANGE_CATEGORIES = ("user_annotation", "gpu_user_annotation")
TOP_RANGES = 15
US_PER_MS = 1e3


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle).get("traceEvents", [])


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (microseconds in, milliseconds out)."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total / US_PER_MS


def gaps_ms(intervals: list[tuple[float, float]], at_least_ms: float) -> tuple[int, float]:
    """(count, total ms) of idle gaps between busy intervals of at least ``at_least_ms``."""
    count, total, reach = 0, 0.0, None
    for start, end in sorted(intervals):
        if reach is not None and start - reach >= at_least_ms * US_PER_MS:
            count += 1
            total += (start - reach) / US_PER_MS
        reach = end if reach is None else max(reach, end)
    return count, total


def copy_kind(name: str) -> str:
    for kind in ("DtoH", "HtoD", "DtoD"):
        if kind in name:
            return kind
    return "other"


def summarize(path: Path, gap_ms: float) -> dict | None:
    events = [e for e in load(path) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        return None
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]
    span = (max(end for _, end in intervals) - min(start for start, _ in intervals)) / US_PER_MS
    busy = union_ms(intervals)
    gap_count, gap_total = gaps_ms(intervals, gap_ms)
    copies: dict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "gb": 0.0})
    for event in gpu:
        if event["cat"] == "gpu_memcpy":
            kind = copies[copy_kind(event.get("name", ""))]
            kind["ms"] += float(event["dur"]) / US_PER_MS
            kind["gb"] += float((event.get("args") or {}).get("bytes", 0)) / 1e9
    ranges: dict[str, dict] = defaultdict(lambda: {"ms": 0.0, "count": 0, "threads": set()})
    for event in events:
        if event.get("cat") in RANGE_CATEGORIES:
            entry = ranges[event["name"]]
            entry["ms"] += float(event["dur"]) / US_PER_MS
            entry["count"] += 1
            entry["threads"].add(event.get("tid"))
    largest = sorted(ranges.items(), key=lambda item: -item[1]["ms"])[:TOP_RANGES]
    eaglets = [(name, entry) for name, entry in ranges.items() if name.startswith("eaglet.")]
    shown = dict(largest) | dict(eaglets)
    return {
        "trace": path.name,
        "gpu_span_ms": round(span, 1),
        "gpu_busy_ms": round(busy, 1),
        "gpu_idle_ms": round(span - busy, 1),
        f"idle_in_gaps_of_{gap_ms}ms_or_more": {"count": gap_count, "ms": round(gap_total, 1)},
        "copies": {kind: {k: round(v, 3) for k, v in entry.items()} for kind, entry in sorted(copies.items())},
        "ranges": {
            name: {"ms": round(entry["ms"], 1), "count": entry["count"], "threads": len(entry["threads"])}
            for name, entry in sorted(shown.items(), key=lambda item: -item[1]["ms"])
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--gap-ms", type=float, default=0.5)
    args = parser.parse_args()
    traces = sorted(p for p in args.folder.rglob("*.json*") if ".json" in p.name and "trace" in p.name)
    if not traces:
        raise SystemExit(f"{args.folder}: no torch profiler traces (*.trace.json[.gz]) here")
    for trace in traces:
        summary = summarize(trace, args.gap_ms)
        if summary is not None:
            print(json.dumps(summary))


if __name__ == "__main__":
    main()
