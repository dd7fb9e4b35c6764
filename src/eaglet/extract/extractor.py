"""`eaglet extract`: the target's EAGLE-3 features for every prepared sample, into a crash-safe store.

Shards are independent units of work: computed in length-bucketed, right-padded batches (causal
attention never lets a real token see the padding after it, so no mask and no wasted attention),
encoded on the device, and handed to a writer thread so the accelerator never waits on the disk.
Under torchrun, rank ``r`` takes shards ``r, r+K, r+2K...``; the store is identical to one process's.
Killed at any moment and restarted with the same command, only the missing shards are computed.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from rich.console import Console

from .. import __version__
from ..config import CPU_BATCH_TOKENS, GPU_BATCH_TOKENS, ExtractConfig
from ..errors import EagletError
from ..formats.files import MANIFEST_FILE
from ..formats.prepared import PreparedSet, load_prepared
from ..formats.spool import remove_spool, spool_dir, spool_problem
from ..formats.store_manifest import (
    ShardPlan,
    bytes_per_token,
    plan_shards,
    planned_identity,
    read_record,
    resume_problem,
)
from ..formats.target_record import require_same_target, stage_target, target_source
from ..fsio import (
    check_output_apart,
    check_output_dir,
    free_disk_bytes,
    output_lock,
    sweep_dead_temporaries,
    write_json_atomic,
)
from ..model.capture import FeatureCapture, batches_by_length, right_padded, target_argmax
from ..model.distributed import init_distributed
from ..model.final_norm import load_final_norm
from ..model.placement import describe, output_device, topology
from ..model.shards import encode_features, write_shard
from ..model.sizing import GIB
from ..model.target import (
    dtype_name,
    hub_id_of,
    load_model,
    load_tokenizer,
    resolve_target,
    target_info,
)
from ..model.transfer import to_device
from ..model.vllm_capture import installed_capture
from ..model.vllm_engine import (
    GENERATED_TOKENS,
    EngineHold,
    EngineSettings,
    HiddenStateEngine,
    start_problem,
    vllm_version,
)
from ..model.vllm_rows import SPOOL_SUFFIX
from ..progress import progress_bar
from .vllm_extractor import VllmShardExtractor

WRITE_QUEUE_DEPTH = 3  # finished shards waiting for a writer while the next one computes
WRITER_WAITS = ("writers", "drain", "drain_rows", "spool_slots")  # the extractors' waits that the shard writers cause
WRITER_THREADS = 4  # shards written (hashed, written, fsynced) in parallel: one stream does not fill the disk


@dataclass
class ExtractedShard:
    """A shard whose device->host copies may still be in flight: ``wait()`` before reading ``tensors``.

    The compute loop never waits for the device; the writer thread that takes the shard does, so the
    next shard's forward passes are queued while this one's last copies finish."""

    plan: ShardPlan
    tensors: dict[str, torch.Tensor]  # what goes to disk (views into ``pooled`` for the features)
    pooled: dict[str, torch.Tensor]  # the recycled host buffers behind the features
    copied: torch.cuda.Event | None  # set once every copy into ``pooled`` is done (None on CPU)
    first_bad: torch.Tensor  # [batches] host int64: first non-finite token of each batch, -1 if none
    batch_tokens: np.ndarray  # [batches] tokens per batch, in stored order
    sample_ids: list[str]  # the shard's sample ids, in stored order

    def wait(self) -> None:
        """Block until the features are on the host; refuse non-finite ones, naming the sample."""
        if self.copied is not None:
            self.copied.synchronize()
        bad = np.flatnonzero(self.first_bad.numpy() >= 0)
        if len(bad):
            batch = int(bad[0])
            token = int(self.batch_tokens[:batch].sum()) + int(self.first_bad[batch])
            row = int(np.searchsorted(self.tensors["offsets"].numpy(), token, side="right")) - 1
            raise EagletError(
                f"non-finite features for sample {self.sample_ids[row]!r}; "
                "check the target's dtype (--dtype float32) and weights"
            )

    def write(self, store: Path) -> dict[str, Any]:
        """The shard written into ``store``; its record."""
        return write_shard(store, self.plan, self.tensors)


class ShardExtractor:
    """One shard's stored tensors from the target: ids, mask, offsets, sample index and features."""

    def __init__(
        self,
        model: torch.nn.Module,
        layer_ids: tuple[int, ...],
        storage_dtype: str,
        batch_tokens: int,
        max_shard_tokens: int,
        target_top: bool,
    ):
        self.capture = FeatureCapture(model, layer_ids)
        self.target_top = target_top  # store the target's argmax per token (the store's manifest says whether)
        self.device = output_device(model)  # where the features come out, are encoded and copied from
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.storage_dtype = storage_dtype
        self.batch_tokens = batch_tokens
        self.max_shard_tokens = max_shard_tokens
        # Host buffers are pinned (fast, asynchronous device->host copies) and pinning is slow, so every
        # shard's buffers have the same capacity and are recycled once the writer is done with them.
        self.free_buffers: queue.SimpleQueue = queue.SimpleQueue()

    def waits(self, writer: Any) -> dict[str, float]:
        """Seconds the forward waited, by cause: for the writers (a full queue, and at the end)."""
        return {"writers": writer.stall_s}

    def _buffers(self, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        try:
            return self.free_buffers.get_nowait()
        except queue.Empty:
            return {
                k: torch.empty((self.max_shard_tokens, *v.shape[1:]), dtype=v.dtype, pin_memory=self.cuda)
                for k, v in template.items()
            }

    def release(self, buffers: dict[str, torch.Tensor]) -> None:
        """The writer is done with a shard: its feature buffers can take the next one."""
        self.free_buffers.put(buffers)

    def _to_device(self, array: np.ndarray, device: torch.device | None = None) -> torch.Tensor:
        return to_device(torch.from_numpy(array), device or self.device)

    def shards(self, prepared: PreparedSet, plans: list[ShardPlan], check: Any = None) -> Iterator[ExtractedShard]:
        """Every plan's shard in order, each queued on the device (not yet computed) when it is yielded. (``check``
        is for extractors that wait on their own: this one returns to its caller after every shard.)"""
        for plan in plans:
            yield self(prepared, plan)

    def __call__(self, prepared: PreparedSet, plan: ShardPlan) -> ExtractedShard:
        """Queue the shard's forward passes and copies; returns before the device is done.

        Samples are computed and stored in plan order (longest first). Encoded features go straight from
        the device into one pinned host buffer per tensor: no gather, no concat, no host sync."""
        samples = np.asarray(plan.samples)
        lengths = prepared.lengths[samples]
        batches = batches_by_length(lengths, self.batch_tokens)  # plan order is longest first: batches keep it
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        pooled: dict[str, torch.Tensor] = {}
        position = 0
        flags = []  # device scalars: first non-finite token of each batch, or -1
        for batch in batches:
            padded = right_padded(lambda local: prepared.sample(int(samples[local]))[0], lengths, batch)
            width = padded.shape[1]
            keep = np.concatenate([row * width + np.arange(lengths[s]) for row, s in enumerate(batch.tolist())])
            aux, last = self.capture(self._to_device(padded, self.capture.input_device))  # [B,S,3,H], [B,S,H]
            keep_index = self._to_device(keep)
            aux = aux.flatten(0, 1).index_select(0, keep_index)  # [sum L, 3, H]: samples back to back
            last = last.flatten(0, 1).index_select(0, keep_index)  # [sum L, H]
            bad = ~(torch.isfinite(aux).flatten(1).all(1) & torch.isfinite(last).all(1))
            flags.append(torch.where(bad.any(), bad.int().argmax(), -1))
            encoded = encode_features(aux, last, self.storage_dtype)
            if self.target_top:
                encoded["target_top"] = target_argmax(self.capture.model, last)  # [sum L] int32
            pooled = pooled or self._buffers(encoded)
            self._copy(encoded, pooled, position)
            position += len(aux)
        first_bad = torch.empty(len(flags), dtype=torch.int64, pin_memory=self.cuda)
        self._copy({"flags": torch.stack(flags).long()}, {"flags": first_bad}, 0)
        copied = None
        if self.copy_stream is not None:
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
        ids = np.concatenate([prepared.sample(int(s))[0] for s in samples])
        mask = np.concatenate([prepared.sample(int(s))[1] for s in samples])
        tensors = {key: value[: offsets[-1]] for key, value in pooled.items()}
        tensors.update(
            input_ids=torch.from_numpy(ids.astype(np.int32)),
            loss_mask=torch.from_numpy(mask.astype(np.uint8)),
            offsets=torch.from_numpy(offsets),
            sample_index=torch.from_numpy(samples.astype(np.int64)),
        )
        return ExtractedShard(
            plan,
            tensors,
            pooled,
            copied,
            first_bad,
            np.array([int(lengths[b].sum()) for b in batches]),
            [prepared.ids[int(s)] for s in samples],
        )

    def _copy(self, sources: dict[str, torch.Tensor], targets: dict[str, torch.Tensor], position: int) -> None:
        """``targets[k][position:] = sources[k]``; on the GPU asynchronously on the copy stream."""
        if self.copy_stream is None:
            for key, value in sources.items():
                targets[key][position : position + len(value)].copy_(value)
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            for key, value in sources.items():
                targets[key][position : position + len(value)].copy_(value, non_blocking=True)
                value.record_stream(self.copy_stream)  # keep the device memory until the copy is done


class ShardWriter:
    """A thread that writes finished shards (and refreshes the manifest) while the next one computes."""

    def __init__(self, store: Path, on_written: Any, release: Any):
        self.store = store
        self.on_written = on_written
        self.release = release
        self.queue: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE_DEPTH)
        self.error: BaseException | None = None
        self.submit_wait_s = 0.0  # the compute loop blocked because every writer was busy (disk-bound)
        self.close_wait_s = 0.0  # after the last shard was handed over, until every shard was written
        # writer-thread seconds summed over shards, by phase: where a writer-bound extraction spends its time
        self.seconds: dict[str, float] = {"wait": 0.0, "write": 0.0}
        self.lock = threading.Lock()  # manifest refreshes happen one at a time
        self.threads = [
            threading.Thread(target=self._run, name=f"eaglet-shard-writer-{i}", daemon=True)
            for i in range(WRITER_THREADS)
        ]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is None:
                try:
                    shard: ExtractedShard = item
                    started = time.perf_counter()
                    shard.wait()
                    waited = time.perf_counter()
                    record = shard.write(self.store)
                    self.release(shard.pooled)
                    phases = {"wait": waited - started, "write": time.perf_counter() - waited}
                    phases |= getattr(shard, "phases", {})
                    del shard, item
                    with self.lock:
                        for phase, seconds in phases.items():
                            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
                        self.on_written(record)
                except BaseException as exc:  # surfaced in the main thread
                    self.error = exc

    def submit(self, shard: ExtractedShard) -> None:
        self.check()
        started = time.perf_counter()
        self.queue.put(shard)
        self.submit_wait_s += time.perf_counter() - started

    @property
    def stall_s(self) -> float:
        """Seconds the extraction waited on the writers (for a compute loop that hands over computed shards)."""
        return self.submit_wait_s + self.close_wait_s

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self, report: bool = True) -> None:
        """Every shard handed over written; ``report`` raises a writer's error here."""
        started = time.perf_counter()
        for _ in self.threads:
            self.queue.put(None)
        for thread in self.threads:
            thread.join()
        self.close_wait_s += time.perf_counter() - started
        if report:
            self.check()


