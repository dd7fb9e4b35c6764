"""`eaglet train`: the EAGLE-3 draft trained with training-time test, offline (a store) or online (the target).

One short loop joins separate pieces: a FeatureSource (data), the draft + TTT loss (model),
DDP/FSDP2 under torchrun (parallelism), checkpoint.py (resume) and metrics.py (logging/plots).
A step consumes ``world x grad_accum`` packed micro-batches in a fixed order, so one process with
``--grad-accum 2`` takes the same steps as two processes with ``--grad-accum 1``.
"""

from __future__ import annotations

import math
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from rich.console import Console

from . import __version__
from .checkpoint import TrainerState, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .data.prepared import load_prepared
from .data.vocab import DraftVocab
from .distributed import Dist, init_distributed
from .draft import FROZEN_PREFIX, DraftConfig, Eagle3Draft, save_draft
from .errors import EagletError
from .features import FeatureBatch, LiveSource, StoreSource, epoch_order, held_out, pack_stream
from .fsio import write_json_atomic
from .layers import default_aux_layer_ids
from .parallel import Parallel
from .metrics import H200_BF16_DENSE_FLOPS, MetricsLog, draft_train_flops_per_token, plot_run
from .progress import progress_bar
from .store import ShardPlan, check_same_target, check_store_counts, prepared_path, read_manifest
from .target import (load_head_weights, load_model, load_tokenizer, read_config, resolve_target, target_info,
                     target_record)
from .loss import TeacherHead
from .prefetch import prefetched
from .transfer import to_device
from .ttt import FlexTTTAttention, TTTInputs, attention_for, documents, simulated_acceptance, ttt_forward


