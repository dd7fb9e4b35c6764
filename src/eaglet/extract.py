"""`eaglet extract`: the target's EAGLE-3 features for every prepared sample, into a crash-safe store.

Shards are independent units of work: computed in length-bucketed, right-padded batches (causal
attention never lets a real token see the padding after it, so no mask and no wasted attention),
encoded on the device, and handed to a writer thread so the accelerator never waits on the disk.
Under torchrun, rank ``r`` takes shards ``r, r+K, r+2K...``; the store is identical to one process's.
Killed at any moment and restarted with the same command, only the missing shards are computed.
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console

from . import __version__
from .capture import FeatureCapture
from .config import ExtractConfig
from .data.prepared import PreparedSet, load_prepared
from .distributed import Dist, init_distributed
from .errors import EagletError
from .fsio import write_json_atomic
from .layers import AUX_CONVENTION, default_aux_layer_ids, validate_aux_layer_ids
from .progress import progress_bar
from .store import (
    MANIFEST_FILE,
    STORE_SCHEMA,
    ShardPlan,
    bytes_per_token,
    encode_features,
    plan_shards,
    read_manifest,
    read_record,
    write_shard,
)
from .target import load_model, load_tokenizer, pick_dtype, resolve_target, target_info

GPU_BATCH_TOKENS = 32768
CPU_BATCH_TOKENS = 4096
WRITE_QUEUE_DEPTH = 1  # shards waiting for the disk while the next one computes
GIB = 1 << 30


def batches_by_length(lengths: np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Sample indices, longest first, grouped so each batch's padded size stays within ``batch_tokens``."""
    order = np.argsort(-lengths, kind="stable")
    batches, current, width = [], [], 0
    for index in order.tolist():
        width = width or int(lengths[index])  # the first (longest) sample fixes the padded width
        if current and (len(current) + 1) * width > batch_tokens:
            batches.append(np.asarray(current))
            current, width = [], int(lengths[index])
        current.append(index)
    if current:
        batches.append(np.asarray(current))
    return batches


class ShardExtractor:
    """One shard's stored tensors from the target: ids, mask, offsets, sample index and features."""

    def __init__(self, model: torch.nn.Module, layer_ids: tuple[int, ...], storage_dtype: str, batch_tokens: int):
        self.capture = FeatureCapture(model, layer_ids)
        self.device = next(model.parameters()).device
        self.storage_dtype = storage_dtype
        self.batch_tokens = batch_tokens

    def __call__(self, prepared: PreparedSet, plan: ShardPlan) -> dict[str, torch.Tensor]:
        first, stop = plan.first_sample, plan.first_sample + plan.num_samples
        ids, mask = prepared.token_range(first, stop)
        offsets = prepared.offsets[first : stop + 1] - prepared.offsets[first]
        lengths = np.diff(offsets)
        chunks: dict[str, list[torch.Tensor]] = {}
        destinations: list[np.ndarray] = []
        for batch in batches_by_length(lengths, self.batch_tokens):
            width = int(lengths[batch].max())
            padded = np.zeros((len(batch), width), dtype=np.int64)
            for row, sample in enumerate(batch.tolist()):
                padded[row, : lengths[sample]] = ids[offsets[sample] : offsets[sample + 1]]
            aux, last = self.capture(torch.from_numpy(padded).to(self.device))  # [B,S,3,H], [B,S,H]
            valid = torch.arange(width, device=self.device)[None, :] < torch.as_tensor(lengths[batch], device=self.device)[:, None]
            aux, last = aux[valid], last[valid]  # [sum L, 3, H], [sum L, H] in batch order
            if not (torch.isfinite(aux).all() and torch.isfinite(last).all()):
                bad = self._first_non_finite(aux, last, lengths[batch])
                raise EagletError(
                    f"non-finite features for sample {prepared.ids[first + int(batch[bad])]!r}; "
                    "check the target's dtype (--dtype float32) and weights"
                )
            for key, value in encode_features(aux, last, self.storage_dtype).items():
                chunks.setdefault(key, []).append(value.to("cpu", non_blocking=True))
            destinations.append(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # Put samples back in prepared order: batch order -> positions [offsets[s], offsets[s+1]).
        order = np.concatenate(destinations)
        batch_lengths = lengths[order]
        source_starts = np.concatenate([[0], np.cumsum(batch_lengths)[:-1]])
        gather = np.empty(int(offsets[-1]), dtype=np.int64)
        for sample, start, length in zip(order.tolist(), source_starts.tolist(), batch_lengths.tolist()):
            gather[offsets[sample] : offsets[sample] + length] = np.arange(start, start + length)
        index = torch.from_numpy(gather)
        tensors = {key: torch.cat(values)[index] for key, values in chunks.items()}
        tensors.update(
            input_ids=torch.from_numpy(ids.astype(np.int32)),
            loss_mask=torch.from_numpy(mask.astype(np.uint8)),
            offsets=torch.from_numpy(offsets.astype(np.int64)),
            sample_index=torch.arange(first, stop, dtype=torch.int64),
        )
        return tensors

    @staticmethod
    def _first_non_finite(aux: torch.Tensor, last: torch.Tensor, lengths: np.ndarray) -> int:
        finite = torch.isfinite(aux).flatten(1).all(1) & torch.isfinite(last).all(1)
        first_bad_token = int((~finite).nonzero()[0, 0])
        return int(np.searchsorted(np.cumsum(lengths), first_bad_token, side="right"))


class ShardWriter:
    """A thread that writes finished shards (and refreshes the manifest) while the next one computes."""

    def __init__(self, store: Path, on_written: Any):
        self.store = store
        self.on_written = on_written
        self.queue: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE_DEPTH)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="eaglet-shard-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is None:
                try:
                    plan, tensors = item
                    self.on_written(write_shard(self.store, plan, tensors))
                except BaseException as exc:  # surfaced in the main thread
                    self.error = exc

    def submit(self, plan: ShardPlan, tensors: dict[str, torch.Tensor]) -> None:
        self.check()
        self.queue.put((plan, tensors))

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        self.check()