class ShardDiscarder:
    """A tensor-parallel rank's writer: the shard's copies are waited for (its features checked) and dropped."""

    stall_s = close_wait_s = 0.0

    def __init__(self, release: Any, on_done: Any):
        self.release = release
        self.on_done = on_done  # called with the shard's token count
        self.seconds: dict[str, float] = {}  # nothing is written

    def submit(self, shard: ExtractedShard) -> None:
        shard.wait()
        self.release(shard.pooled)
        self.on_done(shard.plan.tokens)

    def check(self) -> None:
        pass  # submit() checks each shard before it returns: no error waits here

    def close(self, report: bool = True) -> None:
        pass  # every shard was checked as it was handed over


# ---------------------------------------------------------------------------------------------
# The stage


@dataclass
class ExtractResult:
    out: Path
    manifest: dict[str, Any]
    shards_computed: int
    tokens_computed: int
    seconds: float
    writer_stall_s: float = 0.0  # compute waiting on the disk: the share of `seconds` the disk cost
    writer_seconds: dict[str, float] = field(default_factory=dict)  # writer-thread seconds by phase, all shards
    waits: dict[str, float] = field(default_factory=dict)  # seconds of `seconds` the compute was idle, by cause


def _manifest(
    store: Path, identity: dict[str, Any], plans: list[ShardPlan], config: ExtractConfig, source: dict[str, Any]
) -> dict[str, Any]:
    records = [read_record(store, plan.index) for plan in plans]
    done = [r for r in records if r is not None]
    return identity | {
        "target_source": source,  # how to find the target again (outside the identity: a moved target resumes)
        "eaglet_version": __version__,
        "complete": len(done) == len(plans),
        "num_shards": len(plans),
        "totals": {
            "samples": sum(r["num_samples"] for r in done),
            "tokens": sum(r["tokens"] for r in done),
            "bytes": sum(r["bytes"] for r in done),
        },
        "config": config.model_dump(exclude={"out", "device"}),
        # outside the identity (a resumed store matches on the absolute path): found again after a move
        "prepared_relative": os.path.relpath(identity["prepared"]["path"], store.resolve()),
        "shards": done,
    }


