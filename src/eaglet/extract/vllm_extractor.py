"""`eaglet extract --backend vllm`: a shard's features from vLLM's hidden-state capture, stored as the hf backend stores them.

A feeder thread hands vLLM the requests of ``SHARDS_PER_GENERATE`` shards per ``generate`` call (``model.vllm_engine``),
so vLLM's steps run across shard boundaries and the next call is ready when one returns. Each shard's spool file is
the shard's own safetensors file: vLLM's worker forms the stored tensors on its GPU and writes them in place
(``model.vllm_rows``); the writer thread that takes the shard waits for the file, checks the tokens and finite flags
the worker wrote after the data, cuts them off and moves the file into the store (hashed as it is read once), while
vLLM computes the next ones; the next call's requests are made while vLLM runs the current one. At most
``SPOOLED_SHARDS`` spool files exist at once: their maker waits for the writers to move one before it creates another.
The shard's other tensors (ids, mask, offsets, sample index) and its order are the hf backend's, so a store from
either backend is the same format, resumed and trained on the same way.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..errors import EagletError
from ..formats.prepared import PreparedSet
from ..formats.spool import SHARDS_PER_GENERATE, SPOOLED_SHARDS
from ..formats.store_manifest import ShardPlan
from ..model.shards import adopt_shard
from ..model.vllm_engine import SPOOL_WAIT_S, HiddenStateEngine
from ..model.vllm_rows import SPOOL_SUFFIX, ShardFile, cut_checks, read_checks, wait_for_rows

PERMIT_POLL_S = 0.5  # how often a feeder waiting for a spool slot checks that the extraction still runs


@dataclass
class Feed:
    """What the feeder thread shares with the main thread and the writers."""

    slots: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(SPOOLED_SHARDS))
    stop: threading.Event = field(default_factory=threading.Event)  # the main thread: no more calls to vLLM
    error: BaseException | None = None  # why the feeder stopped; a writer whose shard never ran raises it too
    slot_wait_s: float = 0.0  # vLLM idle because every spool slot was taken: the writers set the pace
    between_calls_s: float = 0.0  # vLLM idle between one call's return and the next: its requests not yet made
    returned_at: float = 0.0  # perf_counter when vLLM's last call so far returned
    rows_done_at: float = 0.0  # perf_counter when the last spool file so far was complete (vLLM's worker wrote it all)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def rows_done(self, at: float) -> None:
        with self.lock:
            self.rows_done_at = max(self.rows_done_at, at)

    def drain_rows_s(self) -> float:
        """How long after its last call returned vLLM's worker was still writing rows (0 before any call)."""
        return max(0.0, self.rows_done_at - self.returned_at) if self.returned_at else 0.0


@dataclass
class Call:
    """One call to vLLM: its requests, what it is doing (for errors), and the event its shards' writers watch."""

    prompts: list[dict]
    params: list
    doing: str
    never_run: threading.Event = field(default_factory=threading.Event)  # set when the call fails or never happens
    slot_wait_s: float = 0.0  # waiting for spool slots while its requests were made