class TTTModule(torch.nn.Module):
    """The draft plus its TTT loss as one forward, so DDP/FSDP see a single module call."""

    def __init__(self, draft: Eagle3Draft, steps: int, decay: float, noise_std: float, attention_kernels: str):
        super().__init__()
        self.draft = draft
        self.steps, self.decay, self.noise_std = steps, decay, noise_std
        self.attention_kernels = attention_kernels

    def attention(self, device: torch.device):
        return attention_for(device, self.draft.config.head_dim, self.attention_kernels)

    def forward(self, inputs: TTTInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out = ttt_forward(self.draft, inputs, self.steps, self.decay, self.attention(inputs.input_ids.device),
                          self.noise_std if self.training else 0.0)
        return out.loss, torch.stack(out.step_losses), torch.stack(out.step_correct), torch.stack(out.step_counts)


@dataclass
class Setup:
    source: Any
    plans: list[ShardPlan]
    lengths: np.ndarray
    vocab: DraftVocab
    layer_ids: tuple[int, ...]
    identity: dict[str, Any]  # what a checkpoint must match
    target_record: dict[str, Any]  # the draft's record of its target: identity + how to find and name it
    target_path: Path
    target_config: dict[str, Any]
    eval_source: Any = None  # a separate held-out store, when given


def _setup(config: TrainConfig, device: str) -> Setup:
    if (config.store is None) == (config.prepared is None):
        raise EagletError("train needs exactly one input: --store STORE (offline) or --prepared DIR (online)")
    resolved = resolve_target(config.target, config.trust_remote_code)
    info = target_info(resolved, load_tokenizer(resolved.path, config.trust_remote_code))
    target_identity = {"name": info.name, "config_hash": info.config_hash, "tokenizer_hash": info.tokenizer_hash}
    accepted_target = target_identity | {"legacy_config_hash": info.legacy_config_hash}
    if config.store is not None:
        manifest = read_manifest(Path(config.store))
        check_same_target(manifest, accepted_target, f"store {config.store}")
        if not manifest["complete"]:
            raise EagletError(f"{config.store}: extraction incomplete; run the same `eaglet extract` again to finish it")
        prepared = load_prepared(prepared_path(Path(config.store), manifest))
        if prepared.manifest_sha256 != manifest["prepared"]["manifest_sha256"]:
            raise EagletError(f"{config.store}: its prepared set {prepared.path} changed since extraction; re-extract")
        check_store_counts(Path(config.store), manifest, prepared)
        vocab = DraftVocab.load(config.draft_vocab_file or prepared.vocab_path)
        source = StoreSource(config.store, config.token_budget, config.seed)
        plans = source.plans
        layer_ids = tuple(manifest["aux_layer_ids"])
    else:
        prepared = load_prepared(config.prepared)
        if prepared.manifest["target"]["tokenizer_hash"] != info.tokenizer_hash:
            raise EagletError(
                f"{config.prepared}: prepared with the tokenizer of {prepared.manifest['target']['name']}, not "
                f"{info.name}'s; prepare again with --target {config.target}"
            )
        vocab = DraftVocab.load(config.draft_vocab_file or prepared.vocab_path)  # before the target loads
        layer_ids = default_aux_layer_ids(info.num_layers)
        model = load_model(resolved.path, device, "auto", config.trust_remote_code)
        source = LiveSource(prepared, model, layer_ids, config.token_budget, config.online_chunk_tokens, config.seed,
                            config.online_forward_tokens)
        plans = source.plans
    eval_source = None
    if config.eval_store is not None:
        eval_manifest = read_manifest(Path(config.eval_store))
        check_same_target(eval_manifest, accepted_target, f"eval store {config.eval_store}")
        if tuple(eval_manifest["aux_layer_ids"]) != tuple(layer_ids):
            raise EagletError(f"eval store {config.eval_store}: aux layers {eval_manifest['aux_layer_ids']}, training uses {list(layer_ids)}")
        eval_source = StoreSource(config.eval_store, config.token_budget, config.seed)
    identity = {"target": target_identity, "layer_ids": list(layer_ids), "draft_vocab_size": vocab.size,
                "draft_layers": config.draft_layers,
                "ttt_steps": config.ttt_steps, "token_budget": config.token_budget, "seed": config.seed,
                "input": "store" if config.store else "online", "eval_fraction": config.eval_fraction}
    return Setup(source, plans, prepared.lengths, vocab, layer_ids, identity, target_identity | target_record(resolved, info),
                 resolved.path, read_config(resolved.path), eval_source)


PREFETCH_STEPS = 2  # optimizer steps' worth of micro-batches prepared ahead (packed, padded, pinned)


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
        out[len(tensor):] = 0
        return out

    return FeatureBatch(
        input_ids=padded(batch.input_ids), loss_mask=padded(batch.loss_mask), aux=padded(batch.aux),
        last=padded(batch.last),
        doc_offsets=torch.cat([batch.doc_offsets, torch.tensor([budget])]) if missing > 0 else batch.doc_offsets,
        sample_index=batch.sample_index,
    )


def _inputs(batch: FeatureBatch, teacher: TeacherHead, device: torch.device, dtype: torch.dtype,
            budget: int | None = None) -> TTTInputs:
    if budget is not None:
        batch = pad_to_budget(batch, budget)
    doc_ids, positions, doc_end = documents(batch.doc_offsets, device)
    teacher_logits, in_vocab = teacher(to_device(batch.last, device))
    return TTTInputs(
        input_ids=to_device(batch.input_ids, device),
        aux=to_device(batch.aux, device, dtype),
        loss_mask=to_device(batch.loss_mask, device).bool(),
        doc_ids=doc_ids, positions=positions, doc_end=doc_end,
        teacher_logits=teacher_logits, teacher_in_vocab=in_vocab,
    )


def _schedule(config: TrainConfig, total_steps: int):
    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / (config.warmup_steps + 1)
        if config.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if config.schedule == "cosine" else 1 - progress
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * shape

    return factor


def _micro_batches_per_epoch(setup: Setup, config: TrainConfig, select) -> tuple[int, int]:
    order = epoch_order(setup.plans, config.seed, 0, select)
    groups = list(pack_stream(((s, int(setup.lengths[s])) for s in order), config.token_budget))
    tokens = sum(min(int(setup.lengths[s]), config.token_budget) for group in groups for s in group)
    return len(groups), tokens


def _total_steps(config: TrainConfig, per_step: int, micro_per_epoch: int, tokens_per_epoch: int) -> int:
    steps_per_epoch = micro_per_epoch // per_step
    if steps_per_epoch == 0:
        raise EagletError(
            f"one optimizer step needs {per_step} micro-batches but an epoch has only {micro_per_epoch}; "
            "lower --grad-accum or --token-budget, or add data"
        )
    if config.max_steps:
        return config.max_steps
    if config.tokens:
        return max(1, math.ceil(config.tokens / (tokens_per_epoch / steps_per_epoch)))
    return max(1, math.floor((config.epochs or 1.0) * steps_per_epoch))


class StopFlag:
    """SIGTERM (a scheduler preempting the job) asks for a checkpoint at the next step boundary."""

    def __init__(self) -> None:
        self.requested = False
        self.previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self.previous)


