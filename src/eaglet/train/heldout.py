"""Held-out evaluation during training: per-TTT-step accuracy and loss, and the acceptance length τ they imply."""

from __future__ import annotations

from typing import Any

import torch

from ..config import TrainConfig
from ..model.distributed import Dist, all_reduce_sum
from .data import FeatureBatch, held_out
from .setup import Model, Setup
from .step import device_inputs
from .ttt import FlexTTTAttention, acceptance_length


def evaluate(model: Model, setup: Setup, config: TrainConfig, device: torch.device, dist: Dist) -> dict[str, Any]:
    """Accuracy, loss and τ over the held-out samples (a separate store when given, else the held-out fraction).

    Under FSDP2 every rank runs as many forwards (``lockstep``): ranks short of a batch run a spare one that counts
    nothing."""
    compiled = issubclass(model.module.attention(device), FlexTTTAttention)
    # with compiled FlexAttention, autograd stays on (nothing is kept: no backward) so evaluation reuses
    # training's kernels instead of compiling no_grad ones (FlexTTTAttention's docstring says why)
    with torch.enable_grad() if compiled else torch.no_grad():
        model.module.eval()
        try:
            correct, counts, losses = _sums(model, setup, config, device, dist)
        finally:
            model.module.train()
    if int(counts[0]) == 0:  # nothing held out (a tiny set): report that rather than a fake zero
        return {"acc": [], "acceptance_length": None, "eval_loss": [], "eval_tokens": 0}
    accuracy = (correct / counts.clamp_min(1)).tolist()
    return {
        "acc": [round(a, 5) for a in accuracy],
        "acceptance_length": round(acceptance_length(accuracy), 4),  # of a chain of ttt_steps draft tokens
        "eval_loss": [round(v, 5) for v in (losses / counts.clamp_min(1)).tolist()],
        "eval_tokens": int(counts[0]),
    }


def _sums(
    model: Model, setup: Setup, config: TrainConfig, device: torch.device, dist: Dist
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    correct, counts, losses = (torch.zeros(config.ttt_steps, device=device) for _ in range(3))
    if setup.eval_source is not None:
        batches = setup.eval_source.batches(0)
    else:
        batches = setup.source.batches(0, lambda s: held_out(s, config.seed, config.eval_fraction))

    def forward(batch: FeatureBatch):
        with model.autocast():
            return model.module(device_inputs(batch, model.teacher, device, torch.float32, config.token_budget))

    total, spare = 0, None
    for index, batch in enumerate(batches):
        total, spare = index + 1, batch
        if index % dist.world != dist.rank:
            continue
        _, step_losses, step_correct, step_counts = forward(batch)
        correct += step_correct.float()
        counts += step_counts.float()
        losses += step_losses.detach().float() * step_counts.float()  # detached: no graph outlives its batch
    if model.parallel.lockstep and spare is not None:
        for _ in range(-(-total // dist.world) - len(range(dist.rank, total, dist.world))):
            forward(spare)
    return tuple(all_reduce_sum([correct, counts, losses], dist))  # type: ignore[return-value]


def held_out_tau(evaluation: dict) -> str:
    """An evaluation's τ as train's console and the run's table print it."""
    return f"held-out τ {evaluation['acceptance_length']:.2f} (a {len(evaluation['acc'])}-token chain, from accuracy)"
