"""Trainer checkpoints: model, optimizer, scheduler, RNG and data position; atomic; the last N kept.

Layout: ``RUN/checkpoints/step-000200/`` with ``draft.safetensors`` (trainable weights + buffers),
``optimizer.safetensors`` + ``optimizer.json`` (the optimizer's state: its tensors, and the rest with references to
them; nothing pickled), ``rng.safetensors`` and ``trainer.json`` (step, epoch, position in the epoch, scheduler).
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import EagletError, first_line
from ..formats.files import (
    CHECKPOINT_WEIGHTS_FILE,
    CHECKPOINTS_DIR,
    OPTIMIZER_STATE_FILE,
    OPTIMIZER_TENSORS_FILE,
    PICKLED_OPTIMIZER_FILE,
    RNG_FILE,
    TRAINER_STATE_FILE,
    checkpoint_dir_name,
)
from ..formats.records import Count, Record, parse_record
from ..formats.target_record import TargetIdentity
from ..fsio import atomic_directory, load_json_file, write_json_atomic
from ..model.shards import write_safetensors
from .tensor_tree import join_tensors, split_tensors


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    micro_in_epoch: int = 0  # micro-batches of this epoch already consumed
    tokens: int = 0  # training tokens seen

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda{index}"] = cuda_state
    return state


def save_checkpoint(
    run: Path,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    scheduler: Any,
    state: TrainerState,
    identity: dict[str, Any],
    keep_last: int,
) -> Path:
    """``model_state``/``optimizer_state``: full (unsharded) state dicts, see ``Parallel.full_state``."""
    final = run / CHECKPOINTS_DIR / checkpoint_dir_name(state.step)
    with atomic_directory(final, overwrite=True) as tmp:
        write_safetensors(tmp / CHECKPOINT_WEIGHTS_FILE, model_state)
        document, tensors = split_tensors(optimizer_state)
        write_safetensors(tmp / OPTIMIZER_TENSORS_FILE, tensors, hashed=False)  # 3.4 GB at the 8B shape
        write_json_atomic(tmp / OPTIMIZER_STATE_FILE, document)
        write_safetensors(tmp / RNG_FILE, _rng_state())
        write_json_atomic(
            tmp / TRAINER_STATE_FILE,
            {"state": state.as_dict(), "scheduler": scheduler.state_dict(), "identity": identity},
        )
    checkpoints = sorted((run / CHECKPOINTS_DIR).glob("step-*"))
    for old in checkpoints[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run: Path) -> Path | None:
    candidates = sorted(p for p in (run / CHECKPOINTS_DIR).glob("step-*") if (p / TRAINER_STATE_FILE).is_file())
    return candidates[-1] if candidates else None


@dataclass
class LoadedCheckpoint:
    state: TrainerState
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]


class TrainerRecord(Record):
    """A checkpoint's trainer.json."""

    state: dict[str, Count]
    scheduler: dict[str, Any]
    identity: dict[str, Any]


def damaged_checkpoint(path: Path, what: str) -> EagletError:
    """The one-line refusal of a checkpoint that cannot be resumed, with the fix."""
    return EagletError(
        f"{path}: a damaged checkpoint ({what}); delete {path} to resume from the checkpoint before "
        "it, or train into another --out"
    )


# what a checkpoint that does not record a setting was trained with (the setting did not exist yet)
IDENTITY_BEFORE_RECORDED = {"eagle_version": "3", "init_from": None}


def load_checkpoint(path: Path, expected_keys: set[str], scheduler: Any, identity: dict[str, Any]) -> LoadedCheckpoint:
    """Read a checkpoint made with the same identity; restores the scheduler and RNG here, and returns the
    model and optimizer states for the caller to load (sharded or not). A damaged one is refused in one line."""
    from safetensors.torch import load_file

    fix = f"delete {path} to resume from the checkpoint before it, or train into another --out"
    saved = parse_record(TrainerRecord, load_json_file(path / TRAINER_STATE_FILE, fix), path / TRAINER_STATE_FILE, fix)
    for key, value in identity.items():
        if key == "target":  # compared as targets are everywhere (a checkpoint from before weights_hash resumes)
            findings = TargetIdentity.model_validate(value).mismatches(saved.identity.get(key), "checkpoint trained on")
            if findings:
                raise EagletError(f"{path}: {findings[0]}; use another --out or the same target")
        elif (trained := saved.identity.get(key, IDENTITY_BEFORE_RECORDED.get(key))) != value:
            raise EagletError(
                f"{path}: checkpoint was trained with {key}={trained!r}, this run has {value!r}; "
                "use another --out or the same settings"
            )
    try:
        state = TrainerState(**saved.state)
    except TypeError as exc:
        raise damaged_checkpoint(path, f"{TRAINER_STATE_FILE}: {exc}") from None
    if (path / PICKLED_OPTIMIZER_FILE).is_file() and not (path / OPTIMIZER_STATE_FILE).is_file():
        raise EagletError(
            f"{path}: a checkpoint of an earlier eaglet, its optimizer state pickled in {PICKLED_OPTIMIZER_FILE} (eaglet "
            "no longer unpickles anything); resume it with the eaglet that wrote it, or train into another --out"
        )
    try:
        model_state = load_file(str(path / CHECKPOINT_WEIGHTS_FILE))
        rng = load_file(str(path / RNG_FILE))
    except Exception as exc:  # safetensors' errors for a missing, cut or foreign file
        raise damaged_checkpoint(path, first_line(exc)) from None
    if set(model_state) != expected_keys:
        raise EagletError(
            f"{path}: checkpoint weights do not match the draft "
            f"(missing {sorted(expected_keys - set(model_state))}, unexpected {sorted(set(model_state) - expected_keys)})"
        )
    optimizer_state = _optimizer_state(path, fix)
    try:
        scheduler.load_state_dict(saved.scheduler)
        torch.set_rng_state(rng["cpu"])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise damaged_checkpoint(path, f"scheduler or RNG state: {exc}") from None
    if torch.cuda.is_available():
        cuda_states = [rng[k] for k in sorted(rng) if k.startswith("cuda")]
        if cuda_states:
            torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])
    return LoadedCheckpoint(state, model_state, optimizer_state)


def _optimizer_state(path: Path, fix: str) -> dict[str, Any]:
    """The optimizer state from its safetensors file and JSON document; a damaged or mismatched pair refused."""
    from safetensors.torch import load_file

    document = load_json_file(path / OPTIMIZER_STATE_FILE, fix)
    try:
        tensors = load_file(str(path / OPTIMIZER_TENSORS_FILE))
    except Exception as exc:  # safetensors' errors for a missing, cut or foreign file
        raise damaged_checkpoint(path, f"{OPTIMIZER_TENSORS_FILE}: {first_line(exc)}") from None
    try:
        state = join_tensors(document, tensors)
    except ValueError as exc:
        raise damaged_checkpoint(path, f"{OPTIMIZER_STATE_FILE}: {exc}") from None
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
        raise damaged_checkpoint(path, f"{OPTIMIZER_STATE_FILE}: not an optimizer state (no 'state' mapping)")
    return state
