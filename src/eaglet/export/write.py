"""`eaglet export`: a trained draft written as the directory one format's consumer loads.

Every format is ``config.json`` + ``model.safetensors`` (bf16 weights) + a ``README.md`` model card + eaglet's own
config (``eaglet_draft.json``, for round trips); what differs between formats is declared in its module
(``eaglet.export.vllm`` ...). ``eaglet export --check`` runs the engines' loaders on the result (``eaglet.consumers``).

``d2t``/``t2d`` are written only when the draft vocabulary is smaller than the target's: with equal vocabularies
vLLM and speculators build no mapping parameter, and a shipped one fails the load.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ..errors import EagletError
from ..formats.draft_config import (
    EAGLE_VARIANTS,
    FIRST_LAYER_PREFIX,
    TRAINED_WEIGHTS_KEY,
    norms_version,
    read_draft_config,
)
from ..formats.eval_report import (
    EvalReportRecord,
    chain_depth,
    draft_weights_digest,
    measured_shape,
    read_eval_report,
)
from ..formats.files import DRAFT_CONFIG_FILE, DRAFT_WEIGHTS_FILE, EXPORTED_DRAFT_CONFIG_FILE, MODEL_CARD_FILE
from ..formats.target_record import require_same_target
from ..fsio import atomic_directory, check_output_apart, check_output_dir, write_json_atomic
from ..model.draft import read_draft_weights
from . import FORMATS, export_format, verifier_reference
from .spec import ExportFormat
from .speculators import EMBEDDING_NAME

SERVING_DTYPE = torch.bfloat16
DEFAULT_SPECULATIVE_TOKENS = 3
VOCAB_MAPPINGS = ("d2t", "t2d")


def serving_weights(
    weights: dict[str, torch.Tensor], config: dict[str, Any], fmt: ExportFormat, embedding: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The draft's tensors under the names ``fmt``'s consumer loads, floating point in bf16."""
    mapped = int(config["draft_vocab_size"]) != int(config["vocab_size"])  # DraftConfig.uses_vocab_mapping
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name in VOCAB_MAPPINGS and not mapped:
            continue
        out[fmt.serving_name(name, FIRST_LAYER_PREFIX)] = (
            tensor.to(SERVING_DTYPE) if tensor.is_floating_point() else tensor
        )
    if fmt.carries_embedding:
        if embedding is None:
            raise EagletError(f"the {fmt.name} format carries the target's embedding: the target is needed (--target)")
        out[EMBEDDING_NAME] = embedding.to(SERVING_DTYPE).contiguous()
    return out


HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # ORG/NAME
CARD_TAGS = ("eagle3", "speculative-decoding", "draft-model", "eaglet")  # the Hub's search finds drafts by these


def card_front_matter(fmt: ExportFormat, verifier: tuple[str, str]) -> str:
    """The model card's Hub metadata (YAML between ``---`` lines): the library that loads the directory, tags, and the
    target as ``base_model`` when the configs name it by hub id (a local path names nothing on the Hub)."""
    import yaml

    from .. import __version__

    name, _ = verifier
    meta: dict[str, Any] = {}
    if HUB_ID.fullmatch(name) and not Path(name).exists():
        meta["base_model"] = name
    meta |= {"library_name": fmt.name, "tags": [*CARD_TAGS, fmt.name], "eaglet_version": __version__}
    return f"---\n{yaml.safe_dump(meta, sort_keys=False)}---\n\n"


