"""One optimizer step: the rank's micro-batches through the TTT module, gradients accumulated, clipped, applied."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.transfer import to_device
from .data import FeatureBatch, pad_to_budget
from .loss import TeacherHead
from .setup import Model
from .ttt import TTTInputs, documents


@dataclass
class DeviceBatch:
    """A packed micro-batch's tensors on the device, in the dtypes the host holds them (the casts and the teacher
    run on the device: ``ttt_inputs``). A recorded step copies every batch into the same ``DeviceBatch``."""

    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] uint8
    aux: torch.Tensor  # [T, 3, H] the store's dtype
    last: torch.Tensor  # [T, H]
    doc_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    doc_end: torch.Tensor  # [T] int64
    target_top: torch.Tensor | None = None  # [T] int32, where the store keeps the target's argmax

    @classmethod
    def from_host(cls, batch: FeatureBatch, device: torch.device) -> "DeviceBatch":
        doc_ids, positions, doc_end = documents(batch.doc_offsets, device)
        return cls(
            to_device(batch.input_ids, device),
            to_device(batch.loss_mask, device),
            to_device(batch.aux, device),
            to_device(batch.last, device),
            doc_ids,
            positions,
            doc_end,
            None if batch.target_top is None else to_device(batch.target_top, device),
        )

    def copy_from(self, batch: FeatureBatch | DeviceBatch) -> None:
        """``batch`` (from the host, or already on the device) into these tensors (same shapes: batches padded to the
        token budget), without blocking."""
        if isinstance(batch, DeviceBatch):
            sources = batch.tensors()
        else:
            sources = [batch.input_ids, batch.loss_mask, batch.aux, batch.last, *documents(batch.doc_offsets, _CPU)]
            sources += [] if batch.target_top is None else [batch.target_top]
        for target, source in zip(self.tensors(), sources, strict=True):
            if target.shape != source.shape or target.dtype != source.dtype:
                raise ValueError(
                    f"a recorded step takes {tuple(target.shape)} {target.dtype}, got "
                    f"{tuple(source.shape)} {source.dtype}"
                )
            source = source.pin_memory() if target.device.type == "cuda" and source.device.type == "cpu" else source
            target.copy_(source, non_blocking=True)

    def tensors(self) -> list[torch.Tensor]:
        tensors = [self.input_ids, self.loss_mask, self.aux, self.last, self.doc_ids, self.positions, self.doc_end]
        return tensors + ([] if self.target_top is None else [self.target_top])


_CPU = torch.device("cpu")


def ttt_inputs(batch: DeviceBatch, teacher: TeacherHead, dtype: torch.dtype) -> TTTInputs:
    """The TTT module's inputs from a batch on the device: features in ``dtype``, the teacher's logits."""
    teacher_logits, in_vocab = teacher(batch.last, batch.target_top)
    return TTTInputs(
        input_ids=batch.input_ids,
        aux=batch.aux.to(dtype),
        loss_mask=batch.loss_mask.bool(),
        doc_ids=batch.doc_ids,
        positions=batch.positions,
        doc_end=batch.doc_end,
        teacher_logits=teacher_logits,
        teacher_in_vocab=in_vocab,
    )


def device_inputs(
    batch: FeatureBatch, teacher: TeacherHead, device: torch.device, dtype: torch.dtype, budget: int | None = None
) -> TTTInputs:
    """A packed batch on the device with its document layout and the teacher's logits (``budget``: padded first)."""
    if budget is not None:
        batch = pad_to_budget(batch, budget)
    return ttt_inputs(DeviceBatch.from_host(batch, device), teacher, dtype)


@dataclass
class StepStats:
    """One step's sums on this rank; all-reduced and divided when logged."""

    loss: torch.Tensor  # [] mean over the rank's micro-batches
    losses: torch.Tensor  # [K] per TTT step, summed over supervised tokens
    correct: torch.Tensor  # [K]
    counts: torch.Tensor  # [K] supervised tokens per TTT step

    def tensors(self) -> list[torch.Tensor]:
        return [self.loss, self.losses, self.correct, self.counts]


class NonFiniteStep(Exception):
    """A step whose loss or gradient is not finite; raised before the optimizer applies it, so the draft and the
    optimizer keep the last good step's state."""

    def __init__(self, what: str, batch: FeatureBatch):
        super().__init__(what)
        self.what = what  # "loss" or "gradient"
        self.batch = batch  # the first micro-batch with a non-finite loss (else the step's first)


def finite(tensor: torch.Tensor) -> bool:
    """One host sync: whether every value is finite."""
    return bool(torch.isfinite(tensor).all())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the value (FSDP2's gradient norm is a DTensor: gathered)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def train_step(
    model: Model, batches: list[FeatureBatch], device: torch.device, ttt_steps: int, clip: float
) -> StepStats:
    """Forward and backward each micro-batch (gradient sync only on the last), then clip and step; a non-finite
    loss or gradient raises ``NonFiniteStep`` instead of being applied."""
    stats = StepStats(torch.zeros((), device=device), *(torch.zeros(ttt_steps, device=device) for _ in range(3)))
    losses = []
    for index, batch in enumerate(batches):
        inputs = device_inputs(batch, model.teacher, device, torch.float32)
        with (
            model.parallel.accumulating(model.wrapped, last=index == len(batches) - 1),
            model.parallel.weight_grads(model.draft, batch.tokens, ttt_steps),
        ):
            with model.autocast():
                loss, losses_k, correct_k, counts_k = model.wrapped(inputs)
                (loss / len(batches)).backward()
        losses.append(loss.detach())
        stats.loss += loss.detach() / len(batches)
        stats.losses += losses_k.detach().float() * counts_k.float()
        stats.correct += correct_k.float()
        stats.counts += counts_k.float()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters, clip)
    if not finite(torch.stack([stats.loss, _local(grad_norm).to(stats.loss.device)])):
        model.optimizer.zero_grad(set_to_none=True)
        bad = [index for index, loss in enumerate(losses) if not finite(loss)]
        raise NonFiniteStep("loss" if bad else "gradient", batches[bad[0] if bad else 0])
    model.optimizer.step()
    model.optimizer.zero_grad(set_to_none=True)
    return stats