def _any_rank(flag: bool, dist: Dist, device: torch.device) -> bool:
    """Every rank stops at the same step when any of them was asked to."""
    if dist.world == 1:
        return flag
    import torch.distributed as tdist

    value = torch.tensor([int(flag)], device=device)
    tdist.all_reduce(value, op=tdist.ReduceOp.MAX)
    return bool(value.item())


def _reduce(tensors: list[torch.Tensor], dist: Dist) -> list[torch.Tensor]:
    if dist.world == 1:
        return tensors
    import torch.distributed as tdist

    for tensor in tensors:
        tdist.all_reduce(tensor)
    return tensors


def evaluate(module: TTTModule, setup: Setup, config: TrainConfig, teacher: TeacherHead, device: torch.device,
             dtype: torch.dtype, dist: Dist, autocast, lockstep: bool = False) -> dict[str, Any]:
    """Per-step accuracy and simulated τ on the held-out samples (``lockstep``: every rank runs as many
    forwards, as FSDP2 needs)."""
    compiled = issubclass(module.attention(device), FlexTTTAttention)
    # with compiled FlexAttention, autograd stays on (nothing is kept: no backward) so evaluation reuses
    # training's kernels instead of compiling no_grad ones (FlexTTTAttention's docstring says why)
    with torch.enable_grad() if compiled else torch.no_grad():
        return _evaluate(module, setup, config, teacher, device, dtype, dist, autocast, lockstep)


