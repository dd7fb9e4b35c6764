"""`eaglet preflight STAGE`: checks in seconds with no weights loaded; exit codes 0 / 1 (--strict warnings) / 2."""

from __future__ import annotations

import json

from conftest import run_cli, small_conversations, write_jsonl


def test_extract_preflight_passes_quickly_as_json(capsys, tmp_path, tiny_prepared, tiny_target):
    code, stdout, err = run_cli(
        [
            "preflight",
            "extract",
            "--json",
            "--prepared",
            tiny_prepared,
            "--target",
            tiny_target,
            "--out",
            tmp_path / "store",
            "--reserve-gb",
            "0",
        ],
        capsys,
    )
    assert code == 0, err
    report = json.loads(stdout)
    assert report["status"] == "pass" and report["seconds"] < 5
    names = [c["name"] for c in report["checks"]]
    assert names == [
        "config",
        "device",
        "prepared set",
        "target",
        "transformers API",
        "tokenizer",
        "context",
        "aux layer ids",
        "output",
        "disk",
        "memory",
    ]
    assert all(set(c) == {"name", "status", "detail", "fix"} for c in report["checks"])
    assert not (tmp_path / "store").exists()


def test_failures_exit_2_with_the_fix(capsys, tmp_path, tiny_prepared, tiny_target):
    code, stdout, _ = run_cli(
        [
            "preflight",
            "extract",
            "--json",
            "--prepared",
            tiny_prepared,
            "--target",
            tiny_target,
            "--out",
            tmp_path / "store",
            "--layers",
            "2,4,9",
        ],
        capsys,
    )
    assert code == 2
    failed = [c for c in json.loads(stdout)["checks"] if c["status"] == "fail"]
    assert failed[0]["name"] == "aux layer ids" and "1..7" in failed[0]["fix"]


def test_warnings_exit_1_only_with_strict(capsys, tmp_path, tiny_target):
    data = write_jsonl(tmp_path / "d.jsonl", small_conversations(3))
    (tmp_path / "out").mkdir()
    args = ["prepare", data, "--target", tiny_target, "--out", tmp_path / "out", "--overwrite"]
    assert run_cli(["preflight", *args], capsys)[0] == 0
    code, stdout, _ = run_cli(["preflight", "--strict", *args], capsys)
    assert code == 1 and "will be replaced" in stdout


def test_bad_data_row_is_caught_before_the_stage(capsys, tmp_path, tiny_target):
    data = write_jsonl(tmp_path / "d.jsonl", small_conversations(2) + ['{"messages": 7}'])
    code, stdout, _ = run_cli(
        ["preflight", "--json", "prepare", data, "--target", tiny_target, "--out", tmp_path / "o"], capsys
    )
    assert code == 2
    failed = [c for c in json.loads(stdout)["checks"] if c["status"] == "fail"]
    assert failed[0]["name"] == "data" and f"{data}:3" in failed[0]["detail"]


def test_train_and_eval_preflight(capsys, tmp_path, tiny_store, tiny_target, tiny_draft):
    code, stdout, err = run_cli(
        ["preflight", "--json", "train", "--store", tiny_store, "--target", tiny_target, "--out", tmp_path / "run"],
        capsys,
    )
    assert code == 0, stdout + err
    code, stdout, err = run_cli(
        [
            "preflight",
            "--json",
            "eval",
            "--draft",
            tiny_draft,
            "--target",
            tiny_target,
            "--out",
            tmp_path / "eval",
            "--prompts",
            write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}]),
        ],
        capsys,
    )
    assert code == 0, stdout + err
    assert {c["name"] for c in json.loads(stdout)["checks"]} >= {"target", "draft", "data", "memory"}


def test_unknown_stage(capsys):
    code, _, err = run_cli(["preflight", "bake"], capsys)
    assert code == 2 and "unknown stage 'bake'" in err


def test_skip_preflight_is_loud(capsys, tmp_path, tiny_target):
    data = write_jsonl(tmp_path / "d.jsonl", small_conversations(3))
    code, _, err = run_cli(
        ["prepare", data, "--target", tiny_target, "--out", tmp_path / "o", "--skip-preflight"], capsys
    )
    assert code == 0 and "PREFLIGHT SKIPPED for prepare" in err


def test_api_check_without_its_parser_warns_instead_of_crashing(monkeypatch):
    import sys

    from eaglet.preflight.checks import WARN, check_library_api

    monkeypatch.setitem(sys.modules, "griffe", None)  # as on a machine where griffe was never installed
    monkeypatch.delitem(sys.modules, "eaglet.apicheck.check", raising=False)
    check = check_library_api.__wrapped__("transformers")
    assert check.status == WARN and "griffe" in check.detail and "reinstall" in check.fix


