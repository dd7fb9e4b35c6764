"""The training step recorded as a CUDA graph: the host launches one graph a step instead of ~1,200 kernels.

An eager step at the 8B shape is host-bound (its launches take longer than the GPU's work); recorded, the host only
copies the batch in and checks one pair of numbers (RESULTS, "`eaglet train` records its step": 76.95 ms, 1.39×
speculators 0.9.0's step in the same call; at the demo's 16,384 tokens the GPU is the bound either way). A non-finite
loss or gradient never reaches the parameters (``NonFiniteStep``, as in the eager step):

    the step (fused AdamW, train's on a GPU): the batch (copied into the same device tensors every step) -> the
        teacher's logits, the TTT forward and backward, the gradient norm, then AdamW, capturable (its step count
        lives on the device), reading the learning rate from a device tensor filled from the scheduler's float before
        each replay (the scheduler and checkpoints keep floats), clipping the gradients as it reads them and skipping
        the update where the loss or gradient norm is not finite; out: the step's statistics and [loss, gradient
        norm], checked by the host after the replay
    with an unfused AdamW, two parts: forward and backward (clipping included) -> the same out, checked by the host
        before the second, AdamW, is replayed

Two parts share one memory pool. Recording needs every step to have the same shapes (batches are padded to the token
budget), one micro-batch a step and one process; the first ``CAPTURE_WARMUP`` steps run eagerly on a side stream
(compiles, AdamW's state, the allocator settle), as torch's CUDA-graph notes ask.

The batch reaches the GPU ahead of its step: the prefetch thread copies it there on its own stream (``Stager``) while
earlier steps run, and the step copies it device to device into the graph's inputs (75 MB at the demo's size: ~3 ms
from the host, ~0.05 ms on the device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import TrainConfig
from .data import FeatureBatch
from .setup import Model
from .step import DeviceBatch, NonFiniteStep, StepStats, finite, train_step, ttt_inputs

CAPTURE_WARMUP = 3  # eager steps before recording: compiles, AdamW's state and the allocator settle
CLIP_EPS = 1e-6  # clip_grad_norm_'s: the scale is clip / (norm + CLIP_EPS)


@dataclass
class StagedBatch:
    """A padded micro-batch the prefetch thread has copied to the device (``Stager``); ``ready`` is recorded on the
    copy's stream (None off the GPU)."""

    host: FeatureBatch  # what a non-finite step's error names
    on_device: DeviceBatch
    ready: torch.cuda.Event | None