def _evaluate(module: TTTModule, setup: Setup, config: TrainConfig, teacher: TeacherHead, device: torch.device,
              dtype: torch.dtype, dist: Dist, autocast, lockstep: bool) -> dict[str, Any]:
    module.eval()
    correct = torch.zeros(config.ttt_steps, device=device)
    counts = torch.zeros(config.ttt_steps, device=device)
    losses = torch.zeros(config.ttt_steps, device=device)
    if setup.eval_source is not None:
        batches = setup.eval_source.batches(0)
    else:
        batches = setup.source.batches(0, lambda s: held_out(s, config.seed, config.eval_fraction))
    total, spare = 0, None
    for index, batch in enumerate(batches):
        total, spare = index + 1, batch
        if index % dist.world != dist.rank:
            continue
        with autocast():
            _, step_losses, step_correct, step_counts = module(_inputs(batch, teacher, device, dtype, config.token_budget))
        correct += step_correct.float()
        counts += step_counts.float()
        losses += step_losses.detach().float() * step_counts.float()  # detached: no graph outlives its batch
    if lockstep and spare is not None:  # ranks one batch short of the others run one that counts nothing
        for _ in range(-(-total // dist.world) - len(range(dist.rank, total, dist.world))):
            with autocast():
                module(_inputs(spare, teacher, device, dtype, config.token_budget))
    correct, counts, losses = _reduce([correct, counts, losses], dist)
    module.train()
    if int(counts[0]) == 0:  # nothing held out (a tiny set): report that rather than a fake zero
        return {"acc": [], "tau": None, "eval_loss": [], "eval_tokens": 0}
    accuracy = (correct / counts.clamp_min(1)).tolist()
    return {"acc": [round(a, 5) for a in accuracy], "tau": round(simulated_acceptance(accuracy), 4),
            "eval_loss": [round(v, 5) for v in (losses / counts.clamp_min(1)).tolist()], "eval_tokens": int(counts[0])}


@dataclass
class TrainResult:
    out: Path
    steps: int
    final_eval: dict[str, Any]
    seconds: float
    resumed_from: int


def run_train(config: TrainConfig, console: Console | None = None) -> TrainResult:
    console = console or Console(stderr=True)
    dist = init_distributed()
    device = torch.device(dist.device(config.device))
    run = Path(config.out)
    setup = _setup(config, str(device))
    use_bf16 = config.precision == "bf16" or (config.precision == "auto" and device.type == "cuda")
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 else nullcontext

    head = load_head_weights(setup.target_path)
    draft_config = DraftConfig.from_target(setup.target_config, setup.vocab.size, setup.layer_ids, setup.target_record,
                                           num_layers=config.draft_layers)
    torch.manual_seed(config.seed)
    draft = Eagle3Draft(draft_config)
    d2t, t2d = torch.from_numpy(setup.vocab.d2t), torch.from_numpy(setup.vocab.t2d)
    draft.init_from_target(head.embed.float(), head.lm_head.float(), d2t, t2d,
                           None if head.final_norm is None else head.final_norm.float())
    draft.lm_head.weight.requires_grad_(not config.freeze_lm_head)
    draft.to(device)
    if config.compile_pointwise and device.type == "cuda":  # CPU: eager (compiling needs a C++ toolchain at run time)
        draft.compile_pointwise()
    teacher = TeacherHead(head.lm_head.to(device, torch.bfloat16 if use_bf16 else torch.float32), d2t.to(device),
                          head.softcap)
    module = TTTModule(draft, config.ttt_steps, config.loss_decay, config.feature_noise_std,
                       config.attention_kernels).to(device)
    parallel = Parallel(config.parallel, dist, device)
    wrapped = parallel.wrap(module)
    parameters = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)

    holds_out = config.eval_fraction > 0 and config.eval_store is None
    train_select = (lambda s: not held_out(s, config.seed, config.eval_fraction)) if holds_out else None
    evaluates = holds_out or config.eval_store is not None
    deadline = time.monotonic() + config.max_minutes * 60 if config.max_minutes else None
    per_step = dist.world * config.grad_accum
    micro_per_epoch, tokens_per_epoch = _micro_batches_per_epoch(setup, config, train_select)
    total_steps = _total_steps(config, per_step, micro_per_epoch, tokens_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config, total_steps))

    state = TrainerState()
    checkpoint = latest_checkpoint(run)
    if checkpoint is not None:
        loaded = load_checkpoint(checkpoint, _checkpoint_keys(module.draft), scheduler, setup.identity)
        parallel.load_state(module, optimizer, module.draft, loaded.model_state, loaded.optimizer_state)
        state = loaded.state
        console.print(f"resuming from {checkpoint} (step {state.step})")
    resumed_from = state.step
    run.mkdir(parents=True, exist_ok=True)
    if dist.is_main:
        write_json_atomic(run / "train_config.json", {"config": config.model_dump(), "identity": setup.identity,
                                                      "total_steps": total_steps, "eaglet_version": __version__})
    metrics = MetricsLog(run, dist.is_main, resumed_step=state.step)
    mean_context = float(np.mean(np.minimum(setup.lengths, config.token_budget))) / 2
    flops_per_token = draft_train_flops_per_token(draft_config, config.ttt_steps, mean_context,
                                                  head_trainable=not config.freeze_lm_head)
    stop = StopFlag()
    pin = device.type == "cuda"

    def host_ready(group: list[FeatureBatch]) -> tuple[list[FeatureBatch], int, int]:
        """(this rank's micro-batches padded and pinned, the group's size and tokens): run ahead by a thread."""
        mine = [pad_to_budget(batch, config.token_budget, pin) for batch in group[dist.rank :: dist.world]]
        return mine, len(group), sum(batch.tokens for batch in group)

    started = time.perf_counter()
    window_tokens, window_started = 0, time.perf_counter()
    final_eval: dict[str, Any] = {}
    module.train()
    try:
        with progress_bar("steps", console) as progress:
            task = progress.add_task("train", total=total_steps, completed=state.step)
            while state.step < total_steps and not stop.requested:
                batches = prefetched(_micro_batches(setup, config, state, train_select, per_step), host_ready,
                                     PREFETCH_STEPS)
                for mine, group_size, group_tokens in batches:
                    step_losses = torch.zeros(config.ttt_steps, device=device)
                    step_correct = torch.zeros(config.ttt_steps, device=device)
                    step_counts = torch.zeros(config.ttt_steps, device=device)
                    loss_sum = torch.zeros((), device=device)
                    for index, batch in enumerate(mine):
                        with parallel.accumulating(wrapped, last=index == len(mine) - 1), autocast():
                            loss, losses_k, correct_k, counts_k = wrapped(_inputs(batch, teacher, device, torch.float32))
                            (loss / len(mine)).backward()
                        loss_sum += loss.detach() / len(mine)
                        step_losses += losses_k.detach().float() * counts_k.float()
                        step_correct += correct_k.float()
                        step_counts += counts_k.float()
                    torch.nn.utils.clip_grad_norm_(parameters, config.clip)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                    state.step += 1
                    state.micro_in_epoch += group_size
                    state.tokens += group_tokens
                    window_tokens += group_tokens
                    progress.advance(task)
                    if state.step % config.log_every == 0 or state.step == total_steps:
                        loss_sum, step_losses, step_correct, step_counts = _reduce(
                            [loss_sum, step_losses, step_correct, step_counts], dist)
                        elapsed = time.perf_counter() - window_started
                        tokens_per_s = window_tokens / elapsed if elapsed > 0 else 0.0
                        metrics.log({
                            "kind": "train", "step": state.step, "epoch": state.epoch, "tokens": state.tokens,
                            "lr": scheduler.get_last_lr()[0], "loss": round(float(loss_sum) / dist.world, 6),
                            "loss_k": [round(v, 5) for v in (step_losses / step_counts.clamp_min(1)).tolist()],
                            "acc_k": [round(v, 5) for v in (step_correct / step_counts.clamp_min(1)).tolist()],
                            "tokens_per_s": round(tokens_per_s, 1),
                            "mfu": round(tokens_per_s * flops_per_token / (H200_BF16_DENSE_FLOPS * dist.world), 5)
                            if device.type == "cuda" else None,
                        })
                        window_tokens, window_started = 0, time.perf_counter()
                    out_of_time = deadline is not None and time.monotonic() > deadline
                    if evaluates and (state.step % config.eval_every == 0 or state.step == total_steps or out_of_time):
                        final_eval = evaluate(module, setup, config, teacher, device, torch.float32, dist, autocast, parallel.lockstep)
                        metrics.log({"kind": "eval", "step": state.step, "tokens": state.tokens, **final_eval})
                    stopping = _any_rank(stop.requested or out_of_time, dist, device)
                    stop.requested = stopping
                    if state.step % config.save_every == 0 or state.step == total_steps or stopping:
                        _save(run, module, optimizer, scheduler, state, setup, config, dist, parallel)
                    if state.step >= total_steps or stop.requested:
                        batches.close()  # stops the prefetch thread
                        break
                else:
                    state.epoch += 1
                    state.micro_in_epoch = 0
    finally:
        stop.restore()
        metrics.close()
    if stop.requested and state.step < total_steps:
        console.print(f"[yellow]stopped at step {state.step} (SIGTERM or --max-minutes); checkpoint saved, "
                      "rerun the same command to resume[/]")
    if dist.is_main:
        plot_run(run)
    return TrainResult(run, state.step, final_eval, time.perf_counter() - started, resumed_from)


