"""Targets: the embedded default, HF directories, bad --target values, and `eaglet target info`."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from conftest import extract_args, run_cli

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


def rewritten(target: Path, copy: Path, change) -> Path:
    """A copy of ``target`` whose weights ``change`` rewrote in place: same config.json and tokenizer."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(target, copy)
    tensors = change(load_file(copy / "model.safetensors"))
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def test_the_weights_fingerprint_sees_values_and_dtype_not_layout(tmp_path, tiny_target):
    """A new fine-tune saved over the old directory changes the fingerprint, and so does another dtype (other
    features); the same tensors written in another order, or split over shards with an index, do not."""
    from safetensors.torch import load_file, save_file

    from eaglet.model.weight_files import weights_fingerprint

    before = weights_fingerprint(tiny_target)
    assert before is not None

    def fine_tuned(tensors):
        return {name: t + 1e-3 if "q_proj" in name else t for name, t in tensors.items()}

    def reordered(tensors):
        return dict(reversed(list(tensors.items())))

    assert weights_fingerprint(rewritten(tiny_target, tmp_path / "tuned", fine_tuned)) != before
    assert (
        weights_fingerprint(rewritten(tiny_target, tmp_path / "half", lambda ts: {n: t.half() for n, t in ts.items()}))
        != before
    )
    assert weights_fingerprint(rewritten(tiny_target, tmp_path / "reordered", reordered)) == before
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_target, sharded)
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    weight_map = {}
    for i, name in enumerate(sorted(tensors)):
        file = f"model-0000{i % 3 + 1}-of-00003.safetensors"
        weight_map[name] = file
    for file in set(weight_map.values()):
        save_file(
            {n: tensors[n] for n, f in weight_map.items() if f == file}, sharded / file, metadata={"format": "pt"}
        )
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert weights_fingerprint(sharded) == before


def test_a_store_of_a_target_rewritten_since_is_refused(tmp_path, capsys, tiny_prepared, tiny_target):
    """Features extracted from the old weights, trained against the new ones' LM head: refused, naming why."""
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    store = tmp_path / "store"
    assert run_cli(extract_args(tiny_prepared, store, target), capsys)[0] == 0
    rewritten(target, tmp_path / "tuned", lambda ts: {n: t * 1.01 for n, t in ts.items()})
    shutil.copy(tmp_path / "tuned" / "model.safetensors", target / "model.safetensors")
    out = tmp_path / "draft"
    for skip, where in (((), "store: "), (("--skip-preflight",), f"store {store}: ")):
        args = ["train", "--store", store, "--out", out, "--target", target, "--max-steps", "1", *skip]
        code, _, err = run_cli(args, capsys)
        assert code == 2 and "Traceback" not in err and where in err, err
        assert "extracted from target with other weights" in err and "rewritten since" in err, err
        assert not out.exists()


@pytest.mark.parametrize(
    "rope, context",
    [
        (None, 512),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}, 2048),  # Qwen's long-context
        ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}, 512),  # already stretched
    ],
)
def test_the_context_a_target_serves(tmp_path, tiny_target, rope, context):
    from eaglet.model.target import context_length

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config | {"rope_scaling": rope}))
    assert context_length(target) == context