# ---------------------------------------------------------------------------------------------
# The stage


@dataclass
class ExtractResult:
    out: Path
    manifest: dict[str, Any]
    shards_computed: int
    tokens_computed: int
    seconds: float


def store_identity(config: ExtractConfig, info: Any, layers: tuple[int, ...], prepared: PreparedSet,
                   tokens_per_shard: int, model_dtype: str) -> dict[str, Any]:
    """Everything that decides the store's bytes; a resumed run must match it exactly."""
    return {
        "schema": STORE_SCHEMA,
        "target": {
            "name": info.name,
            "config_hash": info.config_hash,
            "tokenizer_hash": info.tokenizer_hash,
            "compute_dtype": model_dtype,
            "num_layers": info.num_layers,
            "hidden_size": info.hidden_size,
            "vocab_size": info.vocab_size,
        },
        "aux_layer_ids": list(layers),
        "aux_convention": AUX_CONVENTION,
        "prepared": {
            "path": str(prepared.path.resolve()),
            "manifest_sha256": prepared.manifest_sha256,
            "tokenizer_hash": prepared.manifest["target"]["tokenizer_hash"],
            "samples": len(prepared),
        },
        "storage_dtype": config.storage_dtype,
        "hidden_size": info.hidden_size,
        "tokens_per_shard": tokens_per_shard,
    }


def _check_resume(store: Path, identity: dict[str, Any]) -> None:
    existing = read_manifest(store)
    for key, value in identity.items():
        if existing.get(key) != value:
            raise EagletError(
                f"{store}: an existing store with different '{key}' ({existing.get(key)!r} vs {value!r}); "
                "use another --out, or delete it to start over"
            )


def _manifest(store: Path, identity: dict[str, Any], plans: list[ShardPlan], config: ExtractConfig) -> dict[str, Any]:
    records = [read_record(store, plan.index) for plan in plans]
    done = [r for r in records if r is not None]
    return identity | {
        "eaglet_version": __version__,
        "complete": len(done) == len(plans),
        "num_shards": len(plans),
        "totals": {"samples": sum(r["num_samples"] for r in done), "tokens": sum(r["tokens"] for r in done),
                   "bytes": sum(r["bytes"] for r in done)},
        "config": config.model_dump(exclude={"out", "device"}),
        "shards": done,
    }


