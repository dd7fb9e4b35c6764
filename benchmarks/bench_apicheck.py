"""`eaglet preflight calls` against vLLM's source next to `ty` and `pyright` on the same caller (wall time and
what each reports), all reading the same unpacked vLLM wheel; nothing is imported.

Setup (once): pip download vllm==0.33.0 --no-deps --only-binary :all: -d /tmp/vb, unpack its .py/.pyi files
into /tmp/vb/site (benchmarks/bench_apicheck.py --unpack does it), pip install ty, npm install pyright.
Usage: python benchmarks/bench_apicheck.py --site /tmp/vb/site [--wheel W --unpack] [--pyright BIN] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

CALLER = Path(__file__).parent / "apicheck" / "vllm_caller.py"
REPEATS = 3


def unpack(wheel: Path, site: Path) -> None:
    """The wheel's Python sources and metadata; compiled modules become empty placeholders (names only)."""
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            if info.filename.endswith((".py", ".pyi")) or ".dist-info/" in info.filename:
                archive.extract(info, site)
            elif info.filename.endswith(".so"):
                (site / info.filename).parent.mkdir(parents=True, exist_ok=True)
                (site / info.filename).touch()


def timed(command: list[str], cwd: Path | None = None) -> tuple[float, subprocess.CompletedProcess]:
    best, result = float("inf"), None
    for _ in range(REPEATS):
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env={**os.environ, "NO_COLOR": "1"})
        best = min(best, time.perf_counter() - started)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, required=True)
    parser.add_argument("--wheel", type=Path)
    parser.add_argument("--unpack", action="store_true")
    parser.add_argument("--pyright", default=shutil.which("pyright") or "/tmp/pyr/node_modules/.bin/pyright")
    parser.add_argument("--ty", default=shutil.which("ty") or str(Path(sys.executable).parent / "ty"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.unpack:
        unpack(args.wheel, args.site)
    caller_lines = CALLER.read_text().splitlines()
    record: dict = {
        "benchmark": "apicheck_vllm",
        "caller": str(CALLER.relative_to(Path(__file__).parent.parent)),
        "call_sites_in_caller": sum(
            line.count("(") for line in caller_lines if not line.lstrip().startswith(("def ", "#", '"'))
        ),
        "repeats": f"best of {REPEATS}",
        "cpu": os.cpu_count(),
    }

    seconds, result = timed(
        [
            sys.executable,
            "-m",
            "eaglet.cli",
            "preflight",
            "calls",
            str(CALLER),
            "--against",
            "vllm",
            "--site-packages",
            str(args.site),
            "--json",
        ]
    )
    ours = json.loads(result.stdout)
    record["eaglet"] = {
        "wall_s": round(seconds, 3),
        "check_s": ours["seconds"],
        "version": ours["version"],
        "calls": ours["call_sites"],
        "errors": ours["errors"],
        "unverified": ours["unverified"]["total"],
        "error_lines": sorted({f["line"] for f in ours["findings"] if f["level"] == "error"}),
    }

    if Path(args.ty).exists():
        seconds, result = timed(
            [
                args.ty,
                "check",
                "--extra-search-path",
                str(args.site),
                "--output-format",
                "concise",
                "--python-version",
                "3.12",
                str(CALLER),
            ]
        )
        diagnostics = [l for l in result.stdout.splitlines() if re.match(r".*:\d+:\d+: ", l)]
        record["ty"] = {
            "wall_s": round(seconds, 3),
            "version": subprocess.run([args.ty, "--version"], capture_output=True, text=True).stdout.strip(),
            "diagnostics": len(diagnostics),
            "lines": sorted({int(re.match(r".*?:(\d+):\d+:", l).group(1)) for l in diagnostics}),
            "sample": diagnostics[:12],
        }
    if Path(args.pyright).exists():
        with tempfile.TemporaryDirectory() as project:
            shutil.copy(CALLER, Path(project) / CALLER.name)
            (Path(project) / "pyrightconfig.json").write_text(
                json.dumps({"extraPaths": [str(args.site)], "pythonVersion": "3.12"})
            )
            seconds, result = timed([args.pyright, "--outputjson", CALLER.name], cwd=Path(project))
        data = json.loads(result.stdout)
        errors = [d for d in data["generalDiagnostics"] if d["severity"] == "error"]
        record["pyright"] = {
            "wall_s": round(seconds, 3),
            "version": data.get("version"),
            "errors": len(errors),
            "lines": sorted({d["range"]["start"]["line"] + 1 for d in errors}),
            "sample": [f"{d['range']['start']['line'] + 1}: {d['message'].splitlines()[0]}" for d in errors[:12]],
        }
    print(json.dumps(record, indent=2))
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
