"""The arrows ARCHITECTURE.md forbids: each rule is checked over every import in src/eaglet (module level and inside
functions alike), and the light parts are imported in a fresh interpreter to show torch stays out."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src"

FOUNDATION = ("eaglet.errors", "eaglet.fsio", "eaglet.packages", "eaglet.progress", "eaglet.resources")
FORMATS = ("eaglet.formats",)
DECLARATIONS = ("eaglet.export",)  # the export formats as data; its writer, eaglet.export.write, is a stage
SETTINGS = ("eaglet.config",)
MODEL = ("eaglet.model",)
STAGES = (
    "eaglet.data",
    "eaglet.extract",
    "eaglet.train",
    "eaglet.export.write",
    "eaglet.consumers",
    "eaglet.decode",
    "eaglet.preflight",
    "eaglet.apicheck",
)
RUN = ("eaglet.run",)
HEAVY = ("torch", "transformers", "safetensors.torch", "accelerate")
STAGE_MODULES = ("eaglet.export.write",)  # modules of a lower layer's package that belong to the stages

# (who, may not import, why) — a name covers the module and everything under it; a part may import itself
FORBIDDEN: tuple[tuple[tuple[str, ...], tuple[str, ...], str], ...] = (
    (("eaglet",), ("eaglet.cli",), "the CLI is the top: nothing is built on it"),
    (
        FOUNDATION + FORMATS + DECLARATIONS + SETTINGS + MODEL + STAGES,
        RUN,
        "`eaglet run` sits above the stages; only the CLI starts it",
    ),
    (
        FORMATS,
        HEAVY + DECLARATIONS + SETTINGS + MODEL + STAGES + ("eaglet.progress",),
        "formats is the torch-free owner of the files: reading a manifest must cost milliseconds",
    ),
    (
        DECLARATIONS,
        HEAVY + SETTINGS + MODEL + STAGES + ("eaglet.progress",),
        "an export format is data (names, configs, commands): the config and preflight read it without torch",
    ),
    (FOUNDATION, FORMATS + DECLARATIONS + SETTINGS + MODEL + STAGES, "the foundation depends on nothing of eaglet's"),
    (SETTINGS, HEAVY + MODEL + STAGES, "the typed configs are validated before anything heavy loads"),
    (MODEL, STAGES, "the model parts (target, draft, capture, shard tensors) know no stage"),
    (
        ("eaglet.decode",),
        ("eaglet.train", "eaglet.extract", "eaglet.export.write", "eaglet.preflight"),
        "decoding (eval) runs a trained draft; it never needs training or extraction",
    ),
    (
        ("eaglet.train",),
        ("eaglet.decode", "eaglet.extract", "eaglet.export.write", "eaglet.preflight"),
        "training reads stores through train.data, never through the extraction stage",
    ),
    (
        ("eaglet.extract",),
        ("eaglet.train", "eaglet.decode", "eaglet.export.write", "eaglet.preflight"),
        "extraction only writes stores",
    ),
    (
        ("eaglet.data",),
        ("eaglet.train", "eaglet.decode", "eaglet.extract", "eaglet.export.write", "eaglet.preflight"),
        "preparing data comes before every other stage",
    ),
    (
        ("eaglet.export.write",),
        ("eaglet.train", "eaglet.decode", "eaglet.extract", "eaglet.preflight"),
        "export reads a draft directory through formats",
    ),
    (
        ("eaglet.preflight",),
        ("eaglet.decode", "eaglet.train", "eaglet.extract", "eaglet.export.write", "eaglet.model.shards"),
        "preflight answers in seconds: it asks formats and support, never loads a stage",
    ),
    (
        ("eaglet.apicheck",),
        HEAVY + FOUNDATION[1:] + FORMATS + DECLARATIONS + SETTINGS + MODEL + STAGES[:-1],
        "apicheck is a library of its own (source analysis): it depends only on eaglet.errors",
    ),
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
        named = tuple(name for name in importers if name == "eaglet" or _covers(STAGE_MODULES, name))
        if _covers(STAGE_MODULES, module) and not _covers(named, module):
            continue  # a stage module inside a lower layer's package: only rules naming it (or all of eaglet) bind it
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


@pytest.mark.parametrize(
    "module, source, expected",
    [
        ("eaglet.formats.store_manifest", "import torch\n", "eaglet.formats.store_manifest imports torch"),
        (
            "eaglet.preflight.stages",
            "def f():\n    from ..decode.evaluate import run_eval\n",
            "eaglet.preflight.stages imports eaglet.decode.evaluate",
        ),
        ("eaglet.decode.tree", "from ..train import run_train\n", "eaglet.decode.tree imports eaglet.train"),
        ("eaglet.train.loop", "from .. import cli\n", "eaglet.train.loop imports eaglet.cli"),
    ],
)
def test_the_checker_reports_a_forbidden_arrow(module, source, expected):
    found = violations(module, imports_of(module, source, is_package=False))
    assert any(problem.startswith(expected) for problem in found), found


def test_the_checker_lets_a_part_import_itself():
    module = "eaglet.train.loop"
    assert (
        violations(
            module,
            imports_of(module, "from .data import pad_to_budget\nfrom .ttt import TTTModule\n", is_package=False),
        )
        == []
    )


@pytest.mark.parametrize(
    "module",
    [
        "eaglet.formats.files",
        "eaglet.formats.prepared",
        "eaglet.formats.store_manifest",
        "eaglet.formats.draft_config",
        "eaglet.formats.layers",
        "eaglet.preflight.stages",
        "eaglet.run.pipeline",
        "eaglet.config",
    ],
)
def test_light_parts_load_without_torch(module):
    code = f"import sys, {module}; heavy = sorted(m for m in {HEAVY!r} if m in sys.modules); print(','.join(heavy))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"importing {module} loaded {done.stdout.strip()}"


def test_every_part_has_a_place_in_the_layers():
    """A new top-level module or package must be placed in a layer above (so the rules cover it)."""
    placed = set(FOUNDATION + FORMATS + DECLARATIONS + SETTINGS + MODEL + STAGES + RUN) | {"eaglet.cli", "eaglet"}
    names = {".".join(module_name(path).split(".")[:2]) for path in (SOURCE / "eaglet").rglob("*.py")}
    assert names <= placed, f"not placed in ARCHITECTURE.md's layers: {sorted(names - placed)}"


# imported by eaglet only where the user asked for what needs them, each guarded, none a dependency of eaglet's own
OPTIONAL_IMPORTS = {
    "vllm": "the vllm backend (pip install 'eaglet[vllm]')",
    "numba": "model.vllm_processor asks whether vLLM's in-process image processor can run",
    "speculators": "export --check's speculators reader, run where speculators is installed",
}


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on; CI's is 3.11
    return tomllib.loads((SOURCE.parent / "pyproject.toml").read_text())["project"]


def _declared_distributions() -> set[str]:
    import re

    project = _project()
    requirements = list(project["dependencies"]) + [
        r for extra in project["optional-dependencies"].values() for r in extra
    ]
    return {re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def test_every_package_eaglet_imports_is_declared():
    """`pip install eaglet` brings every third-party package its code imports (pyproject's dependencies or an extra),
    apart from the few optional ones named above, each imported only where the user asked for what needs it."""
    import importlib.metadata

    distributions = importlib.metadata.packages_distributions()
    declared = _declared_distributions()
    imported: dict[str, str] = {}
    for path in (SOURCE / "eaglet").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                else []
            )
            for name in names:
                top = name.split(".")[0]
                if top != "eaglet" and top not in sys.stdlib_module_names:
                    imported.setdefault(top, str(path.relative_to(SOURCE)))
    undeclared = {
        module: where
        for module, where in imported.items()
        if module not in OPTIONAL_IMPORTS
        and module.lower() not in declared  # griffe: the distribution of that name installs griffelib
        and not {d.lower().replace("_", "-") for d in distributions.get(module, [module])} & declared
    }
    assert undeclared == {}, f"imported but not declared in pyproject.toml: {undeclared}"


def test_the_vllm_extra_spans_the_checked_releases():
    """`pip install 'eaglet[vllm]'` asks for the releases preflight calls checked, from the first whose DeepseekV3
    hands over the last layer to the newest checked: one range, stated once in model/vllm_releases.py."""
    from eaglet.model.vllm_releases import CHECKED, DEEPSEEK_LAST_LAYER_SINCE, release_key

    newest = max(CHECKED, key=release_key)
    assert _project()["optional-dependencies"]["vllm"] == [f"vllm>={DEEPSEEK_LAST_LAYER_SINCE},<={newest}"]
