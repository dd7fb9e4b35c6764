"""Host -> device copies that do not make the host wait.

A plain ``tensor.to("cuda")`` from pageable memory synchronises with the stream: the training loop would
wait for the previous step's kernels to finish before it could queue the next step, leaving the GPU idle
while it copies the batch and launches the first kernels (the extraction's forward and vLLM's worker the
same). Copies from pinned memory with
``non_blocking=True`` are queued like kernels (the caching host allocator keeps the pinned buffer until
the copy is done)."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor`` on ``device`` (and in ``dtype``); on CUDA through pinned memory, without blocking."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, dtype, non_blocking=True)
    return tensor.to(device, dtype)
