"""`eaglet export --check DIR`: an export directory checked against each engine that would load it.

For every shipped release of vLLM and SGLang (``fixtures``) the engine's own loader runs on the directory's
config and tensor names (see ``vllm`` and ``sglang``); speculators, where installed, loads it for real and
runs beside eaglet's draft. A result is ``pass``, ``fail`` (the engine would raise, drop or leave unfilled a
tensor, or read a field to mean something else than eaglet wrote) or ``unverified`` (the engine's code does
something eaglet's reader does not follow, or the consumer is not installed), with the findings.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import EagletError
from ..export import format_of_directory
from ..export.spec import ExportFormat
from ..formats.draft_config import FIRST_LAYER_PREFIX, DraftConfig, read_draft_config, weight_problems
from ..formats.files import DRAFT_CONFIG_FILE, DRAFT_WEIGHTS_FILE, EXPORTED_DRAFT_CONFIG_FILE
from ..formats.records import validation_line
from ..fsio import load_json_file
from ..model.draft import vocab_mapping_problem
from .fixtures import VerifierFacts, fixtures
from .pysubset import EngineRaises, NotCovered
from .sglang_loader import SglangReader
from .vllm_loader import VllmReader

PASS, FAIL, UNVERIFIED = "pass", "fail", "unverified"
LAYOUT = "layout"  # the directory checked against itself and the target, before any engine's loader
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
    norm_output: bool | None  # eaglet's meaning (eaglet_draft.json); None: not known
    verifier: VerifierFacts
    fmt: ExportFormat  # the format config.json is in, as the engines recognise it
    weights_file: Path

    def vocab_mapping(self) -> tuple[Any, Any]:
        """(d2t, t2d or None) as stored."""
        from safetensors import safe_open

        with safe_open(str(self.weights_file), framework="pt") as handle:
            return handle.get_tensor("d2t"), handle.get_tensor("t2d") if "t2d" in self.tensors else None


EXPORT_AGAIN = "export the draft again with `eaglet export`"


def read_export(directory: Path) -> ExportFacts:
    from safetensors import safe_open

    config_file, weights_file = directory / DRAFT_CONFIG_FILE, directory / DRAFT_WEIGHTS_FILE
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise EagletError(
                f"{directory}: not an export directory (no {needed.name}); pass a directory `eaglet export` wrote"
            )
    config = load_json_file(config_file, EXPORT_AGAIN)
    if not isinstance(config, dict):
        raise EagletError(f"{config_file}: not a config (a JSON object); {EXPORT_AGAIN}")
    if "aux_layer_convention" in config:  # eaglet's own draft config: an engine's loader misreads it, blamed on itself
        raise EagletError(
            f"{directory}: an eaglet draft (`eaglet train`'s output), not an export; export it for the engine first "
            f"(`eaglet export --draft {directory} --format vllm|sglang|speculators --out DIR`) and check DIR"
        )
    try:
        with safe_open(str(weights_file), framework="pt") as handle:
            tensors = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except Exception as exc:  # a truncated or foreign file
        raise EagletError(f"{weights_file}: unreadable safetensors ({str(exc).splitlines()[0]})") from None
    meant: dict[str, Any] = {}
    if (directory / EXPORTED_DRAFT_CONFIG_FILE).is_file():
        meant = read_draft_config(directory).config.to_dict()  # validated: sizes, ids inside the target
    target = meant.get("target", {})
    layer_config = config.get("transformer_layer_config", config)
    if not isinstance(layer_config, dict):
        raise EagletError(f"{config_file}: 'transformer_layer_config' is not an object; {EXPORT_AGAIN}")
    verifier = VerifierFacts(
        target.get("vocab_size") or _int_or_none(layer_config.get("vocab_size")), target.get("num_layers")
    )
    ids = meant.get("eagle_aux_hidden_state_layer_ids")
    return ExportFacts(
        config,
        tensors,
        tuple(ids) if ids else None,
        meant.get("norm_before_residual"),
        meant.get("norm_output"),
        verifier,
        format_of_directory(config),
        weights_file,
    )


def _int_or_none(value: Any) -> int | None:
    return value if type(value) is int else None


# What every engine reads of a draft's sizes (vLLM's and SGLang's LlamaForCausalLMEagle3, speculators' Eagle3 model
# all build their layers from these), and the defaults they fall back to for the rest.
REQUIRED_SIZES = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "num_hidden_layers")


def _serving_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The draft's sizes as a serving config.json states them, with the engines' defaults where a field is absent."""
    layer = config.get("transformer_layer_config", config)
    if not isinstance(layer, dict):
        raise ValueError("'transformer_layer_config' is not an object")
    missing = [key for key in REQUIRED_SIZES if key not in layer]
    if missing:
        raise ValueError(f"no '{missing[0]}' (every engine builds the draft's layers from it)")
    heads = layer["num_attention_heads"]
    hidden = layer["hidden_size"]
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        nested = config.get("eagle_config")
        ids = nested.get("eagle_aux_hidden_state_layer_ids") if isinstance(nested, dict) else None
        ids = [i + 1 for i in ids] if isinstance(ids, list) and all(type(i) is int for i in ids) else ids
    fields = {key: layer[key] for key in REQUIRED_SIZES}
    fields |= {
        "num_key_value_heads": layer.get("num_key_value_heads", heads),
        "head_dim": layer["head_dim"]
        if "head_dim" in layer
        else (hidden // heads if type(hidden) is int and type(heads) is int and heads > 0 else None),
        "max_position_embeddings": layer.get("max_position_embeddings", 4096),
        "rms_norm_eps": layer.get("rms_norm_eps", 1e-6),
        "draft_vocab_size": config.get("draft_vocab_size", layer["vocab_size"]),
        "target_hidden_size": config.get("target_hidden_size", hidden),
        "eagle_aux_hidden_state_layer_ids": ids,
    }
    nested = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    # the engines read norm_before_fc from eagle_config first, the others from the top level only
    fields["norm_before_fc"] = nested.get("norm_before_fc", config.get("norm_before_fc", False))
    fields |= {name: config.get(name, False) for name in ("fc_norm", "norm_output")}
    return fields


def _layout_check(facts: ExportFacts) -> ConsumerResult:
    """The directory's config against its own tensors and against the target, as an engine's load would find them:
    every size present and an integer, every tensor the config implies present in its shape, aux layer ids inside
    the target."""
    try:
        fields = _serving_fields(facts.config)
        target = {"num_layers": facts.verifier.num_layers} if facts.verifier.num_layers else {}
        config = DraftConfig(**fields, target=target)
    except ValidationError as exc:
        return ConsumerResult(LAYOUT, FAIL, [f"{DRAFT_CONFIG_FILE}: {validation_line(exc)}"])
    except (ValueError, TypeError) as exc:
        return ConsumerResult(LAYOUT, FAIL, [f"{DRAFT_CONFIG_FILE}: {exc}"])
    names = {facts.fmt.eaglet_name(name, FIRST_LAYER_PREFIX): shape for name, shape in facts.tensors.items()}
    findings = weight_problems(config, names)
    if not findings and "d2t" in facts.tensors:  # the shapes fit: the mapping's values next
        problem = vocab_mapping_problem(*facts.vocab_mapping(), config.vocab_size)
        findings += [problem] if problem else []
    if facts.verifier.vocab_size is not None and config.vocab_size != facts.verifier.vocab_size:
        findings.append(f"vocab_size {config.vocab_size}, the target's is {facts.verifier.vocab_size}")
    if findings:
        return ConsumerResult(LAYOUT, FAIL, findings)
    return ConsumerResult(
        LAYOUT,
        PASS,
        [
            f"{len(facts.tensors)} tensors in the shapes config.json implies; aux layers "
            f"{config.eagle_aux_hidden_state_layer_ids} inside the target"
        ],
    )


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
        if (
            draft_vocab is not None
            and vocab is not None
            and draft_vocab < vocab
            and "d2t" not in {**load.loaded, **load.consumed}
        ):
            findings.append(
                f"a {draft_vocab:,}-token draft vocabulary of {vocab:,} without d2t reaching the engine: "
                "draft ids would be read as target ids"
            )
        ids = reader.aux_layer_ids(hf_config, facts.verifier)
        if facts.aux_layer_ids is not None and ids is not None and tuple(ids) != facts.aux_layer_ids:
            findings.append(
                f"captures the inputs of layers {list(ids)}; the draft was trained on {list(facts.aux_layer_ids)}"
            )
        elif ids is None:
            findings.append("reads no aux layer ids from this config (it would use its defaults)")
        residual = reader.norm_before_residual(hf_config)
        if facts.norm_before_residual is not None and residual != facts.norm_before_residual:
            findings.append(
                f"runs the first layer with norm_before_residual={residual}; the draft was trained with "
                f"{facts.norm_before_residual}"
            )
        fed_back_normed = reader.norm_output(model)
        if facts.norm_output is not None and fed_back_normed != facts.norm_output:
            findings.append(
                f"feeds the next draft step the {'normed' if fed_back_normed else 'un-normed'} hidden state; the "
                f"draft was trained on the {'normed' if facts.norm_output else 'un-normed'} one (norm_output)"
            )
    except NotCovered as exc:
        return ConsumerResult(label, UNVERIFIED, [f"eaglet's reader does not follow this release's code: {exc}"])
    except EngineRaises as exc:
        return ConsumerResult(label, FAIL, [f"the engine raises ({exc})"])
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
        # the engine's own code, run on this config, fails the way Python would fail it in the engine
        return ConsumerResult(label, FAIL, [f"the engine's loader fails on this config ({type(exc).__name__}: {exc})"])
    if not findings:
        findings = [
            f"{len(load.loaded)} tensors load into {len(set(load.loaded.values()))} parameters"
            + (f", {', '.join(f'{k} -> {v}' for k, v in load.consumed.items())}" if load.consumed else "")
            + (f"; skipped by the engine's own rules: {', '.join(load.skipped)}" if load.skipped else "")
            + (f"; aux layers {list(ids)} (inputs of those layers)" if ids else "")
        ]
        return ConsumerResult(label, PASS, findings)
    return ConsumerResult(label, FAIL, findings)


def _speculators_check(directory: Path, facts: ExportFacts) -> ConsumerResult:
    from . import speculators_library as speculators

    version = speculators.installed_version()
    if version is None:
        return ConsumerResult(
            "speculators",
            UNVERIFIED,
            [
                "not installed here; `pip install --no-deps speculators==0.9.0` "
                "(as scripts/dev.sh does) loads the directory with its own model class"
            ],
        )
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
    return ConsumerResult(
        label,
        status,
        [
            f"loads every tensor; logits vs eaglet's draft per TTT step: max |Δ| "
            f"{', '.join(f'{d:.1e}' for d in differences)} (tolerance {CONFORMANCE_TOLERANCE:g})"
        ],
    )


def check_export(directory: str | Path) -> list[ConsumerResult]:
    """Every consumer of this directory's format, each shipped release of each engine."""
    directory = Path(directory)
    facts = read_export(directory)
    layout = _layout_check(facts)
    if layout.status == FAIL:  # the engines' loaders would stop at it: their readers are not run on it
        return [layout]
    results = [layout] + ([_speculators_check(directory, facts)] if facts.fmt.library_check else [])
    for engine in facts.fmt.readers:
        for fixture in fixtures(engine):
            results.append(_engine_check(READERS[engine](fixture), facts))
    return results
