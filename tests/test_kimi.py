"""The user eaglet exists for: a Kimi-K2.5-shaped target (tests/kimi.py builds it: the multimodal wrapper, MLA + MoE,
INT4 experts, yarn rope, a tiktoken tokenizer), through every surface that can run without a GPU. vLLM itself runs it
on the GPU machine (benchmarks/kimi_vllm_device.sh) and, in bf16, in vLLM's CPU build (tests/test_vllm_real.py)."""

from __future__ import annotations

import base64
import importlib
import json
import math
import sys
from pathlib import Path

import pytest
from conftest import run_cli
from kimi import BPE_RANKS, CHAT_TEMPLATE, IM_END, KIMI_PATTERN, MEDIA_PAD, kimi_target, special_tokens, training_text

from eaglet.config import EvalConfig, ExtractConfig, RegenerateConfig
from eaglet.errors import EagletError

SOURCES = Path(__file__).parent / "fixtures" / "vllm_call_sources.zip"


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> Path:
    return kimi_target(tmp_path_factory.mktemp("kimi") / "target")


def test_the_tiny_kimi_is_laid_out_as_kimi_k25_is(kimi):
    """The wrapper's config with a vision config and a DeepseekV3 text config quantized as Kimi's; INT4 routed experts
    under language_model., everything Kimi keeps dense in bf16; the vision tower's weights beside them."""
    from safetensors import safe_open

    config = json.loads((kimi / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"] and config["model_type"] == "kimi_k25"
    text = config["text_config"]
    assert text["architectures"] == ["DeepseekV3ForCausalLM"] and text["first_k_dense_replace"] == 1
    assert text["rope_scaling"]["type"] == "yarn" and text["rope_scaling"]["mscale_all_dim"] == 1.0
    assert text["quantization_config"]["format"] == "pack-quantized" and "vision_config" in config
    index = json.loads((kimi / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 2
    expert = "language_model.model.layers.1.mlp.experts.3.down_proj"
    assert {f"{expert}.weight_packed", f"{expert}.weight_scale", f"{expert}.weight_shape"} <= index.keys()
    assert f"{expert}.weight" not in index
    dense = "language_model.model.layers.1.self_attn.kv_b_proj.weight"  # attention stays bf16, as Kimi's
    with safe_open(str(kimi / index[dense]), "pt") as handle:
        assert str(handle.get_slice(dense).get_dtype()) == "BF16"
    assert any(name.startswith("vision_tower.encoder.blocks.") for name in index)


def test_the_tokenizer_is_a_tiktoken_bpe_transformers_reads_without_remote_code(kimi):
    """tiktoken.model (Kimi's file) and the tokenizer.json transformers' converter made of it encode every text the
    same, Kimi's reserved special tokens sit after the BPE ranks, and the chat template writes Kimi's roles."""
    import tiktoken
    from transformers import AutoTokenizer

    ranks = {}
    for line in (kimi / "tiktoken.model").read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    encoding = tiktoken.Encoding(
        name="kimi-tiny", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=special_tokens()
    )
    tokenizer = AutoTokenizer.from_pretrained(kimi)  # trust_remote_code off: no Python of the model's runs
    texts = training_text()[:300] + ["中文 and English, it's 2026: 12345 ×2!\n\n  tabs\tand  spaces"]
    assert all(encoding.encode(text) == tokenizer.encode(text, add_special_tokens=False) for text in texts)
    assert len(ranks) == BPE_RANKS and tokenizer.convert_tokens_to_ids("<|media_pad|>") == MEDIA_PAD
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == IM_END
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_transformers_loads_the_wrappers_language_model_alone(kimi):
    """transformers has no class for the wrapper (only Moonshot's own code does): eaglet loads the DeepseekV3 text
    model under language_model. with the INT4 experts decompressed, every weight read, in one dtype."""
    import torch

    from eaglet.model.placement import causal_lm_problem
    from eaglet.model.target import load_model, wrapped_language_model_of

    wrapped = wrapped_language_model_of(kimi)
    assert wrapped is not None and (wrapped.architecture, wrapped.prefix) == (
        "DeepseekV3ForCausalLM",
        "language_model.",
    )
    assert causal_lm_problem(kimi, trust_remote_code=False) is None
    model = load_model(kimi, device="cpu", dtype="float32")
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, IM_END]])).logits
    assert logits.shape == (1, 4, BPE_RANKS + 256) and torch.isfinite(logits).all()


