"""CUDA graph capture, shared by the engines that replay fixed-shape work: eval's decoding rounds
(``decode/static.py``) and the batch sampler that writes regenerate's and synthesize's text."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

from ..errors import EagletError

WARMUP_RUNS = 2  # eager runs on a side stream before capture (cuBLAS/allocator set-up must not be captured)
T = TypeVar("T")


def capture(
    device: torch.device, body: Callable[[], T], fix: str = "run eval with --cuda-graphs off", pool: Any = None
) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``body`` WARMUP_RUNS times on a side stream, then capture it as a CUDA graph; returns the graph
    and the outputs ``body`` left in the graph's memory (rewritten by every replay). ``fix``: what the user can
    do when the capture fails; ``pool``: another graph's memory pool to share (graphs never replayed at once)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            outputs = body()
    except RuntimeError as error:  # an op that syncs with the host, or one graphs do not support
        raise EagletError(f"CUDA graph capture failed ({str(error).splitlines()[0]}); {fix}") from None
    return graph, outputs