def model_card(
    fmt: ExportFormat,
    config: dict[str, Any],
    verifier: tuple[str, str],
    speculative_tokens: int,
    report: EvalReportRecord | None,
) -> str:
    measured = "not measured yet (run `eaglet eval`)"
    if report:
        where = "vLLM serving it" if report.engine == "vllm" else "eaglet's decoder"
        measured = (
            f"τ = {report.acceptance_length:.2f} accepted tokens per target forward, speedup "
            f"{report.speedup:.2f}× ({measured_shape(report)}, measured by `eaglet eval` through {where} on "
            f"{report.settings.device})"
        )
        if chain_depth(report) != speculative_tokens:  # the τ of another shape than the command serves
            measured += (
                f"; the command below serves a chain of {speculative_tokens}, not measured (`eaglet eval --draft "
                f"PATH/TO/THIS/DIR --depth {speculative_tokens}` measures it)"
            )
    name, how = verifier
    serve = fmt.serve_command(name, speculative_tokens, "PATH/TO/THIS/DIR")
    ids = config["eagle_aux_hidden_state_layer_ids"]
    embedding = (
        "\nIt carries the target's embedding (`embed_tokens.weight`), which the speculators model needs.\n"
        if fmt.carries_embedding
        else ""
    )
    version = norms_version({name: config[name] for name in EAGLE_VARIANTS["3"]})
    source = config.get("target", {}).get("source")
    trained_on = f"\nTrained on the features of {source}.\n" if source else ""
    return (
        card_front_matter(fmt, verifier)
        + f"""# EAGLE-3 draft for {name} ({fmt.name} format)

Trained with eaglet: EAGLE {version}. One Llama-style decoder layer over the target's aux hidden states
(eaglet/vLLM layer ids {ids}: the inputs of those decoder layers), draft vocabulary of
{config["draft_vocab_size"]:,} of the target's {config["vocab_size"]:,} tokens.
{embedding}{trained_on}
Verifier: `{name}` ({how}).

Acceptance: {measured}.

## Serve

```bash
{serve}
```

`eaglet export --check PATH/TO/THIS/DIR` checks this directory against each engine's released loader.
"""
    )


def _target_embedding(config: dict[str, Any], target: str | None) -> torch.Tensor:
    """The target's input embedding, from ``target`` or the target the draft recorded, checked to be that one."""
    from ..model.target import load_head_weights, load_tokenizer, resolve_target, target_info

    recorded = config.get("target", {})
    spec = target or recorded.get("spec")
    if not spec:
        raise EagletError(
            "this format carries the target's embedding and the draft does not record its target: pass --target"
        )
    resolved = resolve_target(spec)
    identity = target_info(resolved, load_tokenizer(resolved.path)).identity
    require_same_target(
        identity,
        recorded,
        f"--target {spec}",
        "the draft was trained for",
        "pass the target it was trained for",
        config_only=True,
    )
    return load_head_weights(resolved.path).embed


def export_draft(
    draft_dir: str | Path,
    format_name: str,
    out: str | Path,
    verifier: str | None = None,
    speculative_tokens: int | None = None,
    report_path: str | Path | None = None,
    overwrite: bool = False,
    target: str | None = None,
) -> Path:
    from ..model.shards import write_safetensors

    draft_dir, out = Path(draft_dir), Path(out)
    fmt = export_format(format_name)
    check_output_apart(out, [draft_dir, report_path, target])
    check_output_dir(out)
    stored = read_draft_config(draft_dir)
    config = stored.config.to_dict()
    if out.exists() and not overwrite:
        raise EagletError(f"{out}: already exists; pass --overwrite or choose another --out")
    layers = config.get("num_hidden_layers", 1)
    if fmt.max_draft_layers is not None and layers > fmt.max_draft_layers:
        others = " or ".join(f.name for f in FORMATS.values() if f.max_draft_layers is None)
        allowed = "one decoder layer" if fmt.max_draft_layers == 1 else f"{fmt.max_draft_layers} decoder layers"
        raise EagletError(
            f"{draft_dir}: a {layers}-layer draft; the {fmt.name} engine loads {allowed} only: export "
            f"--format {others}, or train with --draft-layers {fmt.max_draft_layers}"
        )
    reference = verifier_reference(config, verifier)
    report = read_eval_report(report_path, draft_dir) if report_path else None
    if speculative_tokens is None:  # the shape the report measured, so the card's τ is the command's
        speculative_tokens = (chain_depth(report) if report else None) or DEFAULT_SPECULATIVE_TOKENS
    embedding = _target_embedding(config, target) if fmt.carries_embedding else None
    weights = serving_weights(read_draft_weights(draft_dir, stored), config, fmt, embedding)
    with atomic_directory(out, overwrite=overwrite) as tmp:
        write_safetensors(tmp / DRAFT_WEIGHTS_FILE, weights, metadata={"format": "pt"})
        write_json_atomic(tmp / DRAFT_CONFIG_FILE, fmt.serving_config(config, reference[0], speculative_tokens))
        (tmp / MODEL_CARD_FILE).write_text(
            model_card(fmt, config, reference, speculative_tokens, report), encoding="utf-8"
        )
        write_json_atomic(  # for round trips, and eval reports of this export that a later export is given
            tmp / EXPORTED_DRAFT_CONFIG_FILE,
            config | {"export_format": fmt.name, TRAINED_WEIGHTS_KEY: draft_weights_digest(draft_dir)},
        )
    return out
