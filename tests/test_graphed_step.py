"""The training step recorded as CUDA graphs (``train.graphed``): the same steps as the eager one.

On the CPU the recorded parts run as plain calls (the split into forward/backward and AdamW, the learning rate
through a tensor, the finite check between them); on a GPU they are recorded and replayed."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import run_cli

from eaglet.config import TrainConfig
from eaglet.model.distributed import Dist
from eaglet.train.data import pad_to_budget
from eaglet.train.graphed import GraphedStep
from eaglet.train.metrics import read_metrics
from eaglet.train.setup import (
    build_model,
    build_setup,
    lr_schedule,
    optimizer_flags,
    restore_optimizer_flags,
)
from eaglet.train.step import NonFiniteStep, train_step

BUDGET = 128
ONE = Dist(rank=0, world=1, local_rank=0)


def built(tiny_store, tiny_target, tmp_path, device="cpu", **settings):
    config = TrainConfig(
        out=str(tmp_path / "run"), store=str(tiny_store), target=str(tiny_target), token_budget=BUDGET, lr=3e-3,
        seed=1, warmup_steps=2, **settings,
    )  # fmt: skip
    setup = build_setup(config, device)
    return config, setup, build_model(config, setup, torch.device(device), ONE)


def padded_batches(setup, count, device="cpu"):
    batches = [pad_to_budget(b, BUDGET, pin=device == "cuda") for b in setup.source.batches(0)]
    return (batches * count)[:count]


def parameters_of(model):
    return {name: p.detach().clone() for name, p in model.module.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("fused", [False, True])
def test_the_recorded_steps_work_equals_the_eager_step(tmp_path, tiny_store, tiny_target, fused):
    """Eight steps with a warm-up schedule (the learning rate changes every step) and a clip that bites: the split
    step gives the eager step's statistics and parameters — to float32's rounding of the learning rate, which the
    recorded AdamW reads from a float32 tensor (fused AdamW's kernel reads float32) where the eager one gets a Python
    float. Fused (as on a GPU), AdamW clips the gradients as it reads them: clip_grad_norm_'s scale, applied there."""
    config, setup, eager = built(tiny_store, tiny_target, tmp_path, clip=0.05)
    graphed_model = copy.deepcopy(eager)
    graphed_model.optimizer = torch.optim.AdamW(
        graphed_model.parameters, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay, fused=fused
    )
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(model.optimizer, lr_schedule(config, 8)) for model in (eager, graphed_model)
    ]
    step = GraphedStep(graphed_model, torch.device("cpu"), config.ttt_steps, config.clip, warmup=2)
    rates = []
    for index, batch in enumerate(padded_batches(setup, 8)):
        expected = train_step(eager, [batch], torch.device("cpu"), config.ttt_steps, config.clip)
        got = step([batch])
        for a, b in zip(expected.tensors(), got.tensors()):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), index
        rates.append(graphed_model.optimizer.param_groups[0]["lr"])
        for schedule in schedules:
            schedule.step()
    assert step.recorded is not None and len(set(rates)) > 2  # recorded after 2 steps; the rate moved
    assert (step.apply is None) is fused and (float(step.unclip) > 1) is fused  # fused: one part, AdamW's clip bit
    assert isinstance(graphed_model.optimizer.param_groups[0]["lr"], float)  # the scheduler's float, kept
    want, have = parameters_of(eager), parameters_of(graphed_model)
    assert want.keys() == have.keys() and all(torch.allclose(want[k], have[k], rtol=1e-5, atol=1e-7) for k in want)


def test_batches_copied_to_the_device_ahead_give_the_same_steps(tmp_path, tiny_store, tiny_target):
    """The training loop's prefetch thread copies a recorded step's batches to the device ahead (``Stager``): the
    steps are those of host batches copied in by the step itself, warm-up steps included; a batch of another shape
    is refused, not copied into the recorded inputs."""
    from eaglet.train.graphed import Stager

    config, setup, host_model = built(tiny_store, tiny_target, tmp_path)
    staged_model = copy.deepcopy(host_model)
    staged_model.optimizer = torch.optim.AdamW(
        staged_model.parameters, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
    )
    cpu = torch.device("cpu")
    from_host = GraphedStep(host_model, cpu, config.ttt_steps, config.clip, warmup=2)
    from_stage = GraphedStep(staged_model, cpu, config.ttt_steps, config.clip, warmup=2)
    stage = Stager(cpu)
    batches = padded_batches(setup, 6)
    assert len({tuple(b.input_ids.tolist()) for b in batches}) > 1  # the inputs change between steps
    for index, batch in enumerate(batches):
        want, got = from_host([batch]), from_stage([stage(batch)])
        for a, b in zip(want.tensors(), got.tensors()):
            assert torch.equal(a, b), index
    want, have = parameters_of(host_model), parameters_of(staged_model)
    assert all(torch.equal(want[k], have[k]) for k in want)
    longer = pad_to_budget(next(iter(setup.source.batches(0))), 2 * BUDGET)
    with pytest.raises(ValueError, match="a recorded step takes"):
        from_stage([stage(longer)])


