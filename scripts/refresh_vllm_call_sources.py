"""Keep the released vLLM source files that eaglet's own calls into vLLM bind to, for the tests.

`eaglet preflight` binds eaglet's calls into vLLM (``model/vllm_engine.py``, ``model/vllm_connector.py``) against the
installed vLLM before the vllm backend loads anything, and reads whether vLLM's model for the target captures the last
layer's output (``model/vllm_capture.py``), the attributes eaglet reads off vLLM's objects (``model/vllm_internals.py``)
and, for its CPU build, which head sizes its attention runs
(``model/vllm_cpu.py``). The tests run that check against real releases without installing them (vLLM does not
install on a CPU machine): this script unpacks each wheel (``pip download --no-deps vllm==X``), runs the checks, and
stores exactly the files they read, verbatim, in tests/fixtures/vllm_call_sources.zip under ``<version>/``, with each
wheel's name and sha256 in ``<version>/WHEEL``.

    pip download --no-deps vllm==0.25.1 -d /tmp/wheels      (each release of model/vllm_releases.CHECKED)
    python scripts/refresh_vllm_call_sources.py /tmp/wheels/vllm-*.whl

Releases already in the archive and not given keep their files (0.16.0, the release before the extract route, is no
longer on every index).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "vllm_call_sources.zip"
sys.path.insert(0, str(ROOT / "src"))

from eaglet.apicheck.check import check_calls  # noqa: E402
from eaglet.model.vllm_capture import last_layer_capture  # noqa: E402
from eaglet.model.vllm_cpu import CPU_ATTENTION, CPU_MLA  # noqa: E402
from eaglet.model.vllm_internals import READS, SPEC_DECODE_METRICS  # noqa: E402

KIMI = json.loads((ROOT / "tests" / "fixtures" / "targets" / "kimi-k2.5" / "config.json").read_text())
CAPTURE_TARGETS = [{"architectures": ["LlamaForCausalLM"]}, {"architectures": ["DeepseekV3ForCausalLM"]}, KIMI]


def sources_read(wheel: Path, scratch: Path) -> tuple[str, dict[str, bytes]]:
    """The wheel's version and the files the check of eaglet's calls read, by path inside the wheel."""
    root = scratch / wheel.stem
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(root, [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")])
    report = check_calls([ROOT / "src" / "eaglet"], "vllm", [root], str(wheel))
    read = list(report.sources)
    for config in CAPTURE_TARGETS:  # the model sources eaglet reads to know whether vLLM captures layer N
        read += last_layer_capture(config, root, report.version).files
    for cpu_backend in (CPU_ATTENTION, CPU_MLA):  # the head and block sizes vLLM's CPU build runs
        if (root / cpu_backend).is_file():
            read.append(root / cpu_backend)
    # the modules defining the attributes eaglet reads off vLLM's objects (model/vllm_internals.py)
    read += [root / module for module in {r.module for r in READS} | {SPEC_DECODE_METRICS} if (root / module).is_file()]
    files = {path.relative_to(root).as_posix(): path.read_bytes() for path in read}
    print(f"{wheel.name}: vllm {report.version}, {len(files)} files, {len(report.errors)} errors", file=sys.stderr)
    return report.version, files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheels", nargs="+", type=Path)
    args = parser.parse_args()
    kept: dict[str, bytes] = {}
    if OUT.is_file():
        with zipfile.ZipFile(OUT) as previous:
            kept = {name: previous.read(name) for name in previous.namelist()}
    with tempfile.TemporaryDirectory() as scratch:
        refreshed = {}
        for wheel in args.wheels:
            version, files = sources_read(wheel, Path(scratch))
            digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
            refreshed[f"{version}/WHEEL"] = f"{wheel.name} sha256:{digest}\n".encode()
            refreshed |= {f"{version}/{name}": data for name, data in files.items()}
    versions = {name.split("/")[0] for name in refreshed}
    kept = {name: data for name, data in kept.items() if name.split("/")[0] not in versions}
    with zipfile.ZipFile(OUT, "w", zipfile.ZIP_DEFLATED) as out:
        for name, data in sorted((kept | refreshed).items()):
            out.writestr(name, data)
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
