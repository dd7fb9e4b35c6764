"""`eaglet extract --backend vllm`: a shard's features from vLLM's hidden-state capture, stored as the hf backend stores them.

The main thread runs one shard's requests through vLLM (``model.vllm_engine``); the writer thread that takes the shard
waits for its spool file (vLLM's worker fills it, ``model.vllm_rows``), forms ``aux`` (the aux columns in eaglet's
order) and ``last`` (the final norm over the last layer's output), encodes them with the store's format and writes the
shard, while vLLM computes the next one.
The shard's other tensors (ids, mask, offsets, sample index) and its order are the hf backend's, so a store from
either backend is the same format, resumed and trained on the same way.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import EagletError
from ..formats.prepared import PreparedSet
from ..formats.store_manifest import ShardPlan
from ..model.shards import encode_features
from ..model.vllm_engine import SPOOL_WAIT_S, HiddenStateEngine, aux_columns
from ..model.vllm_rows import SPOOL_SUFFIX, read_rows, wait_for_rows


@dataclass
class SpooledShard:
    """A shard whose features are still in vLLM's spool file: ``wait()`` (in a writer thread) fills ``tensors``."""

    plan: ShardPlan
    tensors: dict[str, torch.Tensor]  # ids, mask, offsets, sample index now; the features after wait()
    spool: Path  # the shard's rows, written by vLLM's worker
    layers: int  # captured layers: the aux ids ascending, then the last layer's output
    hidden_size: int
    dtype: torch.dtype  # vLLM's compute dtype, the spool's
    sample_ids: list[str]
    columns: list[int]  # the aux ids' captured columns, in eaglet's order
    norm: nn.Module
    storage_dtype: str
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # no recycled buffers: nothing to release
    phases: dict[str, float] = field(default_factory=dict)  # seconds of wait(): vLLM's worker, reading, forming

    @torch.inference_mode()
    def wait(self) -> None:
        started = time.perf_counter()
        wait_for_rows(self.spool, SPOOL_WAIT_S)
        written = time.perf_counter()
        total = len(self.tensors["input_ids"])
        rows = read_rows(self.spool, total, self.layers, self.hidden_size, self.dtype)
        self.spool.unlink()  # its mapping stays readable until the tensors go
        if not torch.equal(rows.token_ids, self.tensors["input_ids"]):
            raise EagletError(
                f"{self.spool}: vLLM's hidden states are for other tokens than the shard's; extract again"
            )
        device = next(self.norm.parameters()).device
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            hidden = rows.hidden.to(device, non_blocking=True)  # [T, 4, H]: three aux layers ascending, then the last
            read = time.perf_counter()
            aux = hidden[:, self.columns]  # [T, 3, H]
            last = self.norm(hidden[:, -1])  # [T, H]
            finite = torch.isfinite(aux).flatten(1).all(1) & torch.isfinite(last).all(1)
            encoded = encode_features(aux, last, self.storage_dtype)
            host = {name: value.to("cpu") for name, value in encoded.items()}
            finite = finite.to("cpu")
        self.phases = {
            "spool_wait": written - started,
            "spool_read": read - written,
            "form": time.perf_counter() - read,
        }
        if not bool(finite.all()):
            token = int((~finite).int().argmax())
            row = int(np.searchsorted(self.tensors["offsets"].numpy(), token, side="right")) - 1
            raise EagletError(
                f"non-finite features for sample {self.sample_ids[row]!r}; check the target's dtype and weights"
            )
        self.tensors.update(host)


class VllmShardExtractor:
    """One shard's requests through vLLM; the features are formed by whoever waits on the returned shard."""

    def __init__(self, engine: HiddenStateEngine, norm: nn.Module, layer_ids: tuple[int, ...], storage_dtype: str):
        self.engine = engine
        self.norm = norm
        self.columns = aux_columns(layer_ids)
        self.storage_dtype = storage_dtype

    def release(self, buffers: dict[str, torch.Tensor]) -> None:
        """Nothing is recycled: each shard's host tensors are its own."""

    def __call__(self, prepared: PreparedSet, plan: ShardPlan) -> SpooledShard:
        samples = np.asarray(plan.samples)
        rows = [prepared.sample(int(s)) for s in samples]
        tokens = [ids for ids, _ in rows]
        settings = self.engine.settings
        spool = self.engine.run([ids.tolist() for ids in tokens], f"shard-{plan.index:05d}{SPOOL_SUFFIX}")
        lengths = np.array([len(ids) for ids in tokens])
        tensors = {
            "input_ids": torch.from_numpy(np.concatenate(tokens).astype(np.int32)),
            "loss_mask": torch.from_numpy(np.concatenate([mask for _, mask in rows]).astype(np.uint8)),
            "offsets": torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)),
            "sample_index": torch.from_numpy(samples.astype(np.int64)),
        }
        return SpooledShard(
            plan,
            tensors,
            spool,
            len(self.columns) + 1,
            settings.hidden_size,
            getattr(torch, settings.dtype),
            [prepared.ids[int(s)] for s in samples],
            self.columns,
            self.norm,
            self.storage_dtype,
        )