def run_extract(
    config: ExtractConfig,
    console: Console | None = None,
    model: torch.nn.Module | None = None,
    only_shards: set[int] | None = None,
    engine: HiddenStateEngine | None = None,
) -> ExtractResult:
    """The store ``config.out``: its missing shards computed (``only_shards``: those alone), one writer a replica.
    ``model`` (hf) or ``engine`` (vllm, opened by ``open_vllm_engine`` for this store) reuse a loaded target."""
    dist = init_distributed()
    check_output_dir(config.out)
    check_output_apart(config.out, [config.prepared, config.target])
    replica, replicas = config.replicas
    tag = "" if replicas == 1 else f"-replica-{replica}-of-{replicas}"  # replicas share a store by design
    with output_lock(config.out, tag) if dist.is_main else contextlib.nullcontext():
        return _extract(config, console or Console(stderr=True), model, only_shards, dist, engine)


def _extract(
    config: ExtractConfig,
    console: Console,
    model: torch.nn.Module | None,
    only_shards: set[int] | None,
    dist: Any,
    engine: HiddenStateEngine | None,
) -> ExtractResult:
    store = Path(config.out)
    prepared = load_prepared(config.prepared, config.max_samples)
    target = stage_target(config)
    resolved = resolve_target(target, config.trust_remote_code)
    info = target_info(resolved, load_tokenizer(resolved.path, config.trust_remote_code))
    require_same_target(
        info.identity,
        prepared.manifest["target"],
        str(config.prepared),
        "prepared with",
        f"prepare again with --target {target}",
        tokenizer_only=True,
    )
    place = topology(config, dist.rank, dist.world)
    device = dist.device(config.device)
    identity = planned_identity(config, info, prepared, store, dtype_name(config.dtype, device))
    layers = tuple(identity["aux_layer_ids"])
    per_token = bytes_per_token(info.hidden_size, config.storage_dtype, identity["target_top"])
    plans = plan_shards(prepared.lengths, identity["tokens_per_shard"], tail_pieces=identity["tail_pieces"])
    source = target_source(resolved.spec, resolved.path, hub_id_of(resolved))

    problem = resume_problem(store, identity)
    if problem:
        raise EagletError(problem)
    sweep_dead_temporaries(store)  # shards a killed run was writing (its finished ones are kept and resumed)
    todo_all = [
        p for p in plans if read_record(store, p.index) is None and (only_shards is None or p.index in only_shards)
    ]
    mine = [p for p in todo_all if p.index % place.replicas == place.replica]
    _check_disk(store, sum(p.tokens for p in todo_all) * per_token, config.reserve_gb)
    if mine and config.backend == "vllm":
        problem = spool_problem(spool_dir(config.spool_dir, store), store, [p.tokens * per_token for p in mine])
        if problem:
            raise EagletError(problem)
    # vLLM starts its own workers; before the store: a failed load leaves none
    if mine and config.backend == "vllm" and engine is None:
        if dist.world > 1:
            raise EagletError(
                "--backend vllm runs in one process (vLLM starts a worker per GPU for --tensor-parallel-size); "
                "run it without torchrun"
            )
        engine = open_vllm_engine(
            config,
            resolved.path,
            layers,
            info.num_layers,
            info.hidden_size,
            prepared,
            store,
            identity["target"]["compute_dtype"],
        )
    elif mine and config.backend == "hf" and model is None:  # before the store: a target that cannot load leaves none
        model = load_model(resolved.path, device, config.dtype, config.trust_remote_code, config, dist.world)
        if config.placement == "split" and dist.is_main:
            console.print(f"target split: {describe(model)}")
    if dist.is_main:
        store.mkdir(parents=True, exist_ok=True)
        write_json_atomic(store / MANIFEST_FILE, _manifest(store, identity, plans, config, source))
    dist.barrier()

    started = time.perf_counter()
    waits: dict[str, float] = {}
    writer_seconds: dict[str, float] = {}
    if mine:
        batch_tokens = config.batch_tokens or (GPU_BATCH_TOKENS if device.startswith("cuda") else CPU_BATCH_TOKENS)
        max_shard_tokens = max(p.tokens for p in mine)
        if engine is not None:
            extractor = VllmShardExtractor(engine)
        else:
            extractor = ShardExtractor(
                model, layers, config.storage_dtype, batch_tokens, max_shard_tokens, identity["target_top"]
            )

        with progress_bar("tok", console) as progress:
            task = progress.add_task(
                f"extract{'' if place.replicas == 1 else f' replica {place.replica}'}",
                total=sum(p.tokens for p in mine),
            )

            def refresh(record: dict[str, Any]) -> None:
                """A shard is on disk: the manifest and the progress bar say so."""
                if dist.is_main and place.replicas == 1:
                    write_json_atomic(store / MANIFEST_FILE, _manifest(store, identity, plans, config, source))
                progress.advance(task, record["tokens"])

            # a tensor-parallel group computes every shard on every rank; its rank 0 writes
            writer = (
                ShardWriter(store, refresh, extractor.release)
                if place.writes
                else ShardDiscarder(extractor.release, lambda tokens: progress.advance(task, tokens))
            )
            failed = True
            try:
                with contextlib.closing(extractor.shards(prepared, mine, writer.check)) as shards:
                    for shard in shards:
                        writer.submit(shard)
                failed = False
            finally:
                try:
                    writer.close(report=not failed)  # a writer's error after the first one would hide it
                    waits = extractor.waits(writer)
                    writer_seconds = writer.seconds
                finally:
                    if engine is not None:  # vLLM's files of a failed shard are not kept: resumed, it is recomputed
                        remove_spool(engine.settings.spool, not config.spool_dir, f"shard-*{SPOOL_SUFFIX}*")
    seconds = time.perf_counter() - started
    dist.barrier()
    manifest = _manifest(store, identity, plans, config, source)
    if dist.is_main:
        write_json_atomic(store / MANIFEST_FILE, manifest)
    stall_s = sum(seconds for cause, seconds in waits.items() if cause in WRITER_WAITS)
    return ExtractResult(
        store, manifest, len(mine), sum(p.tokens for p in mine), seconds, stall_s, writer_seconds, waits
    )


