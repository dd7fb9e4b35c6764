"""The arrows ARCHITECTURE.md forbids: each rule is checked over every import in src/eaglet (module level and inside
functions alike), and the light parts are imported in a fresh interpreter to show torch stays out."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src"

FOUNDATION = ("eaglet.errors", "eaglet.fsio", "eaglet.progress", "eaglet.resources", "eaglet.config")
MODEL = ("eaglet.target", "eaglet.capture", "eaglet.draft", "eaglet.loss", "eaglet.ttt", "eaglet.transfer",
         "eaglet.support", "eaglet.store", "eaglet.distributed", "eaglet.placement", "eaglet.sizing")
STAGES = ("eaglet.data", "eaglet.extract", "eaglet.store_check", "eaglet.train", "eaglet.export", "eaglet.consumers",
          "eaglet.decode", "eaglet.preflight", "eaglet.apicheck")
HEAVY = ("torch", "transformers", "safetensors.torch", "accelerate")

# (who, may not import, why) — a name covers the module and everything under it; a part may import itself
FORBIDDEN: tuple[tuple[tuple[str, ...], tuple[str, ...], str], ...] = (
    (("eaglet",), ("eaglet.cli",), "the CLI is the top: nothing is built on it"),
    (("eaglet.formats",) + FOUNDATION + MODEL + STAGES, ("eaglet.pipeline",),
     "`eaglet run` sits above the stages; only the CLI starts it"),
    (("eaglet.formats",), HEAVY + MODEL + STAGES + ("eaglet.config", "eaglet.progress", "eaglet.data"),
     "formats is the torch-free owner of the files: reading a manifest must cost milliseconds"),
    (FOUNDATION, ("eaglet.formats",) + MODEL + STAGES, "the foundation depends on nothing of eaglet's"),
    (MODEL, STAGES, "the model parts (target, draft, TTT, capture, store tensors) know no stage"),
    (("eaglet.decode",), ("eaglet.train", "eaglet.extract", "eaglet.export", "eaglet.preflight"),
     "decoding (eval) runs a trained draft; it never needs training or extraction"),
    (("eaglet.train",), ("eaglet.decode", "eaglet.extract", "eaglet.export", "eaglet.preflight"),
     "training reads stores through train.data, never through the extraction stage"),
    (("eaglet.extract",), ("eaglet.train", "eaglet.decode", "eaglet.export", "eaglet.preflight"),
     "extraction only writes stores"),
    (("eaglet.data",), ("eaglet.train", "eaglet.decode", "eaglet.extract", "eaglet.export", "eaglet.preflight"),
     "preparing data comes before every other stage"),
    (("eaglet.export",), ("eaglet.train", "eaglet.decode", "eaglet.extract", "eaglet.preflight"),
     "export reads a draft directory through formats"),
    (("eaglet.preflight",), ("eaglet.decode", "eaglet.train", "eaglet.extract", "eaglet.export", "eaglet.store"),
     "preflight answers in seconds: it asks formats and support, never loads a stage"),
    (("eaglet.apicheck",), HEAVY + FOUNDATION[1:] + ("eaglet.formats",) + MODEL + STAGES[:-1],
     "apicheck is a library of its own (source analysis): it depends only on eaglet.errors"),
)


def _covers(names: tuple[str, ...], module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(module: str, source: str, is_package: bool) -> set[str]:
    """Every module ``source`` imports (relative imports resolved; ``from X import y`` counts X and X.y)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def violations(module: str, imported: set[str]) -> list[str]:
    """The forbidden arrows among ``module``'s imports (its own part may import itself)."""
    problems = []
    for importers, targets, why in FORBIDDEN:
        if not _covers(importers, module):
            continue
        own_part = next((t for t in targets if _covers((t,), module)), None)
        for name in sorted(imported):
            if _covers(targets, name) and not (own_part and _covers((own_part,), name)):
                problems.append(f"{module} imports {name}: {why}")
    return problems


def test_no_forbidden_import_in_eaglet():
    problems = []
    for path in sorted((SOURCE / "eaglet").rglob("*.py")):
        module = module_name(path)
        problems += violations(module, imports_of(module, path.read_text(encoding="utf-8"), path.name == "__init__.py"))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module, source, expected", [
    ("eaglet.formats.store", "import torch\n", "eaglet.formats.store imports torch"),
    ("eaglet.preflight.stages", "def f():\n    from ..decode.evaluate import run_eval\n",
     "eaglet.preflight.stages imports eaglet.decode.evaluate"),
    ("eaglet.decode.tree", "from ..train import run_train\n", "eaglet.decode.tree imports eaglet.train"),
    ("eaglet.train.loop", "from .. import cli\n", "eaglet.train.loop imports eaglet.cli"),
])
def test_the_checker_reports_a_forbidden_arrow(module, source, expected):
    found = violations(module, imports_of(module, source, is_package=False))
    assert any(problem.startswith(expected) for problem in found), found


def test_the_checker_lets_a_part_import_itself():
    module = "eaglet.train.loop"
    assert violations(module, imports_of(module, "from .data import pad_to_budget\nfrom ..ttt import TTTModule\n",
                                         is_package=False)) == []


@pytest.mark.parametrize("module", ["eaglet.formats.files", "eaglet.formats.prepared", "eaglet.formats.store",
                                    "eaglet.formats.draft", "eaglet.formats.layers", "eaglet.preflight.stages",
                                    "eaglet.pipeline", "eaglet.config"])
def test_light_parts_load_without_torch(module):
    code = (f"import sys, {module}; heavy = sorted(m for m in {HEAVY!r} if m in sys.modules); "
            "print(','.join(heavy))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"importing {module} loaded {done.stdout.strip()}"


def test_every_part_has_a_place_in_the_layers():
    """A new top-level module or package must be placed in a layer above (so the rules cover it)."""
    placed = set(FOUNDATION + MODEL + STAGES) | {"eaglet.formats", "eaglet.pipeline", "eaglet.cli", "eaglet"}
    names = {".".join(module_name(path).split(".")[:2]) for path in (SOURCE / "eaglet").rglob("*.py")}
    assert names <= placed, f"not placed in ARCHITECTURE.md's layers: {sorted(names - placed)}"
