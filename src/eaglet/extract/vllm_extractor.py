"""`eaglet extract --backend vllm`: a shard's features from vLLM's hidden-state capture, stored as the hf backend stores them.

A maker thread makes each shard's spool file and requests ahead (at most ``SPOOLED_SHARDS`` spool files exist at once:
it waits for the writers to move one before it creates another) and hands the shard to the writers; a feeder thread
adds each made shard's requests to vLLM at once (``model.vllm_engine``), so vLLM's steps run across shard boundaries
and never wait for a call to end or begin. Each shard's spool file is the shard's own safetensors file: vLLM's worker
forms the stored tensors on its GPU and writes them in place (``model.vllm_rows``); the writer thread that takes the
shard waits for the file, checks the tokens and finite flags the worker wrote after the data, cuts them off and moves
the file into the store (hashed in one pass), while vLLM computes the next ones. The shard's other tensors (ids, mask, offsets, sample index) and its order are the hf
backend's, so a store from either backend is the same format, resumed and trained on the same way.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..errors import EagletError
from ..formats.prepared import PreparedSet
from ..formats.spool import SPOOLED_SHARDS
from ..formats.store_manifest import ShardPlan
from ..model.shards import adopt_shard
from ..model.vllm_engine import SPOOL_WAIT_S, HiddenStateEngine
from ..model.vllm_rows import SPOOL_SUFFIX, ShardFile, cut_checks, read_checks, wait_for_rows

NOT_YET = object()  # the maker's next shard is still being made
PERMIT_POLL_S = 0.5  # how often a thread waiting for a spool slot or a shard checks that the extraction still runs


@dataclass
class Feed:
    """What the maker and feeder threads share with the main thread and the writers."""

    slots: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(SPOOLED_SHARDS))
    stop: threading.Event = field(default_factory=threading.Event)  # the main thread: no more requests to vLLM
    error: BaseException | None = None  # why the feeder stopped; a writer whose shard never ran raises it too
    slot_wait_s: float = 0.0  # vLLM had nothing to run because every spool slot was taken: the writers set the pace
    making_s: float = 0.0  # vLLM had nothing to run while eaglet made the next shard's file and requests
    returned_at: float = 0.0  # perf_counter when vLLM last reported finished requests (its last, once the feed ends)
    rows_done_at: float = 0.0  # perf_counter when the last spool file so far was complete (vLLM's worker wrote it all)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def rows_done(self, at: float) -> None:
        with self.lock:
            self.rows_done_at = max(self.rows_done_at, at)

    def drain_rows_s(self) -> float:
        """How long after vLLM finished its last requests its worker was still writing rows (0 before any)."""
        return max(0.0, self.rows_done_at - self.returned_at) if self.returned_at else 0.0


@dataclass
class MadeShard:
    """A shard's requests for vLLM, made after its spool file (the shard already handed to the writers)."""

    index: int
    prompts: list[dict]
    params: list
    never_run: threading.Event  # set when its requests fail in vLLM or never go there: its writer stops waiting
    slot_wait_s: float  # the maker's wait for its spool slot


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
    """Shards' requests through vLLM, several at once; vLLM's worker forms their stored tensors, whoever waits on a
    shard maps them."""

    def __init__(self, engine: HiddenStateEngine):
        self.engine = engine
        self.slot_wait_s = 0.0  # over every ``shards`` call
        self.making_s = 0.0
        self.feeds: list[Feed] = []  # each ``shards`` call's: its drain is known once the writers are done

    def waits(self, writer: Any) -> dict[str, float]:
        """Seconds vLLM was idle, by cause, once the writers are done: after its last requests, its worker still
        writing the last rows (``drain_rows``), then eaglet checking and moving the last files into the store
        (``drain``); nothing queued because every spool slot was taken (``spool_slots``) or the next shard's file and
        requests were still being made (``making``; they are made ahead). vLLM's shards are handed to the writers
        before they are computed, so a writer queue that fills does not idle it."""
        drain_rows = min(writer.close_wait_s, sum(feed.drain_rows_s() for feed in self.feeds))
        return {
            "drain_rows": drain_rows,
            "drain": writer.close_wait_s - drain_rows,
            "spool_slots": self.slot_wait_s,
            "making": self.making_s,
        }

    def release(self, buffers: dict[str, torch.Tensor]) -> None:
        """Nothing is recycled: each shard's host tensors are its own."""

    def shards(self, prepared: PreparedSet, plans: list[ShardPlan], check: Any) -> Iterator[SpooledShard]:
        """Every plan's shard in plan order, each as soon as its requests are made (not yet computed). ``check()``
        raises the writers' error: waiting for the maker, this one is asked every ``PERMIT_POLL_S``."""
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
            feed.stop.set()  # a feeder still running stops at vLLM's next outputs
            feeder.join()
            self.slot_wait_s += feed.slot_wait_s
            self.making_s += feed.making_s

    def _feed(self, prepared: PreparedSet, plans: list[ShardPlan], feed: Feed, ready: queue.Queue) -> None:
        """Adds each shard's requests to vLLM as soon as the maker thread has made them (it makes them ahead, as spool
        slots allow), and collects vLLM's finished requests until every shard's are."""
        made: queue.Queue = queue.Queue()  # MadeShard, an exception, then None once every shard is made
        maker = threading.Thread(
            target=self._make, args=(prepared, plans, feed, ready, made), name="eaglet-vllm-requests", daemon=True
        )
        maker.start()
        never_runs: list[threading.Event] = []  # every made shard's (its requests are not kept once in vLLM)
        unfinished: dict[int, int] = {}  # shard index -> its requests vLLM has not finished
        owner: dict[str, int] = {}  # request id -> its shard's index
        all_made = False
        try:
            while not feed.stop.is_set():
                while not all_made:
                    shard = self._next_made(made, feed, wait=not unfinished)
                    if shard is NOT_YET:
                        break
                    if shard is None:
                        all_made = True
                        break
                    never_runs.append(shard.never_run)
                    ids = self.engine.submit(shard.prompts, shard.params, _doing([shard.index]))
                    unfinished[shard.index] = len(ids)
                    owner.update(dict.fromkeys(ids, shard.index))
                    del shard  # its prompts and parameters are vLLM's now
                if not unfinished:
                    break
                for request in self.engine.finished(_doing(list(unfinished))):
                    index = owner.pop(request)
                    unfinished[index] -= 1
                    if not unfinished[index]:
                        del unfinished[index]
                feed.returned_at = time.perf_counter()
        except BaseException as exc:  # raised in the main thread
            feed.error = exc
        finally:
            stopped_early = feed.error is not None or feed.stop.is_set()
            feed.stop.set()  # the maker gives up waiting for a spool slot
            maker.join()
            while not made.empty():
                item = made.get()
                if isinstance(item, MadeShard):
                    never_runs.append(item.never_run)
                elif isinstance(item, BaseException):
                    feed.error = feed.error or item
            if stopped_early:
                for never_run in never_runs:  # the writers waiting on these shards' spool files stop waiting
                    never_run.set()
            ready.put(None)

    def _next_made(self, made: queue.Queue, feed: Feed, wait: bool) -> MadeShard | object | None:
        """The maker's next shard; ``NOT_YET`` when none is made yet and vLLM still has work (``wait`` false); None
        when there are no more (or the extraction stops). Waiting, vLLM is idle: the time is counted by cause (a
        spool slot, or the making)."""
        idle_from = time.perf_counter()
        while True:
            try:
                item = made.get(timeout=PERMIT_POLL_S) if wait else made.get_nowait()
                break
            except queue.Empty:
                if not wait:
                    return NOT_YET
                if feed.stop.is_set():
                    return None
        if isinstance(item, BaseException):
            raise item
        if item is not None and wait and feed.returned_at:  # vLLM idle since its last outputs: by cause
            idle = time.perf_counter() - idle_from
            on_slots = min(idle, item.slot_wait_s)
            feed.slot_wait_s += on_slots
            feed.making_s += idle - on_slots
        return item

    def _make(
        self, prepared: PreparedSet, plans: list[ShardPlan], feed: Feed, ready: queue.Queue, made: queue.Queue
    ) -> None:
        """Each plan's shard in order: a spool slot taken, the spool file created, the shard handed to the writers and
        its requests to the feeder; ends with None (or the exception that stopped it)."""
        try:
            for plan in plans:
                if feed.stop.is_set():
                    return
                waiting = time.perf_counter()
                while not feed.slots.acquire(timeout=PERMIT_POLL_S):
                    if feed.stop.is_set():
                        return
                slot_wait_s = time.perf_counter() - waiting
                never_run = threading.Event()
                try:
                    shard, prompts, params = self._shard(prepared, plan, feed, never_run)
                except BaseException:
                    feed.slots.release()
                    raise
                ready.put(shard)
                made.put(MadeShard(plan.index, prompts, params, never_run, slot_wait_s))
        except BaseException as exc:  # noqa: BLE001 - handed to the feeder, raised in the main thread
            made.put(exc)
        finally:
            made.put(None)

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


def _doing(shards: list[int]) -> str:
    """What vLLM is doing, for an engine's death."""
    return f"computing the hidden states of shards {min(shards)}..{max(shards)}"
