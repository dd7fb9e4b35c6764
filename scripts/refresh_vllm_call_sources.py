"""Keep the released vLLM source files that eaglet's own calls into vLLM bind to, for the tests.

`eaglet preflight` binds eaglet's calls into vLLM (``model/vllm_engine.py``) against the installed vLLM before the
vllm backend loads anything. The tests run that check against real releases without installing them (vLLM does not
install on a CPU machine): this script unpacks each wheel (``pip download --no-deps vllm==X``), runs the check, and
stores exactly the files it read, verbatim, in tests/fixtures/vllm_call_sources.zip under ``<version>/``, with each
wheel's name and sha256 in ``<version>/WHEEL``.

    pip download --no-deps vllm==0.24.0 vllm==0.33.0 vllm==0.18.0 -d /tmp/wheels
    python scripts/refresh_vllm_call_sources.py /tmp/wheels/vllm-*.whl
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "vllm_call_sources.zip"
sys.path.insert(0, str(ROOT / "src"))

from eaglet.apicheck.check import check_calls  # noqa: E402


def sources_read(wheel: Path, scratch: Path) -> tuple[str, dict[str, bytes]]:
    """The wheel's version and the files the check of eaglet's calls read, by path inside the wheel."""
    root = scratch / wheel.stem
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(root, [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")])
    report = check_calls([ROOT / "src" / "eaglet"], "vllm", [root], str(wheel))
    files = {path.relative_to(root).as_posix(): path.read_bytes() for path in report.sources}
    print(f"{wheel.name}: vllm {report.version}, {len(files)} files, {len(report.errors)} errors", file=sys.stderr)
    return report.version, files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheels", nargs="+", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch, zipfile.ZipFile(OUT, "w", zipfile.ZIP_DEFLATED) as out:
        for wheel in args.wheels:
            version, files = sources_read(wheel, Path(scratch))
            digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
            out.writestr(f"{version}/WHEEL", f"{wheel.name} sha256:{digest}\n")
            for name, data in sorted(files.items()):
                out.writestr(f"{version}/{name}", data)
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
