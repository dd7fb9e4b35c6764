"""Linear layers the TTT unroll calls K times a step, with their weight gradient made once per step.

Autograd gives a layer called K times K weight gradients, each made in the matmul dtype (bf16 under autocast), cast
to the float32 master weight's dtype and added into ``.grad``: K weight-sized casts and adds per layer. Inside
``deferred_weight_grads`` each call keeps its input and, in backward, its output gradient; leaving the block makes
each weight's gradient as one matmul over all K calls' rows (accumulated inside the matmul) and adds it to ``.grad``
once. The weight is cast once per block.
The 8B-shaped draft's step on an H200: 74.8 -> 73.8 ms, and 70.5 -> 68.6 ms replayed as a CUDA graph (RESULTS).

A layer followed by an objective that makes its own gradient in the forward pass (the fused loss after the LM head:
``SharedLinear.objective``) has that gradient written straight into one buffer laid out for the block's calls, so its
weight-gradient matmul reads the buffer as it is (no concatenation), and the caller's scalar on the objective (the TTT
decay) scales the call's input [rows, in] instead of its output gradient [rows, out].

The trainer uses it in one process on a GPU (``train.parallel``): DDP and FSDP reduce gradients from autograd's hooks
on the weights, which never fire here, and on the CPU it measured slower.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

KEPT_GRAD_BYTES = 1 << 30  # output gradients kept per layer before a partial flush: bounds the extra memory (the
# 8B shape's LM head keeps all 7 calls' 2,048 x 32,000 bf16 in 0.9 GB; the GPU demo's 16,384-token batches flush its
# LM head every second call)


@dataclass
class _Calls:
    """One block's calls of one layer: the weight in the matmul dtype, each call's input and output gradient."""

    parameter: nn.Parameter  # [out, in], the master weight whose ``.grad`` the flushes add to
    weight: torch.Tensor | None = None  # [out, in], the matmul dtype, detached: autograd never reaches the parameter
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # call index -> its input [rows, in]
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # call index -> its output gradient [rows, out]
    calls: int = 0
    capacity: int | None = None  # calls a block makes (sizes the objectives' buffer); None: a slot per call
    written: torch.Tensor | None = None  # [capacity·rows, out] objectives' output gradients, call i at rows i·rows
    slots: dict[int, torch.Tensor] = field(default_factory=dict)  # call index -> its written gradient [rows, out]
    scaled: list[int] = field(default_factory=list)  # calls whose backward has run: slot and scaled input final

    def weight_for(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            device = x.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.parameter.dtype
            self.weight = self.parameter.detach().to(dtype)
        return self.weight

    def keep(self, index: int, grad: torch.Tensor) -> None:
        """Call ``index``'s output gradient; past ``KEPT_GRAD_BYTES`` the kept calls are flushed at once."""
        self.grads[index] = grad
        if sum(g.numel() * g.element_size() for g in self.grads.values()) > KEPT_GRAD_BYTES:
            self._flush_kept()

    def reserve(self, x: torch.Tensor, out_features: int) -> tuple[int, torch.Tensor]:
        """A new call of input ``x`` [rows, in] whose output gradient its objective writes: (its index, the slot
        [rows, out] to write it to). With a capacity, call i's slot is rows i·rows.. of one buffer."""
        index = self.calls
        self.calls += 1
        self.inputs[index] = x
        rows = x.shape[0]
        if self.capacity is None:
            slot = x.new_empty(rows, out_features)
        else:
            if self.written is None:
                self.written = x.new_empty(self.capacity * rows, out_features)
            if index >= self.capacity or rows * self.capacity != len(self.written):
                raise RuntimeError(
                    f"call {index} of {rows} rows does not fit the buffer laid out for {self.capacity} calls of "
                    f"{len(self.written) // self.capacity} rows"
                )
            slot = self.written[index * rows : (index + 1) * rows]
        self.slots[index] = slot
        return index, slot

    def keep_written(self, index: int, scale: torch.Tensor) -> None:
        """Call ``index``'s written gradient is final, to be scaled by ``scale`` (a scalar): its input takes it."""
        self.inputs[index] = self.inputs[index] * scale
        self.scaled.append(index)

    def flush(self) -> None:
        """Add the kept and written calls' weight gradient to ``.grad``: one matmul over each kind's rows."""
        self._flush_kept()
        self._flush_written()

    def _flush_kept(self) -> None:
        if self.grads:
            order = sorted(self.grads)
            self._add(
                torch.cat([self.grads.pop(i) for i in order]),  # [calls·rows, out]
                torch.cat([self.inputs.pop(i) for i in order]),  # [calls·rows, in]
            )

    def _flush_written(self) -> None:
        if self.scaled:
            order = sorted(self.scaled)
            slots = [self.slots.pop(i) for i in order]
            rows = slots[0].shape[0]
            in_place = self.written is not None and order == list(range(len(order)))
            self._add(
                self.written[: len(order) * rows] if in_place else torch.cat(slots),  # [calls·rows, out]
                torch.cat([self.inputs.pop(i) for i in order]),  # [calls·rows, in], each scaled
            )
            self.scaled.clear()

    def _add(self, grads: torch.Tensor, inputs: torch.Tensor) -> None:
        update = (grads.T @ inputs.to(grads.dtype)).to(self.parameter.dtype)  # [out, in]
        if self.parameter.grad is None:
            self.parameter.grad = update
        else:
            self.parameter.grad.add_(update)


