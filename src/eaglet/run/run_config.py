"""`eaglet run`'s YAML: the run's own keys and one section per stage (validated by the stage's config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from ..config import ExportFormat, StrictModel, describe_validation_error, parse_override, read_yaml, set_dotted
from ..errors import EagletError
from ..export import FORMAT_NAMES


class ExportSection(StrictModel):
    formats: list[ExportFormat] = Field(default_factory=lambda: list(FORMAT_NAMES))
    speculative_tokens: int | None = Field(
        default=None, ge=1, le=16, description="draft tokens a round (default: the eval's chain length, else 3)"
    )


class HeldOutSection(StrictModel):
    """The target's greedy answers to the held-out split of the regenerated prompts, extracted beside the
    training store: training then reports its held-out τ on prompts it never saw (instead of
    on a sample of its own training answers, which share their prompts with the rest)."""

    max_prompts: int | None = Field(default=None, ge=1, description="only N held-out prompts")


class MachineSection(StrictModel):
    """The machine the run is planned for (`--plan` on a laptop for a GPU server); default: this one."""

    gpus: int = Field(ge=0, description="GPUs the stages may use (torchrun's world for --placement tp)")
    gpu_memory: str = Field(description="memory per GPU, e.g. 141GiB")
    name: str = Field(default="GPU", description="e.g. H200: sets the peak FLOPs time estimates scale from")
    extract_tokens_per_s: float | None = Field(
        default=None,
        gt=0,
        description="measured extraction rate (default: estimated from the target's active parameters)",
    )
    generate_tokens_per_s: float | None = Field(default=None, gt=0, description="measured regeneration rate")


class RunConfig(StrictModel):
    """One YAML, a section per stage. Paths between stages are set by the run, not by the sections."""

    out: str = Field(default="eaglet-run", description="run directory")
    target: str = "embedded"
    trust_remote_code: bool = False
    synthesize: dict[str, Any] | None = Field(
        default=None, description="SynthesizeConfig keys: the target writes prompts for regenerate; absent = none"
    )
    regenerate: dict[str, Any] | None = Field(
        default=None, description="RegenerateConfig keys; absent = no regeneration"
    )
    prepare: dict[str, Any] = Field(
        default_factory=dict, description="PrepareConfig keys (inputs default to the regenerated answers)"
    )
    extract: dict[str, Any] | None = Field(default_factory=dict, description="ExtractConfig keys; null = train online")
    train: dict[str, Any] = Field(default_factory=dict, description="TrainConfig keys")
    export: ExportSection = Field(default_factory=ExportSection)
    heldout: HeldOutSection | None = Field(
        default=None, description="also regenerate, prepare and extract the held-out prompts; train evaluates on them"
    )
    eval: dict[str, Any] | None = Field(default_factory=dict, description="EvalConfig keys; null = no evaluation")
    machine: MachineSection | None = Field(default=None, description="plan for this machine instead of the one here")


def load_run_config(path: Path, overrides: dict[str, Any] | None = None, sets: list[str] | None = None) -> RunConfig:
    """The run config in ``path``, with ``overrides`` (whole top-level keys) and ``sets`` (``--set train.lr=1e-4``,
    dotted into the sections) over it."""
    data = read_yaml(path) | (overrides or {})
    for text in sets or []:
        key, value = parse_override(text)
        set_dotted(data, key, value)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise EagletError(describe_validation_error(exc, f"config {path}")) from None
