"""What the trainer consumes: packed batches of features, offline (a store) or online (the live target).

An epoch is planned once, from the sample lengths alone: samples ordered by ``epoch_order`` (shards shuffled, then
samples within each shard), truncated to the token budget and packed greedily into micro-batches of at most that
many tokens (``plan_epoch``). A source then fetches the features of each planned micro-batch — a store reads its
shards (checked as they are read), the live target runs a forward — so online and offline training take the same
batches in the same order, and counting an epoch's batches costs no features. ``pad_to_budget`` fills a batch to
exactly the budget (one shape for compiled kernels).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..errors import EagletError
from ..formats.prepared import PreparedSet
from ..formats.store_manifest import ShardPlan, plan_shards, read_manifest, require_complete
from ..formats.target_record import TargetIdentity, require_same_target
from ..model.capture import FeatureCapture, batches_by_length, right_padded
from ..model.shards import ShardError, StoreReader, decode_features
from .prefetch import prefetched

PREFETCH_SHARDS = 2  # shards read (and checksummed) ahead of the batch being trained on
LIVE_FEATURE_DTYPE = torch.bfloat16  # live features are rounded as a bf16 store rounds them

SampleFilter = Callable[[int], bool]


@dataclass
class FeatureBatch:
    input_ids: torch.Tensor  # [T] int64, samples packed back to back
    loss_mask: torch.Tensor  # [T] uint8
    aux: torch.Tensor  # [T, 3, H]
    last: torch.Tensor  # [T, H], final-normed: teacher logits = lm_head(last)
    doc_offsets: torch.Tensor  # [n+1] int64, sample boundaries inside the batch
    sample_index: torch.Tensor  # [n] int64, rows of the prepared set
    # [T] int32: the target's argmax over its whole vocabulary at each token, where the store keeps it (else the
    # teacher computes it from ``last``)
    target_top: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())


def kept_length(length: int, token_budget: int) -> int:
    """Tokens of a sample that training sees: longer samples are cut to the budget."""
    return min(int(length), token_budget)


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


def plan_epoch(order: list[int], lengths: np.ndarray, token_budget: int) -> list[list[int]]:
    """Greedy packing of the samples in ``order``: a micro-batch closes when the next sample would overflow."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for sample in order:
        length = kept_length(lengths[sample], token_budget)
        if current and used + length > token_budget:
            groups.append(current)
            current, used = [], 0
        current.append(sample)
        used += length
    if current:
        groups.append(current)
    return groups


def assemble(pieces: list[tuple[int, dict[str, torch.Tensor]]], token_budget: int) -> FeatureBatch:
    """pieces: (sample index, {input_ids, loss_mask, aux, last[, target_top]} for that sample), each cut to the
    budget; the batch has ``target_top`` where every piece does."""
    cut = [{k: v[: kept_length(len(v), token_budget)] for k, v in piece.items()} for _, piece in pieces]
    lengths = torch.tensor([len(p["input_ids"]) for p in cut])
    top = all("target_top" in p for p in cut)
    return FeatureBatch(
        input_ids=torch.cat([p["input_ids"] for p in cut]).long(),
        loss_mask=torch.cat([p["loss_mask"] for p in cut]),
        aux=torch.cat([p["aux"] for p in cut]),
        last=torch.cat([p["last"] for p in cut]),
        doc_offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        sample_index=torch.tensor([index for index, _ in pieces], dtype=torch.int64),
        target_top=torch.cat([p["target_top"] for p in cut]) if top else None,
    )


def non_finite_samples(batch: FeatureBatch) -> list[int]:
    """The batch's samples (prepared-set rows) with a non-finite feature value."""
    bad_token = ~(torch.isfinite(batch.aux).flatten(1).all(1) & torch.isfinite(batch.last).all(1))  # [T]
    documents = torch.bucketize(torch.arange(batch.tokens), batch.doc_offsets[1:], right=True)  # [T] doc of each token
    rows = torch.unique(documents[bad_token[: batch.tokens]]).tolist()
    return [int(batch.sample_index[row]) for row in rows if row < len(batch.sample_index)]


def pad_to_budget(batch: FeatureBatch, budget: int, pin: bool = False) -> FeatureBatch:
    """Fill the packed batch up to exactly ``budget`` tokens with one padding document (loss-masked,
    attending only to itself), so every step has the same shapes: compiled kernels and block masks
    are built once instead of once per batch length. ``pin``: written straight into pinned memory (one
    copy), ready for a non-blocking copy to the GPU."""
    missing = budget - batch.tokens
    if missing <= 0 and not pin:
        return batch

    def padded(tensor: torch.Tensor) -> torch.Tensor:  # [tokens, ...] -> [max(budget, tokens), ...], zeros after
        out = torch.empty((max(budget, len(tensor)), *tensor.shape[1:]), dtype=tensor.dtype, pin_memory=pin)
        out[: len(tensor)] = tensor
        out[len(tensor) :] = 0
        return out

    return FeatureBatch(
        input_ids=padded(batch.input_ids),
        loss_mask=padded(batch.loss_mask),
        aux=padded(batch.aux),
        last=padded(batch.last),
        doc_offsets=torch.cat([batch.doc_offsets, torch.tensor([budget])]) if missing > 0 else batch.doc_offsets,
        sample_index=batch.sample_index,
        target_top=None if batch.target_top is None else padded(batch.target_top),
    )


