"""Input written to hurt: a store that asks for remote code, configs that expand or nest without end, non-finite
numbers, text that is not Unicode. Each is refused in one line (or, for the store, simply not obeyed), quickly."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import extract_args, run_cli, small_conversations, write_jsonl
from helpers import assert_refused

BOUNDED_SECONDS = 10  # a refused input is refused in seconds, not after a minute of expansion


def evil_target(root: Path, tiny_target: Path, marker: Path) -> Path:
    """The tiny target plus Python code that transformers imports only with trust_remote_code (it leaves a marker)."""
    target = root / "evil-target"
    shutil.copytree(tiny_target, target)
    (target / "evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class EvilConfig(LlamaConfig):\n    pass\n"
        "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n"
    )
    config = json.loads((target / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (target / "config.json").write_text(json.dumps(config))
    return target


def flip_a_byte(store: Path) -> None:
    shard = store / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 1
    shard.write_bytes(bytes(data))


def test_repair_never_takes_remote_code_from_the_store(tmp_path, capsys, tiny_prepared, tiny_target):
    marker = tmp_path / "remote-code-ran"
    target = evil_target(tmp_path, tiny_target, marker)
    store = tmp_path / "store"
    code, _, err = run_cli(extract_args(tiny_prepared, store, target), capsys)
    assert code == 0 and not marker.exists(), err
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["config"] |= {"trust_remote_code": True, "offload_dir": str(tmp_path / "elsewhere"), "placement": "split"}
    (store / "manifest.json").write_text(json.dumps(manifest))
    flip_a_byte(store)
    code, out, err = run_cli(["store", "verify", store, "--repair"], capsys)
    assert code == 0 and "repaired" in out, err
    assert not marker.exists() and not (tmp_path / "elsewhere").exists()
    flip_a_byte(store)  # the user's own flag is obeyed: the same store, repaired with --trust-remote-code (in a
    # process of its own: the imported remote code would change transformers' classes for every later test)
    subprocess.run(
        [sys.executable, "-m", "eaglet.cli", "store", "verify", str(store), "--repair", "--trust-remote-code"],
        capture_output=True,
        text=True,
    )
    assert marker.exists()


def alias_bomb(levels: int = 9) -> str:
    """YAML whose value expands to 9**levels strings through nested aliases (about 1 KB of text)."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, levels):
        lines.append(f"l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * 9) + "]")
    return "\n".join(lines) + f"\ntrain:\n  lr: *l{levels - 1}\n"


def refused_quickly(capsys, args, *fragments) -> str:
    started = time.monotonic()
    line = assert_refused(run_cli(args, capsys), *fragments)
    assert time.monotonic() - started < BOUNDED_SECONDS
    assert len(line) < 400, line  # the message repeats what was given, not its expansion
    return line


def test_a_yaml_alias_bomb_is_refused_in_seconds(tmp_path, capsys, tiny_store):
    config = tmp_path / "bomb.yaml"
    config.write_text(alias_bomb())
    assert len(config.read_bytes()) < 1500
    refused_quickly(
        capsys,
        ["train", "--config", config, "--store", tiny_store, "--out", tmp_path / "run"],
        str(config),
        "values once its aliases are expanded",
    )
    refused_quickly(capsys, ["run", config, "--plan"], str(config), "values once its aliases are expanded")
    levels = ["&v0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [
        f"&v{i} [" + ", ".join([f"*v{i - 1}"] * 9) + "]" for i in range(1, 9)
    ]
    refused_quickly(
        capsys,
        ["train", "--store", tiny_store, "--out", tmp_path / "run", "--set", f"lr=[{', '.join(levels)}]"],
        "--set lr",
        "values once its aliases are expanded",
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "text,message",
    [
        ("train:\n  lr: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper than"),
        ("train:\n  lr: " + "{a: " * 40 + "1" + "}" * 40 + "\n", "nested deeper than 32 levels"),
    ],
)
def test_a_deeply_nested_yaml_is_refused(tmp_path, capsys, tiny_store, text, message):
    config = tmp_path / "deep.yaml"
    config.write_text(text)
    refused_quickly(
        capsys, ["train", "--config", config, "--store", tiny_store, "--out", tmp_path / "run"], str(config), message
    )


