"""`eaglet run`: every stage from one YAML; skipped when done with the same settings and inputs, re-run
from the first change on; --plan runs nothing; --only/--from; bad configs refused in one line."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import run_cli, small_conversations, write_jsonl
from rich.console import Console

from eaglet.run.pipeline import Pipeline
from eaglet.run.run_config import load_run_config


def run_config(tmp_path: Path, target: Path, **changes) -> Path:
    data = write_jsonl(tmp_path / "conversations.jsonl", small_conversations(40))
    prompts = write_jsonl(
        tmp_path / "prompts.jsonl", [{"id": f"p{i}", "prompt": "the cat sat on", "split": "heldout"} for i in range(2)]
    )
    config = {
        "out": str(tmp_path / "run"),
        "target": str(target),
        "prepare": {"inputs": [str(data)]},
        "extract": {"shard_mb": 0.05, "reserve_gb": 0},
        "train": {"max_steps": 6, "token_budget": 128, "lr": 0.003, "log_every": 2, "eval_every": 3, "device": "cpu"},
        "export": {"formats": ["vllm", "sglang"]},
        "eval": {"prompts": [str(prompts)], "max_new_tokens": 8, "depth": 2, "device": "cpu"},
    }
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        config[section][key] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def statuses(run_dir: Path, out: str) -> dict[str, str]:
    """stage -> ran/skipped, from the summary table."""
    found = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│") if c.strip()]
        if (
            len(cells) >= 2
            and cells[0] in ("prepare", "extract", "train", "export", "eval")
            and cells[1] in ("ran", "skipped")
        ):
            found[cells[0]] = cells[1]
    return found


def test_run_all_then_skip_then_rerun_from_the_change(tmp_path, capsys, tiny_target):
    config = run_config(tmp_path, tiny_target)
    run_dir = tmp_path / "run"
    code, out, err = run_cli(["run", config, "--plan"], capsys)
    assert code == 0, err
    assert "not run yet" in out and not run_dir.exists()  # --plan writes nothing

    code, out, err = run_cli(["run", config], capsys)
    assert code == 0, err
    assert statuses(run_dir, out) == {s: "ran" for s in ("prepare", "extract", "train", "export", "eval")}
    for path in (
        "prepared/manifest.json",
        "store/manifest.json",
        "draft/model.safetensors",
        "export/vllm/config.json",
        "export/sglang/config.json",
        "eval/report.json",
        "run.json",
    ):
        assert (run_dir / path).is_file(), path
    assert "τ " in out and "lossless True" in out
    assert f"--speculative-draft-model-path {run_dir / 'export' / 'sglang'}" in out  # how to serve, with real paths
    assert f'"model": "{run_dir / "export" / "vllm"}"' in out
    card = (run_dir / "export" / "vllm" / "README.md").read_text()
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert f"{report['acceptance_length']:.2f}" in card  # the model card quotes the measured τ

    code, out, err = run_cli(["run", config], capsys)
    assert code == 0, err
    assert statuses(run_dir, out) == {s: "skipped" for s in ("prepare", "extract", "train", "export", "eval")}

    code, out, err = run_cli(["run", config, "--plan", "--set", "train.lr=0.001"], capsys)  # the README's way
    assert code == 0 and out.count("settings or inputs changed") == 1 and re.search(r"train\s*│ run ", out), err
    changed = run_config(tmp_path, tiny_target, train__lr=0.001)
    code, out, err = run_cli(["run", changed, "--plan"], capsys)
    assert "settings or inputs changed" in out
    code, out, err = run_cli(["run", changed], capsys)
    assert code == 0, err
    assert statuses(run_dir, out) == {
        "prepare": "skipped",
        "extract": "skipped",
        "train": "ran",
        "export": "ran",
        "eval": "ran",
    }

    code, out, err = run_cli(["run", changed, "--only", "eval"], capsys)
    assert code == 0, err
    assert statuses(run_dir, out) == {
        "prepare": "skipped",
        "extract": "skipped",
        "train": "skipped",
        "export": "skipped",
        "eval": "ran",
    }
    code, out, err = run_cli(["run", changed, "--from", "export"], capsys)
    assert code == 0, err
    assert statuses(run_dir, out)["export"] == "ran" and statuses(run_dir, out)["train"] == "skipped"

    prompts = tmp_path / "prompts.jsonl"  # eval's prompt file edited: eval alone runs again, and says why
    write_jsonl(prompts, [{"id": "p0", "prompt": "the dog ran to", "split": "heldout"}])
    plans = {p.name: p for p in Pipeline(load_run_config(changed), changed, Console(quiet=True)).plan()}
    assert (plans["eval"].action, plans["eval"].reason) == ("run", f"{prompts} changed")
    assert all(plans[name].action == "skip" for name in ("prepare", "extract", "train", "export"))


def test_a_moved_run_directory_keeps_its_finished_stages(tmp_path, capsys, tiny_target):
    """Moving a run (or copying it to another machine) re-runs nothing, and a stage re-run there finds the
    store's prepared set beside the store, not at the absolute path recorded at extraction (gone)."""
    config = run_config(tmp_path, tiny_target, eval__max_new_tokens=4)
    code, out, err = run_cli(["run", config], capsys)
    assert code == 0, err
    code, out, err = run_cli(["run", config], capsys)
    assert code == 0, err
    assert statuses(tmp_path / "run", out) == {s: "skipped" for s in ("prepare", "extract", "train", "export", "eval")}

    moved = tmp_path / "elsewhere" / "run"
    moved.parent.mkdir()
    (tmp_path / "run").rename(moved)
    code, out, err = run_cli(["run", config, "--out", str(moved)], capsys)
    assert code == 0, err
    assert statuses(moved, out) == {s: "skipped" for s in ("prepare", "extract", "train", "export", "eval")}
    code, out, err = run_cli(["run", config, "--out", str(moved), "--from", "train"], capsys)
    assert code == 0, err
    assert statuses(moved, out)["train"] == "ran"
    code, out, err = run_cli(["store", "verify", str(moved / "store")], capsys)
    assert code == 0 and "not found" not in err, err  # token ids checked against the moved prepared set


