"""`eaglet train`'s loop: epochs of planned micro-batches, one optimizer step per ``world x grad_accum`` of them.

A step consumes its micro-batches in a fixed order, so one process with ``--grad-accum 2`` takes the same steps as
two processes with ``--grad-accum 1``. A checkpoint records the step and the position in the epoch's plan; a
resumed run fetches the rest of that plan, so nothing is skipped or taken twice.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from rich.console import Console

from .. import __version__
from ..config import TrainConfig
from ..errors import SIGNAL_EXIT_BASE, EagletError, Interrupted
from ..formats.files import TRAIN_CONFIG_FILE
from ..fsio import check_output_apart, check_output_dir, output_lock, write_json_atomic
from ..model.distributed import Dist, all_reduce_sum, any_rank, init_distributed
from ..model.draft import FROZEN_PREFIX, save_draft
from ..model.sizing import PREFETCH_STEPS, draft_train_flops_per_token
from ..progress import progress_bar
from .checkpoint import (
    TrainerState,
    damaged_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    unloaded_optimizer_state,
)
from .data import FeatureBatch, kept_length, non_finite_samples, pad_to_budget
from .graphed import StagedBatch, Stager, step_function
from .heldout import evaluate
from .metrics import H200_BF16_DENSE_FLOPS, MetricsLog, plot_run
from .prefetch import prefetched
from .setup import (
    Model,
    Setup,
    build_model,
    build_setup,
    lr_schedule,
    optimizer_flags,
    restore_optimizer_flags,
    total_steps,
)
from .step import NonFiniteStep, StepStats

MAX_SAMPLES_NAMED = 3  # samples a non-finite step's error line names


@dataclass
class TrainResult:
    out: Path
    steps: int
    final_eval: dict[str, Any]
    seconds: float
    resumed_from: int
    interrupted_by: signal.Signals | None = None  # what stopped the run before its last step (its checkpoint kept)

    def interruption(self) -> Interrupted:
        """The stop as the CLI reports it (exit code 128 + the signal's number, as a shell reports a signal)."""
        assert self.interrupted_by is not None
        return Interrupted(
            f"stopped at step {self.steps} by {signal_label(self.interrupted_by)}; checkpoint saved: run the same "
            "command again to resume",
            SIGNAL_EXIT_BASE + self.interrupted_by.value,
        )


def signal_label(number: signal.Signals) -> str:
    return "Ctrl-C" if number == signal.SIGINT else number.name


class StopFlag:
    """Ctrl-C (SIGINT) or a scheduler preempting the job (SIGTERM) asks for a checkpoint at the next step boundary; a
    second Ctrl-C stops at once (Python's KeyboardInterrupt)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, console: Console) -> None:
        self.console = console
        self.requested = False
        self.by: signal.Signals | None = None  # the signal that asked, on this rank
        self.previous = {number: signal.signal(number, self._handle) for number in self.SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.by == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.by = signal.Signals(signum)
        again = (
            " (Ctrl-C again stops at once, losing the steps since the last checkpoint)"
            if signum == signal.SIGINT
            else ""
        )
        self.console.print(f"[yellow]{signal_label(self.by)}: stopping after this step with a checkpoint{again}[/]")

    def restore(self) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)


def run_train(config: TrainConfig, console: Console | None = None) -> TrainResult:
    """Train into ``config.out``, resuming its latest checkpoint; one run at a time writes it. A run that fails
    before its first checkpoint leaves no directory behind (nothing in it could be resumed)."""
    dist = init_distributed()
    run = check_output_dir(config.out)
    check_output_apart(run, [config.store, config.prepared, config.eval_store, config.target, config.draft_vocab_file])
    with output_lock(run) if dist.is_main else contextlib.nullcontext():
        created = not run.exists()
        try:
            return _train(config, console or Console(stderr=True), dist, run)
        except BaseException:
            if created and dist.is_main and latest_checkpoint(run) is None:
                shutil.rmtree(run, ignore_errors=True)
            raise


def _train(config: TrainConfig, console: Console, dist: Dist, run: Path) -> TrainResult:
    device = torch.device(dist.device(config.device))
    setup = build_setup(config, str(device))
    model = build_model(config, setup, device, dist)
    select = setup.train_select(config)
    per_step = dist.world * config.grad_accum
    steps = total_steps(config, per_step, setup.source.plan(0, select), setup.lengths)
    scheduler = torch.optim.lr_scheduler.LambdaLR(model.optimizer, lr_schedule(config, steps))
    for problem in [config.warmup_problem(steps), setup.budget_cut]:
        if dist.is_main and problem:
            console.print(f"[yellow]warning[/] {problem[0]} ({problem[1]})", highlight=False)
    state = _resume(run, model, scheduler, setup, console)
    resumed_from = state.step
    run.mkdir(parents=True, exist_ok=True)
    if dist.is_main:
        write_json_atomic(
            run / TRAIN_CONFIG_FILE,
            {
                "config": config.model_dump(),
                "identity": setup.identity,
                "total_steps": steps,
                # how each step runs: recorded CUDA graphs (train.graphed) after the warm-up steps, or eagerly
                "step": "cuda_graphs" if model.graphed else "eager",
                "eaglet_version": __version__,
            },
        )
    metrics = MetricsLog(run, dist.is_main, resumed_step=state.step)
    mean_context = float(np.mean([kept_length(n, config.token_budget) for n in setup.lengths])) / 2
    flops_per_token = draft_train_flops_per_token(
        model.draft.config, config.ttt_steps, mean_context, head_trainable=not config.freeze_lm_head
    )
    deadline = time.monotonic() + config.max_minutes * 60 if config.max_minutes else None
    pin = device.type == "cuda"
    stage = Stager(device) if model.graphed else None  # a recorded step's batches go to the GPU ahead, too

    def host_ready(group: list[FeatureBatch]) -> tuple[list[FeatureBatch | StagedBatch], int, int]:
        """(this rank's micro-batches padded and pinned — and for a recorded step on the device already —, the
        group's size and tokens): run ahead by a thread."""
        mine = [pad_to_budget(batch, config.token_budget, pin) for batch in group[dist.rank :: dist.world]]
        tokens = sum(batch.tokens for batch in group)
        return ([stage(batch) for batch in mine] if stage else mine), len(group), tokens

    step = step_function(model, config, device)
    stop = StopFlag(console)
    timed_out = False  # --max-minutes ended the run
    started = time.perf_counter()
    window_tokens, window_started = 0, time.perf_counter()
    final_eval: dict[str, Any] = {}
    model.module.train()
    try:
        with progress_bar("steps", console) as progress:
            task = progress.add_task("train", total=steps, completed=state.step)
            while state.step < steps and not stop.requested:
                plan = setup.source.plan(state.epoch, select)
                remaining = setup.source.fetch(plan[state.micro_in_epoch :])
                groups = prefetched(_in_groups(remaining, per_step), host_ready, PREFETCH_STEPS)
                for mine, group_size, group_tokens in groups:
                    try:
                        stats = step(mine)
                    except NonFiniteStep as exc:
                        groups.close()
                        raise _non_finite_error(exc, state.step + 1, setup, run) from None
                    scheduler.step()
                    state.step += 1
                    state.micro_in_epoch += group_size
                    state.tokens += group_tokens
                    window_tokens += group_tokens
                    progress.advance(task)
                    if state.step % config.log_every == 0 or state.step == steps:
                        elapsed = time.perf_counter() - window_started
                        metrics.log(
                            _train_record(
                                state,
                                scheduler,
                                stats,
                                dist,
                                window_tokens / max(elapsed, 1e-9),
                                flops_per_token if device.type == "cuda" else None,
                            )
                        )
                        window_tokens, window_started = 0, time.perf_counter()
                    out_of_time = deadline is not None and time.monotonic() > deadline
                    if setup.evaluates(config) and (
                        state.step % config.eval_every == 0 or state.step == steps or out_of_time
                    ):
                        final_eval = evaluate(model, setup, config, device, dist)
                        metrics.log({"kind": "eval", "step": state.step, "tokens": state.tokens, **final_eval})
                    timed_out = timed_out or out_of_time
                    stop.requested = any_rank(stop.requested or out_of_time, dist, device)
                    if state.step % config.save_every == 0 or state.step == steps or stop.requested:
                        _save(run, model, scheduler, state, setup, config, dist)
                    if state.step >= steps or stop.requested:
                        groups.close()  # stops the prefetch thread
                        break
                else:
                    state.epoch += 1
                    state.micro_in_epoch = 0
    finally:
        stop.restore()
        metrics.close()
    if timed_out and state.step < steps and stop.by is None:
        console.print(
            f"[yellow]stopped at step {state.step} (--max-minutes); checkpoint saved, rerun the same command to "
            "resume[/]"
        )
    if dist.is_main:
        plot_run(run)
    interrupted_by = stop.by if state.step < steps else None
    return TrainResult(run, state.step, final_eval, time.perf_counter() - started, resumed_from, interrupted_by)


def _non_finite_error(error: NonFiniteStep, step: int, setup: Setup, run: Path) -> EagletError:
    """One line naming the step, where the micro-batch's samples come from, and the checkpoint the run keeps."""
    batch = error.batch
    bad = non_finite_samples(batch)
    culprits = bad or batch.sample_index.tolist()
    named = "; ".join(setup.source.origin(sample) for sample in culprits[:MAX_SAMPLES_NAMED])
    more = f" and {len(culprits) - MAX_SAMPLES_NAMED} more" if len(culprits) > MAX_SAMPLES_NAMED else ""
    kept = latest_checkpoint(run)
    keeps = f"the run keeps its last good checkpoint {kept}" if kept else "no checkpoint was written"
    if bad:
        cause = f"non-finite {error.what} from non-finite features of {named}{more}; {setup.source.repair_hint()}"
    else:
        cause = f"non-finite {error.what} on finite features ({named}{more}); lower --lr or --clip"
    return EagletError(f"step {step}: {cause}; the step was not applied and {keeps}")


def _in_groups(batches: Iterator[FeatureBatch], size: int) -> Iterator[list[FeatureBatch]]:
    """Consecutive micro-batches in groups of ``size`` (one optimizer step); a short last group is dropped."""
    group: list[FeatureBatch] = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []


def _train_record(
    state: TrainerState, scheduler, stats: StepStats, dist: Dist, tokens_per_s: float, flops_per_token: float | None
) -> dict[str, Any]:
    """The metrics.jsonl row of a logged step (sums all-reduced over the ranks); MFU on GPU only."""
    loss, losses, correct, counts = all_reduce_sum(stats.tensors(), dist)
    return {
        "kind": "train",
        "step": state.step,
        "epoch": state.epoch,
        "tokens": state.tokens,
        "lr": scheduler.get_last_lr()[0],
        "loss": round(float(loss) / dist.world, 6),
        "loss_k": [round(v, 5) for v in (losses / counts.clamp_min(1)).tolist()],
        "acc_k": [round(v, 5) for v in (correct / counts.clamp_min(1)).tolist()],
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu": None
        if flops_per_token is None
        else round(tokens_per_s * flops_per_token / (H200_BF16_DENSE_FLOPS * dist.world), 5),
    }


def _checkpoint_keys(model: Model) -> set[str]:
    """What a checkpoint holds of the draft: everything but the frozen embedding (the target's)."""
    return {k for k in model.draft.state_dict() if not k.startswith(FROZEN_PREFIX)}


def _resume(run: Path, model: Model, scheduler, setup: Setup, console: Console) -> TrainerState:
    """The run's latest checkpoint loaded into the model, optimizer and schedule; a fresh state when there is none."""
    checkpoint = latest_checkpoint(run)
    if checkpoint is None:
        return TrainerState()
    loaded = load_checkpoint(checkpoint, _checkpoint_keys(model), scheduler, setup.identity)
    flags = optimizer_flags(model.optimizer)
    try:
        model.parallel.load_state(
            model.module, model.optimizer, model.draft, loaded.model_state, loaded.optimizer_state
        )
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:  # shapes or optimizer entries of another draft
        raise damaged_checkpoint(checkpoint, str(exc).splitlines()[0]) from None
    if loaded.state.step and (problem := unloaded_optimizer_state(model.module, model.optimizer)):
        raise damaged_checkpoint(checkpoint, problem)
    restore_optimizer_flags(model.optimizer, flags)
    console.print(f"resuming from {checkpoint} (step {loaded.state.step})")
    return loaded.state


def _save(
    run: Path, model: Model, scheduler, state: TrainerState, setup: Setup, config: TrainConfig, dist: Dist
) -> None:
    """A checkpoint and the draft directory (rank 0 writes; gathering the full state is collective)."""
    full_model, full_optimizer = model.parallel.full_state(model.module, model.optimizer, model.draft)
    if dist.is_main:
        model_state = {k: v for k, v in full_model.items() if not k.startswith(FROZEN_PREFIX)}
        save_checkpoint(run, model_state, full_optimizer, scheduler, state, setup.identity, config.keep_last)
        save_draft(model.draft.config, model_state, run)
    dist.barrier()
