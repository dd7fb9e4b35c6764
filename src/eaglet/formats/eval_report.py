"""An `eaglet eval` report as its readers use it: `eaglet export` quotes its τ and speedup in the model card, so the
report must be an eval report, of finite numbers, measured on the draft being exported."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field

from ..errors import EagletError
from ..fsio import load_json_file, sha256_file
from .draft_config import TRAINED_WEIGHTS_KEY
from .files import DRAFT_WEIGHTS_FILE, EXPORTED_DRAFT_CONFIG_FILE
from .records import SHA256_PATTERN, Record, Sha256, parse_record

PASS_A_REPORT = "pass the report.json `eaglet eval` wrote for this draft"


class EvalSettings(Record):
    mode: Literal["chain", "tree"]
    device: str
    depth: int | None = Field(default=None, ge=1)  # draft tokens a round (chain) or the tree's depth
    topk: int | None = None
    budget: int | None = None


class EvalReportShape(Record):
    """What the report says of where it was measured: eaglet's decoder or a serving engine."""

    engine: str | None = None  # "vllm": served by vLLM (`eval --backend vllm`); None: eaglet's own decoder


class EvalReportRecord(EvalReportShape):
    acceptance_length: float = Field(ge=0)
    speedup: float = Field(gt=0)
    settings: EvalSettings
    # sha256 of the draft's weights file; reports of eaglet releases before it was written lack it
    draft_weights_sha256: Sha256 | None = None


def draft_weights_digest(draft_dir: str | Path) -> str:
    """The sha256 of the trained draft's weights file: for an export directory (bf16, serving names) the one it
    records of the draft it was exported from, so a draft and its exports have one digest."""
    draft_dir = Path(draft_dir)
    exported = draft_dir / EXPORTED_DRAFT_CONFIG_FILE
    if exported.is_file():
        recorded = load_json_file(exported, "export again")
        digest = recorded.get(TRAINED_WEIGHTS_KEY) if isinstance(recorded, dict) else None
        if isinstance(digest, str) and re.fullmatch(SHA256_PATTERN, digest):
            return digest
    return sha256_file(draft_dir / DRAFT_WEIGHTS_FILE)


def read_eval_report(path: str | Path, draft_dir: str | Path) -> EvalReportRecord:
    """The report at ``path``, refused in one line when it is not an eval report or was measured on another draft."""
    report = parse_record(EvalReportRecord, load_json_file(path, PASS_A_REPORT), path, PASS_A_REPORT)
    if report.draft_weights_sha256 is None:
        return report
    digest = draft_weights_digest(draft_dir)
    if report.draft_weights_sha256 != digest:
        raise EagletError(
            f"{path}: measured on another draft (weights sha256 {report.draft_weights_sha256[:12]}…, {draft_dir}'s "
            f"are {digest[:12]}…); run `eaglet eval --draft {draft_dir}` and pass its report"
        )
    return report


def chain_depth(report: EvalReportRecord) -> int | None:
    """The chain length the report measured (what a serve command's num_speculative_tokens must be for its τ to
    apply); None for a tree, or a report from before eval recorded its depth."""
    return report.settings.depth if report.settings.mode == "chain" else None


def measured_shape(report: EvalReportRecord) -> str:
    settings = report.settings
    if settings.mode == "chain":
        return f"a chain of {settings.depth} draft tokens" if settings.depth else "a chain"
    shape = "/".join(str(v) for v in (settings.depth, settings.topk, settings.budget) if v is not None)
    return f"eaglet's dynamic tree (depth/top-k/budget {shape})" if shape else "eaglet's dynamic tree"
