"""What a training run is built from: its data (a store, or a prepared set and the live target), the draft
initialised from the target, the teacher head, the TTT module wrapped for DDP/FSDP2, the optimizer, and how many
steps the run takes with which learning rate."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..config import TrainConfig
from ..data.vocab import DraftVocab
from ..errors import EagletError, shown
from ..formats.draft_config import (
    DEFAULT_EAGLE_VERSION,
    EAGLE_VARIANTS,
    EMBEDDING_TENSOR,
    DraftConfig,
    StoredDraft,
    draft_norms,
    norms_version,
)
from ..formats.files import DRAFT_WEIGHTS_FILE
from ..formats.layers import resolve_aux_layer_ids
from ..formats.prepared import PreparedSet, load_prepared
from ..formats.start_draft import read_start_draft
from ..formats.store_manifest import ShardPlan, check_store_counts, prepared_path, read_manifest, require_complete
from ..formats.target_record import TargetIdentity, require_same_target, stage_target
from ..fsio import sha256_file
from ..model.distributed import Dist
from ..model.draft import Eagle3Draft
from ..model.sizing import GIB
from ..model.target import (
    load_head_weights,
    load_model,
    load_tokenizer,
    read_config,
    resolve_target,
    target_info,
    target_record,
)
from .data import FeatureSource, LiveSource, StoreSource, held_out, kept_length
from .loss import TeacherHead
from .parallel import Parallel
from .ttt import TTTModule


@dataclass
class Setup:
    source: FeatureSource
    plans: list[ShardPlan]
    lengths: np.ndarray  # every prepared sample's length
    vocab: DraftVocab
    layer_ids: tuple[int, ...]
    identity: dict[str, Any]  # what a checkpoint must match
    target_record: dict[str, Any]  # the draft's record of its target: identity + how to find and name it
    target_path: Path
    target_config: dict[str, Any]
    norms: dict[str, bool]  # the draft's EAGLE norm settings (--eagle-version's, or the start draft's)
    start: StoredDraft | None  # the draft --init-from names
    eval_source: FeatureSource | None = None  # a separate held-out store, when given
    budget_cut: tuple[str, str] | None = None  # (why, fix) where --token-budget cuts trainable tokens off samples

    def train_select(self, config: TrainConfig) -> Callable[[int], bool] | None:
        return training_samples(config)

    def evaluates(self, config: TrainConfig) -> bool:
        return self.eval_source is not None or config.eval_fraction > 0

    @property
    def argmax_stored(self) -> bool:
        """Every batch, trained on or held out, carries the target's argmax: the teacher needs only the LM head's
        draft-vocabulary rows (a 128k-vocabulary target's whole head is 1 GB in bf16 at hidden 4096)."""
        sources = [self.source] + ([self.eval_source] if self.eval_source is not None else [])
        return all(source.keeps_target_top for source in sources)


def build_setup(config: TrainConfig, device: str) -> Setup:
    if (config.store is None) == (config.prepared is None):
        raise EagletError("train needs exactly one input: --store STORE (offline) or --prepared DIR (online)")
    target = stage_target(config)
    resolved = resolve_target(target, config.trust_remote_code)
    info = target_info(resolved, load_tokenizer(resolved.path, config.trust_remote_code))
    identity = info.identity
    source: FeatureSource
    if config.store is not None:
        source, prepared = open_store(Path(config.store), identity, config, "store")
        vocab = DraftVocab.load(config.draft_vocab_file or prepared.vocab_path)
        layer_ids = source.layer_ids
        if config.layers and tuple(config.layers) != layer_ids:
            raise EagletError(
                f"{config.store}: extracted with aux layers {list(layer_ids)}, --layers asks for "
                f"{config.layers}; drop --layers or extract again with --layers"
            )
    else:
        prepared = load_prepared(config.prepared)
        require_same_target(
            identity,
            prepared.manifest["target"],
            str(config.prepared),
            "prepared with",
            f"prepare again with --target {target}",
            tokenizer_only=True,
        )
        vocab = DraftVocab.load(config.draft_vocab_file or prepared.vocab_path)  # before the target loads
        layer_ids = resolve_aux_layer_ids(config.layers, info.num_layers)
        if config.placement == "tp":
            raise EagletError(
                "online training runs the target in the training processes, which cannot also be its "
                "tensor-parallel group; extract a store with `torchrun ... eaglet extract --placement tp`"
                " and train on it, or use --placement split"
            )
    start = None
    if config.init_from is not None:  # before the online target loads: known from files alone
        start = read_start_draft(
            config.init_from, info, layer_ids, vocab.size, config.draft_layers, config.eagle_version
        )
    norms = draft_norms(start.config) if start else EAGLE_VARIANTS[config.eagle_version or DEFAULT_EAGLE_VERSION]
    covered = samples_of(source) if config.store else None  # a store made with --max-samples: its first samples
    budget_cut = check_trainable(prepared, config, covered)
    # before the online target loads: a bad eval store is known from files alone
    eval_source = open_eval_store(config, identity, layer_ids, prepared, covered)
    if config.store is None:
        model = load_model(resolved.path, device, "auto", config.trust_remote_code, config)
        source = LiveSource(
            prepared,
            model,
            layer_ids,
            config.token_budget,
            config.online_chunk_tokens,
            config.seed,
            config.online_forward_tokens,
            int(config.online_cache_gb * GIB),
        )
    run_identity = {
        "target": identity.to_record(),
        "layer_ids": list(layer_ids),
        "draft_vocab_size": vocab.size,
        "draft_layers": config.draft_layers,
        "eagle_version": norms_version(norms),
        "init_from": sha256_file(Path(config.init_from) / DRAFT_WEIGHTS_FILE) if config.init_from else None,
        "ttt_steps": config.ttt_steps,
        "token_budget": config.token_budget,
        "seed": config.seed,
        "input": "store" if config.store else "online",
        "eval_fraction": config.eval_fraction,
    }
    return Setup(
        source,
        source.plans,
        prepared.lengths,
        vocab,
        layer_ids,
        run_identity,
        identity.to_record() | target_record(resolved, info),
        resolved.path,
        read_config(resolved.path),
        norms,
        start,
        eval_source,
        budget_cut,
    )


def open_store(
    store: Path, identity: TargetIdentity, config: TrainConfig, what: str
) -> tuple[StoreSource, PreparedSet]:
    """A complete store of this target with its prepared set (unchanged since extraction, the same samples), as a
    source whose every shard read is checked against that set."""
    manifest = read_manifest(store)  # read once: the source below takes it
    require_same_target(
        identity, manifest["target"], f"{what} {store}", "extracted from", "use the matching target or re-extract"
    )
    require_complete(store, manifest)
    prepared = load_prepared(prepared_path(store, manifest))
    if prepared.manifest_sha256 != manifest["prepared"]["manifest_sha256"]:
        raise EagletError(f"{store}: its prepared set {prepared.path} changed since extraction; re-extract")
    check_store_counts(store, manifest, prepared)
    return StoreSource(store, config.token_budget, config.seed, prepared=prepared, manifest=manifest), prepared


def open_eval_store(
    config: TrainConfig,
    identity: TargetIdentity,
    layer_ids: tuple[int, ...],
    training: PreparedSet,
    trained: int | None,
) -> StoreSource | None:
    """The separate held-out store, if given: this target's, the training's aux layers, and none of the first
    ``trained`` training samples (all of them by default) among its own."""
    if config.eval_store is None:
        return None
    eval_source, held_out = open_store(Path(config.eval_store), identity, config, "eval store")
    if eval_source.layer_ids != layer_ids:
        raise EagletError(
            f"eval store {config.eval_store}: aux layers {list(eval_source.layer_ids)}, training uses {list(layer_ids)}"
        )
    check_held_out_apart(config, training, len(training) if trained is None else trained, held_out, eval_source)
    return eval_source


def samples_of(source: FeatureSource) -> int:
    """How many prepared samples a source covers (a store made with --max-samples covers the first ones)."""
    return sum(plan.num_samples for plan in source.plans)


def check_held_out_apart(
    config: TrainConfig, training: PreparedSet, trained: int, held_out: PreparedSet, eval_source: FeatureSource
) -> None:
    """Refuse an eval store holding a training sample (the same token ids, whatever its id or file): its held-out
    accuracy and τ would be partly training numbers, and the user picks checkpoints by them."""
    evaluated = samples_of(eval_source)
    seen = {digest: index for index, digest in enumerate(training.sample_digests(trained))}
    shared = [
        (index, seen[digest]) for index, digest in enumerate(held_out.sample_digests(evaluated)) if digest in seen
    ]
    if shared:
        first, twin = shared[0]
        raise EagletError(
            f"eval store {config.eval_store}: {len(shared):,} of its {evaluated:,} samples are training samples "
            f"(first: {shown(held_out.ids[first])}, trained as {shown(training.ids[twin])}); extract the eval store "
            "from prompts the training never sees, or drop --eval-store (--eval-fraction holds samples out)"
        )


def training_samples(config: TrainConfig) -> Callable[[int], bool] | None:
    """The training samples: all but the held-out fraction (unless a separate held-out store is given)."""
    if config.eval_fraction > 0 and config.eval_store is None:
        return lambda sample: not held_out(sample, config.seed, config.eval_fraction)
    return None


def trainable_tokens(prepared: PreparedSet) -> np.ndarray:
    """[N] loss-masked tokens per sample, summed in one pass over the set's mask (an empty sample holds none)."""
    if not len(prepared.mask):
        return np.zeros(len(prepared), dtype=np.int64)
    starts = np.minimum(prepared.offsets[:-1], len(prepared.mask) - 1)  # reduceat needs indices inside the array
    return np.add.reduceat(prepared.mask, starts, dtype=np.int64) * (prepared.lengths > 0)


def check_trainable(prepared: PreparedSet, config: TrainConfig, samples: int | None = None) -> tuple[str, str] | None:
    """Refuse a set whose training samples hold no loss-masked token within the tokens training sees (a sample is
    cut to --token-budget): it would train at loss 0 and ship an untrained draft. Where the cut drops some of them:
    (why, fix) for a warning."""
    count = len(prepared) if samples is None else samples
    select = training_samples(config)
    trained = [sample for sample in range(count) if select is None or select(sample)]
    if not trained:
        raise EagletError(
            f"{prepared.path}: --eval-fraction {config.eval_fraction} holds out all {count:,} of its samples, "
            "leaving none to train on; lower --eval-fraction, or give a held-out set with --eval-store"
        )
    index = np.asarray(trained)
    total = int(trainable_tokens(prepared)[index].sum())
    if not total:
        raise EagletError(
            f"{prepared.path}: none of its {len(trained):,} training samples has a trainable token (every loss "
            "mask is 0); prepare conversations with assistant answers"
        )
    budget = config.token_budget
    cut = index[prepared.lengths[index] > budget]  # samples training sees only the first `budget` tokens of
    lost = sum(int(prepared.sample(sample)[1][budget:].sum()) for sample in cut.tolist())
    if not lost:
        return None
    longest = int(prepared.lengths[cut].max())
    if lost == total:
        raise EagletError(
            f"{prepared.path}: --token-budget {budget:,} cuts every training sample before its first trainable token "
            f"(training sees a sample's first {budget:,} tokens; the longest is {longest:,}); raise --token-budget to "
            f"{longest:,}"
        )
    return (
        f"--token-budget {budget:,} cuts {len(cut):,} of {len(trained):,} training samples (the longest {longest:,} "
        f"tokens): {lost / total:.1%} of the trainable tokens are never trained on",
        f"raise --token-budget to {longest:,}, or prepare with --max-len {budget:,}",
    )


@dataclass
class Model:
    """The draft and everything that trains it."""

    draft: Eagle3Draft
    module: TTTModule  # the draft + its TTT loss
    wrapped: torch.nn.Module  # ``module`` as DDP/FSDP2 runs it
    parallel: Parallel
    teacher: TeacherHead
    parameters: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    autocast: Callable[[], Any]
    graphed: bool = False  # the step is recorded as CUDA graphs (``train.graphed``); the optimizer is capturable


def build_model(config: TrainConfig, setup: Setup, device: torch.device, dist: Dist) -> Model:
    """The draft initialised from the target (embedding, LM-head rows, final norm), wrapped and with its optimizer."""
    use_bf16 = config.precision == "bf16" or (config.precision == "auto" and device.type == "cuda")
    head = load_head_weights(setup.target_path)
    draft_config = DraftConfig.from_target(
        setup.target_config,
        setup.vocab.size,
        setup.layer_ids,
        setup.target_record,
        num_layers=config.draft_layers,
        norms=setup.norms,
    )
    torch.manual_seed(config.seed)
    draft = Eagle3Draft(draft_config)
    d2t, t2d = torch.from_numpy(setup.vocab.d2t), torch.from_numpy(setup.vocab.t2d)
    draft.init_from_target(
        head.embed.float(), head.lm_head.float(), d2t, t2d, None if head.final_norm is None else head.final_norm.float()
    )
    if setup.start is not None:
        start_from(draft, setup.start, d2t)
    draft.lm_head.weight.requires_grad_(not config.freeze_lm_head)
    draft.to(device)
    if config.compile_pointwise and device.type == "cuda":  # CPU: eager (compiling needs a C++ toolchain at run time)
        draft.compile_pointwise()
    teacher = TeacherHead(
        head.lm_head.to(torch.bfloat16 if use_bf16 else torch.float32),
        d2t,
        head.softcap,
        device,
        whole_head=not setup.argmax_stored,
    )
    module = TTTModule(
        draft, config.ttt_steps, config.loss_decay, config.feature_noise_std, config.attention_kernels
    ).to(device)
    parallel = Parallel(config.parallel, dist, device)
    wrapped = parallel.wrap(module)
    parameters = [p for p in module.parameters() if p.requires_grad]
    graphed = config.records_step(device.type, dist.world)
    optimizer = torch.optim.AdamW(
        parameters,
        lr=config.lr,
        betas=config.betas,
        weight_decay=config.weight_decay,
        fused=device.type == "cuda" and parallel.strategy != "fsdp2",  # one kernel for every tensor (FSDP2: foreach)
        capturable=graphed,  # AdamW's step count on the device, so its step can be recorded
    )
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 else nullcontext
    return Model(draft, module, wrapped, parallel, teacher, parameters, optimizer, autocast, graphed)


def start_from(draft: Eagle3Draft, start: StoredDraft, d2t: torch.Tensor) -> None:
    """The start draft's weights into ``draft`` (its embedding stays the target's, frozen), refused in one line when
    its draft vocabulary maps to other target tokens than this run's."""
    from ..model.draft import read_draft_weights

    directory = start.config_file.parent
    state = read_draft_weights(directory, start)
    own = state.get("d2t", torch.zeros_like(d2t))  # a draft without d2t has the identity mapping
    if not torch.equal(own.long(), d2t.long()):
        raise EagletError(
            f"--init-from {directory}: its draft vocabulary is other target tokens than this run's (d2t differs); "
            "pass its vocabulary with --set draft_vocab_file=..., or prepare with it"
        )
    weights = {name: tensor.float() for name, tensor in state.items() if tensor.is_floating_point()}
    weights.pop(EMBEDDING_TENSOR, None)
    with torch.no_grad():
        for name, parameter in draft.named_parameters():
            if name in weights:
                parameter.copy_(weights[name])


OPTIMIZER_FLAGS = ("fused", "capturable")  # how AdamW runs: this run's choice, whatever a checkpoint recorded


def optimizer_flags(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{flag: group.get(flag) for flag in OPTIMIZER_FLAGS} for group in optimizer.param_groups]


def restore_optimizer_flags(optimizer: torch.optim.Optimizer, flags: list[dict[str, Any]]) -> None:
    """After loading a checkpoint: its parameter groups carry the saving run's ``fused``/``capturable`` (a GPU run
    that recorded its step, resumed on a CPU, would ask for a capturable CPU step and fail), and AdamW's step counts
    were placed by them. Put back this run's flags and move the step counts where they run: the parameter's device
    (fused or capturable), else the host."""
    for group, own in zip(optimizer.param_groups, flags):
        group.update(own)
        on_device = bool(own.get("fused") or own.get("capturable"))
        for parameter in group["params"]:
            state = optimizer.state.get(parameter, {})
            if "step" in state:
                state["step"] = state["step"].to(parameter.device if on_device else "cpu", torch.float32)


def total_steps(config: TrainConfig, per_step: int, epoch_plan: list[list[int]], lengths: Any) -> int:
    """Optimizer steps the run takes: --max-steps, else --tokens or --epochs worth of the planned epoch."""
    steps_per_epoch = len(epoch_plan) // per_step
    if steps_per_epoch == 0:
        raise EagletError(
            f"one optimizer step needs {per_step} micro-batches but an epoch has only {len(epoch_plan)}; "
            "lower --grad-accum or --token-budget, or add data"
        )
    if config.max_steps:
        return config.max_steps
    if config.tokens:
        tokens_per_epoch = sum(kept_length(lengths[s], config.token_budget) for group in epoch_plan for s in group)
        return max(1, math.ceil(config.tokens / (tokens_per_epoch / steps_per_epoch)))
    return max(1, math.floor((config.epochs or 1.0) * steps_per_epoch))


def lr_schedule(config: TrainConfig, steps: int) -> Callable[[int], float]:
    """The learning-rate factor per step: linear warm-up, then cosine, linear or constant to min_lr_ratio."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / (config.warmup_steps + 1)
        if config.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - config.warmup_steps) / max(1, steps - config.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if config.schedule == "cosine" else 1 - progress
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * shape

    return factor
