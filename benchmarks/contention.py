"""A process that is not idle: what eaglet's threads share the GIL with (vLLM's engine core loop, a training loop)."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


def _spin(stop: threading.Event) -> None:
    count = 0
    while not stop.is_set():
        count += 1


@contextmanager
def busy_python_thread(busy: bool = True) -> Iterator[None]:
    """For the block, a thread running Python bytecode without pause (when ``busy``): it gives the GIL up only at the
    switch interval, so a thread that released it for a system call or a hash waits up to 5 ms to have it back."""
    if not busy:
        yield
        return
    stop = threading.Event()
    thread = threading.Thread(target=_spin, args=(stop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
