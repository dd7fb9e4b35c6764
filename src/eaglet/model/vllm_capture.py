"""Whether the installed vLLM's model for a target hands the extract route the last layer's output, read from its source.

eaglet asks vLLM for the aux layers and for layer id N (the last decoder layer's output, before the final norm, that
becomes ``last``). Each vLLM model collects the requested states in its own forward: most through the shared
``_maybe_add_hidden_state(aux, layer_idx + 1, ...)`` after every layer, which includes N; some with their own loop
``if idx in self.aux_hidden_state_layers`` over the layers' *inputs*, which never reaches N unless the forward also
checks ``self.end_layer`` after the loop. vLLM 0.24.0's DeepseekV2/V3 (Kimi-K2's) is one of the latter: its engine
dies on the first step (the proposer expects 4 states and gets 3), after the whole model load. This is known from the
source in milliseconds, without importing vLLM.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .vllm_releases import DEEPSEEK_LAST_LAYER_SINCE

REGISTRY = "vllm/model_executor/models/registry.py"
MODELS = "vllm/model_executor/models"
REGISTERED = re.compile(r'"(\w+)"\s*:\s*\(\s*"(\w+)"\s*,\s*"(\w+)"\s*\)')  # "Arch": ("module", "Class")
OWN_LOOP = re.compile(r"\bin\s+self\.aux_hidden_state_layers")  # the model collects the states itself
LAST_OUTPUT = re.compile(  # ... and also the last layer's output
    r"end_layer\s+in\s+self\.aux_hidden_state_layers|_maybe_add_hidden_state\([^)]*\+\s*1", re.S
)
DELEGATES = re.compile(r"language_model\.set_aux_hidden_state_layers")  # a wrapper: its language model collects


@dataclass
class CaptureVerdict:
    problem: str | None = None
    files: list[Path] = field(default_factory=list)  # the vLLM sources read (the tests keep them)


def installed_vllm_root() -> Path | None:
    """The directory holding the installed ``vllm`` package (found, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


def last_layer_capture(config: dict[str, Any], root: Path, version: str) -> CaptureVerdict:
    """Whether vLLM (its sources under ``root``) captures layer id N for the model ``config`` (config.json as
    written, not ``read_config``'s flattening: a wrapper's own class and its ``text_config``'s are both judged)."""
    verdict = CaptureVerdict()
    registry = root / REGISTRY
    if not registry.is_file():
        return verdict  # not a vLLM layout eaglet knows: vLLM itself will say
    verdict.files.append(registry)
    modules = {arch: module for arch, module, _ in REGISTERED.findall(registry.read_text())}
    architectures = [*(config.get("architectures") or [])[:1]]
    text = config.get("text_config") or {}
    architectures += (text.get("architectures") or [])[:1]
    for index, arch in enumerate(architectures):
        module = modules.get(arch)
        if module is None:
            return verdict
        path = root / MODELS / f"{module}.py"
        if not path.is_file():
            return verdict
        verdict.files.append(path)
        source = path.read_text()
        if DELEGATES.search(source) and index + 1 < len(architectures):
            continue  # the wrapper hands the layers to its language model: judge that one
        if OWN_LOOP.search(source) and not LAST_OUTPUT.search(source):
            verdict.problem = (
                f"vLLM {version}'s {arch} ({MODELS}/{module}.py) captures hidden states only at decoder layers' "
                "inputs, not the last layer's output that eaglet's `last` feature needs (its engine would die on "
                f"the first step, after the model load); install a vLLM release that captures it (vllm>="
                f"{DEEPSEEK_LAST_LAYER_SINCE}), or use --backend hf"
            )
        return verdict
    return verdict


def installed_capture(target_path: Path, version: str) -> CaptureVerdict | None:
    """``last_layer_capture`` of the target (its config.json as written: a wrapper's class and its language model's)
    against the installed vLLM, or None where its source is not found."""
    from .target import raw_config

    root = installed_vllm_root()
    return None if root is None else last_layer_capture(raw_config(target_path), root, version)
