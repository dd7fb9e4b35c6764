"""A draft directory's config: eaglet's ``DraftConfig`` (written as an HF-style config.json by `eaglet train`, kept
as eaglet_draft.json inside every export) and the one reader of it, for loading, exporting, evaluating and preflight."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import ValidationError
from pydantic.dataclasses import dataclass as record_dataclass

from ..errors import EagletError
from ..fsio import load_json_file
from .files import DRAFT_CONFIG_FILE, DRAFT_WEIGHTS_FILE, EXPORTED_DRAFT_CONFIG_FILE, TRAIN_CONFIG_FILE
from .foreign_draft import exported_format_name, foreign_draft_fields, is_made_elsewhere
from .layers import AUX_CONVENTION, validate_aux_layer_ids
from .records import RECORD_CONFIG, Positive, validation_line


def attention_head_dim(text: dict[str, Any]) -> int:
    """The width of one (non-latent) attention head in a text model's config: its ``head_dim``, or the hidden size
    over the heads where the config leaves it out (Llama's convention)."""
    return int(text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"]))


DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"
# `train --eagle-version`: the draft's norm settings. 3.1 as its paper and SGLang's ``use_aux_norm`` have it: one norm
# per aux feature, and the normed hidden state fed back
EAGLE_VARIANTS: dict[str, dict[str, bool]] = {
    "3": {"fc_norm": False, "norm_before_fc": False, "norm_output": False},
    "3.1": {"fc_norm": True, "norm_before_fc": False, "norm_output": True},
}
# new drafts' default: on the GPU demo's store, same steps, 3.1's τ was 3.17 to 3's 2.73 (tree), 1.91 to 1.70 (chain of
# 3) in eaglet's decoder (benchmarks/RESULTS.md, "EAGLE 3.1")
DEFAULT_EAGLE_VERSION = "3.1"
AUX_FEATURES = 3  # EAGLE-3 fuses three target layers' hidden states


def norms_version(norms: dict[str, bool]) -> str:
    """The variant these norm settings are ("3", "3.1"), or the settings spelled out (a draft made elsewhere)."""
    named = [version for version, variant in EAGLE_VARIANTS.items() if variant == norms]
    return named[0] if named else "3 with " + ", ".join(name for name, on in norms.items() if on)


FIRST_LAYER_PREFIX = "midlayer."  # the EAGLE-3 layer's serving name (vLLM's and SGLang's checkpoints)
TRAINED_WEIGHTS_KEY = "trained_weights_sha256"  # an export's record of the trained draft's weights file
EXPORT_ONLY_KEYS = ("export_format", TRAINED_WEIGHTS_KEY)  # what an export adds to eaglet's config


@record_dataclass(config=RECORD_CONFIG | {"extra": "forbid"})
class DraftConfig:
    """Written as an HF-style config.json; rope settings are inherited from the target. Validated whenever one is
    made or read (strict JSON types, finite, sizes that fit together, aux layer ids inside the recorded target)."""

    hidden_size: Positive
    num_attention_heads: Positive
    num_key_value_heads: Positive
    head_dim: Positive
    intermediate_size: Positive
    vocab_size: Positive  # the target's
    draft_vocab_size: Positive
    target_hidden_size: Positive
    eagle_aux_hidden_state_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: Positive = 4096
    num_hidden_layers: Positive = 1
    hidden_act: Literal["silu"] = "silu"
    norm_before_residual: bool = False
    # EAGLE 3.1 (arXiv 2605.09992), as vLLM, SGLang and speculators name it: an RMSNorm on each aux feature before
    # ``fc`` (fc_norm), or one over their concatenation (norm_before_fc, speculators' default); the hidden state fed
    # back to the next draft step taken after the final norm instead of before it (norm_output)
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False
    tie_word_embeddings: bool = False
    architectures: list[str] = field(default_factory=lambda: [DRAFT_ARCHITECTURE])
    model_type: Literal["llama"] = "llama"
    aux_layer_convention: Literal[AUX_CONVENTION] = AUX_CONVENTION
    target: dict[str, Any] = field(default_factory=dict)  # name, config_hash, tokenizer_hash, num_layers, ...

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.fc_norm and self.norm_before_fc:
            raise ValueError("fc_norm and norm_before_fc are two ways to norm the aux features; set one")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} exceeds vocab_size {self.vocab_size}")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        target_layers = self.target.get("num_layers")
        try:
            validate_aux_layer_ids(
                self.eagle_aux_hidden_state_layer_ids,
                target_layers
                if isinstance(target_layers, int) and target_layers > 0
                else max(self.eagle_aux_hidden_state_layer_ids + [0]) + 1,
            )
        except EagletError as exc:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids: {exc}") from None

    @property
    def eagle_version(self) -> str:
        """The variant its norm settings are ("3", "3.1"), or those settings spelled out (a draft made elsewhere)."""
        return norms_version(draft_norms(self))

    @property
    def uses_vocab_mapping(self) -> bool:
        """Whether the draft vocabulary is a subset of the target's (then ``d2t``/``t2d`` travel with it)."""
        return self.draft_vocab_size != self.vocab_size

    @classmethod
    def from_target(
        cls,
        target_config: dict[str, Any],
        draft_vocab_size: int,
        layer_ids: tuple[int, ...],
        target_identity: dict[str, Any] | None = None,
        num_layers: int = 1,
        norms: dict[str, bool] | None = None,
    ) -> "DraftConfig":
        heads = int(target_config["num_attention_heads"])
        hidden = int(target_config["hidden_size"])
        rope = target_config.get("rope_parameters") or {}  # transformers 5's form: theta and scaling in one dict
        scaled = rope.get("rope_type", "default") != "default"
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(target_config.get("num_key_value_heads") or heads),
            head_dim=attention_head_dim(target_config),
            intermediate_size=int(target_config["intermediate_size"]),
            vocab_size=int(target_config["vocab_size"]),
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=hidden,
            eagle_aux_hidden_state_layer_ids=list(layer_ids),
            rms_norm_eps=float(target_config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(target_config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=dict(target_config.get("rope_scaling") or {})
            or ({k: v for k, v in rope.items() if k != "rope_theta"} if scaled else None),
            max_position_embeddings=int(target_config.get("max_position_embeddings", 4096)),
            num_hidden_layers=num_layers,
            **(norms or EAGLE_VARIANTS[DEFAULT_EAGLE_VERSION]),
            target=dict(target_identity or {}),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


EMBEDDING_TENSOR = "embed_tokens.weight"  # the target's; only the speculators export carries it
VOCAB_MAPPING_TENSORS = ("d2t", "t2d")


def draft_weight_shapes(config: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a draft directory may hold under eaglet's names, with its shape."""
    hidden, heads, kv, head_dim = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    inner = config.intermediate_size

    def layer(prefix: str, attention_input: int, hidden_norm: bool) -> dict[str, tuple[int, ...]]:
        shapes = {
            f"{prefix}input_layernorm.weight": (hidden,),
            f"{prefix}post_attention_layernorm.weight": (hidden,),
            f"{prefix}self_attn.q_proj.weight": (heads * head_dim, attention_input),
            f"{prefix}self_attn.k_proj.weight": (kv * head_dim, attention_input),
            f"{prefix}self_attn.v_proj.weight": (kv * head_dim, attention_input),
            f"{prefix}self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{prefix}mlp.gate_proj.weight": (inner, hidden),
            f"{prefix}mlp.up_proj.weight": (inner, hidden),
            f"{prefix}mlp.down_proj.weight": (hidden, inner),
        }
        if hidden_norm:
            shapes[f"{prefix}hidden_norm.weight"] = (hidden,)
        return shapes

    aux = config.target_hidden_size
    shapes = {"fc.weight": (hidden, AUX_FEATURES * aux), **layer(FIRST_LAYER_PREFIX, 2 * hidden, True)}
    if config.fc_norm:
        shapes |= {f"fc_norm.{index}.weight": (aux,) for index in range(AUX_FEATURES)}
    if config.norm_before_fc:
        shapes["input_norm.weight"] = (AUX_FEATURES * aux,)
    for index in range(1, config.num_hidden_layers):
        shapes |= layer(f"layers.{index}.", hidden, False)
    return shapes | {
        "norm.weight": (hidden,),
        "lm_head.weight": (config.draft_vocab_size, hidden),
        "d2t": (config.draft_vocab_size,),
        "t2d": (config.vocab_size,),
        EMBEDDING_TENSOR: (config.vocab_size, hidden),
    }


def weight_problems(config: DraftConfig, found: dict[str, tuple[int, ...]]) -> list[str]:
    """How tensors ``found`` (eaglet's names -> shapes) differ from the draft ``config`` describes. The embedding
    may be absent (only the speculators export carries it), and so may ``d2t``/``t2d`` when the draft vocabulary is
    the target's whole one."""
    expected = draft_weight_shapes(config)
    may_lack = {EMBEDDING_TENSOR, *(() if config.uses_vocab_mapping else VOCAB_MAPPING_TENSORS)}
    problems = [f"{name}: missing" for name in expected if name not in found and name not in may_lack]
    problems += [
        f"{name}: shape {list(found[name])}, the config needs {list(shape)}"
        for name, shape in expected.items()
        if name in found and tuple(found[name]) != shape
    ]
    problems += [f"{name}: not a tensor of this draft" for name in found if name not in expected]
    return problems


@dataclass(frozen=True)
class StoredDraft:
    config: DraftConfig
    export_format: str | None  # None: `eaglet train`'s output; else the format an export was written in
    config_file: Path
    made_elsewhere: bool = False  # not eaglet's (foreign_draft): no target record, its tensors in ``export_format``


def read_draft_config(directory: str | Path, target_layers: int | None = None) -> StoredDraft:
    """The config of a draft directory (`eaglet train` output, an `eaglet export` directory, or an EAGLE-3 draft made
    elsewhere: ``foreign_draft``; ``target_layers``: the target's decoder layers, for one that names no aux layers),
    refused in one line when the directory holds no draft."""
    directory = Path(directory)
    config_file = directory / EXPORTED_DRAFT_CONFIG_FILE
    if not config_file.is_file():
        config_file = directory / DRAFT_CONFIG_FILE
    if not config_file.is_file() or not (directory / DRAFT_WEIGHTS_FILE).is_file():
        raise EagletError(
            f"{directory}: not a draft (needs {DRAFT_CONFIG_FILE} and {DRAFT_WEIGHTS_FILE}); run "
            "`eaglet train`, or pass its --out"
        )
    fields = load_json_file(config_file, "train (or export) again")
    if not isinstance(fields, dict):
        raise EagletError(f"{config_file}: not an eaglet draft config; train again")
    if config_file.name == DRAFT_CONFIG_FILE and is_made_elsewhere(fields):
        return _made_elsewhere(fields, config_file, target_layers)
    export_format = fields.get("export_format")
    if export_format is not None and not isinstance(export_format, str):
        raise EagletError(f"{config_file}: export_format {export_format!r} is not a format name; export again")
    try:
        config = DraftConfig(**{k: v for k, v in fields.items() if k not in EXPORT_ONLY_KEYS})
    except ValidationError as exc:
        raise EagletError(
            f"{config_file}: not a valid eaglet draft config ({validation_line(exc)}); train again"
        ) from None
    except TypeError as exc:
        raise EagletError(f"{config_file}: not an eaglet draft config ({exc}); train again") from None
    if config_file.name == DRAFT_CONFIG_FILE:
        check_against_training_record(config, config_file)
    return StoredDraft(config, export_format, config_file)


def _made_elsewhere(fields: dict[str, Any], config_file: Path, target_layers: int | None) -> StoredDraft:
    try:
        config = DraftConfig(**foreign_draft_fields(fields, config_file, target_layers))
    except (ValidationError, TypeError) as exc:
        reason = validation_line(exc) if isinstance(exc, ValidationError) else str(exc)
        raise EagletError(f"{config_file}: a draft made elsewhere that eaglet cannot run ({reason})") from None
    return StoredDraft(config, exported_format_name(fields), config_file, made_elsewhere=True)


def check_against_training_record(config: DraftConfig, config_file: Path) -> None:
    """Refuse a train output whose config.json no longer says what its weights learned from, by the run's own
    record (train_config.json): aux layer ids edited by hand (to suit an engine's convention, say) would make eval
    and every export capture other layers than the draft was trained on."""
    record_file = config_file.with_name(TRAIN_CONFIG_FILE)
    if not record_file.is_file():
        return
    record = load_json_file(record_file, "train again")
    identity = record.get("identity") if isinstance(record, dict) else None
    if not isinstance(identity, dict):
        return
    trained_layers = identity.get("layer_ids")
    if isinstance(trained_layers, list) and trained_layers != config.eagle_aux_hidden_state_layer_ids:
        raise EagletError(
            f"{config_file}: eagle_aux_hidden_state_layer_ids {config.eagle_aux_hidden_state_layer_ids}, but the "
            f"draft was trained on {trained_layers} ({record_file.name}); put {trained_layers} back — `eaglet "
            "export` writes each engine's own layer convention"
        )
    trained_target = identity.get("target")
    trained_hash = trained_target.get("config_hash") if isinstance(trained_target, dict) else None
    if trained_hash and trained_hash != config.target.get("config_hash"):
        raise EagletError(
            f"{config_file}: its target (config_hash {str(config.target.get('config_hash'))[:12]}) is not the one "
            f"the draft was trained against ({trained_hash[:12]}, {record_file.name}); put the trained target's "
            "record back, or train again"
        )


class ServedLayouts(NamedTuple):
    """The draft layouts an engine loads (the first is the one eaglet exports for it) and who loads them."""

    formats: tuple[str, ...]
    loader: str

    @property
    def exported(self) -> str:
        return self.formats[0]


# `eval --backend vllm`: vLLM's eagle3 loader reads its own layout, and a speculators save through its speculators
# config reader (vllm/transformers_utils/configs/speculators), an eaglet export or speculators' trainer's own.
SERVED_BY_VLLM = ServedLayouts(("vllm", "speculators"), "--backend vllm (vLLM's eagle3 loader)")


def require_export(directory: str | Path, served: ServedLayouts, target_layers: int | None = None) -> StoredDraft:
    """The draft at ``directory``, refused in one line unless it is in a layout the engine loads (an `eaglet export`
    directory or a draft made elsewhere in that layout), with the command that makes one."""
    stored = read_draft_config(directory, target_layers)
    if stored.export_format not in served.formats:
        made_by = "`eaglet train`'s output" if stored.export_format is None else f"a {stored.export_format} export"
        raise EagletError(
            f"--draft {directory}: {made_by}; {served.loader} loads a {' or '.join(served.formats)} export: run "
            f"`eaglet export --draft {directory} --format {served.exported} --out DIR` and pass --draft DIR"
        )
    return stored


def require_fits_target(config: DraftConfig, name: str, vocab_size: int, hidden_size: int, where: str) -> None:
    """A draft made elsewhere records no target to compare: refuse, in one line, one whose sizes cannot be this
    target's (its vocabulary, the width of the features it fuses; its aux layers were checked against the target's
    depth when it was read)."""
    if config.vocab_size != vocab_size:
        raise EagletError(
            f"{where}: a draft for a {config.vocab_size:,}-token vocabulary; {name} has {vocab_size:,}: pass the "
            "target it was trained for"
        )
    if config.target_hidden_size != hidden_size:
        raise EagletError(
            f"{where}: fuses {config.target_hidden_size}-wide features; {name}'s hidden size is {hidden_size}: pass "
            "the target it was trained for"
        )


def draft_norms(config: DraftConfig) -> dict[str, bool]:
    """A draft's norm settings (EAGLE_VARIANTS' keys), as a run starting from it keeps them."""
    return {name: getattr(config, name) for name in EAGLE_VARIANTS["3"]}


def start_problems(
    start: DraftConfig, layer_ids: tuple[int, ...], draft_vocab_size: int, draft_layers: int, version: str | None
) -> list[str]:
    """How a draft to start training from (``train --init-from``) cannot be this run's: other aux layers than its
    features, another draft vocabulary size, another depth, or norms other than --eagle-version asks for. The same
    rule for preflight and for the run (the vocabulary's mapping itself is compared once the tensors load)."""
    problems = []
    if list(start.eagle_aux_hidden_state_layer_ids) != list(layer_ids):
        problems.append(
            f"it reads aux layers {start.eagle_aux_hidden_state_layer_ids}, this run's features are of {list(layer_ids)}"
        )
    if start.draft_vocab_size != draft_vocab_size:
        problems.append(
            f"its draft vocabulary has {start.draft_vocab_size:,} tokens, this run's {draft_vocab_size:,} (prepare "
            "with --draft-vocab of its size, or pass its vocabulary with --set draft_vocab_file=...)"
        )
    if start.num_hidden_layers != draft_layers:
        problems.append(
            f"it has {start.num_hidden_layers} decoder layers: pass --draft-layers {start.num_hidden_layers}"
        )
    if version is not None and draft_norms(start) != EAGLE_VARIANTS[version]:
        problems.append(f"it is EAGLE {start.eagle_version}, --eagle-version asks for {version}: leave it out")
    return problems
