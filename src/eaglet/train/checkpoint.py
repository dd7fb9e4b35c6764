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
from ..fsio import atomic_directory, load_json_file, sha256_file, write_json_atomic
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
        document, tensors = split_tensors(optimizer_state)
        digests = {
            CHECKPOINT_WEIGHTS_FILE: write_safetensors(tmp / CHECKPOINT_WEIGHTS_FILE, model_state)[1],
            # 3.4 GB at the 8B shape: hashed as written, ~2 s at sha256's 1.6 GB/s beside a 2.4 s write
            OPTIMIZER_TENSORS_FILE: write_safetensors(tmp / OPTIMIZER_TENSORS_FILE, tensors)[1],
            RNG_FILE: write_safetensors(tmp / RNG_FILE, _rng_state())[1],
        }
        write_json_atomic(tmp / OPTIMIZER_STATE_FILE, document)
        write_json_atomic(
            tmp / TRAINER_STATE_FILE,
            {"state": state.as_dict(), "scheduler": scheduler.state_dict(), "identity": identity, "files": digests},
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
    files: dict[str, str] | None = None  # each tensor file's sha256 (checkpoints before it recorded none)


def damaged_checkpoint(path: Path, what: str) -> EagletError:
    """The one-line refusal of a checkpoint that cannot be resumed, with the fix."""
    return EagletError(
        f"{path}: a damaged checkpoint ({what}); delete {path} to resume from the checkpoint before "
        "it, or train into another --out"
    )


CHECKSUMMED_FILES = (CHECKPOINT_WEIGHTS_FILE, OPTIMIZER_TENSORS_FILE, RNG_FILE)

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
    _verify_files(path, saved.files or {})
    try:
        model_state = load_file(str(path / CHECKPOINT_WEIGHTS_FILE))
        rng = load_file(str(path / RNG_FILE))
    except Exception as exc:  # safetensors' errors for a missing, cut or foreign file
        raise damaged_checkpoint(path, first_line(exc)) from None
    if problem := non_finite(model_state):
        raise damaged_checkpoint(path, f"{CHECKPOINT_WEIGHTS_FILE}: {problem}")
    if set(model_state) != expected_keys:
        raise EagletError(
            f"{path}: checkpoint weights do not match the draft "
            f"(missing {sorted(expected_keys - set(model_state))}, unexpected {sorted(set(model_state) - expected_keys)})"
        )
    optimizer_state = _optimizer_state(path, fix, state.step)
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


def _optimizer_state(path: Path, fix: str, step: int) -> dict[str, Any]:
    """The optimizer state from its safetensors file and JSON document; a damaged or mismatched pair refused, and
    after ``step`` > 0 steps one that lacks any parameter's state."""
    from safetensors.torch import load_file

    document = load_json_file(path / OPTIMIZER_STATE_FILE, fix)
    try:
        tensors = load_file(str(path / OPTIMIZER_TENSORS_FILE))
    except Exception as exc:  # safetensors' errors for a missing, cut or foreign file
        raise damaged_checkpoint(path, f"{OPTIMIZER_TENSORS_FILE}: {first_line(exc)}") from None
    if problem := non_finite(tensors):
        raise damaged_checkpoint(path, f"{OPTIMIZER_TENSORS_FILE}: {problem}")
    try:
        state = join_tensors(document, tensors)
    except ValueError as exc:
        raise damaged_checkpoint(path, f"{OPTIMIZER_STATE_FILE}: {exc}") from None
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
        raise damaged_checkpoint(path, f"{OPTIMIZER_STATE_FILE}: not an optimizer state (no 'state' mapping)")
    groups = state.get("param_groups")
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise damaged_checkpoint(path, f"{OPTIMIZER_STATE_FILE}: no parameter groups listing their parameters")
    named = {name for group in groups for name in group["params"]}
    if strangers := sorted(set(state["state"]) - named):
        raise damaged_checkpoint(
            path, f"{OPTIMIZER_STATE_FILE}: state for {strangers[0]}, a parameter none of its groups has"
        )
    if step and (missing := sorted(named - set(state["state"]))):
        raise damaged_checkpoint(
            path, f"{OPTIMIZER_STATE_FILE}: no optimizer state for {missing[0]} (Adam would start it again from zero)"
        )
    return state


def _verify_files(path: Path, digests: dict[str, str]) -> None:
    """Each tensor file as it was written (its recorded sha256): a flipped or edited byte is refused, not resumed."""
    for name, digest in digests.items():
        if name not in CHECKSUMMED_FILES:
            raise damaged_checkpoint(
                path, f"{TRAINER_STATE_FILE} records a checksum for {name!r}, not a checkpoint file"
            )
        try:
            actual = sha256_file(path / name)
        except OSError as exc:
            raise damaged_checkpoint(path, f"{name}: {first_line(exc)}") from None
        if actual != digest:
            raise damaged_checkpoint(
                path, f"{name} changed since it was written (sha256 {actual[:12]}, recorded {digest[:12]})"
            )


def non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The first tensor holding a NaN or an infinity, named: resumed, it would train a NaN draft."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"{name} holds NaN or infinite values"
    return None


def unloaded_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """After a resume's load: a parameter left without optimizer state (Adam would restart from zero for it, so the
    resume is not exact) or with moments of another shape (a traceback at the first step otherwise)."""
    names = {id(parameter): name for name, parameter in module.named_parameters()}
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            name = names.get(id(parameter), "a parameter")
            state = optimizer.state.get(parameter)
            steps = state.get("step") if state else None
            if not state or (steps is not None and not float(steps)):  # an absent entry is loaded as a zero step
                return f"no optimizer state for {name} (Adam would start it again from zero)"
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() and value.shape != parameter.shape:
                    return (
                        f"optimizer state {key} of {name} is {tuple(value.shape)}, the parameter "
                        f"{tuple(parameter.shape)}"
                    )
    return None
