"""A draft directory's config: eaglet's ``DraftConfig`` (written as an HF-style config.json by `eaglet train`, kept
as eaglet_draft.json inside every export) and the one reader of it, for loading, exporting, evaluating and preflight."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import EagletError
from .files import DRAFT_CONFIG_FILE, DRAFT_WEIGHTS_FILE, EXPORTED_DRAFT_CONFIG_FILE
from .layers import AUX_CONVENTION

DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"
FIRST_LAYER_PREFIX = "midlayer."  # the EAGLE-3 layer's serving name (vLLM's and SGLang's checkpoints)
SPECULATORS_FIRST_LAYER_PREFIX = "layers.0."  # the speculators library's name for it
EXPORT_ONLY_KEYS = ("export_format",)  # what an export adds to eaglet's config
EXPORT_FORMATS = ("vllm", "sglang", "speculators")
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config format the speculators export writes


@dataclass
class DraftConfig:
    """Written as an HF-style config.json; rope settings are inherited from the target."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    eagle_aux_hidden_state_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    num_hidden_layers: int = 1
    hidden_act: str = "silu"
    norm_before_residual: bool = False
    tie_word_embeddings: bool = False
    architectures: list[str] = field(default_factory=lambda: [DRAFT_ARCHITECTURE])
    model_type: str = "llama"
    aux_layer_convention: str = AUX_CONVENTION
    target: dict[str, Any] = field(default_factory=dict)  # name, config_hash, tokenizer_hash

    @classmethod
    def from_target(cls, target_config: dict[str, Any], draft_vocab_size: int, layer_ids: tuple[int, ...],
                    target_identity: dict[str, Any] | None = None, num_layers: int = 1) -> "DraftConfig":
        heads = int(target_config["num_attention_heads"])
        hidden = int(target_config["hidden_size"])
        rope = target_config.get("rope_parameters") or {}  # transformers 5's form: theta and scaling in one dict
        scaled = rope.get("rope_type", "default") != "default"
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(target_config.get("num_key_value_heads") or heads),
            head_dim=int(target_config.get("head_dim") or hidden // heads),
            intermediate_size=int(target_config["intermediate_size"]),
            vocab_size=int(target_config["vocab_size"]),
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=hidden,
            eagle_aux_hidden_state_layer_ids=list(layer_ids),
            rms_norm_eps=float(target_config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(target_config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=dict(target_config.get("rope_scaling") or {}) or (
                {k: v for k, v in rope.items() if k != "rope_theta"} if scaled else None),
            max_position_embeddings=int(target_config.get("max_position_embeddings", 4096)),
            num_hidden_layers=num_layers,
            target=dict(target_identity or {}),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)



@dataclass(frozen=True)
class StoredDraft:
    config: DraftConfig
    export_format: str | None  # None: `eaglet train`'s output; else the format an export was written in
    config_file: Path


def read_draft_config(directory: str | Path) -> StoredDraft:
    """The config of a draft directory (`eaglet train` output or an `eaglet export` directory), refused in one
    line when the directory holds no eaglet draft."""
    directory = Path(directory)
    config_file = directory / EXPORTED_DRAFT_CONFIG_FILE
    if not config_file.is_file():
        config_file = directory / DRAFT_CONFIG_FILE
    if not config_file.is_file() or not (directory / DRAFT_WEIGHTS_FILE).is_file():
        raise EagletError(f"{directory}: not a draft (needs {DRAFT_CONFIG_FILE} and {DRAFT_WEIGHTS_FILE}); run "
                          "`eaglet train`, or pass its --out")
    try:
        fields = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise EagletError(f"{config_file}: not valid JSON ({exc}); train again") from None
    if not isinstance(fields, dict):
        raise EagletError(f"{config_file}: not an eaglet draft config; train again")
    try:
        config = DraftConfig(**{k: v for k, v in fields.items() if k not in EXPORT_ONLY_KEYS})
    except TypeError as exc:
        raise EagletError(f"{config_file}: not an eaglet draft config ({exc})") from None
    return StoredDraft(config, fields.get("export_format"), config_file)