@dataclass
class SpooledShard:
    """A shard vLLM's worker is filling in its spool file: ``wait()`` (in a writer thread) checks it once complete,
    ``write(store)`` moves it into the store."""

    plan: ShardPlan
    tensors: dict[str, torch.Tensor]  # ids, mask, offsets, sample index (also in the file)
    spool: Path  # the shard's file, its stored tensors formed and written by vLLM's worker
    file: ShardFile  # where the file holds what
    sample_ids: list[str]
    feed: Feed  # the feeder's state: its spool slot is given back once the file has left the spool
    never_run: threading.Event  # set by the feeder when this shard's call to vLLM failed or was never made
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # no recycled buffers: nothing to release
    phases: dict[str, float] = field(default_factory=dict)  # seconds of wait(): vLLM's worker, the checks
    slot_held: bool = True

    def wait(self) -> None:
        started = time.perf_counter()
        try:
            try:
                wait_for_rows(self.spool, SPOOL_WAIT_S, abandoned=self.never_run)
            except EagletError:
                if self.never_run.is_set() and self.feed.error is not None:
                    raise self.feed.error from None  # the cause, whichever thread reports first
                raise
            written = time.perf_counter()
            self.feed.rows_done(written)
            checks = read_checks(self.spool, self.file)
            if not torch.equal(checks.token_ids, self.tensors["input_ids"]):
                raise EagletError(
                    f"{self.spool}: vLLM's hidden states are for other tokens than the shard's; extract again"
                )
            finite = checks.finite.numpy()
            if not finite.all():
                token = int(np.argmin(finite))
                row = int(np.searchsorted(self.tensors["offsets"].numpy(), token, side="right")) - 1
                raise EagletError(
                    f"non-finite features for sample {self.sample_ids[row]!r}; check the target's dtype and weights"
                )
            cut_checks(self.spool, self.file)
        except BaseException:
            self.spool.unlink(missing_ok=True)
            self._release()
            raise
        self.phases = {"spool_wait": written - started, "spool_check": time.perf_counter() - written}

    def write(self, store: Path) -> dict[str, Any]:
        """The checked file moved into ``store`` as the shard; its record."""
        try:
            return adopt_shard(store, self.plan, self.spool)
        finally:
            self._release()

    def _release(self) -> None:
        if self.slot_held:
            self.slot_held = False
            self.feed.slots.release()


