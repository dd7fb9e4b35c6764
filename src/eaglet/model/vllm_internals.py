"""Every plain attribute eaglet reads off a vLLM object, in one list, checked against vLLM's source.

`eaglet preflight calls` binds eaglet's calls into vLLM (arguments to functions and constructors); it cannot see an
attribute read (``llm.llm_engine``, ``output.kv_transfer_params``) or a metric found by its name. Those are listed
here, each with the class that defines it and where eaglet reads it, and ``missing_reads`` says which of them a vLLM
source tree no longer defines: CI runs it over every release in ``vllm_releases.CHECKED`` (their files kept in
tests/fixtures/vllm_call_sources.zip), preflight over the installed vLLM.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class InternalRead:
    """``owner.attribute``, defined in ``module`` (a path under vLLM's package root), read by ``used_by``."""

    module: str
    owner: str
    attribute: str
    used_by: str

    def __str__(self) -> str:
        return f"{self.owner}.{self.attribute} ({self.module}; eaglet's {self.used_by})"


LLM = "vllm/entrypoints/llm.py"
OUTPUTS = "vllm/outputs.py"
READER = "vllm/v1/metrics/reader.py"
READS = (
    InternalRead(LLM, "LLM", "llm_engine", "model.vllm_engine.EngineQueue, decode.vllm_serving.ServingEngine.close"),
    InternalRead(LLM, "LLM", "get_metrics", "decode.vllm_serving.Counters.read"),
    InternalRead("vllm/v1/engine/llm_engine.py", "LLMEngine", "engine_core", "decode.vllm_serving.ServingEngine.close"),
    InternalRead("vllm/v1/engine/core_client.py", "EngineCoreClient", "shutdown", "ServingEngine.close"),
    InternalRead(OUTPUTS, "RequestOutput", "request_id", "model.vllm_engine.stream_requests"),
    InternalRead(OUTPUTS, "RequestOutput", "finished", "model.vllm_engine.EngineQueue.finished"),
    InternalRead(OUTPUTS, "RequestOutput", "outputs", "data.regenerate, decode.vllm_serving"),
    InternalRead(OUTPUTS, "RequestOutput", "kv_transfer_params", "model.vllm_engine.HiddenStateEngine.finished"),
    InternalRead(OUTPUTS, "CompletionOutput", "token_ids", "data.regenerate, decode.vllm_serving"),
    InternalRead(READER, "Metric", "name", "decode.vllm_serving.Counters.read"),
    InternalRead(READER, "Counter", "value", "decode.vllm_serving.Counters.read"),
    InternalRead(READER, "Vector", "values", "decode.vllm_serving.Counters.read"),
    InternalRead("vllm/v1/request.py", "Request", "kv_transfer_params", "model.vllm_connector"),
    InternalRead("vllm/v1/request.py", "Request", "request_id", "model.vllm_connector"),
    InternalRead("vllm/v1/request.py", "Request", "prompt_token_ids", "model.vllm_connector"),
)
# metrics eaglet finds by name in ``LLM.get_metrics()`` (decode.vllm_serving), and the module that registers them
SPEC_DECODE_METRICS = "vllm/v1/spec_decode/metrics.py"
METRIC_NAMES = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)


def class_defines(tree: ast.Module, owner: str, attribute: str) -> bool | None:
    """Whether class ``owner`` in ``tree`` defines ``attribute`` (a method, a class-level name or annotation, or a
    ``self.attribute`` assignment in one of its methods); None when the module has no such class."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == owner:
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == attribute:
                    return True
                if not isinstance(item, (ast.Assign, ast.AnnAssign)):
                    continue
                for target in getattr(item, "targets", None) or [item.target]:  # x = ... / x: T = ...
                    if isinstance(target, ast.Name) and target.id == attribute:
                        return True
                    if isinstance(target, ast.Attribute) and target.attr == attribute:
                        if isinstance(target.value, ast.Name) and target.value.id == "self":
                            return True
            return False
    return None


def missing_reads(root: Path, reads: tuple[InternalRead, ...] = READS) -> list[str]:
    """What of ``reads`` (and the metric names) vLLM's source under ``root`` (the folder holding ``vllm/``) does
    not define, one line each; empty: every read still finds its attribute."""
    missing = []
    parsed: dict[str, ast.Module | None] = {}
    for read in reads:
        if read.module not in parsed:
            path = root / read.module
            parsed[read.module] = ast.parse(path.read_text(encoding="utf-8")) if path.is_file() else None
        tree = parsed[read.module]
        found = class_defines(tree, read.owner, read.attribute) if tree is not None else None
        if tree is None:
            missing.append(f"{read}: {read.module} is not in this vLLM")
        elif found is None:
            missing.append(f"{read}: {read.module} has no class {read.owner}")
        elif not found:
            missing.append(f"{read}: {read.owner} no longer defines {read.attribute}")
    metrics = root / SPEC_DECODE_METRICS
    source = metrics.read_text(encoding="utf-8") if metrics.is_file() else ""
    missing += [
        f"metric {name!r} ({SPEC_DECODE_METRICS}; eaglet's decode.vllm_serving): not registered by this vLLM"
        for name in METRIC_NAMES
        if f'"{name}"' not in source
    ]
    return missing