def _installed_release(version: str, root: Path, monkeypatch) -> None:
    """vLLM ``version``'s released sources (the fixture's), found by ``import vllm``'s lookup as if installed."""
    import zipfile

    with zipfile.ZipFile(SOURCES) as archive:
        archive.extractall(root, [name for name in archive.namelist() if name.startswith(f"{version}/")])
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.syspath_prepend(str(root / version))
    importlib.invalidate_caches()


@pytest.mark.parametrize("version, refused", [("0.24.0", True), ("0.33.0", False)])
def test_preflight_judges_the_wrappers_language_model_on_the_real_path(kimi, tmp_path, monkeypatch, version, refused):
    """The check reads the target's config.json as written (the wrapper's class delegates to its text model's), not
    read_config's flattening that kept only the wrapper's class and let Kimi through on vLLM 0.24.0, whose DeepseekV3
    never captures the last layer (the engine dies after the whole model load)."""
    from eaglet.preflight.checks import FAIL, PASS, check_vllm_capture

    _installed_release(version, tmp_path, monkeypatch)
    check = check_vllm_capture(kimi, version)
    if refused:
        assert check.status == FAIL and "DeepseekV3ForCausalLM" in check.detail and "deepseek_v2.py" in check.detail
    else:
        assert check.status == PASS


NUMBA_BESIDE_NUMPY_2_5 = "Numba needs NumPy 2.4 or less. Got NumPy 2.5."  # the H100's, 2026-12-07


def test_a_wrapper_vllm_cannot_build_the_image_processor_of_is_refused_before_the_engine_starts(kimi, tmp_path):
    """vLLM builds Kimi-K2.5's image processor at engine start even for its language model alone: in process with
    numba (0.25.1 on), else the checkpoint's remote code. numba failing to import beside numpy 2.5 killed vLLM 0.25.1's
    start on the H100; preflight says so and names both ways out. A processor transformers has needs neither."""
    from eaglet.model.vllm_processor import image_processor_problem

    wrapper = "KimiK25ForConditionalGeneration"
    problem = image_processor_problem(kimi, wrapper, "0.25.1", False, NUMBA_BESIDE_NUMPY_2_5)
    assert problem and str(kimi) in problem and NUMBA_BESIDE_NUMPY_2_5 in problem
    assert "numpy<=2.4" in problem and "--trust-remote-code" in problem
    assert image_processor_problem(kimi, wrapper, "0.25.1", False, None) is None  # numba imports: the fused processor
    assert image_processor_problem(kimi, wrapper, "0.25.1", True, NUMBA_BESIDE_NUMPY_2_5) is None  # the checkpoint's
    older = image_processor_problem(kimi, wrapper, "0.24.0", False, None)  # no in-process processor before 0.25.1
    assert older and "vllm>=0.25.1" in older and "--trust-remote-code" in older
    assert image_processor_problem(kimi, "DeepseekV3ForCausalLM", "0.25.1", False, NUMBA_BESIDE_NUMPY_2_5) is None

    library_processor = tmp_path / "library-processor"
    library_processor.mkdir()
    (library_processor / "preprocessor_config.json").write_text(
        json.dumps({"image_processor_type": "CLIPImageProcessor"})
    )
    assert image_processor_problem(library_processor, wrapper, "0.25.1", False, NUMBA_BESIDE_NUMPY_2_5) is None
    (library_processor / "preprocessor_config.json").write_text('{"image_processor_type": ')  # cut short
    with pytest.raises(EagletError, match=r"preprocessor_config.json: not valid JSON .*restore the checkpoint's own"):
        image_processor_problem(library_processor, wrapper, "0.25.1", False, NUMBA_BESIDE_NUMPY_2_5)