def open_vllm_engine(
    config: ExtractConfig,
    target_path: Path,
    layers: tuple[int, ...],
    num_layers: int,
    hidden_size: int,
    prepared: PreparedSet,
    store: Path,
    model_dtype: str,
    profile_dir: str | None = None,
) -> HiddenStateEngine:
    """vLLM on the target, sized for the longest sample and a forward of ``--batch-tokens``; ``profile_dir``: where
    vLLM's torch profiler writes its worker's traces (benchmarks/vllm_extract_parity.py; off in `eaglet extract`)."""
    problem = start_problem(target_path, config)
    if problem is None:
        verdict = installed_capture(target_path, vllm_version() or "?")
        problem = verdict.problem if verdict is not None else None
    if problem:
        raise EagletError(problem)
    load_final_norm(target_path, "cpu", torch.float32)  # vLLM's worker forms `last` with it: its absence, named now
    longest = int(prepared.lengths.max())
    if config.max_model_len is not None and config.max_model_len < longest + GENERATED_TOKENS:
        raise EagletError(
            f"--max-model-len {config.max_model_len}: the prepared set's longest sample has {longest:,} tokens and "
            f"vLLM needs {longest + GENERATED_TOKENS:,}; leave --max-model-len out (extraction sizes it) or raise it"
        )
    settings = EngineSettings(
        hold=EngineHold.of(config, target_path, model_dtype),
        aux_layer_ids=layers,
        num_layers=num_layers,
        hidden_size=hidden_size,
        spool=spool_dir(config.spool_dir, store),
        storage_dtype=config.storage_dtype,
        max_model_len=longest + GENERATED_TOKENS,
        max_num_batched_tokens=max(config.batch_tokens or GPU_BATCH_TOKENS, longest + GENERATED_TOKENS),
        profile_dir=profile_dir,
    )
    return HiddenStateEngine(settings)


def _check_disk(store: Path, needed_bytes: int, reserve_gb: float) -> None:
    """Fail in seconds, before any model load, when the store cannot fit."""
    free = free_disk_bytes(store)
    if needed_bytes + reserve_gb * GIB > free:
        raise EagletError(
            f"{store}: needs {needed_bytes / GIB:.2f} GiB (+ {reserve_gb:g} GiB reserve) but {free / GIB:.2f} GiB are free; "
            "free space, choose another --out, use --storage-dtype fp8-aux (0.63x the size) or fp8 (0.5x), or --max-samples"
        )
