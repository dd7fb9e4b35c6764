"""Feature sources: what the trainer consumes, offline (a store) or online (the live target).

Both yield the same ``FeatureBatch``es for the same seed and epoch: samples are ordered by
``epoch_order`` (shards shuffled, then samples within each shard) and packed greedily into a fixed
token budget. So online and offline training share one code path and one data order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol

import numpy as np
import torch

from .capture import FeatureCapture
from .data.prepared import PreparedSet
from .errors import EagletError
from .extract import batches_by_length
from .prefetch import prefetched
from .store import (ShardError, ShardPlan, check_layout, check_same_target, decode_features, plan_shards, read_header,
                    read_manifest, read_shard, read_tensor)

PREFETCH_SHARDS = 2


@dataclass
class FeatureBatch:
    input_ids: torch.Tensor  # [T] int64, samples packed back to back
    loss_mask: torch.Tensor  # [T] uint8
    aux: torch.Tensor  # [T, 3, H]
    last: torch.Tensor  # [T, H], final-normed: teacher logits = lm_head(last)
    doc_offsets: torch.Tensor  # [n+1] int64, sample boundaries inside the batch
    sample_index: torch.Tensor  # [n] int64, rows of the prepared set

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())


SampleFilter = Callable[[int], bool]


class FeatureSource(Protocol):
    hidden_size: int
    layer_ids: tuple[int, ...]

    def batches(self, epoch: int, select: SampleFilter | None = None) -> Iterator[FeatureBatch]: ...


def epoch_order(plans: list[ShardPlan], seed: int, epoch: int, select: SampleFilter | None = None) -> list[int]:
    """Sample indices for an epoch: shard order shuffled, samples shuffled within each shard;
    ``select`` keeps a subset (a train/held-out split)."""
    rng = np.random.default_rng([seed, epoch])
    order: list[int] = []
    for shard in rng.permutation(len(plans)).tolist():
        plan = plans[shard]
        order.extend(np.asarray(plan.samples)[rng.permutation(plan.num_samples)].tolist())
    return [s for s in order if select(s)] if select is not None else order


def held_out(sample: int, seed: int, fraction: float) -> bool:
    """A fixed pseudo-random split of sample indices (independent of the epoch)."""
    return float(np.random.default_rng([seed, sample, 7]).random()) < fraction


def pack_stream(items: Iterable[tuple[int, int]], token_budget: int) -> Iterator[list[int]]:
    """Greedy packing of (sample, length) in order: a batch closes when the next sample would overflow."""
    current: list[int] = []
    used = 0
    for index, length in items:
        length = min(length, token_budget)  # longer samples are truncated to the budget
        if current and used + length > token_budget:
            yield current
            current, used = [], 0
        current.append(index)
        used += length
    if current:
        yield current


def _assemble(pieces: list[tuple[int, dict[str, torch.Tensor]]], token_budget: int) -> FeatureBatch:
    """pieces: (sample index, {input_ids, loss_mask, aux, last} for that sample)."""
    cut = [{k: v[:token_budget] for k, v in piece.items()} for _, piece in pieces]
    lengths = torch.tensor([len(p["input_ids"]) for p in cut])
    return FeatureBatch(
        input_ids=torch.cat([p["input_ids"] for p in cut]).long(),
        loss_mask=torch.cat([p["loss_mask"] for p in cut]),
        aux=torch.cat([p["aux"] for p in cut]),
        last=torch.cat([p["last"] for p in cut]),
        doc_offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        sample_index=torch.tensor([index for index, _ in pieces], dtype=torch.int64),
    )


class StoreSource:
    """Streams a store's shards (a prefetch thread reads ahead) in the epoch's order. The shard list, each shard's
    size and tensor layout are checked against the manifest when the source opens (headers only: seconds), and each
    shard's sha256 as it is read, before anything of it is trained on."""

    def __init__(self, store: str | Path, token_budget: int, seed: int = 0, expect_target: dict | None = None):
        self.store = Path(store)
        self.manifest = read_manifest(self.store)
        if not self.manifest["complete"]:
            raise EagletError(f"{store}: extraction incomplete; run the same `eaglet extract` command again to finish it")
        if expect_target is not None:
            check_same_target(self.manifest, expect_target, f"store {store}")
        self.hidden_size = self.manifest["hidden_size"]
        self.plans = [ShardPlan(entry["index"], self._sample_index(entry), entry["tokens"])
                      for entry in self.manifest["shards"]]
        self.by_index = {s["index"]: s for s in self.manifest["shards"]}
        self.token_budget = token_budget
        self.seed = seed
        self.layer_ids = tuple(self.manifest["aux_layer_ids"])

    def _damaged(self, entry: dict, reason: str) -> EagletError:
        return EagletError(f"{self.store / entry['file']}: {reason}; run `eaglet store verify {self.store} --repair` "
                           "to re-extract the damaged shards")

    def _sample_index(self, entry: dict) -> tuple[int, ...]:
        """The shard's samples, read from its header and index tensor (its layout checked on the way)."""
        path = self.store / entry["file"]
        try:
            if path.stat().st_size != entry["bytes"]:
                raise ShardError(f"size {path.stat().st_size} bytes, the manifest says {entry['bytes']}")
            check_layout(read_header(path), entry, self.hidden_size)
            return tuple(read_tensor(path, "sample_index").tolist())
        except FileNotFoundError:
            raise self._damaged(entry, "file missing") from None
        except ShardError as exc:
            raise self._damaged(entry, str(exc)) from None

    def _shard_samples(self, index: int) -> dict[int, dict[str, torch.Tensor]]:
        entry = self.by_index[index]
        try:
            tensors = read_shard(self.store, entry)
            check_layout({k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, entry, self.hidden_size)
        except ShardError as exc:
            raise self._damaged(entry, str(exc)) from None
        aux, last = decode_features(tensors, torch.bfloat16 if tensors["aux"].dtype == torch.bfloat16 else torch.float32)
        offsets = tensors["offsets"].tolist()
        samples = {}
        for row, sample in enumerate(tensors["sample_index"].tolist()):
            begin, end = offsets[row], offsets[row + 1]
            samples[sample] = {"input_ids": tensors["input_ids"][begin:end], "loss_mask": tensors["loss_mask"][begin:end],
                               "aux": aux[begin:end], "last": last[begin:end]}
        return samples

    def _prefetched(self, shards: list[int]) -> Iterator[tuple[int, dict[int, dict[str, torch.Tensor]]]]:
        """Shards in the given order, read (and checked) ahead by a background thread; a damaged shard's error is
        raised here, at that shard."""
        return prefetched(iter(shards), lambda shard: (shard, self._shard_samples(shard)), PREFETCH_SHARDS)

    def batches(self, epoch: int, select: SampleFilter | None = None) -> Iterator[FeatureBatch]:
        order = epoch_order(self.plans, self.seed, epoch, select)
        by_shard: dict[int, list[int]] = {plan.index: [] for plan in self.plans}
        shard_of = {s: p.index for p in self.plans for s in p.samples}
        for sample in order:
            by_shard[shard_of[sample]].append(sample)
        shard_sequence = list(dict.fromkeys(shard_of[s] for s in order))
        pieces: dict[int, dict[str, torch.Tensor]] = {}

        def stream() -> Iterator[tuple[int, int]]:
            for shard, samples in self._prefetched(shard_sequence):
                for sample in by_shard[shard]:
                    pieces[sample] = samples[sample]
                    yield sample, len(samples[sample]["input_ids"])

        for group in pack_stream(stream(), self.token_budget):
            yield _assemble([(sample, pieces.pop(sample)) for sample in group], self.token_budget)


class LiveSource:
    """The target computes features on the fly for the same batches a store would give."""

    def __init__(self, prepared: PreparedSet, model: torch.nn.Module, layer_ids: tuple[int, ...], token_budget: int,
                 tokens_per_shard: int, seed: int = 0, forward_tokens: int = 4096):
        self.prepared = prepared
        self.capture = FeatureCapture(model, layer_ids)
        self.device = next(model.parameters()).device
        self.plans = plan_shards(prepared.lengths, tokens_per_shard)
        self.token_budget = token_budget
        self.seed = seed
        self.forward_tokens = forward_tokens
        self.hidden_size = model.config.hidden_size
        self.layer_ids = tuple(layer_ids)

    def batches(self, epoch: int, select: SampleFilter | None = None) -> Iterator[FeatureBatch]:
        order = epoch_order(self.plans, self.seed, epoch, select)
        lengths = self.prepared.lengths
        for group in pack_stream(((s, int(lengths[s])) for s in order), self.token_budget):
            yield _assemble(list(zip(group, self._features_many(group))), self.token_budget)

    def _features_many(self, samples: list[int]) -> list[dict[str, torch.Tensor]]:
        lengths = np.array([min(len(self.prepared.sample(s)[0]), self.token_budget) for s in samples])
        out: list[dict[str, torch.Tensor] | None] = [None] * len(samples)
        for batch in batches_by_length(lengths, self.forward_tokens):
            width = int(lengths[batch].max())
            padded = torch.zeros((len(batch), width), dtype=torch.long)
            for row, position in enumerate(batch.tolist()):
                ids, _ = self.prepared.sample(samples[position])
                padded[row, : lengths[position]] = torch.from_numpy(ids[: lengths[position]].astype(np.int64))
            aux, last = self.capture(padded.to(self.device))
            for row, position in enumerate(batch.tolist()):
                length = int(lengths[position])
                ids, mask = self.prepared.sample(samples[position])
                out[position] = {"input_ids": torch.from_numpy(ids[:length].astype(np.int64)),
                                 "loss_mask": torch.from_numpy(mask[:length].astype(np.uint8)),
                                 "aux": aux[row, :length], "last": last[row, :length]}
        return out  # type: ignore[return-value]
