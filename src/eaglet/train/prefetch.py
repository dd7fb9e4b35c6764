"""Host-side batch preparation run ahead of the training loop, in a background thread.

Packing a batch, padding it to the token budget and pinning it are memory copies of tens of MB per step
(the demo's 16,384-token batch carries 75 MB of features). Done on the training loop's thread they sit
between one step's kernel launches and the next, and the GPU waits; a thread does them while the loop
launches the current step (torch's copies release the GIL). Items come out in order, each exactly once.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator, TypeVar

import torch

Item = TypeVar("Item")
Prepared = TypeVar("Prepared")

_DONE = object()
_POLL_S = 0.1  # how often a blocked producer checks whether the consumer has gone


def prefetched(items: Iterator[Item], prepare: Callable[[Item], Prepared], depth: int) -> Iterator[Prepared]:
    """``prepare(item)`` for each item, computed up to ``depth`` items ahead in a background thread. An exception
    in the thread is raised here, at the item it happened on; closing the generator stops the thread."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    # the CUDA device is per thread: under torchrun each rank's worker must use its rank's GPU (pinned buffers,
    # an online target's forward), not GPU 0
    cuda_device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def offer(value) -> bool:
        while not stop.is_set():
            try:
                ready.put(value, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        try:
            for item in items:
                if not offer((prepare(item), None)):
                    return
        except BaseException as exc:  # handed to the consumer, raised there
            offer((None, exc))
            return
        offer((_DONE, None))

    worker = threading.Thread(target=produce, name="eaglet-batch-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            value, error = ready.get()
            if error is not None:
                raise error
            if value is _DONE:
                return
            yield value
    finally:
        stop.set()
        worker.join()