def test_the_exported_drafts_yarn_rope_states_the_scale_eaglet_trained_with(tmp_path):
    """Kimi's yarn (factor 64, mscale = mscale_all_dim = 1) trains at cos/sin scale 1.0 (transformers' YaRN); the
    export states it for each engine generation: attention_factor (transformers, vLLM >= 0.27) and attn_factor (vLLM
    <= 0.26 multiplies 0.1 ln 64 + 1 = 1.416 by it). Llama-3's scaling is left as it is."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from eaglet.export.spec import serving_rope_scaling, yarn_mscale

    kimi_scaling = json.loads((Path(__file__).parent / "fixtures/targets/kimi-k2.5/config.json").read_text())
    kimi_scaling = kimi_scaling["text_config"]["rope_scaling"]
    served = serving_rope_scaling(kimi_scaling)
    config = LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128, rope_scaling=dict(kimi_scaling))
    trained = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")[1]
    assert served["attention_factor"] == pytest.approx(trained) == pytest.approx(1.0)
    assert served["attn_factor"] * yarn_mscale(64.0) == pytest.approx(trained)
    assert yarn_mscale(64.0) == pytest.approx(0.1 * math.log(64) + 1)
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_type": "llama3"}  # fmt: skip
    assert serving_rope_scaling(llama3) == llama3 and serving_rope_scaling(None) is None


def test_vllms_moe_settings_are_validated_before_anything_loads(kimi, tmp_path, capsys):
    """Each vLLM setting is refused in one line where it cannot apply: on the hf backend, a quantized KV cache on
    the extract route (vLLM keeps the captured states in it), expert parallelism on a dense target."""
    from conftest import tiny_llama_dir

    from eaglet.model.vllm_engine import hold_problem

    with pytest.raises(ValueError, match="--enable-expert-parallel is the vllm backend's"):
        EvalConfig(draft="d", out="o", enable_expert_parallel=True)
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8: vLLM's extract route keeps the hidden states"):
        ExtractConfig(prepared="p", out="o", backend="vllm", kv_cache_dtype="fp8")
    assert RegenerateConfig(prompts=["demo"], out="o", backend="vllm", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    moe = ExtractConfig(prepared="p", out="o", backend="vllm", enable_expert_parallel=True)
    assert hold_problem(kimi, moe) is None
    dense = tiny_llama_dir(tmp_path / "dense")
    assert "has no routed experts" in hold_problem(dense, moe)
    code, _, err = run_cli(["extract", "--prepared", "p", "--out", "o", "--max-num-seqs", "0"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--max-num-seqs" in err
    code, _, err = run_cli(["eval", "--draft", "d", "--out", "o", "--backend", "vllm", "--mode", "tree"], capsys)
    assert code != 0 and "--mode chain" in err and "Traceback" not in err


def test_a_max_model_len_under_the_longest_sample_is_refused_before_vllm_starts(kimi, tmp_path, capsys):
    """Extraction sizes vLLM's context to the longest prepared sample; a smaller --max-model-len would cut samples,
    so preflight refuses it in one line with the fix."""
    from conftest import small_conversations, write_jsonl

    prepared = tmp_path / "prepared"
    write_jsonl(tmp_path / "c.jsonl", small_conversations(4))
    assert run_cli(["prepare", tmp_path / "c.jsonl", "--out", prepared, "--target", kimi], capsys)[0] == 0
    args = ["extract", "--prepared", prepared, "--out", tmp_path / "store", "--backend", "vllm", "--max-model-len", "8"]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "--max-model-len 8: the prepared set's longest sample needs" in err, err
    assert "leave --max-model-len out" in err and not (tmp_path / "store").exists()


def test_eval_through_vllm_needs_the_vllm_export(kimi, tmp_path):
    """vLLM's eagle3 loader reads an `eaglet export --format vllm` directory: a train output is refused with the
    command that makes one."""
    from eaglet.formats.draft_config import SERVED_BY_VLLM, require_export

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"architectures": ["x"]}))
    (draft / "model.safetensors").write_bytes(b"")
    with pytest.raises(EagletError):
        require_export(draft, SERVED_BY_VLLM)


@pytest.mark.slow
def test_the_kimi_path_runs_end_to_end_on_the_hf_backends(kimi, tmp_path, capsys):
    """`eaglet run` on the tiny Kimi with every stage on transformers (vLLM's route runs on the GPU machine): the
    wrapper's language model answers, its INT4 experts decompressed, prepare masks Kimi's assistant turns, extract,
    train, export and eval run, and the exports carry the stated rope scale."""
    run = tmp_path / "run.yaml"
    run.write_text(
        f"target: {kimi}\n"
        "regenerate: {prompts: [demo], max_prompts: 6, max_new_tokens: 24}\n"
        "prepare: {}\nextract: {}\ntrain: {max_steps: 2, token_budget: 512, warmup_steps: 0}\n"
        "export: {formats: [vllm, sglang]}\neval: {max_prompts: 2, max_new_tokens: 8}\n"
    )
    code, out, err = run_cli(["run", str(run), "--out", tmp_path / "out"], capsys)
    assert code == 0, err[-2000:]
    report = json.loads((tmp_path / "out" / "eval" / "report.json").read_text())
    assert report["lossless"] is True and report["acceptance_length"] >= 1.0
    served = json.loads((tmp_path / "out" / "export" / "vllm" / "config.json").read_text())["rope_scaling"]
    assert served["attention_factor"] == pytest.approx(1.0) and served["type"] == "yarn"
    prepared = json.loads((tmp_path / "out" / "prepared" / "manifest.json").read_text())
    assert prepared["counts"]["samples"] == 6


KIMI_CONFIG = Path(__file__).parent / "fixtures" / "targets" / "kimi-k2.5"  # Kimi-K2.5's config.json, nothing else
EXAMPLE = Path(__file__).parent.parent / "examples" / "kimi_8xh200_vllm.yaml"


def _plan(tmp_path, capsys, machine: str, tensor_parallel_size: int) -> tuple[int, str, str]:
    """`eaglet run --plan` of the shipped Kimi example on ``machine`` at ``tensor_parallel_size``."""
    import yaml

    config = yaml.safe_load(EXAMPLE.read_text())
    config["target"] = str(KIMI_CONFIG)
    config["machine"] = yaml.safe_load(machine)
    for stage in ("regenerate", "extract", "eval"):
        config[stage]["tensor_parallel_size"] = tensor_parallel_size
    path = tmp_path / f"kimi_tp{tensor_parallel_size}.yaml"
    path.write_text(yaml.safe_dump(config))
    return run_cli(["run", path, "--plan", "--out", tmp_path / "run"], capsys)


def test_the_shipped_kimi_example_plans_clean(tmp_path, capsys):
    """The example as shipped (8 x H200, tp 8): every vLLM stage fits, with room for a request of Kimi's whole
    context; the config-only target is planned from config.json, its tokenizer left to preflight on the machine."""
    code, out, err = run_cli(["run", EXAMPLE, "--plan", "--out", tmp_path / "run"], capsys)
    assert code == 0, err
    assert "vllm tp x8:" in out and "71.0 GiB" in out and "refused" not in out


@pytest.mark.parametrize(
    "machine, tensor_parallel_size, refusal",
    [
        # the heads: 64 do not split over 6 ranks (what preflight's "vllm load" check says), though the memory fits
        ("{gpus: 8, gpu_memory: 141GiB, name: H200}", 6, "64 attention heads do not split evenly over 6 ranks"),
        # 8 x H100: 71 GiB of INT4 weights per rank over 0.85 x 80 GiB; every GPU is in use, so the advice is not tp
        ("{gpus: 8, gpu_memory: 80GiB, name: H100}", 8, "all 8 GPUs of this machine are in use"),
        ("{gpus: 4, gpu_memory: 141GiB, name: H200}", 4, "all 4 GPUs of this machine are in use"),
    ],
)
def test_plan_refuses_what_vllm_would_refuse_with_advice_the_machine_can_follow(
    tmp_path, capsys, machine, tensor_parallel_size, refusal
):
    code, out, err = _plan(tmp_path, capsys, machine, tensor_parallel_size)
    assert code == 2 and refusal in err and "regenerate (vllm backend)" in err, err
    if "all" in refusal:  # every GPU already in use: more tensor parallelism is not advice this machine can follow
        assert "raise --tensor-parallel-size" not in err


def test_the_one_gpu_kimi_example_differs_from_the_8_gpu_one_only_in_target_machine_and_sizes(kimi, tmp_path, capsys):
    """examples/kimi_tiny_1gpu_vllm.yaml (the run the H100 went through) plans clean on the tiny Kimi, and its
    stages and backends are the 8 x H200 example's."""
    import yaml

    tiny = yaml.safe_load((EXAMPLE.parent / "kimi_tiny_1gpu_vllm.yaml").read_text())
    big = yaml.safe_load(EXAMPLE.read_text())
    assert list(tiny) == list(big)
    assert all(tiny[stage].get("backend") == big[stage].get("backend") for stage in ("regenerate", "extract", "eval"))
    tiny["target"] = str(kimi)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny))
    code, out, err = run_cli(["run", path, "--plan", "--out", tmp_path / "run"], capsys)
    assert code == 0 and "vllm tp x1:" in out and "refused" not in out, err


