"""`eaglet preflight calls` over several real releases: every error it reports, read a second time.

Rows: vLLM 0.10.1.1 and 0.33.0 (unpacked wheels) under two callers (benchmarks/apicheck/), and eaglet's own source
against the installed transformers and torch. The second reading of an error is independent of the checker:
  - a library importable here (at the release checked): the call's shape bound with inspect.signature on the
    imported object (a name that does not import is confirmed missing);
  - a release that does not import here (vLLM needs its GPU stack): benchmarks/apicheck/second_reading.json, each
    error read in the release's source by a person, with where it was read. An error without a verdict counts as
    unreviewed, never as confirmed.

    pip download --no-deps vllm==0.10.1.1 vllm==0.33.0 -d /tmp/wheels
    python benchmarks/bench_apicheck_releases.py --vllm-wheels /tmp/wheels --out benchmarks/results/apicheck_releases.json
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import tempfile
import zipfile
from pathlib import Path

from eaglet.apicheck.check import check_calls, library_roots

HERE = Path(__file__).parent
ROOT = HERE.parent
CALLERS = {"vllm": [HERE / "apicheck" / "vllm_caller.py", HERE / "apicheck" / "vllm_config_caller.py"]}
VERDICTS = HERE / "apicheck" / "second_reading.json"
VLLM_RELEASES = ("0.10.1.1", "0.33.0")


def unpack(wheel: Path, site: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            if info.filename.endswith((".py", ".pyi")) or ".dist-info/" in info.filename:
                archive.extract(info, site)


def call_at(path: Path, line: int) -> ast.Call | None:
    """The outermost call expression starting on ``line`` of ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.lineno == line]
    return max(calls, key=lambda c: c.end_col_offset - c.col_offset) if calls else None


def runtime_reading(finding) -> str:
    """Bind the call's shape to the imported object: 'confirmed' when Python would raise, 'false' when not."""
    module_path, *attributes = finding.target.split(".")
    obj = None
    parts = finding.target.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
            attributes = parts[cut:]
            break
        except ImportError:
            continue
    if obj is None:
        return "confirmed"
    for attribute in attributes:
        if attribute in ("__init__", "__new__"):
            break
        if not hasattr(obj, attribute):
            return "confirmed"
        obj = getattr(obj, attribute)
    if "does not exist" in finding.message or "no longer has" in finding.message:
        return "false"  # the name imports
    call = call_at(Path(finding.path), finding.line)
    if call is None or any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return "unreadable"
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return "unreadable"
    try:
        signature.bind(*range(len(call.args)), **{k.arg: None for k in call.keywords})
    except TypeError:
        return "confirmed"
    return "false"


def read_row(
    name: str, package: str, roots: list[Path], source: str, callers: list[Path], verdicts: dict, runtime: bool
) -> dict:
    report = check_calls(callers, package, roots, source)
    release = f"{package} {report.version}"
    counts = {"confirmed": 0, "false": 0, "unreviewed": 0, "unreadable": 0}
    errors = []
    for finding in report.errors:
        where = f"{Path(finding.path).relative_to(ROOT)}:{finding.line}"
        if runtime:
            verdict, why = runtime_reading(finding), "inspect.signature of the imported object"
        else:
            entry = verdicts.get(release, {}).get(where)
            verdict, why = (entry["verdict"], entry["why"]) if entry else ("unreviewed", "")
        counts[verdict] += 1
        errors.append(
            {"at": where, "target": finding.target, "message": finding.message, "second_reading": verdict, "why": why}
        )
    return {
        "row": name,
        "release": release,
        "call_sites": report.call_sites,
        "imports": report.imports,
        "errors": len(report.errors),
        "warnings": len(report.warnings),
        "unverified": sum(report.unverified.values()),
        "second_reading": counts,
        "seconds": round(report.seconds, 2),
        "error_list": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-wheels", type=Path, required=True, help="folder holding the vLLM wheels")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    verdicts = json.loads(VERDICTS.read_text()) if VERDICTS.is_file() else {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="eaglet-releases-") as tmp:
        for version in VLLM_RELEASES:
            wheel = next(args.vllm_wheels.glob(f"vllm-{version}-*.whl"))
            site = Path(tmp) / version
            unpack(wheel, site)
            for caller in CALLERS["vllm"]:
                rows.append(read_row(caller.stem, "vllm", [site], str(wheel.name), [caller], verdicts, runtime=False))
    for package in ("transformers", "torch"):
        roots, source = library_roots(package)
        rows.append(
            read_row("eaglet's own source", package, roots, source, [ROOT / "src" / "eaglet"], verdicts, runtime=True)
        )
    for row in rows:
        second = row["second_reading"]
        print(
            f"{row['release']:22s} {row['row']:24s} {row['call_sites']:4d} calls {row['errors']:3d} errors: "
            f"{second['confirmed']} confirmed, {second['false']} false, {second['unreviewed']} unreviewed; "
            f"{row['unverified']} unverified"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
