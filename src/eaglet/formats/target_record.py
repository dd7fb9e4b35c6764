"""Which target a prepared set, store or draft was made with: its identity, and how to find it again.

``TargetIdentity`` is what decides an artifact's tokens and features (the model's config identity, the tokenizer,
the sizes). It is built once, from the loaded target (``eaglet.model.target.TargetInfo.identity``), written into every
artifact's metadata (``to_record``) and compared in one place (``mismatches``): stages raise on the findings,
preflight lists them.

Each artifact also records how to find its target again (``target_source``: the --target given, the local directory it resolved
to, the hub id when known). A stage given no --target takes that: the spec when it still resolves here
('embedded', an existing path, a hub id), else the recorded directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import EagletError
from .draft_config import read_draft_config
from .prepared import read_prepared_manifest
from .records import Positive, Record
from .store_manifest import read_manifest

EMBEDDED_SPEC = "embedded"
SOURCE_KEYS = ("spec", "path", "hub_id")  # what a record keeps to find its target


class TargetIdentity(Record):
    """The target an artifact was made from (the ``target`` object of every manifest and draft config)."""

    name: str
    config_hash: (
        str  # of what the model computes (``eaglet.model.target.config_identity``), not of the whole config.json
    )
    tokenizer_hash: str
    vocab_size: Positive
    num_layers: Positive
    hidden_size: Positive
    # a sample of the weights' bytes: a directory rewritten in place by a new fine-tune keeps its config and tokenizer;
    # None in records written before it was kept, and for a target with no safetensors (nothing to compare)
    weights_hash: str | None = None

    def to_record(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in IDENTITY_KEYS}

    def mismatches(
        self,
        recorded: dict[str, Any] | None,
        made: str = "made with",
        *,
        tokenizer_only: bool = False,
        config_only: bool = False,
    ) -> list[str]:
        """How the target an artifact recorded (its ``target`` object) differs from this one; [] when it is this.
        ``made`` says how the artifact came from it ("extracted from"); ``tokenizer_only``: token ids are all that is
        compared (a prepared set serves any target of its tokenizer)."""
        recorded = recorded or {}
        keys = ("tokenizer_hash",) if tokenizer_only else ("config_hash",) if config_only else IDENTITY_HASHES
        findings = []
        for key in keys:
            if recorded.get(key) != getattr(self, key):
                what = "tokenizer" if key == "tokenizer_hash" else "target"
                findings.append(
                    f"{made} {what} {recorded.get('name', '?')} ({key} {str(recorded.get(key))[:12]}), but this run "
                    f"uses {self.name} ({getattr(self, key)[:12]})"
                )
        if not (tokenizer_only or config_only) and other_weights(self, recorded):  # the features came from them
            findings.append(
                f"{made} {recorded.get('name', '?')} with other weights (weights_hash "
                f"{str(recorded['weights_hash'])[:12]}) than this run's {self.name} holds ({str(self.weights_hash)[:12]}; "
                "its directory rewritten since, by a new fine-tune?)"
            )
        return findings


def other_weights(identity: TargetIdentity, recorded: dict[str, Any] | None) -> bool:
    """Whether an artifact records other weights of this target than ``identity`` holds (False where either does
    not say): a draft evaluated or exported there is still loadable, but drafts for what the weights were."""
    known = (recorded or {}).get("weights_hash")
    return bool(known and identity.weights_hash and known != identity.weights_hash)


IDENTITY_KEYS = tuple(TargetIdentity.model_fields)
IDENTITY_HASHES = ("config_hash", "tokenizer_hash")


def require_same_target(
    identity: TargetIdentity,
    recorded: dict[str, Any] | None,
    where: str,
    made: str,
    fix: str,
    *,
    tokenizer_only: bool = False,
    config_only: bool = False,
) -> None:
    """Refuse, in one line naming ``where`` and ``fix``, an artifact made from another target."""
    findings = identity.mismatches(recorded, made, tokenizer_only=tokenizer_only, config_only=config_only)
    if findings:
        raise EagletError(f"{where}: {findings[0]}; {fix}")


def target_source(spec: str, path: Path | str, hub_id: str | None) -> dict[str, Any]:
    """The record written into a prepared set's, store's or draft's metadata."""
    return {"spec": spec, "path": str(path), "hub_id": hub_id}


def recorded_target(record: dict[str, Any] | None, where: str) -> str:
    """The --target to use for an artifact whose target record is ``record``."""
    record = record or {}
    spec, path, hub_id = (record.get(key) for key in SOURCE_KEYS)
    if spec == EMBEDDED_SPEC:
        return EMBEDDED_SPEC
    for candidate in (spec, path):
        if candidate and Path(candidate).expanduser().exists():
            return str(candidate)
    if hub_id:
        return str(hub_id)
    if not (spec or path):
        raise EagletError(f"{where}: records no target; pass --target")
    raise EagletError(f"{where}: made with target {spec or path}, which is not on this machine; pass --target")


def target_of_prepared(prepared: str | Path) -> str:
    manifest = read_prepared_manifest(Path(prepared))
    return recorded_target(manifest.get("target_source"), f"prepared set {prepared}")


def target_of_store(store: str | Path) -> str:
    manifest = read_manifest(Path(store), check_shards=False)
    return recorded_target(manifest.get("target_source"), f"store {store}")


def target_of_draft(draft: str | Path) -> str:
    return recorded_target(read_draft_config(draft).config.target, f"draft {draft}")


def stage_target(config: Any) -> str:
    """A stage's --target: the one given, else the one its input records — a store's (offline training), a draft's
    (eval), a prepared set's (extract, online training) — else the embedded model."""
    if config.target:
        return str(config.target)
    if getattr(config, "store", None):
        return target_of_store(config.store)
    if getattr(config, "draft", None):
        return target_of_draft(config.draft)
    if getattr(config, "prepared", None):
        return target_of_prepared(config.prepared)
    return EMBEDDED_SPEC