def test_plan_and_preflight_refuse_the_same_split(tmp_path):
    """One set of checks: the plan's refusal at tp 6 is preflight's "vllm load" failure, word for word."""
    from eaglet.config import RegenerateConfig
    from eaglet.model.vllm_engine import hold_problem
    from eaglet.preflight.checks import FAIL, check_vllm_backend

    config = RegenerateConfig(
        prompts=["demo"], out=str(tmp_path / "a.jsonl"), target=str(KIMI_CONFIG), backend="vllm", tensor_parallel_size=6
    )
    check = check_vllm_backend(KIMI_CONFIG, config, captures=False)[0]
    assert check.status == FAIL and check.detail == hold_problem(KIMI_CONFIG, config)


def test_vllms_memory_is_counted_as_its_worker_counts_it():
    """Kimi-K2.5 over 8 ranks: MLA's q_a/kv_a projections and the routers whole on every rank (vLLM replicates them),
    the rest split; the vision tower only when vLLM builds it; MLA's latent KV cache whole on every rank."""
    from eaglet.fsio import GIB
    from eaglet.model.sizing import Machine, weights_of
    from eaglet.model.target import raw_config, read_config
    from eaglet.model.vllm_memory import VllmAsk, kv_cache_bytes_per_token, vision_tower_parameters, vllm_layout

    raw, weights = raw_config(KIMI_CONFIG), weights_of(read_config(KIMI_CONFIG))
    h200 = Machine(8, 141 * GIB, "H200")
    text_only = vllm_layout(raw, weights, h200, VllmAsk(tensor_parallel_size=8))
    with_vision = vllm_layout(raw, weights, h200, VllmAsk(tensor_parallel_size=8, language_model_only=False))
    assert 0.4e9 < vision_tower_parameters(raw) < 0.5e9  # MoonViT: 27 layers of width 1152, and the patch merger
    assert with_vision.weights_per_gpu - text_only.weights_per_gpu == vision_tower_parameters(raw) * 2
    assert weights.vllm_replicated_bytes > 0
    assert text_only.weights_per_gpu > weights.stored_bytes / 8  # replicated modules are not divided
    assert kv_cache_bytes_per_token(raw, 8, "auto") == 61 * (512 + 64) * 2  # the latent, per layer, bf16
    assert kv_cache_bytes_per_token(raw, 8, "fp8") == 61 * (512 + 64)
    short = vllm_layout(raw, weights, Machine(8, 80 * GIB, "H100"), VllmAsk(8, 0.95, max_model_len=4096))
    assert not short.problems and short.kv_tokens >= 4096  # 0.95 of an H100 holds Kimi at 4k context
    whole = vllm_layout(raw, weights, Machine(8, 80 * GIB, "H100"), VllmAsk(8, 0.95))
    assert whole.problems and "max_model_len 262,144" in whole.problems[0]