class VllmShardExtractor:
    """Shards' requests through vLLM, several per call; vLLM's worker forms their stored tensors, whoever waits on a
    shard maps them."""

    def __init__(self, engine: HiddenStateEngine):
        self.engine = engine
        self.slot_wait_s = 0.0  # over every ``shards`` call
        self.between_calls_s = 0.0
        self.feeds: list[Feed] = []  # each ``shards`` call's: its drain is known once the writers are done

    def waits(self, writer: Any) -> dict[str, float]:
        """Seconds vLLM was idle, by cause, once the writers are done: after its last call, its worker still writing
        the last rows (``drain_rows``), then eaglet checking and moving the last files into the store (``drain``);
        every spool slot taken (``spool_slots``); the next call's requests not yet made (``between_calls``; they are
        made while the previous call runs). vLLM's shards are handed to the writers before they are computed, so a
        writer queue that fills does not idle it."""
        drain_rows = min(writer.close_wait_s, sum(feed.drain_rows_s() for feed in self.feeds))
        return {
            "drain_rows": drain_rows,
            "drain": writer.close_wait_s - drain_rows,
            "spool_slots": self.slot_wait_s,
            "between_calls": self.between_calls_s,
        }

    def release(self, buffers: dict[str, torch.Tensor]) -> None:
        """Nothing is recycled: each shard's host tensors are its own."""

    def shards(self, prepared: PreparedSet, plans: list[ShardPlan], check: Any) -> Iterator[SpooledShard]:
        """Every plan's shard in plan order, each as soon as its requests are ready for vLLM (not yet computed).
        ``check()`` raises the writers' error: waiting for the feeder, this one is asked every ``PERMIT_POLL_S``."""
        feed = Feed()
        self.feeds.append(feed)
        ready: queue.Queue = queue.Queue()  # SpooledShard, then None when the feeder ends
        feeder = threading.Thread(
            target=self._feed, args=(prepared, plans, feed, ready), name="eaglet-vllm-feeder", daemon=True
        )
        feeder.start()
        try:
            while (shard := _next(ready, check)) is not None:
                yield shard
            if feed.error is not None:
                raise feed.error
        finally:
            feed.stop.set()  # a feeder still running stops after its current call
            feeder.join()
            self.slot_wait_s += feed.slot_wait_s
            self.between_calls_s += feed.between_calls_s

    def _feed(self, prepared: PreparedSet, plans: list[ShardPlan], feed: Feed, ready: queue.Queue) -> None:
        """Calls vLLM with ``SHARDS_PER_GENERATE`` shards' requests at a time; the next call's requests (its spool
        files created, its shards handed to the writers) are made by a second thread while vLLM runs this one."""
        groups = [plans[first : first + SHARDS_PER_GENERATE] for first in range(0, len(plans), SHARDS_PER_GENERATE)]
        made: list[Call] = []  # every call whose shards went to the writers
        returned: float | None = None  # when the previous call to vLLM returned
        with ThreadPoolExecutor(1, thread_name_prefix="eaglet-vllm-requests") as maker:
            following = maker.submit(self._call, prepared, groups[0], feed, ready) if groups else None
            try:
                for index in range(len(groups)):
                    waiting = time.perf_counter()
                    call = following.result()
                    if call is None:  # stopped while waiting for a spool slot
                        return
                    made.append(call)
                    if returned is not None:  # vLLM idle since its last call returned: by cause
                        idle = time.perf_counter() - waiting
                        on_slots = min(idle, call.slot_wait_s)
                        feed.slot_wait_s += on_slots
                        feed.between_calls_s += idle - on_slots
                    following = None
                    if index + 1 < len(groups):
                        following = maker.submit(self._call, prepared, groups[index + 1], feed, ready)
                    if feed.stop.is_set():
                        return
                    self.engine.generate(call.prompts, call.params, call.doing)
                    returned = feed.returned_at = time.perf_counter()
            except BaseException as exc:  # raised in the main thread
                feed.error = exc
            finally:
                stopped_early = feed.error is not None or feed.stop.is_set()
                feed.stop.set()  # the request maker gives up waiting for a spool slot
                if following is not None:
                    try:
                        if (pending := following.result()) is not None:
                            made.append(pending)
                    except BaseException as exc:  # noqa: BLE001 - the first error is the one reported
                        feed.error = feed.error or exc
                if stopped_early:
                    for call in made:  # the writers waiting on these calls' spool files stop waiting
                        call.never_run.set()
                ready.put(None)

    def _call(self, prepared: PreparedSet, group: list[ShardPlan], feed: Feed, ready: queue.Queue) -> Call | None:
        """One call's requests: a spool slot taken, the spool file created and the shard handed to the writers, for
        each shard of ``group``; None when the extraction stopped while a slot was awaited."""
        call = Call([], [], f"computing the hidden states of shards {group[0].index}..{group[-1].index}")
        try:
            for plan in group:
                waiting = time.perf_counter()
                while not feed.slots.acquire(timeout=PERMIT_POLL_S):
                    if feed.stop.is_set():
                        call.never_run.set()
                        return None
                call.slot_wait_s += time.perf_counter() - waiting
                shard, prompts, params = self._shard(prepared, plan, feed, call.never_run)
                call.prompts += prompts
                call.params += params
                ready.put(shard)
        except BaseException:
            call.never_run.set()
            raise
        return call

    def _shard(
        self, prepared: PreparedSet, plan: ShardPlan, feed: Feed, never_run: threading.Event
    ) -> tuple[SpooledShard, list, list]:
        """A shard's stored tensors but the features, its spool file, and its requests."""
        samples = np.asarray(plan.samples)
        rows = [prepared.sample(int(s)) for s in samples]
        tokens = [ids for ids, _ in rows]
        lengths = np.array([len(ids) for ids in tokens])
        tensors = {
            "input_ids": torch.from_numpy(np.concatenate(tokens).astype(np.int32)),
            "loss_mask": torch.from_numpy(np.concatenate([mask for _, mask in rows]).astype(np.uint8)),
            "offsets": torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)),
            "sample_index": torch.from_numpy(samples.astype(np.int64)),
        }
        spool, file, prompts, params = self.engine.requests(
            tensors, [ids.tolist() for ids in tokens], f"shard-{plan.index:05d}{SPOOL_SUFFIX}"
        )
        shard = SpooledShard(plan, tensors, spool, file, [prepared.ids[int(s)] for s in samples], feed, never_run)
        return shard, prompts, params


def _next(ready: queue.Queue, check: Any) -> SpooledShard | None:
    """The feeder's next shard; meanwhile the writers' error, should they stop taking shards, is raised here."""
    while True:
        try:
            return ready.get(timeout=PERMIT_POLL_S)
        except queue.Empty:
            check()