def _micro_batches(setup: Setup, config: TrainConfig, state: TrainerState, select, per_step: int) -> Iterator[list[FeatureBatch]]:
    """This epoch's micro-batches from the resume position, in groups of ``per_step``; a short last group is dropped."""
    group: list[FeatureBatch] = []
    for index, batch in enumerate(setup.source.batches(state.epoch, select)):
        if index < state.micro_in_epoch:
            continue
        group.append(batch)
        if len(group) == per_step:
            yield group
            group = []


def _checkpoint_keys(draft: Eagle3Draft) -> set[str]:
    """What a checkpoint holds of the draft: everything but the frozen embedding (the target's)."""
    return {k for k in draft.state_dict() if not k.startswith(FROZEN_PREFIX)}


def _save(run: Path, module: TTTModule, optimizer, scheduler, state: TrainerState, setup: Setup,
          config: TrainConfig, dist: Dist, parallel: Parallel) -> None:
    full_model, full_optimizer = parallel.full_state(module, optimizer, module.draft)  # collective
    if dist.is_main:
        model_state = {k: v for k, v in full_model.items() if not k.startswith(FROZEN_PREFIX)}
        save_checkpoint(run, model_state, full_optimizer, scheduler, state, setup.identity, config.keep_last)
        save_draft(module.draft.config, model_state, run)
    dist.barrier()