def run_extract(config: ExtractConfig, console: Console | None = None, model: torch.nn.Module | None = None,
                only_shards: set[int] | None = None) -> ExtractResult:
    console = console or Console(stderr=True)
    dist = init_distributed()
    store = Path(config.out)
    prepared = load_prepared(config.prepared, config.max_samples)
    resolved = resolve_target(config.target, config.trust_remote_code)
    info = target_info(resolved, load_tokenizer(resolved.path, config.trust_remote_code))
    if prepared.manifest["target"]["tokenizer_hash"] != info.tokenizer_hash:
        raise EagletError(
            f"{config.prepared}: prepared with tokenizer of {prepared.manifest['target']['name']} "
            f"({prepared.manifest['target']['tokenizer_hash'][:12]}), but --target {config.target} has "
            f"{info.tokenizer_hash[:12]}; prepare again with this target"
        )
    layers = (validate_aux_layer_ids(config.layers, info.num_layers) if config.layers
              else default_aux_layer_ids(info.num_layers))
    per_token = bytes_per_token(info.hidden_size, config.storage_dtype)
    tokens_per_shard = max(1, int(config.shard_mb * 1e6 / per_token))
    plans = plan_shards(prepared.lengths, tokens_per_shard)
    device = dist.device(config.device)
    model_dtype = str(pick_dtype(config.dtype, device)).replace("torch.", "")
    identity = store_identity(config, info, layers, prepared, tokens_per_shard, model_dtype)

    if (store / MANIFEST_FILE).is_file():
        _check_resume(store, identity)
    todo_all = [p for p in plans if read_record(store, p.index) is None and (only_shards is None or p.index in only_shards)]
    mine = [p for p in todo_all if p.index % dist.world == dist.rank]
    _check_disk(store, sum(p.tokens for p in todo_all) * per_token, config.reserve_gb)
    if dist.is_main:
        store.mkdir(parents=True, exist_ok=True)
        write_json_atomic(store / MANIFEST_FILE, _manifest(store, identity, plans, config))
    dist.barrier()

    started = time.perf_counter()
    if mine:
        if model is None:
            model = load_model(resolved.path, device, config.dtype, config.trust_remote_code)
        batch_tokens = config.batch_tokens or (GPU_BATCH_TOKENS if device.startswith("cuda") else CPU_BATCH_TOKENS)
        extractor = ShardExtractor(model, layers, config.storage_dtype, batch_tokens)
        refresh = (lambda record: write_json_atomic(store / MANIFEST_FILE, _manifest(store, identity, plans, config))) \
            if dist.is_main and dist.world == 1 else (lambda record: None)
        writer = ShardWriter(store, refresh)
        with progress_bar("tok", console) as progress:
            task = progress.add_task(f"extract{'' if dist.world == 1 else f' rank {dist.rank}'}",
                                     total=sum(p.tokens for p in mine))
            try:
                for plan in mine:
                    writer.submit(plan, extractor(prepared, plan))
                    progress.advance(task, plan.tokens)
            finally:
                writer.close()
    seconds = time.perf_counter() - started
    dist.barrier()
    manifest = _manifest(store, identity, plans, config)
    if dist.is_main:
        write_json_atomic(store / MANIFEST_FILE, manifest)
    return ExtractResult(store, manifest, len(mine), sum(p.tokens for p in mine), seconds)


def _check_disk(store: Path, needed_bytes: int, reserve_gb: float) -> None:
    """Fail in seconds, before any model load, when the store cannot fit."""
    probe = store
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed_bytes + reserve_gb * GIB > free:
        raise EagletError(
            f"{store}: needs {needed_bytes / GIB:.2f} GiB (+ {reserve_gb:g} GiB reserve) but {free / GIB:.2f} GiB are free; "
            "free space, choose another --out, use --storage-dtype fp8 (half the size) or --max-samples"
        )