def test_a_yaml_that_is_not_utf8(tmp_path, capsys, tiny_store):
    config = tmp_path / "latin1.yaml"
    config.write_bytes("train:\n  lr: 0.001  # r\u00e9glage\n".encode("latin-1"))
    refused_quickly(
        capsys,
        ["train", "--config", config, "--store", tiny_store, "--out", tmp_path / "run"],
        str(config),
        "not UTF-8 text",
        "save it as UTF-8",
    )


@pytest.mark.parametrize(
    "stage,args,option",
    [
        ("train", ["--lr", "inf"], "--lr: Input should be a finite number"),
        ("train", ["--lr", "nan"], "--lr: Input should be a finite number"),
        ("train", ["--set", "feature_noise_std=inf"], "--set feature_noise_std: Input should be a finite number"),
        (
            "train",
            ["--set", "feature_noise_std=1e300"],
            "--set feature_noise_std: Input should be less than or equal to 100",
        ),
        ("train", ["--epochs", "inf"], "--epochs: Input should be a finite number"),
        ("train", ["--set", "betas=[0.9, 1.5]"], "'betas.1': Input should be less than 1"),
        ("extract", ["--shard-mb", "inf"], "--shard-mb: Input should be a finite number"),
        ("eval", ["--temperature", "inf"], "--temperature: Input should be a finite number"),
        ("regenerate", ["--temperature", "nan"], "--temperature: Input should be a finite number"),
    ],
)
def test_every_float_option_is_finite_and_in_range(
    tmp_path, capsys, tiny_store, tiny_prepared, tiny_draft, stage, args, option
):
    out = tmp_path / "out"
    base = {
        "train": ["train", "--store", tiny_store, "--out", out],
        "extract": ["extract", "--prepared", tiny_prepared, "--out", out],
        "eval": ["eval", "--draft", tiny_draft, "--out", out],
        "regenerate": ["regenerate", "demo", "--out", tmp_path / "out.jsonl"],
    }[stage]
    refused_quickly(capsys, [*base, *args], option)
    assert not out.exists() and not (tmp_path / "out.jsonl").exists()


def test_a_lone_surrogate_in_a_conversation(tmp_path, capsys, tiny_target):
    rows = small_conversations(3)
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [json.dumps(r) for r in rows[:1]]
        + ['{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "x"}]}']
        + [json.dumps(r) for r in rows[1:]],
    )
    assert_refused(
        run_cli(["prepare", data, "--out", tmp_path / "p", "--target", tiny_target], capsys),
        f"{data}:2",
        "lone surrogate",
        "fix the escape",
    )
    assert not (tmp_path / "p").exists()
    code, _, err = run_cli(
        ["prepare", data, "--out", tmp_path / "p", "--target", tiny_target, "--on-bad-row", "skip"], capsys
    )
    assert code == 0, err
    assert json.loads((tmp_path / "p" / "manifest.json").read_text())["counts"]["samples"] == 3


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_conversation_nested_thousands_of_levels_deep(tmp_path, capsys, tiny_target, suffix):
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    data = tmp_path / f"d{suffix}"
    data.write_text(deep + "\n" if suffix == ".jsonl" else "[" + deep + "]")
    assert_refused(
        run_cli(["prepare", data, "--out", tmp_path / "p", "--target", tiny_target], capsys),
        str(data),
        "nested too deeply",
    )
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(
    "text, line, key",
    [
        ("train:\n  lr: 0.001\n  max_steps: 5\n  lr: 0.1\n", 4, "'lr' set twice in one mapping, first on line 2"),
        ("train:\n  lr: 0.001\ntrain:\n  lr: 0.1\n", 3, "'train' set twice in one mapping, first on line 1"),
    ],
)
def test_a_key_set_twice_is_refused_not_the_last_one_taken(tmp_path, capsys, tiny_store, text, line, key):
    """YAML requires unique keys; PyYAML keeps the last silently, so a config edited by appending ran with whichever
    came last. A merge key (`<<: *base`) overridden in its mapping stays allowed."""
    config = tmp_path / "twice.yaml"
    config.write_text(text)
    refused_quickly(
        capsys,
        ["train", "--config", config, "--store", tiny_store, "--out", tmp_path / "run"],
        f"{config}:{line}: invalid YAML",
        key,
        "keep one",
    )
    assert not (tmp_path / "run").exists()
    from eaglet.config import load_yaml_text

    merged = load_yaml_text("base: &base\n  lr: 0.1\n  clip: 1.0\ntrain:\n  <<: *base\n  lr: 0.01\n")
    assert merged["train"] == {"lr": 0.01, "clip": 1.0}