class _DeferredMatmul(torch.autograd.Function):
    """x [rows, in] @ weight.T, whose backward gives x its gradient and keeps the output's for the flush."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, calls: _Calls) -> torch.Tensor:
        x = x.to(weight.dtype)
        ctx.calls, ctx.index = calls, calls.calls
        calls.inputs[calls.calls] = x
        calls.calls += 1
        ctx.save_for_backward(weight)
        return x @ weight.T

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (weight,) = ctx.saved_tensors
        grad_x = grad_out @ weight
        ctx.calls.keep(ctx.index, grad_out)
        return grad_x, None, None


class _DeferredObjective(torch.autograd.Function):
    """objective(x @ weight.T): a scalar (and values without gradient) whose gradient in the logits the objective
    writes during the forward pass into the slot it is given. Backward makes x's gradient from the slot and leaves the
    slot for the flush, the caller's scalar on the objective moved onto x [rows, in]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, calls: _Calls, objective, *args):
        x = x.to(weight.dtype)
        index, slot = calls.reserve(x, weight.shape[0])
        with torch.autocast(x.device.type, enabled=False):  # the objective picks its own dtypes
            value, *extras = objective(x @ weight.T, *args, slot)
        ctx.calls, ctx.index, ctx.slot, ctx.args = calls, index, slot, len(args)
        ctx.save_for_backward(weight)
        ctx.mark_non_differentiable(*extras)
        return value, *extras

    @staticmethod
    def backward(ctx, grad_value: torch.Tensor, *_grad_extras):
        (weight,) = ctx.saved_tensors
        scale = grad_value.to(weight.dtype)
        ctx.calls.keep_written(ctx.index, scale)
        return (ctx.slot @ weight) * scale, None, None, None, *([None] * ctx.args)


class SharedLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict names) that defers its weight gradient inside
    ``deferred_weight_grads``; elsewhere, and without autograd, it is a plain linear layer. 2-D inputs, no bias."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.calls: _Calls | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls is None or not torch.is_grad_enabled() or not self.weight.requires_grad:
            return super().forward(x)
        return _DeferredMatmul.apply(x, self.calls.weight_for(x), self.calls)

    def deferring(self) -> bool:
        """Whether a call now keeps its weight gradient for the block's flush."""
        return self.calls is not None and torch.is_grad_enabled() and self.weight.requires_grad

    def objective(self, x: torch.Tensor, objective, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``objective(x @ weight.T, *args, grad_out)`` -> (scalar, *values without gradient), the objective writing
        the scalar's gradient in the logits [rows, out] into ``grad_out``; only while ``deferring()``."""
        if not self.deferring():
            raise RuntimeError("SharedLinear.objective runs inside deferred_weight_grads, with autograd on")
        return _DeferredObjective.apply(x, self.calls.weight_for(x), self.calls, objective, *args)


@contextlib.contextmanager
def deferred_weight_grads(module: nn.Module, calls_per_layer: int | None = None) -> Iterator[None]:
    """Forward and backward inside the block; on leaving it, every ``SharedLinear`` of ``module`` has its weight
    gradient in ``.grad`` (added to what was there: gradient accumulation works as usual). A block left by an
    exception adds none of the gradients it still kept. ``calls_per_layer`` (the TTT steps) lays the objectives'
    written gradients out in one buffer."""
    layers = [layer for layer in module.modules() if isinstance(layer, SharedLinear)]
    for layer in layers:
        layer.calls = _Calls(layer.weight, capacity=calls_per_layer)
    try:
        yield
        for layer in layers:
            layer.calls.flush()
    finally:
        for layer in layers:
            layer.calls = None