def test_run_takes_dotted_overrides_of_its_config(tmp_path, capsys):
    """`eaglet run CONFIG --set section.key=value` overrides one key of one stage, as a stage command's --set does;
    a key no section has is refused in one line naming it."""
    out = tmp_path / "run"
    code, _, err = run_cli(["run", EXAMPLE, "--plan", "--out", out, "--set", "extract.tensor_parallel_size=6"], capsys)
    assert code == 2 and "extract (vllm backend)" in err and "do not split evenly over 6 ranks" in err, err
    code, _, err = run_cli(["run", EXAMPLE, "--plan", "--out", out, "--set", "extract.no_such_key=1"], capsys)
    assert code == 2 and err.count("\n") == 1 and "no_such_key" in err, err
    code, _, err = run_cli(["run", EXAMPLE, "--plan", "--out", out, "--set", "train"], capsys)
    assert code == 2 and "expected KEY=VALUE" in err, err


def test_plan_times_a_training_run_bounded_by_epochs_or_steps(tmp_path, capsys):
    """Training without --max-minutes gets a time from its tokens (epochs over the planned prepared tokens, or steps
    of the token budget) at the draft step's FLOPs, with that rate's source; twice the epochs, twice the time."""
    from rich.console import Console

    from eaglet.run import Pipeline, load_run_config

    def train_plan(*sets: str):
        config = load_run_config(EXAMPLE, {"target": str(KIMI_CONFIG), "out": str(tmp_path / "run")}, list(sets))
        return next(p for p in Pipeline(config, EXAMPLE, Console(quiet=True)).plan() if p.name == "train")

    one, two = train_plan("train.max_minutes=null"), train_plan("train.max_minutes=null", "train.epochs=2")
    assert one.seconds > 0 and two.seconds == pytest.approx(2 * one.seconds, rel=1e-6)
    assert "50% MFU" in one.rate_source and "tok/s" in one.rate_source
    steps = train_plan("train.max_minutes=null", "train.max_steps=100", "train.token_budget=4096")
    assert f"{100 * 4096:,} tokens" in steps.rate_source
    capped = train_plan("train.max_steps=100000000")  # the example's 60 minutes come first
    assert capped.seconds == 3600 and capped.rate_source == "its --max-minutes"


def test_an_eval_max_model_len_under_what_its_prompts_need_is_refused_before_vllm_starts(
    tmp_path, capsys, tiny_draft, tiny_target
):
    """`eval --backend vllm` opens vLLM at the longest prompt, its answer and a draft round; a --max-model-len under
    that would cut answers short, so preflight refuses it in one line with the fix."""
    export = tmp_path / "export"
    assert run_cli(["export", "--draft", tiny_draft, "--format", "vllm", "--out", export], capsys)[0] == 0
    args = ["eval", "--draft", export, "--target", tiny_target, "--out", tmp_path / "eval", "--backend", "vllm"]
    code, _, err = run_cli([*args, "--max-model-len", "8", "--max-prompts", "2"], capsys)
    assert code == 2 and "--max-model-len 8: the longest prompt with --max-new-tokens 128" in err, err
    assert "raise it or leave it out" in err and not (tmp_path / "eval").exists()