@pytest.mark.parametrize("fused", [False, True])
def test_a_non_finite_batch_stops_the_recorded_step_before_adamw(tmp_path, tiny_store, tiny_target, fused):
    """Unfused, AdamW is not replayed; fused (one recorded step), AdamW skips the update: either way the parameters,
    the moments and AdamW's step count stay as the last good step left them."""
    config, setup, model = built(tiny_store, tiny_target, tmp_path)
    model.optimizer = torch.optim.AdamW(model.parameters, lr=config.lr, fused=fused)
    good, bad = padded_batches(setup, 2)
    bad.aux[3] = float("nan")
    step = GraphedStep(model, torch.device("cpu"), config.ttt_steps, config.clip, warmup=0)
    step([good])
    before = parameters_of(model)
    adam_steps = [float(s["step"]) for s in model.optimizer.state.values()]
    moments = {k: s["exp_avg"].clone() for k, s in model.optimizer.state.items()}
    with pytest.raises(NonFiniteStep) as caught:
        step([bad])
    assert caught.value.what == "loss" and caught.value.batch is bad
    after = parameters_of(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [float(s["step"]) for s in model.optimizer.state.values()] == adam_steps
    assert all(torch.equal(moments[k], s["exp_avg"]) for k, s in model.optimizer.state.items())


def test_a_recorded_step_takes_one_micro_batch(tmp_path, tiny_store, tiny_target):
    config, setup, model = built(tiny_store, tiny_target, tmp_path)
    with pytest.raises(ValueError, match="one micro-batch"):
        GraphedStep(model, torch.device("cpu"), config.ttt_steps, config.clip)(padded_batches(setup, 2))


@pytest.mark.parametrize(
    ("settings", "device", "world", "recorded"),
    [
        ({}, "cuda:0", 1, True),
        ({}, "cpu", 1, False),
        ({}, "cuda:0", 2, False),
        ({"grad_accum": 2}, "cuda:0", 1, False),
        ({"cuda_graphs": False}, "cuda:0", 1, False),
        ({"store": None, "prepared": "p"}, "cuda:0", 1, False),
    ],
)
def test_which_runs_record_their_step(settings, device, world, recorded):
    config = TrainConfig(**{"out": "o", "store": "s", **settings})
    assert config.records_step(device, world) is recorded


def test_a_checkpoint_of_a_recorded_run_resumes_where_the_step_is_not_recorded(tmp_path, tiny_store, tiny_target):
    """A GPU run's optimizer state says capturable (its step counts on the device); loaded on the CPU, this run's
    flags are put back and its step counts moved to the host, and AdamW steps (a capturable CPU step would fail)."""
    config, setup, model = built(tiny_store, tiny_target, tmp_path)
    train_step(model, padded_batches(setup, 1), torch.device("cpu"), config.ttt_steps, config.clip)
    saved = copy.deepcopy(model.optimizer.state_dict())
    for group in saved["param_groups"]:
        group.update(capturable=True, fused=True)
    flags = optimizer_flags(model.optimizer)
    model.optimizer.load_state_dict(saved)
    assert model.optimizer.param_groups[0]["capturable"] is True
    restore_optimizer_flags(model.optimizer, flags)
    assert optimizer_flags(model.optimizer) == flags and not flags[0]["capturable"]
    assert all(state["step"].device.type == "cpu" for state in model.optimizer.state.values())
    stats = train_step(model, padded_batches(setup, 1), torch.device("cpu"), config.ttt_steps, config.clip)
    assert torch.isfinite(stats.loss)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs record GPU work")
def test_recorded_training_on_gpu_takes_the_eager_runs_steps(tmp_path, capsys, tiny_store, tiny_target):
    """`eaglet train` on a GPU records its step by default: the same losses as with --no-cuda-graphs (bf16: close,
    not bitwise), a resumed recorded run included."""
    common = ["train", "--store", tiny_store, "--target", tiny_target, "--token-budget", BUDGET, "--log-every", "1",
              "--lr", "3e-3", "--seed", "1", "--device", "cuda", "--max-steps", "12", "--eval-every", "5"]  # fmt: skip
    assert run_cli([*common, "--out", tmp_path / "eager", "--no-cuda-graphs"], capsys)[0] == 0
    assert run_cli([*common, "--out", tmp_path / "graphed", "--max-steps", "8", "--save-every", "8"], capsys)[0] == 0
    assert run_cli([*common, "--out", tmp_path / "graphed"], capsys)[0] == 0  # resumed at step 8, recorded again

    def losses(run):
        return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]

    assert len(losses(tmp_path / "graphed")) == 12
    assert json.loads((tmp_path / "graphed" / "train_config.json").read_text())["step"] == "cuda_graphs"
    assert json.loads((tmp_path / "eager" / "train_config.json").read_text())["step"] == "eager"
    assert losses(tmp_path / "graphed") == pytest.approx(losses(tmp_path / "eager"), rel=2e-2)
