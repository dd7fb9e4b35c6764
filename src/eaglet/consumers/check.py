"""`eaglet export --check DIR`: an export directory checked against each engine that would load it.

For every shipped release of vLLM and SGLang (``fixtures``) the engine's own loader runs on the directory's
config and tensor names (see ``vllm`` and ``sglang``); speculators, where installed, loads it for real and
runs beside eaglet's draft. A result is ``pass``, ``fail`` (the engine would raise, drop or leave unfilled a
tensor, or read a field to mean something else than eaglet wrote) or ``unverified`` (the engine's code does
something eaglet's reader does not follow, or the consumer is not installed), with the findings.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import EagletError
from .fixtures import VerifierFacts, fixtures
from .pysubset import EngineRaises, NotCovered
from .sglang import SglangReader
from .vllm import VllmReader

PASS, FAIL, UNVERIFIED = "pass", "fail", "unverified"
READERS = {"vllm": VllmReader, "sglang": SglangReader}
CONFORMANCE_TOLERANCE = 1e-3  # float32 logits of the same bf16 weights through two implementations


@dataclass
class ConsumerResult:
    consumer: str  # "vllm 0.33.0", "speculators 0.9.0"
    status: str
    findings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ExportFacts:
    """What the directory holds and what eaglet meant by it."""

    config: dict[str, Any]  # config.json
    tensors: dict[str, tuple[int, ...]]  # model.safetensors: name -> shape
    aux_layer_ids: tuple[int, ...] | None  # eaglet's convention (input of layer i), from eaglet_draft.json
    norm_before_residual: bool | None
    verifier: VerifierFacts

    @property
    def speculators_format(self) -> bool:
        return "speculators_config" in self.config


def read_export(directory: Path) -> ExportFacts:
    from safetensors import safe_open

    config_file, weights_file = directory / "config.json", directory / "model.safetensors"
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise EagletError(f"{directory}: not an export directory (no {needed.name}); pass a directory `eaglet export` wrote")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise EagletError(f"{config_file}: not valid JSON ({exc})") from None
    try:
        with safe_open(str(weights_file), framework="pt") as handle:
            tensors = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except Exception as exc:  # a truncated or foreign file
        raise EagletError(f"{weights_file}: unreadable safetensors ({str(exc).splitlines()[0]})") from None
    eaglet_file = directory / "eaglet_draft.json"
    meant = json.loads(eaglet_file.read_text(encoding="utf-8")) if eaglet_file.is_file() else {}
    target = meant.get("target", {})
    layer_config = config.get("transformer_layer_config", config)
    verifier = VerifierFacts(target.get("vocab_size") or layer_config.get("vocab_size"), target.get("num_layers"))
    ids = meant.get("eagle_aux_hidden_state_layer_ids")
    return ExportFacts(config, tensors, tuple(ids) if ids else None, meant.get("norm_before_residual"), verifier)


def _engine_check(reader: Any, facts: ExportFacts) -> ConsumerResult:
    label = reader.fixture.label
    findings: list[str] = []
    try:
        hf_config = reader.hf_config(facts.config)
        model = reader.build(hf_config, facts.verifier)
        load = reader.load(model, list(facts.tensors))
        findings += load.errors
        findings += [f"{param}: no exported tensor fills it (left at its initial value)" for param in load.unfilled]
        vocab, draft_vocab = hf_config.get("vocab_size"), hf_config.get("draft_vocab_size")
        if draft_vocab is not None and vocab is not None and draft_vocab < vocab and "d2t" not in {
                **load.loaded, **load.consumed}:
            findings.append(f"a {draft_vocab:,}-token draft vocabulary of {vocab:,} without d2t reaching the engine: "
                            "draft ids would be read as target ids")
        ids = reader.aux_layer_ids(hf_config, facts.verifier)
        if facts.aux_layer_ids is not None and ids is not None and tuple(ids) != facts.aux_layer_ids:
            findings.append(f"captures the inputs of layers {list(ids)}; the draft was trained on {list(facts.aux_layer_ids)}")
        elif ids is None:
            findings.append("reads no aux layer ids from this config (it would use its defaults)")
        residual = reader.norm_before_residual(hf_config)
        if facts.norm_before_residual is not None and residual != facts.norm_before_residual:
            findings.append(f"runs the first layer with norm_before_residual={residual}; the draft was trained with "
                            f"{facts.norm_before_residual}")
    except NotCovered as exc:
        return ConsumerResult(label, UNVERIFIED, [f"eaglet's reader does not follow this release's code: {exc}"])
    except EngineRaises as exc:
        return ConsumerResult(label, FAIL, [f"the engine raises ({exc})"])
    if not findings:
        findings = [f"{len(load.loaded)} tensors load into {len(set(load.loaded.values()))} parameters"
                    + (f", {', '.join(f'{k} -> {v}' for k, v in load.consumed.items())}" if load.consumed else "")
                    + (f"; skipped by the engine's own rules: {', '.join(load.skipped)}" if load.skipped else "")
                    + (f"; aux layers {list(ids)} (inputs of those layers)" if ids else "")]
        return ConsumerResult(label, PASS, findings)
    return ConsumerResult(label, FAIL, findings)


def _speculators_check(directory: Path, facts: ExportFacts) -> ConsumerResult:
    from . import speculators

    version = speculators.installed_version()
    if version is None:
        return ConsumerResult("speculators", UNVERIFIED, ["not installed here; `pip install --no-deps speculators==0.9.0` "
                                                          "(as scripts/dev.sh does) loads the directory with its own model class"])
    label = f"speculators {version}"
    try:
        _, load = speculators.load(directory)
    except Exception as exc:  # the library's own refusal, in its words
        return ConsumerResult(label, FAIL, [f"Eagle3DraftModel.from_pretrained raises: {str(exc).splitlines()[0]}"])
    findings = [f"{name}: in the model, not in the checkpoint" for name in load.missing]
    findings += [f"{name}: in the checkpoint, not in the model" for name in load.unexpected]
    findings += [f"{name}: shape differs from the model's" for name in load.mismatched]
    findings += [f"{name}: never filled (NaN)" for name in load.unset]
    if findings:
        return ConsumerResult(label, FAIL, findings)
    if not (directory / "eaglet_draft.json").is_file():
        return ConsumerResult(label, PASS, ["loads every tensor (no eaglet_draft.json: logits not compared)"])
    differences = speculators.compare_logits(directory)
    worst = max(differences)
    status = PASS if worst <= CONFORMANCE_TOLERANCE else FAIL
    return ConsumerResult(label, status, [f"loads every tensor; logits vs eaglet's draft per TTT step: max |Δ| "
                                          f"{', '.join(f'{d:.1e}' for d in differences)} (tolerance {CONFORMANCE_TOLERANCE:g})"])


def check_export(directory: str | Path) -> list[ConsumerResult]:
    """Every consumer of this directory's format, each shipped release of each engine."""
    directory = Path(directory)
    facts = read_export(directory)
    engines = ("vllm",) if facts.speculators_format else ("vllm", "sglang")
    results = [_speculators_check(directory, facts)] if facts.speculators_format else []
    for engine in engines:
        for fixture in fixtures(engine):
            results.append(_engine_check(READERS[engine](fixture), facts))
    return results
