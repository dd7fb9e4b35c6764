"""`eaglet extract --backend vllm`: what holds without a GPU. The features themselves are compared with the hf
backend's on the H200 (benchmarks/vllm_extract_parity.py, RESULTS.md); here: the layer columns vLLM is asked for,
the final norm that turns vLLM's last capture into eaglet's ``last``, the refusals before anything loads, and eaglet's
calls into vLLM bound against released vLLM sources."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import extract_args, run_cli

from eaglet.apicheck.check import check_calls
from eaglet.config import ExtractConfig, build_config
from eaglet.errors import EagletError
from eaglet.model.capture import FeatureCapture, decoder_layers
from eaglet.model.final_norm import load_final_norm
from eaglet.model.target import load_model
from eaglet.model.vllm_engine import TESTED_VLLM, aux_columns, captured_layers

SOURCES = Path(__file__).parent / "fixtures" / "vllm_call_sources.zip"
EAGLET = Path(__file__).parent.parent / "src" / "eaglet"
BREAKING_VLLM = "0.18.0"  # has the extract_hidden_states route but not the spool reader eaglet calls


def test_vllm_is_asked_for_the_aux_layers_ascending_then_the_last_layer_output():
    assert captured_layers((2, 16, 29), 32) == (2, 16, 29, 32)
    # listed out of order: vLLM still captures in layer order, and each aux id finds its own column
    assert captured_layers((16, 2, 29), 32) == (2, 16, 29, 32)
    assert aux_columns((16, 2, 29)) == [1, 0, 2]
    with pytest.raises(EagletError, match="repeat a layer"):
        captured_layers((2, 2, 29), 32)


def _last_layer_output(model, ids):
    """What vLLM's capture at layer id N holds: the last decoder layer's output, before the final norm."""
    grabbed = {}
    layer = decoder_layers(model)[-1]
    handle = layer.register_forward_hook(
        lambda m, a, out: grabbed.setdefault("h", out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    return grabbed["h"]


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_final_norm_turns_the_last_layer_output_into_the_hf_backends_last(tmp_path, arch, tiny_target):
    from targets import tiny_target as make_target

    path = tiny_target if arch == "llama" else make_target(tmp_path / arch, arch)
    model = load_model(path, device="cpu")
    ids = torch.randint(0, 200, (2, 17))
    _, last = FeatureCapture(model, (2, 4, 5))(ids)
    norm = load_final_norm(path, "cpu", torch.float32)
    torch.testing.assert_close(norm(_last_layer_output(model, ids)), last, rtol=0, atol=0)


def test_final_norm_of_a_gemma_target_keeps_its_one_plus_weight(tmp_path):
    """Gemma's RMSNorm multiplies by (1 + w): the module is the architecture's own, not a plain RMSNorm."""
    from conftest import build_tokenizer
    from transformers import Gemma2Config, Gemma2ForCausalLM

    tokenizer = build_tokenizer("qwen3")
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=8,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
    )  # fmt: skip
    model = Gemma2ForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.uniform_(-0.5, 0.5)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model = load_model(tmp_path, device="cpu")
    ids = torch.randint(0, 200, (1, 9))
    _, last = FeatureCapture(model, (2, 4, 5))(ids)
    norm = load_final_norm(tmp_path, "cpu", torch.float32)
    torch.testing.assert_close(norm(_last_layer_output(model, ids)), last, rtol=0, atol=0)


def test_final_norm_missing_from_the_checkpoint_is_named(tmp_path, tiny_target):
    from safetensors.torch import load_file, save_file

    for item in tiny_target.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(EagletError, match=r"no final-norm tensor 'weight'.*model\.norm\.weight"):
        load_final_norm(tmp_path, "cpu", torch.float32)


def test_backend_settings_that_contradict_each_other_are_refused():
    with pytest.raises(EagletError, match="vLLM places the target itself"):
        build_config(
            ExtractConfig, "extract", cli_values={"prepared": "p", "out": "o", "backend": "vllm", "placement": "tp"}
        )
    with pytest.raises(EagletError, match="tensor-parallel-size is the vllm backend's"):
        build_config(ExtractConfig, "extract", cli_values={"prepared": "p", "out": "o", "tensor_parallel_size": 2})


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--gpu-memory-utilization", "1.5", "'gpu_memory_utilization': Input should be less than 1 (got 1.5)"),
        ("--gpu-memory-utilization", "0", "'gpu_memory_utilization': Input should be greater than 0 (got 0"),
        ("--tensor-parallel-size", "0", "'tensor_parallel_size': Input should be greater than or equal to 1 (got 0"),
        ("--backend", "sglang", "'backend': Input should be 'hf' or 'vllm' (got 'sglang')"),
    ],
)
def test_bad_vllm_settings_are_one_line_before_anything(tmp_path, capsys, tiny_prepared, option, value, message):
    out = tmp_path / "store"
    code, _, err = run_cli(["extract", "--prepared", tiny_prepared, "--out", out, option, value], capsys)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not out.exists() and not any(tmp_path.iterdir())


def test_extract_with_vllm_where_it_is_not_installed_is_refused_before_any_store(
    tmp_path, capsys, tiny_prepared, tiny_target
):
    out = tmp_path / "store"
    code, _, err = run_cli(extract_args(tiny_prepared, out, tiny_target, "--backend", "vllm"), capsys)
    assert code != 0
    assert "vLLM is not installed" in err and "Traceback" not in err
    assert not out.exists()


def _release(version: str, root: Path) -> Path:
    """The released vLLM files eaglet's calls bind to (scripts/refresh_vllm_call_sources.py), unpacked."""
    with zipfile.ZipFile(SOURCES) as archive:
        members = [name for name in archive.namelist() if name.startswith(f"{version}/")]
        assert members, f"{SOURCES} has no vLLM {version}"
        archive.extractall(root, members)
    return root / version


