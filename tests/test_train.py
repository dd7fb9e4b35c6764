"""`eaglet train`: learns, writes the draft and metrics, resumes exactly, online == offline, DDP == accumulation."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import run_cli

from eaglet.train.metrics import read_metrics

BASE = ["--token-budget", "128", "--log-every", "1", "--eval-every", "10", "--lr", "3e-3", "--seed", "1"]


def train_args(store, out, target, *extra):
    return ["train", "--store", store, "--out", out, "--target", target, *BASE, *extra]


def train_losses(run):
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


def test_train_offline_learns_and_writes_everything(tmp_path, capsys, tiny_store, tiny_target):
    out = tmp_path / "run"
    code, stdout, err = run_cli(
        train_args(tiny_store, out, tiny_target, "--max-steps", "30", "--save-every", "10"), capsys
    )
    assert code == 0, err
    losses = train_losses(out)
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    for name in (
        "config.json",
        "model.safetensors",
        "metrics.jsonl",
        "loss.png",
        "accuracy.png",
        "tau.png",
        "train_config.json",
    ):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000020", "step-000030"]  # keep_last 2
    assert json.loads((out / "train_config.json").read_text())["step"] == "eager"  # CPU: nothing recorded
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and config["target_hidden_size"] == 64
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        assert {
            "fc.weight",
            "midlayer.self_attn.q_proj.weight",
            "midlayer.hidden_norm.weight",
            "norm.weight",
            "lm_head.weight",
            "d2t",
            "t2d",
        } <= names and not any("embed" in n for n in names)
        assert handle.get_slice("midlayer.self_attn.q_proj.weight").get_shape() == [64, 128]  # takes 2H
        assert handle.get_slice("fc.weight").get_shape() == [64, 192]  # 3H -> H
    evals = [r for r in read_metrics(out) if r["kind"] == "eval"]
    assert len(evals) == 3 and len(evals[-1]["acc"]) == 7 and evals[-1]["acceptance_length"] >= 1
    assert f"held-out τ {evals[-1]['acceptance_length']:.2f} (a 7-token chain" in stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "stop_signal,exit_code,named", [(signal.SIGTERM, 0, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")]
)
def test_a_signal_then_resume_gives_the_same_losses(
    tmp_path, capsys, tiny_store, tiny_target, stop_signal, exit_code, named
):
    """A scheduler's SIGTERM or the user's Ctrl-C: a checkpoint at the next step, then the same command resumes."""
    reference = tmp_path / "reference"
    assert run_cli(train_args(tiny_store, reference, tiny_target, "--max-steps", "40"), capsys)[0] == 0
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "eaglet.cli", *map(str, train_args(tiny_store, out, tiny_target, "--max-steps", "40"))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and len(train_losses(out) if out.exists() else []) < 13:
        time.sleep(0.01)
    proc.send_signal(stop_signal)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == exit_code, err
    assert f"by {named}; checkpoint saved: run the same command again to resume".encode() in err
    assert b"Traceback" not in err
    interrupted_at = len(train_losses(out))
    assert 13 <= interrupted_at < 40
    resumed = subprocess.run(cmd, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr
    assert train_losses(out) == pytest.approx(train_losses(reference), rel=1e-6)


def test_a_checkpoint_from_before_the_weights_fingerprint_resumes(tmp_path, capsys, tiny_store, tiny_target):
    """A run checkpointed by an eaglet whose target record had no weights fingerprint resumes after the upgrade, to
    the same losses as a run never stopped."""
    reference = tmp_path / "reference"
    assert run_cli(train_args(tiny_store, reference, tiny_target, "--max-steps", "6"), capsys)[0] == 0
    out = tmp_path / "run"
    args = train_args(tiny_store, out, tiny_target, "--max-steps", "6", "--save-every", "3")
    assert run_cli(args, capsys)[0] == 0
    checkpoint = out / "checkpoints" / "step-000003"
    record = json.loads((checkpoint / "trainer.json").read_text())
    del record["identity"]["target"]["weights_hash"]
    (checkpoint / "trainer.json").write_text(json.dumps(record))
    shutil.rmtree(out / "checkpoints" / "step-000006")
    code, _, err = run_cli(args, capsys)
    assert code == 0 and "resuming from" in err, err
    assert train_losses(out) == pytest.approx(train_losses(reference), rel=1e-6)


def test_an_eagle31_draft_trains_resumes_as_itself_and_is_evaluated_as_trained(
    tmp_path, capsys, tiny_store, tiny_target
):
    """EAGLE 3.1 (a norm per aux feature, the normed state fed back): trained and saved with its norms, its
    checkpoint refused to an EAGLE-3 resume, and `eaglet eval` of its vLLM export decodes with the draft the same
    logits as the trained one (the norms travel and are read back)."""
    out = tmp_path / "run"
    args = train_args(tiny_store, out, tiny_target, "--max-steps", "6", "--save-every", "3", "--eagle-version", "3.1")
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert (config["fc_norm"], config["norm_before_fc"], config["norm_output"]) == (True, False, True)
    from eaglet.model.draft import load_draft

    trained = load_draft(out)
    assert [name for name in trained.serving_state_dict() if name.startswith("fc_norm.")] == [
        f"fc_norm.{i}.weight" for i in range(3)
    ]
    assert not torch.equal(trained.fc_norm[0].weight, torch.ones_like(trained.fc_norm[0].weight))  # it trained
    code, _, err = run_cli(train_args(tiny_store, out, tiny_target, "--max-steps", "9", "--eagle-version", "3"), capsys)
    assert code == 2 and "eagle_version='3.1', this run has '3'" in err, err
    export = tmp_path / "export"
    assert run_cli(["export", "--draft", out, "--format", "vllm", "--out", export], capsys)[0] == 0
    served = json.loads((export / "config.json").read_text())
    assert (served["fc_norm"], served["norm_output"]) == (True, True)
    exported = load_draft(export)
    aux = torch.randn(5, 3, trained.config.target_hidden_size)
    assert torch.allclose(exported.fuse(aux), trained.fuse(aux), atol=1e-2)  # bf16 export of a float32 draft
    assert (
        run_cli(
            [
                "eval",
                "--draft",
                export,
                "--out",
                tmp_path / "eval",
                "--max-prompts",
                "2",
                "--max-new-tokens",
                "8",
                "--target",
                tiny_target,
            ],
            capsys,
        )[0]
        == 0
    )
    assert json.loads((tmp_path / "eval" / "report.json").read_text())["lossless"] is True


def test_train_init_from_a_draft_continues_from_its_weights(tmp_path, capsys, tiny_store, tiny_target, tiny_draft):
    """--init-from a trained draft (or its bf16 export) starts where it ended: a lower first loss than a fresh start
    with the same seed; a start of other norms than --eagle-version asks for is one line, before anything trains."""
    losses = {}
    for name, start in (("fresh", None), ("trained", tiny_draft), ("exported", tmp_path / "export")):
        if name == "exported":
            assert run_cli(["export", "--draft", tiny_draft, "--format", "vllm", "--out", start], capsys)[0] == 0
        extra = ["--init-from", start] if start else []
        code, _, err = run_cli(train_args(tiny_store, tmp_path / name, tiny_target, "--max-steps", "2", *extra), capsys)
        assert code == 0, err
        losses[name] = train_losses(tmp_path / name)[0]
    assert losses["trained"] < 0.9 * losses["fresh"], losses
    assert losses["exported"] == pytest.approx(losses["trained"], rel=1e-2)  # the same weights, rounded to bf16
    args = train_args(tiny_store, tmp_path / "refused", tiny_target, "--init-from", tiny_draft, "--eagle-version", "3")
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "it is EAGLE 3.1, --eagle-version asks for 3: leave it out" in err, err
    assert not (tmp_path / "refused").exists()


def test_online_takes_the_same_steps_as_offline(tmp_path, capsys, tiny_store, tiny_target, tiny_prepared):
    from eaglet.formats.store_manifest import read_manifest

    chunk = read_manifest(tiny_store)["tokens_per_shard"]
    offline, online = tmp_path / "offline", tmp_path / "online"
    assert run_cli(train_args(tiny_store, offline, tiny_target, "--max-steps", "8"), capsys)[0] == 0
    args = [
        "train",
        "--prepared",
        tiny_prepared,
        "--out",
        online,
        "--target",
        tiny_target,
        *BASE,
        "--max-steps",
        "8",
        "--set",
        f"online_chunk_tokens={chunk}",
    ]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    # the store holds bf16 features, the live target float32: equal up to that rounding
    assert train_losses(online) == pytest.approx(train_losses(offline), rel=2e-2)


def test_online_training_uses_the_layers_asked_for(tmp_path, capsys, tiny_target, tiny_prepared):
    """Online --layers captures those layers live: the same steps as a store extracted with the same --layers."""
    from conftest import extract_args

    from eaglet.formats.store_manifest import read_manifest

    store = tmp_path / "store"
    assert run_cli(extract_args(tiny_prepared, store, tiny_target, "--layers", "1,3,6"), capsys)[0] == 0
    offline, online = tmp_path / "offline", tmp_path / "online"
    assert run_cli(train_args(store, offline, tiny_target, "--max-steps", "4"), capsys)[0] == 0
    args = [
        "train",
        "--prepared",
        tiny_prepared,
        "--out",
        online,
        "--target",
        tiny_target,
        *BASE,
        "--max-steps",
        "4",
        "--layers",
        "1,3,6",
        "--set",
        f"online_chunk_tokens={read_manifest(store)['tokens_per_shard']}",
    ]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert json.loads((online / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
    assert train_losses(online) == pytest.approx(train_losses(offline), rel=2e-2)


@pytest.mark.parametrize(
    "source, layers, expected",
    [
        ("prepared", "1,3,99", "aux layer"),  # past the target's 8 layers
        ("prepared", "1,x,3", "--layers '1,x,3'"),  # not integers
        ("store", "1,3,6", "the store holds [2, 4, 5]"),  # the store was extracted from other layers
    ],
)
def test_bad_layers_for_training_are_one_line_errors_before_anything_loads(
    tmp_path, capsys, tiny_store, tiny_target, tiny_prepared, source, layers, expected
):
    out = tmp_path / "run"
    given = ["--store", tiny_store] if source == "store" else ["--prepared", tiny_prepared]
    code, _, err = run_cli(
        ["train", *given, "--out", out, "--target", tiny_target, *BASE, "--max-steps", "1", "--layers", layers], capsys
    )
    assert code != 0 and expected in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("parallel,port", [("ddp", 29533), ("fsdp2", 29534)])
def test_two_processes_equal_one_process_with_accumulation(tmp_path, capsys, tiny_store, tiny_target, parallel, port):
    """torchrun with 2 gloo processes takes the same steps as one process with the same global batch;
    under FSDP2 the gathered checkpoint and draft are whole, and a rerun resumes from them."""
    from safetensors.torch import load_file

    single = tmp_path / "single"
    on_cpu = ("--device", "cpu")  # gloo processes; on a machine with one GPU, two processes would share it
    args = train_args(tiny_store, single, tiny_target, "--max-steps", "6", "--grad-accum", "2", *on_cpu)
    assert run_cli(args, capsys)[0] == 0
    multi = tmp_path / parallel
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(port),
        "-m",
        "eaglet.cli",
        *map(
            str,
            train_args(
                tiny_store, multi, tiny_target, "--max-steps", "6", "--parallel", parallel, "--eval-every", "3", *on_cpu
            ),
        ),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert train_losses(multi) == pytest.approx(train_losses(single), rel=1e-5)
    a, b = load_file(str(single / "model.safetensors")), load_file(str(multi / "model.safetensors"))
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)
    again = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert again.returncode == 0 and "resuming from" in again.stderr, again.stderr[-3000:]
    for name, value in load_file(str(multi / "model.safetensors")).items():  # loaded, nothing left to train
        torch.testing.assert_close(value, b[name], rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a node's GPUs: on a GPU machine")
def test_more_processes_than_gpus_is_a_one_line_error():
    from eaglet.errors import EagletError
    from eaglet.model.distributed import Dist

    beyond = torch.cuda.device_count()
    with pytest.raises(EagletError, match="--nproc-per-node"):
        Dist(rank=beyond, world=beyond + 1, local_rank=beyond).device("auto")


def test_store_from_another_target_is_refused(tmp_path, capsys, tiny_store):
    from conftest import tiny_llama_dir

    other = tiny_llama_dir(tmp_path / "other", tokenizer_family="gemma")
    code, _, err = run_cli(train_args(tiny_store, tmp_path / "run", other, "--max-steps", "2"), capsys)
    assert code == 2 and "preflight failed for train: store:" in err and "extract with this --target" in err
    code, _, err = run_cli(
        train_args(tiny_store, tmp_path / "run", other, "--max-steps", "2", "--skip-preflight"), capsys
    )
    assert code == 2 and "extracted from target tiny-target0" in err


def test_needs_exactly_one_input(tmp_path, capsys, tiny_target):
    code, _, err = run_cli(["train", "--out", tmp_path / "r", "--target", tiny_target], capsys)
    assert code == 2 and "needs exactly one of --store and --prepared" in err
    code, _, err = run_cli(["train", "--out", tmp_path / "r", "--target", tiny_target, "--skip-preflight"], capsys)
    assert code == 2 and "exactly one input" in err


def store_of(root, rows, target):
    """A prepared set of ``rows`` and its store, made in process."""
    from conftest import write_jsonl
    from rich.console import Console

    from eaglet.config import ExtractConfig, PrepareConfig
    from eaglet.data.prepare import run_prepare
    from eaglet.extract.extractor import run_extract

    data, quiet = write_jsonl(root / "conversations.jsonl", rows), Console(quiet=True)
    run_prepare(PrepareConfig(inputs=[str(data)], out=str(root / "prepared"), target=str(target)), quiet)
    run_extract(ExtractConfig(prepared=str(root / "prepared"), out=str(root / "store"), reserve_gb=0), quiet)
    return root / "store"


@pytest.fixture(scope="module")
def held_out_stores(tmp_path_factory, tiny_target):
    """Stores of conversations the tiny store never saw: one apart, one that also holds a training conversation
    under another id."""
    from conftest import small_conversations

    unseen = [dict(row, id=f"h{i}") for i, row in enumerate(small_conversations(12, seed=7))]
    copied = dict(small_conversations(60)[5], id="renamed-c5")  # tiny_prepared's conversation c5
    apart = store_of(tmp_path_factory.mktemp("apart"), unseen, tiny_target)
    leaky = store_of(tmp_path_factory.mktemp("leaky"), unseen[:6] + [copied] + unseen[6:], tiny_target)
    return apart, leaky


def test_time_budget_and_separate_eval_store(tmp_path, capsys, tiny_store, tiny_target, held_out_stores):
    out = tmp_path / "run"
    apart, _ = held_out_stores
    code, _, err = run_cli(
        train_args(
            tiny_store, out, tiny_target, "--max-steps", "500", "--max-minutes", "0.0001", "--eval-store", apart
        ),
        capsys,
    )
    assert code == 0, err
    assert "stopped at step 1" in err
    assert (out / "checkpoints" / "step-000001").is_dir()
    evals = [r for r in read_metrics(out) if r["kind"] == "eval"]
    assert len(evals) == 1 and evals[0]["eval_tokens"] > 0


def test_an_eval_store_holding_training_samples_is_refused(
    tmp_path, capsys, tiny_store, tiny_prepared, tiny_target, held_out_stores
):
    """Held-out numbers over training samples are training numbers: the training store itself, or a store holding
    one training conversation under another id, is refused before any step, naming the sample."""
    _, leaky = held_out_stores
    for eval_store, message in (
        (tiny_store, "60 of its 60 samples are training samples (first: 'c"),
        (leaky, "1 of its 13 samples are training samples (first: 'renamed-c5', trained as 'c5')"),
    ):
        code, _, err = run_cli(
            train_args(tiny_store, tmp_path / "run", tiny_target, "--max-steps", "2", "--eval-store", eval_store),
            capsys,
        )
        assert code == 2 and message in err and "drop --eval-store" in err and "Traceback" not in err, err
        assert not (tmp_path / "run" / "checkpoints").exists()
    online = ["train", "--prepared", tiny_prepared, "--out", tmp_path / "run", "--target", tiny_target, *BASE]
    code, _, err = run_cli([*online, "--max-steps", "2", "--eval-store", leaky], capsys)  # online: the same
    assert code == 2 and "trained as 'c5'" in err, err


def test_padding_to_the_budget_does_not_change_the_loss():
    from test_ttt import tiny_setup

    from eaglet.train.data import FeatureBatch, pad_to_budget
    from eaglet.train.ttt import TTTInputs, documents, ttt_forward

    draft, inputs = tiny_setup()
    batch = FeatureBatch(
        input_ids=inputs.input_ids,
        loss_mask=inputs.loss_mask.to(torch.uint8),
        aux=inputs.aux,
        last=torch.zeros(len(inputs.input_ids), 32, dtype=torch.float64),
        doc_offsets=torch.tensor([0, 7, 12, 19]),
        sample_index=torch.arange(3),
    )
    padded = pad_to_budget(batch, 32)
    assert padded.tokens == 32 and padded.doc_offsets.tolist() == [0, 7, 12, 19, 32]
    assert not padded.aux[19:].any() and not padded.input_ids[19:].any() and not padded.loss_mask[19:].any()
    assert torch.equal(padded.aux[:19], batch.aux)
    doc_ids, positions, doc_end = documents(padded.doc_offsets, torch.device("cpu"))
    extra = 32 - 19
    grown = TTTInputs(
        input_ids=padded.input_ids,
        aux=padded.aux,
        loss_mask=padded.loss_mask.bool(),
        doc_ids=doc_ids,
        positions=positions,
        doc_end=doc_end,
        teacher_logits=torch.cat(
            [inputs.teacher_logits, torch.randn(extra, inputs.teacher_logits.shape[1], dtype=torch.float64)]
        ),
        teacher_in_vocab=torch.cat([inputs.teacher_in_vocab, torch.ones(extra, dtype=torch.bool)]),
    )
    a, b = ttt_forward(draft, inputs, 3), ttt_forward(draft, grown, 3)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-12, atol=1e-12)


def test_frozen_head_stays_the_targets_rows_and_norm_starts_from_the_targets(tmp_path, capsys, tiny_store, tiny_target):
    from safetensors.torch import load_file

    from eaglet.model.target import load_head_weights, resolve_target

    head = load_head_weights(resolve_target(str(tiny_target)).path)
    out = tmp_path / "run"
    code, _, err = run_cli(
        train_args(tiny_store, out, tiny_target, "--max-steps", "3", "--set", "freeze_lm_head=true"), capsys
    )
    assert code == 0, err
    weights = load_file(str(out / "model.safetensors"))
    used = torch.arange(len(weights["d2t"])) + weights["d2t"]
    assert torch.equal(weights["lm_head.weight"], head.lm_head[used].float())  # never moved
    assert not torch.equal(weights["fc.weight"], torch.zeros_like(weights["fc.weight"]))
    # the draft's final norm started from the target's (then trained): three small steps stay close to it
    assert head.final_norm is not None and torch.allclose(weights["norm.weight"], head.final_norm.float(), atol=0.05)
    assert not torch.allclose(head.final_norm.float(), torch.ones_like(head.final_norm.float()), atol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled FlexAttention runs on GPUs only")
def test_evaluation_reuses_the_training_kernels_on_gpu(tmp_path, capsys, tiny_store, tiny_target):
    """Past dynamo's recompile limit FlexAttention silently runs its dense fallback (45 GB at a 16k budget):
    training + held-out evaluation must fit in the kernels compiled for training. (Dynamo's caches are reset
    first: kernels earlier tests compiled for other shapes count toward the limit; on the H200 this test failed
    after the FlexAttention gradient tests and passed alone.)"""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        code, _, err = run_cli(
            train_args(tiny_store, tmp_path / "run", tiny_target, "--max-steps", "12", "--device", "cuda"), capsys
        )
    assert code == 0, err
    assert [r for r in read_metrics(tmp_path / "run") if r["kind"] == "eval"]


def test_an_unknown_attention_kernels_value_is_a_one_line_error(tmp_path, capsys, tiny_store, tiny_target):
    out = tmp_path / "run"
    code, _, err = run_cli(
        train_args(tiny_store, out, tiny_target, "--max-steps", "1", "--set", "attention_kernels=two"), capsys
    )
    assert code == 2 and "attention_kernels" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (
        err
    )
    assert not out.exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="stream synchronisation is a GPU matter")
@pytest.mark.parametrize("prefetched", [False, True])
def test_moving_a_batch_to_the_gpu_never_waits_for_the_stream(prefetched):
    """A pageable `.to("cuda")` waits for the queued kernels: each step would wait for the previous one
    to finish before queuing its own work. A batch's inputs (features, ids, masks, documents, teacher)
    reach the device without any synchronising call — padded here, or (the training loop) padded into
    pinned memory ahead of time by the prefetch thread."""
    from eaglet.train.data import FeatureBatch, pad_to_budget
    from eaglet.train.loss import TeacherHead
    from eaglet.train.step import device_inputs

    tokens, hidden = 40, 16
    batch = FeatureBatch(
        input_ids=torch.randint(0, 50, (tokens,)),
        loss_mask=torch.ones(tokens, dtype=torch.uint8),
        aux=torch.randn(tokens, 3, hidden).bfloat16(),
        last=torch.randn(tokens, hidden).bfloat16(),
        doc_offsets=torch.tensor([0, 25, tokens]),
        sample_index=torch.tensor([0, 1]),
    )
    cuda = torch.device("cuda")
    teacher = TeacherHead(torch.randn(50, hidden, device=cuda), torch.zeros(20, dtype=torch.long, device=cuda))
    budget = 64
    if prefetched:
        batch = pad_to_budget(batch, budget, pin=True)
        assert batch.aux.is_pinned() and batch.input_ids.is_pinned()
        budget = None
    device_inputs(batch, teacher, cuda, torch.float32, budget)  # warm-up: pinned-memory and kernel set-up
    torch.cuda.set_sync_debug_mode("error")
    try:
        inputs = device_inputs(batch, teacher, cuda, torch.float32, budget)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert inputs.aux.shape == (64, 3, hidden) and inputs.aux.dtype == torch.float32
    assert inputs.doc_ids.device.type == "cuda" and int(inputs.loss_mask.sum()) == tokens


def test_a_figure_is_drawn_once_it_has_two_points(tmp_path):
    """A run with one held-out evaluation (the CPU demo's) gets its loss curve, and no accuracy or τ figure of one
    dot; a second evaluation draws them."""
    from eaglet.train.metrics import plot_run

    rows = [{"kind": "train", "step": s, "loss": 3.0 - s / 10} for s in (1, 2, 3)]
    rows.append({"kind": "eval", "step": 3, "tokens": 384, "acceptance_length": 2.2, "acc": [0.4, 0.2]})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [p.name for p in plot_run(tmp_path)] == ["loss.png"]
    with (tmp_path / "metrics.jsonl").open("a") as metrics:
        metrics.write(
            json.dumps({"kind": "eval", "step": 6, "tokens": 768, "acceptance_length": 2.3, "acc": [0.5, 0.3]}) + "\n"
        )
    assert [p.name for p in plot_run(tmp_path)] == ["loss.png", "accuracy.png", "tau.png"]