class FeatureSource:
    """A set of samples (``plans``: shards of sample indices, ``lengths`` per sample) whose epochs are planned once
    and whose features a subclass fetches per planned micro-batch."""

    plans: list[ShardPlan]
    lengths: dict[int, int] | np.ndarray
    token_budget: int
    seed: int
    hidden_size: int
    layer_ids: tuple[int, ...]
    keeps_target_top: bool = False  # every batch carries the target's argmax (a store that keeps it)

    def plan(self, epoch: int, select: SampleFilter | None = None) -> list[list[int]]:
        return plan_epoch(epoch_order(self.plans, self.seed, epoch, select), self.lengths, self.token_budget)

    def batches(self, epoch: int, select: SampleFilter | None = None) -> Iterator[FeatureBatch]:
        return self.fetch(self.plan(epoch, select))

    def fetch(self, groups: list[list[int]]) -> Iterator[FeatureBatch]:
        raise NotImplementedError

    def origin(self, sample: int) -> str:
        """Where a sample's features come from, for an error line."""
        raise NotImplementedError

    def repair_hint(self) -> str:
        """What to do about damaged features from this source."""
        raise NotImplementedError


class StoreSource(FeatureSource):
    """Streams a store's shards (a prefetch thread reads ahead) in the planned order, every read through
    ``StoreReader``: the shard list, each shard's size, layout and samples are checked when the source opens
    (headers and two small tensors: seconds), each shard's sha256 and content as it is read, before anything of it
    is trained on. With its ``prepared`` set, shards must hold exactly their planned samples, ids and masks."""

    def __init__(
        self,
        store: str | Path,
        token_budget: int,
        seed: int = 0,
        expect_target: TargetIdentity | None = None,
        prepared: PreparedSet | None = None,
        manifest: dict[str, Any] | None = None,  # the store's, when the caller has read it already
    ):
        self.store = Path(store)
        self.manifest = manifest or read_manifest(self.store)
        require_complete(self.store, self.manifest)
        if expect_target is not None:
            require_same_target(
                expect_target,
                self.manifest["target"],
                f"store {store}",
                "extracted from",
                "use the matching target or re-extract",
            )
        self.prepared = prepared
        self.reader = StoreReader(self.store, self.manifest, prepared)
        self.keeps_target_top = self.reader.target_top
        self.hidden_size = self.manifest["hidden_size"]
        self.lengths = {}
        self.plans = [self._open(entry) for entry in self.manifest["shards"]]
        self.by_index = {s["index"]: s for s in self.manifest["shards"]}
        self.shard_of = {sample: plan.index for plan in self.plans for sample in plan.samples}
        self.token_budget = token_budget
        self.seed = seed
        self.layer_ids = tuple(self.manifest["aux_layer_ids"])

    def _damaged(self, entry: dict, reason: str) -> EagletError:
        return EagletError(f"{self.store / entry['file']}: {reason}; {self.repair_hint()}")

    def repair_hint(self) -> str:
        return f"run `eaglet store verify {self.store} --repair` to re-extract the damaged shards"

    def origin(self, sample: int) -> str:
        shard = self.by_index[self.shard_of[sample]]["file"] if sample in self.shard_of else "no shard"
        name = f" ({self.prepared.ids[sample]!r})" if self.prepared is not None else ""
        return f"{self.store / shard} sample {sample}{name}"

    def _open(self, entry: dict) -> ShardPlan:
        """The shard's samples and their lengths, from its header, index and offsets (checked on the way)."""
        try:
            samples, offsets = self.reader.open(entry)
        except ShardError as exc:
            raise self._damaged(entry, str(exc)) from None
        for row, sample in enumerate(samples):
            if sample in self.lengths:
                raise self._damaged(entry, f"sample {sample} is also in another shard")
            self.lengths[sample] = offsets[row + 1] - offsets[row]
        return ShardPlan(entry["index"], tuple(samples), entry["tokens"])

    def _shard_samples(self, index: int) -> dict[int, dict[str, torch.Tensor]]:
        entry = self.by_index[index]
        try:
            tensors = self.reader.read(entry)
        except ShardError as exc:
            raise self._damaged(entry, str(exc)) from None
        aux, last = decode_features(
            tensors, torch.bfloat16 if tensors["aux"].dtype == torch.bfloat16 else torch.float32
        )
        offsets = tensors["offsets"].tolist()
        samples = {}
        for row, sample in enumerate(tensors["sample_index"].tolist()):
            begin, end = offsets[row], offsets[row + 1]
            samples[sample] = {
                "input_ids": tensors["input_ids"][begin:end],
                "loss_mask": tensors["loss_mask"][begin:end],
                "aux": aux[begin:end],
                "last": last[begin:end],
            }
            if "target_top" in tensors:
                samples[sample]["target_top"] = tensors["target_top"][begin:end]
        return samples

    def fetch(self, groups: list[list[int]]) -> Iterator[FeatureBatch]:
        """The planned micro-batches; shards read in order of first use, a damaged one's error raised at it."""
        sequence = list(dict.fromkeys(self.shard_of[s] for group in groups for s in group))
        loaded = prefetched(iter(sequence), lambda shard: (shard, self._shard_samples(shard)), PREFETCH_SHARDS)
        pieces: dict[int, dict[str, torch.Tensor]] = {}
        try:
            for group in groups:
                for sample in group:
                    while sample not in pieces:
                        _, samples = next(loaded)
                        pieces.update(samples)
                yield assemble([(sample, pieces.pop(sample)) for sample in group], self.token_budget)
        finally:
            loaded.close()  # stops the reading thread when training stops early