def test_memory_checks_count_the_dtype_the_stage_will_load():
    from eaglet.preflight.stages import _device_bytes

    assert _device_bytes("cpu", "float32") == ("cpu", 4)  # eval's default: float32 even where auto means bf16
    assert _device_bytes("cpu", "bfloat16") == ("cpu", 2)
    assert _device_bytes("cpu") == ("cpu", 4)  # auto on CPU loads float32


def test_eval_preflight_checks_the_static_cache_before_any_load(capsys, tmp_path, tiny_target, tiny_draft):
    """`--cuda-graphs on` with a sliding-window target fails in preflight (its config alone tells), naming the fix."""
    import shutil

    sliding = tmp_path / "sliding"
    shutil.copytree(tiny_target, sliding)
    config = json.loads((sliding / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=16)
    (sliding / "config.json").write_text(json.dumps(config))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    results = {}
    for target in (tiny_target, sliding):
        code, stdout, err = run_cli(
            [
                "preflight",
                "--json",
                "eval",
                "--draft",
                tiny_draft,
                "--target",
                target,
                "--out",
                tmp_path / "eval",
                "--prompts",
                prompts,
                "--device",
                "cpu",
                "--cuda-graphs",
                "on",
            ],
            capsys,
        )
        results[target] = {c["name"]: c for c in json.loads(stdout)["checks"]}
    assert results[tiny_target]["static cache"]["status"] == "pass"
    check = results[sliding]["static cache"]
    assert check["status"] == "fail" and "sliding-window" in check["detail"] and "--cuda-graphs off" in check["fix"]


def test_train_preflight_counts_the_batches_a_recorded_step_keeps_on_the_gpu(tmp_path, tiny_store):
    """On a GPU the recorded step's next batches wait on the device (``train.graphed.Stager``): preflight's memory
    sum counts them, and only where the step is recorded."""
    from eaglet.config import TrainConfig
    from eaglet.formats.draft_config import DraftConfig
    from eaglet.model.sizing import STAGED_BATCHES, staged_batch_bytes
    from eaglet.preflight.stages import train_memory

    llama_8b = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                "vocab_size": 128_256}  # fmt: skip
    draft = DraftConfig.from_target(llama_8b, 32_000, (2, 16, 29))
    # no held-out split: its forwards beside a recorded step are counted apart
    config = TrainConfig(out=str(tmp_path / "run"), store=str(tiny_store), token_budget=2048, eval_fraction=0)
    recorded = train_memory(config, "cuda:0", 2, draft, 128_256, 0)
    eager = train_memory(config.model_copy(update={"cuda_graphs": False}), "cuda:0", 2, draft, 128_256, 0)
    on_cpu = train_memory(config, "cpu", 4, draft, 128_256, 0)
    assert f"{STAGED_BATCHES} batches copied ahead" in recorded[1]
    assert "copied ahead" not in eager[1] and "copied ahead" not in on_cpu[1]
    assert recorded[0] - eager[0] == STAGED_BATCHES * staged_batch_bytes(2048, 4096)
    # ids, mask, features, the target's argmax, documents
    assert staged_batch_bytes(2048, 4096) == 2048 * (8 + 1 + 4 * 4096 * 2 + 4 + 3 * 8)


def test_a_warm_up_as_long_as_the_run_is_said_before_and_while_training(capsys, tmp_path, tiny_store, tiny_target):
    """The default 20 warm-up steps on a short run leave the learning rate rising to the end: preflight warns when
    --max-steps says so, training when its packed epochs do."""
    base = ["train", "--store", tiny_store, "--target", tiny_target]
    code, stdout, err = run_cli(["preflight", "--json", *base, "--out", tmp_path / "a", "--max-steps", "5"], capsys)
    schedule = next(c for c in json.loads(stdout)["checks"] if c["name"] == "schedule")
    assert code == 0 and schedule["status"] == "warn", stdout + err
    assert "peaks at 24% of --lr" in schedule["detail"] and schedule["fix"] == "lower --warmup-steps, e.g. to 0"
    args = ["preflight", "--json", *base, "--out", tmp_path / "a", "--max-steps", "5", "--warmup-steps", "4"]
    code, stdout, err = run_cli(args, capsys)
    assert next(c for c in json.loads(stdout)["checks"] if c["name"] == "schedule")["status"] == "pass"
    code, stdout, err = run_cli([*base, "--out", tmp_path / "run", "--token-budget", "1024", "--epochs", "1"], capsys)
    steps = json.loads((tmp_path / "run" / "train_config.json").read_text())["total_steps"]
    assert code == 0 and steps <= 20, err
    assert f"--warmup-steps 20 is as long as the run ({steps} steps)" in err
