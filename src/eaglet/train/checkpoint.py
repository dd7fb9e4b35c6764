"""Trainer checkpoints: model, optimizer, scheduler, RNG and data position; atomic; the last N kept.

Layout: ``RUN/checkpoints/step-000200/`` with ``draft.safetensors`` (trainable weights + buffers),
``optimizer.pt`` (loaded with ``weights_only=True``: tensors and plain containers only, no pickled
objects), ``rng.safetensors`` and ``trainer.json`` (step, epoch, position in the epoch, scheduler).
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import EagletError
from ..formats.files import (CHECKPOINT_WEIGHTS_FILE, CHECKPOINTS_DIR, OPTIMIZER_FILE, RNG_FILE, TRAINER_STATE_FILE,
                            checkpoint_dir_name)
from ..fsio import atomic_directory, read_json, write_json_atomic



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


def save_checkpoint(run: Path, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any],
                    scheduler: Any, state: TrainerState, identity: dict[str, Any], keep_last: int) -> Path:
    """``model_state``/``optimizer_state``: full (unsharded) state dicts, see ``Parallel.full_state``."""
    from safetensors.torch import save_file

    final = run / CHECKPOINTS_DIR / checkpoint_dir_name(state.step)
    with atomic_directory(final, overwrite=True) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in model_state.items()}, str(tmp / CHECKPOINT_WEIGHTS_FILE))
        torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        save_file(_rng_state(), str(tmp / RNG_FILE))
        write_json_atomic(tmp / TRAINER_STATE_FILE, {"state": state.as_dict(), "scheduler": scheduler.state_dict(),
                                             "identity": identity})
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


def load_checkpoint(path: Path, expected_keys: set[str], scheduler: Any, identity: dict[str, Any]) -> LoadedCheckpoint:
    """Read a checkpoint made with the same identity; restores the scheduler and RNG here, and returns the
    model and optimizer states for the caller to load (sharded or not)."""
    from safetensors.torch import load_file

    saved = read_json(path / TRAINER_STATE_FILE)
    for key, value in identity.items():
        if saved["identity"].get(key) != value:
            raise EagletError(
                f"{path}: checkpoint was trained with {key}={saved['identity'].get(key)!r}, this run has {value!r}; "
                "use another --out or the same settings"
            )
    model_state = load_file(str(path / CHECKPOINT_WEIGHTS_FILE))
    if set(model_state) != expected_keys:
        raise EagletError(f"{path}: checkpoint weights do not match the draft "
                          f"(missing {sorted(expected_keys - set(model_state))}, unexpected {sorted(set(model_state) - expected_keys)})")
    optimizer_state = torch.load(path / OPTIMIZER_FILE, weights_only=True, map_location="cpu")
    scheduler.load_state_dict(saved["scheduler"])
    rng = load_file(str(path / RNG_FILE))
    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available():
        cuda_states = [rng[k] for k in sorted(rng) if k.startswith("cuda")]
        if cuda_states:
            torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])
    return LoadedCheckpoint(TrainerState(**saved["state"]), model_state, optimizer_state)