@pytest.mark.parametrize("version", TESTED_VLLM)
def test_eaglets_calls_into_vllm_bind_to_the_tested_releases(tmp_path, version):
    report = check_calls([EAGLET], "vllm", [_release(version, tmp_path)], f"vllm {version}")
    assert report.version == version
    assert report.call_sites >= 4 and not report.errors, [f.message for f in report.errors]
    assert not report.unverified, report.unverified_examples


def test_a_release_where_our_call_breaks_is_named_with_the_call(tmp_path):
    report = check_calls([EAGLET], "vllm", [_release(BREAKING_VLLM, tmp_path)], f"vllm {BREAKING_VLLM}")
    assert report.version == BREAKING_VLLM
    broken = {(Path(f.path).name, f.target.rsplit(".", 1)[-1]) for f in report.errors}
    assert ("vllm_engine.py", "load_hidden_states") in broken
    assert all("does not exist in vllm 0.18.0" in f.message or "no longer has" in f.message for f in report.errors)


def test_preflight_names_the_broken_call_before_the_load(tmp_path, monkeypatch):
    """`check_library_api('vllm')` reads the installed vLLM: here the breaking release on the path."""
    from eaglet.preflight.checks import FAIL, check_library_api

    monkeypatch.syspath_prepend(str(_release(BREAKING_VLLM, tmp_path)))
    check_library_api.cache_clear()
    try:
        check = check_library_api("vllm")
    finally:
        check_library_api.cache_clear()
    assert check.status == FAIL
    assert "vllm_engine.py:" in check.detail and "_hidden_states" in check.detail and "vllm 0.18.0" in check.detail
    assert "vllm==0.24.0" in check.fix


def test_a_spool_file_whose_writer_never_releases_it_is_refused_not_waited_on_forever(tmp_path):
    """vLLM's connector holds LOCK_EX on `<file>.lock` until the file is written; an engine that stops stepping never
    releases it. eaglet waits a bounded time and names the file and the cause."""
    import fcntl

    from eaglet.model.vllm_engine import wait_for_spool

    spooled = tmp_path / "req-1.safetensors"
    lock = tmp_path / "req-1.safetensors.lock"
    writer = os.open(lock, os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(writer, fcntl.LOCK_EX)  # as the connector's wait_for_save does
    try:
        with pytest.raises(EagletError, match=r"req-1\.safetensors: vLLM's connector has not finished writing"):
            wait_for_spool(spooled, timeout_s=0.2)
    finally:
        os.close(writer)  # the connector's writer thread releases it once the file is written
    wait_for_spool(spooled, timeout_s=0.2)  # released: returns at once
    wait_for_spool(tmp_path / "no-lock.safetensors", timeout_s=0.2)  # the connector ran without locks


def test_a_deepseek_v3_checkpoint_vllm_would_refuse_is_named_before_any_engine(
    tmp_path, capsys, tiny_prepared, tiny_target
):
    """transformers writes a DeepseekV3 config.json without `topk_method`; vLLM then builds the router without its
    score-correction bias and the load dies on the checkpoint's `e_score_correction_bias` (seen on the H200). The
    preflight says so, with the fix, from config.json and the weights' names."""
    import json

    from targets import tiny_target as make_target

    from eaglet.model.vllm_engine import config_problem

    target = make_target(tmp_path / "dsv3", "deepseek_v3")
    problem = config_problem(target)
    assert problem and "mlp.gate.e_score_correction_bias" in problem and '"topk_method": "noaux_tc"' in problem
    code, out, err = run_cli(["preflight", "extract", "--prepared", tiny_prepared, "--out", tmp_path / "s",
                              "--target", target, "--backend", "vllm"], capsys)  # fmt: skip
    assert code != 0 and "topk_method" in out + err and "Traceback" not in err
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config | {"topk_method": "noaux_tc"}))
    assert config_problem(target) is None
    assert config_problem(tiny_target) is None  # a dense Llama has no router