class FeatureCache:
    """Live features kept in host memory for later epochs, up to ``budget_bytes``: after the first epoch an online
    step costs what an offline one does. Features are rounded as a store rounds them (bf16), computed or cached
    alike."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.samples: dict[int, dict[str, torch.Tensor]] = {}

    def get(self, sample: int) -> dict[str, torch.Tensor] | None:
        return self.samples.get(sample)

    def put(self, sample: int, features: dict[str, torch.Tensor]) -> None:
        size = sum(tensor.numel() * tensor.element_size() for tensor in features.values())
        if self.used_bytes + size <= self.budget_bytes:
            self.samples[sample] = features
            self.used_bytes += size


class LiveSource(FeatureSource):
    """The target computes the features of each planned micro-batch, the same batches a store would give; each
    sample's features are computed once and kept (``FeatureCache``) while they fit."""

    def __init__(
        self,
        prepared: PreparedSet,
        model: torch.nn.Module,
        layer_ids: tuple[int, ...],
        token_budget: int,
        tokens_per_shard: int,
        seed: int = 0,
        forward_tokens: int = 4096,
        cache_bytes: int = 0,
    ):
        self.prepared = prepared
        self.capture = FeatureCapture(model, layer_ids)
        self.plans = plan_shards(prepared.lengths, tokens_per_shard)
        self.lengths = prepared.lengths
        self.token_budget = token_budget
        self.seed = seed
        self.forward_tokens = forward_tokens
        self.hidden_size = model.config.hidden_size
        self.layer_ids = tuple(layer_ids)
        self.cache = FeatureCache(cache_bytes)
        self.computed = 0  # samples whose features the target computed: what the cache saves
        # training's prefetch thread and the held-out evaluation fetch at once: the cache's books are kept under it
        self.bookkeeping = threading.Lock()

    def origin(self, sample: int) -> str:
        return f"{self.prepared.path} sample {sample} ({self.prepared.ids[sample]!r})"

    def repair_hint(self) -> str:
        return "the target computed them: check its dtype (--set precision=fp32) and weights"

    def fetch(self, groups: list[list[int]]) -> Iterator[FeatureBatch]:
        for group in groups:
            missing = [sample for sample in group if self.cache.get(sample) is None]
            computed = dict(zip(missing, self._features_many(missing))) if missing else {}
            with self.bookkeeping:
                self.computed += len(computed)
                for sample, features in computed.items():
                    self.cache.put(sample, features)
            yield assemble(
                [(sample, computed.get(sample) or self.cache.get(sample)) for sample in group], self.token_budget
            )

    def _features_many(self, samples: list[int]) -> list[dict[str, torch.Tensor]]:
        """The samples' features on the host in the store's dtype, from length-bucketed target forwards."""
        lengths = np.array([kept_length(self.lengths[s], self.token_budget) for s in samples])
        out: list[dict[str, torch.Tensor] | None] = [None] * len(samples)
        for batch in batches_by_length(lengths, self.forward_tokens):
            ids_of = lambda position: self.prepared.sample(samples[position])[0]  # noqa: E731
            padded = torch.from_numpy(right_padded(ids_of, lengths, batch))
            aux, last = (tensor.to(LIVE_FEATURE_DTYPE).cpu() for tensor in self.capture(padded))
            for row, position in enumerate(batch.tolist()):
                length = int(lengths[position])
                ids, mask = self.prepared.sample(samples[position])
                out[position] = {
                    "input_ids": torch.from_numpy(ids[:length].astype(np.int64)),
                    "loss_mask": torch.from_numpy(mask[:length].astype(np.uint8)),
                    "aux": aux[row, :length].clone(),
                    "last": last[row, :length].clone(),
                }
        return out  # type: ignore[return-value]