class Stager:
    """Copies micro-batches to the device on its own stream, ahead of their step (called in the prefetch thread, so
    the copy overlaps the steps before): the recorded step then only waits for ``ready`` and copies on the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, batch: FeatureBatch) -> StagedBatch:
        if self.stream is None:
            return StagedBatch(batch, DeviceBatch.from_host(batch, self.device), None)
        with torch.cuda.stream(self.stream):
            on_device = DeviceBatch.from_host(batch, self.device)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return StagedBatch(batch, on_device, ready)


class Recorded:
    """``fn`` recorded as a CUDA graph on a GPU: ``replay`` relaunches its kernels, which write the same output
    tensors each time. On other devices ``replay`` calls ``fn``: the same step without the recording (how the CPU
    tests run it)."""

    def __init__(self, fn: Callable[[], Any], device: torch.device, pool: Any = None):
        self.fn = fn
        self.graph = torch.cuda.CUDAGraph() if device.type == "cuda" else None
        self.outputs: Any = None
        if self.graph is not None:
            # thread-local: the prefetch thread pins memory while this one records
            with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
                self.outputs = fn()

    def pool(self) -> Any:
        return None if self.graph is None else self.graph.pool()

    def replay(self) -> Any:
        if self.graph is None:
            self.outputs = self.fn()
        else:
            self.graph.replay()
        return self.outputs


class GraphedStep:
    """``train_step``'s work for one micro-batch a step, replayed from recorded graphs after ``warmup`` eager steps.
    Called like ``train_step`` (a list of one batch); returns the same statistics."""

    def __init__(self, model: Model, device: torch.device, ttt_steps: int, clip: float, warmup: int = CAPTURE_WARMUP):
        self.model, self.device, self.ttt_steps, self.clip = model, device, ttt_steps, clip
        self.warmup_left = warmup
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        # the batch's host-to-device copy runs here, beside the previous step's AdamW (the inputs' only reader, the
        # forward/backward graph, has finished by then: the finite check waited for it)
        self.copies = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.buffers: DeviceBatch | None = None
        # fused AdamW takes two device scalars as torch.amp.GradScaler hands them (``grad_scale``, ``found_inf``):
        # it divides each gradient by the first as it reads it (clipping in AdamW's one pass, not a pass of its
        # own) and skips the whole update where the second is 1, so a fused step is one graph, checked after it
        self.fused = bool(model.optimizer.defaults.get("fused"))
        self.unclip = torch.ones((), device=device)  # max(1, norm / clip): what AdamW divides the gradients by
        self.recorded: Recorded | None = None  # the step (fused AdamW), or its forward and backward -> stats, check
        self.apply: Recorded | None = None  # an unfused AdamW, replayed once the check passed
        self.rates: list[torch.Tensor] = []  # per parameter group: the learning rate the recorded AdamW reads

    def __call__(self, batches: list[FeatureBatch | StagedBatch]) -> StepStats:
        """One step on ``batches[0]``: a host batch (copied in here) or one ``Stager`` copied to the device ahead."""
        if len(batches) != 1:
            raise ValueError(f"a recorded step takes one micro-batch, got {len(batches)}")
        (given,) = batches
        batch = given.host if isinstance(given, StagedBatch) else given
        if self.warmup_left > 0:
            self.warmup_left -= 1
            return self._eager([batch])
        if self.buffers is None:
            self.buffers = DeviceBatch.from_host(batch, self.device)
            self._record()
        elif isinstance(given, StagedBatch):
            self._copy_staged(given)
        else:
            self._copy_in(batch)
        for rate, group in zip(self.rates, self.model.optimizer.param_groups):
            rate.fill_(group["lr"])
        stats, check = self.recorded.replay()
        if not finite(check):  # the one host sync of a step, as in the eager step; a fused AdamW skipped the update
            raise NonFiniteStep("loss" if not finite(check[0]) else "gradient", batch)
        if self.apply is not None:
            self.apply.replay()
        return StepStats(*(tensor.clone() for tensor in stats.tensors()))  # the graph rewrites its outputs

    def _copy_in(self, batch: FeatureBatch) -> None:
        if self.copies is None:
            self.buffers.copy_from(batch)
            return
        with torch.cuda.stream(self.copies):
            self.buffers.copy_from(batch)
        torch.cuda.current_stream(self.device).wait_stream(self.copies)

    def _copy_staged(self, staged: StagedBatch) -> None:
        """Device to device, on the step's stream once the stager's copy is done. The inputs' only reader, the
        forward/backward graph, has finished: the previous step's finite check waited for it."""
        current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if current is not None and staged.ready is not None:
            current.wait_event(staged.ready)
        self.buffers.copy_from(staged.on_device)
        if current is not None:
            for source in staged.on_device.tensors():  # made on the stager's stream: kept until this copy is done
                source.record_stream(current)

    def _eager(self, batches: list[FeatureBatch]) -> StepStats:
        if self.side is None:
            return train_step(self.model, batches, self.device, self.ttt_steps, self.clip)
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            stats = train_step(self.model, batches, self.device, self.ttt_steps, self.clip)
        torch.cuda.current_stream(self.device).wait_stream(self.side)
        return stats

    def _record(self) -> None:
        groups = self.model.optimizer.param_groups
        self.rates = [torch.tensor(float(group["lr"]), dtype=torch.float32, device=self.device) for group in groups]
        if self.fused:
            self.recorded = Recorded(self._whole_step, self.device)
        else:
            self.recorded = Recorded(self._forward_backward, self.device)
            self.apply = Recorded(self._apply, self.device, self.recorded.pool())

    def _whole_step(self) -> tuple[StepStats, torch.Tensor]:
        """Forward, backward and a fused AdamW that skips the update unless the loss and gradient are finite."""
        stats, check = self._forward_backward()
        self._apply(skip=(~torch.isfinite(check).all()).float())
        return stats, check

    def _forward_backward(self) -> tuple[StepStats, torch.Tensor]:
        """Gradients start from none each step (recorded: the graph writes them afresh instead of adding)."""
        model = self.model
        model.optimizer.zero_grad(set_to_none=True)
        inputs = ttt_inputs(self.buffers, model.teacher, torch.float32)
        with model.parallel.weight_grads(model.draft, len(inputs.input_ids), self.ttt_steps):
            with model.autocast():
                loss, losses_k, correct_k, counts_k = model.wrapped(inputs)
                loss.backward()
        if self.fused:  # as clip_grad_norm_ scales them (clip / (norm + 1e-6), at most 1), applied by AdamW
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters if p.grad is not None])
            self.unclip.copy_(((grad_norm + CLIP_EPS) / self.clip).clamp_min(1.0))
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters, self.clip)
        loss = loss.detach()
        counts = counts_k.float()
        stats = StepStats(loss, losses_k.detach().float() * counts, correct_k.float(), counts)
        return stats, torch.stack([loss, grad_norm.to(loss.device, loss.dtype)])

    def _apply(self, skip: torch.Tensor | None = None) -> None:
        """AdamW reading the learning rate from ``rates`` (only while it runs: the scheduler keeps floats); fused, also
        the clip's ``unclip`` and ``skip`` (1.0: leave parameters, moments and step count as they are)."""
        optimizer = self.model.optimizer
        groups = optimizer.param_groups
        floats = [group["lr"] for group in groups]
        for group, rate in zip(groups, self.rates):
            group["lr"] = rate
        if self.fused:
            optimizer.grad_scale, optimizer.found_inf = self.unclip, skip
        try:
            optimizer.step()
        finally:
            for group, value in zip(groups, floats):
                group["lr"] = value
            if self.fused:
                del optimizer.grad_scale, optimizer.found_inf


def step_function(model: Model, config: TrainConfig, device: torch.device) -> Callable[[list[FeatureBatch]], StepStats]:
    """The run's step: recorded (``GraphedStep``) when ``model.graphed``, else the eager ``train_step``."""
    if model.graphed:
        return GraphedStep(model, device, config.ttt_steps, config.clip)
    return lambda batches: train_step(model, batches, device, config.ttt_steps, config.clip)