def test_killed_run_resumes_with_the_same_command(tmp_path, tiny_target):
    config = run_config(tmp_path, tiny_target, train__max_steps=400, train__save_every=20)
    command = [sys.executable, "-m", "eaglet.cli", "run", str(config)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = tmp_path / "run" / "draft" / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not any(checkpoints.glob("step-*/trainer.json")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    state = json.loads((tmp_path / "run" / "run.json").read_text())["stages"]
    assert state["extract"]["complete"] and not state["train"]["complete"]
    resumed = subprocess.run(command, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stderr and "interrupted: resumes" in resumed.stderr
    assert statuses(tmp_path / "run", resumed.stdout) == {
        "prepare": "skipped",
        "extract": "skipped",
        "train": "ran",
        "export": "ran",
        "eval": "ran",
    }


def test_an_edited_input_file_reruns_its_stage_and_a_touched_one_does_not(tmp_path, capsys, tiny_target):
    """The user's conversations are part of prepare's fingerprint by content: rows added to the file re-run prepare
    (not "done" on the old rows); a file rewritten with the same bytes is still done."""
    config = run_config(tmp_path, tiny_target)
    data = tmp_path / "conversations.jsonl"
    assert run_cli(["run", config, "--only", "prepare"], capsys)[0] == 0

    def prepare_plan():
        pipeline = Pipeline(load_run_config(config), config, Console(quiet=True))
        return next(p for p in pipeline.plan() if p.name == "prepare")

    assert (prepare_plan().action, prepare_plan().reason) == ("skip", "done, same settings and inputs")
    data.write_bytes(data.read_bytes())  # a new modification time, the same content
    assert prepare_plan().action == "skip"
    write_jsonl(data, small_conversations(41))
    assert (prepare_plan().action, prepare_plan().reason) == ("run", f"{data} changed")
    assert run_cli(["run", config, "--only", "prepare"], capsys)[0] == 0
    manifest = json.loads((tmp_path / "run" / "prepared" / "manifest.json").read_text())
    assert manifest["counts"]["rows_read"] == 41
    assert prepare_plan().action == "skip"


def test_a_target_rewritten_in_place_reruns_the_run(tmp_path, capsys, tiny_target):
    """A new fine-tune saved over the target's directory keeps its config and tokenizer; the run re-runs (its
    stages' outputs came from the old weights) and --plan says why."""
    from safetensors.torch import load_file, save_file

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    config = run_config(tmp_path, target)
    assert run_cli(["run", config, "--only", "prepare"], capsys)[0] == 0

    def prepare_plan():
        pipeline = Pipeline(load_run_config(config), config, Console(quiet=True))
        return next(p for p in pipeline.plan() if p.name == "prepare")

    assert prepare_plan().action == "skip"
    tensors = load_file(target / "model.safetensors")
    save_file({n: t * 1.01 for n, t in tensors.items()}, target / "model.safetensors", metadata={"format": "pt"})
    assert (prepare_plan().action, prepare_plan().reason) == ("run", f"target {target} changed (weights)")


def test_a_preempted_train_stops_the_run_and_the_same_command_resumes_it(tmp_path, tiny_target):
    """A scheduler's SIGTERM mid-train: the checkpoint is kept, the run stops there (no export of an unfinished
    draft, the train stage not complete) and the same command resumes training from the checkpoint."""
    config = run_config(tmp_path, tiny_target, train__max_steps=400, train__save_every=20)
    command = [sys.executable, "-m", "eaglet.cli", "run", str(config)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    checkpoints = tmp_path / "run" / "draft" / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not any(checkpoints.glob("step-*/trainer.json")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "train stopped at step" in err and "by SIGTERM; checkpoint saved" in err and "Traceback" not in err
    state = json.loads((tmp_path / "run" / "run.json").read_text())["stages"]
    assert not state["train"]["complete"] and "export" not in state
    assert not (tmp_path / "run" / "export").exists()
    resumed = subprocess.run(command, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stderr
    assert statuses(tmp_path / "run", resumed.stdout)["train"] == "ran"
    assert json.loads((tmp_path / "run" / "run.json").read_text())["stages"]["train"]["result"].startswith("step 400")


def test_bad_run_configs_are_one_line_errors(tmp_path, capsys, tiny_target):
    config = run_config(tmp_path, tiny_target)
    data = yaml.safe_load(config.read_text())
    cases = [
        ({**data, "trian": {}}, "unknown key 'trian'"),
        ({**data, "train": {**data["train"], "out": "x"}}, "train.out is set by `eaglet run`"),
        ({**data, "train": {**data["train"], "lr": -1}}, "section 'train': 'lr'"),
        ({**data, "prepare": {}}, "prepare.inputs is required without a 'regenerate' section"),
    ]
    for content, message in cases:
        config.write_text(yaml.safe_dump(content))
        code, _, err = run_cli(["run", config], capsys)
        assert code == 2 and message in err and "Traceback" not in err, (message, err)
    config.write_text(yaml.safe_dump(data))
    code, _, err = run_cli(["run", config, "--only", "nosuch"], capsys)
    assert code == 2 and "no stage 'nosuch'" in err
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    for args in (["run", config, "--out", taken], ["run", config, "--out", taken, "--plan"], ["demo", "--out", taken]):
        code, out, err = run_cli([*args, "--plan"] if args[0] == "demo" else args, capsys)
        assert code == 2 and "a file, not a directory" in err and taken.read_text() == "mine", err
        assert "stage" not in out  # no plan sized for a run that cannot start


def test_a_run_recorded_before_target_fingerprints_keeps_its_finished_stages(tmp_path, capsys, tiny_target):
    """run.json written by an eaglet whose fingerprints had no target hashes (its records carry no 'target'): after
    the upgrade its finished stages are still done, not deleted and redone (an extraction can be days)."""
    config = run_config(tmp_path, tiny_target)
    assert run_cli(["run", config, "--only", "prepare"], capsys)[0] == 0
    run_file = tmp_path / "run" / "run.json"
    record = json.loads(run_file.read_text())
    pipeline = Pipeline(load_run_config(config), config, Console(quiet=True))
    prepare = next(stage for stage in pipeline.stages if stage.name == "prepare")
    del record["stages"]["prepare"]["target"]
    record["stages"]["prepare"]["fingerprint"] = pipeline._fingerprint(prepare, record["stages"], with_target=False)
    run_file.write_text(json.dumps(record))
    plan = next(p for p in Pipeline(load_run_config(config), config, Console(quiet=True)).plan() if p.name == "prepare")
    assert (plan.action, plan.reason) == ("skip", "done, same settings and inputs")


def test_an_out_holding_the_users_own_folders_is_refused(tmp_path, capsys, tiny_target):
    """`--out .` in a project with its own eval/ folder: a stage starts by deleting its output, so the user's folder
    would be lost. Refused, --plan included; a directory with other files only is fine."""
    config = run_config(tmp_path, tiny_target)
    project = tmp_path / "project"
    (project / "eval").mkdir(parents=True)
    (project / "eval" / "my_script.py").write_text("print('mine')")
    for extra in ([], ["--plan"]):
        code, _, err = run_cli(["run", config, "--out", project, *extra], capsys)
        assert code == 2 and "Traceback" not in err, err
        assert f"--out {project}: holds eval, which this run would replace" in err and "choose a new or empty" in err
    assert (project / "eval" / "my_script.py").read_text() == "print('mine')"
    (project / "eval" / "my_script.py").rename(project / "my_script.py")
    (project / "eval").rmdir()
    code, _, err = run_cli(["run", config, "--out", project, "--only", "prepare"], capsys)
    assert code == 0 and (project / "my_script.py").is_file(), err


def test_bad_options_of_the_new_commands_are_one_line_errors(tmp_path, capsys, tiny_store, tiny_target):
    cases = [
        (["demo", "--scale", "tpu", "--out", tmp_path / "d"], "--scale tpu: choose cpu, gpu or auto"),
    ]
    if not torch.cuda.is_available():  # the GPU demo's sizes on a CPU would run for hours: said, with the CPU demo
        cases += [
            (["demo", "--scale", "gpu", "--out", tmp_path / "d", *plan], "sees no CUDA GPU")
            for plan in ([], ["--plan"])
        ]
    cases += [
        (
            ["train", "--store", tiny_store, "--target", tiny_target, "--out", tmp_path / "t", "--parallel", "zero3"],
            "--parallel: ",
        ),
        (
            ["train", "--store", tiny_store, "--target", tiny_target, "--out", tmp_path / "t", "--draft-layers", "0"],
            "--draft-layers: ",
        ),
    ]
    for args, message in cases:
        code, _, err = run_cli(args, capsys)
        assert code == 2 and message in err and "Traceback" not in err, (args, err)
    assert not (tmp_path / "d").exists() and not (tmp_path / "t").exists()  # nothing written


def test_heldout_prompts_are_answered_extracted_and_trained_against(tmp_path, capsys, tiny_target):
    prompts = write_jsonl(
        tmp_path / "split_prompts.jsonl",
        [{"id": f"t{i}", "prompt": f"tell me about the number {i}", "split": "train"} for i in range(6)]
        + [{"id": f"h{i}", "prompt": f"what comes after {i}?", "split": "heldout"} for i in range(3)],
    )
    config = yaml.safe_load(run_config(tmp_path, tiny_target).read_text())
    config.pop("prepare")
    config |= {
        "regenerate": {
            "prompts": [str(prompts)],
            "split": "train",
            "max_new_tokens": 6,
            "n": 2,
            "temperature": 0.8,
            "device": "cpu",
        },
        "heldout": {"max_prompts": 2},
    }
    path = tmp_path / "heldout.yaml"
    path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    code, out, err = run_cli(["run", path], capsys)
    assert code == 0, err
    held = [json.loads(line) for line in (run_dir / "heldout.jsonl").read_text().splitlines()]
    assert sorted(row["id"].split("#")[0] for row in held) == ["h0", "h1"]  # held-out prompts only, greedy, once each
    trained_on = (run_dir / "regenerated.jsonl").read_text()
    assert '"h0' not in trained_on and trained_on.count("\n") == 12  # 6 train prompts x n=2
    assert (run_dir / "store_heldout" / "manifest.json").is_file()
    train_config = json.loads((run_dir / "draft" / "train_config.json").read_text())["config"]
    assert train_config["eval_store"] == str(run_dir / "store_heldout")
    assert any(
        json.loads(line)["kind"] == "eval" for line in (run_dir / "draft" / "metrics.jsonl").read_text().splitlines()
    )

    code, out, err = run_cli(["run", path], capsys)
    assert code == 0 and statuses(run_dir, out) == {
        s: "skipped" for s in ("prepare", "extract", "train", "export", "eval")
    }
    config["heldout"]["max_prompts"] = 3  # a different held-out set: regenerate .. train run again; training does
    path.write_text(yaml.safe_dump(config))  # not read the held-out store, so the same draft needs no new export/eval
    code, out, err = run_cli(["run", path], capsys)
    assert code == 0, err
    assert statuses(run_dir, out) == {
        "prepare": "ran",
        "extract": "ran",
        "train": "ran",
        "export": "skipped",
        "eval": "skipped",
    }
    assert len((run_dir / "heldout.jsonl").read_text().splitlines()) == 3

    for broken, message in (
        ({**config, "regenerate": {**config["regenerate"], "split": "all"}}, "regenerate.split: train"),
        ({**config, "extract": None}, "'heldout' needs a 'regenerate' section"),
    ):
        path.write_text(yaml.safe_dump(broken))
        code, _, err = run_cli(["run", path], capsys)
        assert code == 2 and message in err and "Traceback" not in err, err


def test_plan_counts_the_prompts_each_split_would_regenerate(tmp_path):
    from eaglet.run.plan import _count_rows

    rows = [{"prompt": "a", "split": "train"}] * 3 + [{"prompt": "b", "split": "heldout"}] * 2 + [{"prompt": "c"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows + ["{not json"])
    assert (_count_rows([str(path)], "train"), _count_rows([str(path)], "heldout"), _count_rows([str(path)])) == (
        4,
        2,
        6,
    )


@pytest.mark.parametrize(
    "evaluation, message",
    [
        ({"batch_size": 2, "mode": "tree"}, "eval: --batch-size 2: batched decoding drafts chains greedily"),
        ({"tune": True}, "eval: --tune times tree shapes; add --mode tree"),
    ],
)
def test_eval_settings_no_decoder_runs_are_refused_before_the_first_stage(
    tmp_path, capsys, tiny_target, evaluation, message
):
    config = run_config(tmp_path, tiny_target)
    data = yaml.safe_load(config.read_text())
    data["eval"] = (data.get("eval") or {}) | evaluation
    config.write_text(yaml.safe_dump(data))
    code, _, err = run_cli(["run", config], capsys)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()  # refused before prepare, not after training


def test_an_eval_prompt_too_long_for_the_target_is_refused_before_the_first_stage(tmp_path, capsys, tiny_target):
    """eval's prompt files exist before the run: one too long for the target's context (512 positions) stops the run
    and its plan before prepare, not after training."""
    long = write_jsonl(tmp_path / "long.jsonl", [{"id": "long", "prompt": "word " * 600, "split": "heldout"}])
    config = run_config(tmp_path, tiny_target, eval__prompts=[str(long)])
    for args in (["run", config, "--plan"], ["run", config]):
        code, _, err = run_cli(args, capsys)
        assert code == 2 and f"preflight failed for eval: prompts: {long}:1: the prompt is " in err, err
        assert "passes the target's context of 512" in err and "Traceback" not in err
        assert not (tmp_path / "run").exists()


def test_a_run_with_synthesize_answers_the_targets_own_prompts_beside_the_given_ones(tmp_path, capsys, tiny_target):
    """`synthesize:` runs first; regenerate answers the given prompts and the synthesized ones (their own splits), and
    the plan counts them before they exist."""
    from rich.console import Console

    from eaglet.run import Pipeline, load_run_config

    config = run_config(tmp_path, tiny_target)
    data = yaml.safe_load(config.read_text())
    data["synthesize"] = {"count": 100, "device": "cpu"}
    data["regenerate"] = {"prompts": [str(tmp_path / "prompts.jsonl")], "device": "cpu"}
    data["prepare"] = {}
    config.write_text(yaml.safe_dump(data))
    pipeline = Pipeline(load_run_config(config), config, Console(quiet=True))
    assert [stage.name for stage in pipeline.stages][:2] == ["synthesize", "regenerate"]
    regenerate = pipeline.stages[1]
    assert regenerate.config.prompts[-1] == str(tmp_path / "run" / "synthesized.jsonl")
    assert regenerate.reads == ("synthesize",)  # its fingerprint follows the synthesized prompts
    evaluate = next(stage for stage in pipeline.stages if stage.name == "eval")  # judged on their held-out split too
    assert evaluate.config.prompts[-1] == str(tmp_path / "run" / "synthesized.jsonl")
    data["synthesize"]["heldout_fraction"] = 0  # none held out: the eval reads only the given prompts
    config.write_text(yaml.safe_dump(data))
    evaluate = next(
        s for s in Pipeline(load_run_config(config), config, Console(quiet=True)).stages if s.name == "eval"
    )
    assert str(tmp_path / "run" / "synthesized.jsonl") not in evaluate.config.prompts
    del data["synthesize"]["heldout_fraction"]
    config.write_text(yaml.safe_dump(data))
    code, out, err = run_cli(["run", config, "--plan"], capsys)
    assert code == 0 and "synthesize" in out, err
    del data["regenerate"]
    data["prepare"] = {"inputs": [str(tmp_path / "conversations.jsonl")]}
    config.write_text(yaml.safe_dump(data))
    code, _, err = run_cli(["run", config, "--plan"], capsys)
    assert code == 2 and "'synthesize' writes prompts for `regenerate` to answer" in err, err
