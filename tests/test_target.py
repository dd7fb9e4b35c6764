"""Targets: the embedded default, HF directories, bad --target values, and `eaglet target info`."""

from __future__ import annotations

import json
import time

import pytest
from conftest import run_cli

from eaglet.errors import EagletError
from eaglet.model.target import EMBEDDED_NAME, load_model, load_tokenizer, resolve_target, target_info


def test_target_info_embedded_json(capsys, embedded_target):
    code, stdout, err = run_cli(["target", "info", "--json"], capsys)
    assert code == 0, err
    info = json.loads(stdout)
    assert info["name"] == EMBEDDED_NAME and info["architecture"] == "LlamaForCausalLM"
    assert (info["num_layers"], info["hidden_size"], info["vocab_size"]) == (30, 576, 49152)
    assert info["num_parameters"] == 134_515_008
    assert info["has_chat_template"] is True
    assert info["aux_layer_ids"] == [2, 15, 27]


def test_target_info_table(capsys, tiny_target):
    code, stdout, _ = run_cli(["target", "info", "--target", tiny_target], capsys)
    assert code == 0
    assert "default aux layer ids" in stdout and "[2, 4, 5]" in stdout


def test_cached_embedded_load_is_fast(embedded_target):
    started = time.perf_counter()
    resolved = resolve_target("embedded")
    load_tokenizer(resolved.path)
    model = load_model(resolved.path, device="cpu")
    assert time.perf_counter() - started < 5.0
    assert model.config.num_hidden_layers == 30


@pytest.mark.parametrize(
    "spec,fragment",
    [("missing-dir/", "no such directory or file"), ("nope.gguf", "GGUF file not found")],
)
def test_bad_target_specs(spec, fragment):
    with pytest.raises(EagletError, match=fragment):
        resolve_target(spec)


def test_directory_without_config(tmp_path, capsys):
    code, _, err = run_cli(["target", "info", "--target", tmp_path], capsys)
    assert code == 2 and "has no config.json" in err


def test_unreachable_hub_id(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_cli(["target", "info", "--target", "some-org/some-model"], capsys)
    assert code == 2 and "could not fetch from the hub" in err


def test_target_info_without_weights(tiny_target):
    info = target_info(resolve_target(str(tiny_target)))
    assert (info.num_layers, info.hidden_size, info.aux_layer_ids) == (8, 64, (2, 4, 5))
    assert info.num_parameters > 0 and info.has_chat_template
