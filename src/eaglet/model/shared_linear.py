"""Linear layers the TTT unroll calls K times a step, with their weight gradient made once per step.

Autograd gives a layer called K times K weight gradients, each made in the matmul dtype (bf16 under autocast), cast
to the float32 master weight's dtype and added into ``.grad``: K weight-sized casts and adds per layer. Inside
``deferred_weight_grads`` each call keeps its input and, in backward, its output gradient; leaving the block makes
each weight's gradient as one matmul over all K calls' rows (accumulated inside the matmul) and adds it to ``.grad``
once. The weight is cast once per block.
The 8B-shaped draft's step on an H200: 74.8 -> 73.8 ms, and 70.5 -> 68.6 ms replayed as a CUDA graph (RESULTS).

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
            self.flush()

    def flush(self) -> None:
        """Add the kept calls' weight gradient to ``.grad``: one matmul over their rows."""
        if not self.grads:
            return
        order = sorted(self.grads)
        grads = torch.cat([self.grads.pop(i) for i in order])  # [calls·rows, out]
        inputs = torch.cat([self.inputs.pop(i) for i in order])  # [calls·rows, in]
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


@contextlib.contextmanager
def deferred_weight_grads(module: nn.Module) -> Iterator[None]:
    """Forward and backward inside the block; on leaving it, every ``SharedLinear`` of ``module`` has its weight
    gradient in ``.grad`` (added to what was there: gradient accumulation works as usual). A block left by an
    exception adds none of the gradients it still kept."""
    layers = [layer for layer in module.modules() if isinstance(layer, SharedLinear)]
    for layer in layers:
        layer.calls = _Calls(layer.weight)
    try:
        yield
        for layer in layers:
            layer.calls.flush()
    finally:
        for layer in layers:
            layer.calls = None
