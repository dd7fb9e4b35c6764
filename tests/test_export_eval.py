"""`eaglet export` (golden configs, names, shapes, round trip) and `eaglet eval` (report, lossless)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli, write_jsonl
from safetensors import safe_open

from eaglet.decode.chain import speculative_decode
from eaglet.decode.runners import DraftRunner, TargetRunner
from eaglet.model.draft import load_draft
from eaglet.model.sampling import Sampling
from eaglet.model.target import config_identity, load_head_weights, load_model, resolve_target

EXPECTED_TENSORS = {
    "fc.weight": [64, 192],
    "midlayer.input_layernorm.weight": [64],
    "midlayer.hidden_norm.weight": [64],
    "midlayer.self_attn.q_proj.weight": [64, 128],
    "midlayer.self_attn.k_proj.weight": [32, 128],
    "midlayer.self_attn.v_proj.weight": [32, 128],
    "midlayer.self_attn.o_proj.weight": [64, 64],
    "midlayer.post_attention_layernorm.weight": [64],
    "midlayer.mlp.gate_proj.weight": [128, 64],
    "midlayer.mlp.up_proj.weight": [128, 64],
    "midlayer.mlp.down_proj.weight": [64, 128],
    "norm.weight": [64],
}


def eval_args(draft, target, prompts, out, *options) -> list:
    """`eaglet eval` of ``draft`` on ``target`` over ``prompts`` on the CPU, then ``options``."""
    return [
        "eval",
        "--draft",
        draft,
        "--target",
        target,
        "--prompts",
        prompts,
        "--out",
        out,
        "--device",
        "cpu",
        *options,
    ]


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_export_golden(tmp_path, capsys, tiny_draft, fmt):
    out = tmp_path / fmt
    code, stdout, err = run_cli(
        [
            "export",
            "--draft",
            tiny_draft,
            "--format",
            fmt,
            "--out",
            out,
            "--verifier",
            "org/tiny-target",
            "--speculative-tokens",
            "4",
        ],
        capsys,
    )
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        shapes = {k: handle.get_slice(k).get_shape() for k in handle.keys()}
        dtypes = {k: handle.get_slice(k).get_dtype() for k in handle.keys()}
    vocab, draft_vocab = (
        config.get("vocab_size") or config["transformer_layer_config"]["vocab_size"],
        config["draft_vocab_size"],
    )
    expected = (
        EXPECTED_TENSORS
        if fmt != "speculators"
        else {  # speculators' own name for the first layer
            k.replace("midlayer.", "layers.0."): v for k, v in EXPECTED_TENSORS.items()
        }
    )
    assert {k: v for k, v in shapes.items() if k in expected} == expected
    assert shapes["lm_head.weight"] == [draft_vocab, 64] and dtypes["fc.weight"] == "BF16"
    assert draft_vocab == vocab and "d2t" not in shapes and "t2d" not in shapes  # the whole vocabulary: no mapping
    assert config["target_hidden_size"] == 64 and config["norm_before_residual"] is False
    if fmt in ("vllm", "sglang"):  # one config for both engines, each reading the ids its way
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and not any("embed" in k for k in shapes)
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM's convention = eaglet's
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang adds one back
        assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (64, 4, 2)
    else:
        assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
        assert shapes["embed_tokens.weight"] == [vocab, 64]  # the speculators model has no other embedding
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
        assert config["transformer_layer_config"]["hidden_size"] == 64
        method = config["speculators_config"]["proposal_methods"][0]
        assert (
            method["speculative_tokens"] == 4
            and config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-target"
        )
    card = (out / "README.md").read_text()
    assert "org/tiny-target" in card and ("vllm serve" in card or "sglang.launch_server" in card)
    # the Hub's metadata, as the Hub reads it: YAML between the first two --- lines
    import yaml

    front = yaml.safe_load(card.split("---\n")[1])
    assert front["base_model"] == "org/tiny-target" and front["library_name"] == fmt
    assert {"eagle3", "speculative-decoding", fmt} <= set(front["tags"]) and front["eaglet_version"]


def test_round_trip_gives_identical_greedy_outputs(tmp_path, tiny_draft, tiny_target):
    from eaglet.export.write import export_draft

    target_path = resolve_target(str(tiny_target)).path
    model = load_model(target_path, device="cpu")
    embed = load_head_weights(target_path).embed
    original = load_draft(tiny_draft, embed=embed.float())
    runner = TargetRunner(model, (2, 4, 5))
    prompt = [5, 17, 33, 8, 90, 12]
    reference = speculative_decode(
        runner, DraftRunner(original.to(torch.bfloat16).float()), prompt, 24, 3, Sampling(), set()
    )
    for fmt in ("vllm", "sglang", "speculators"):
        exported = export_draft(tiny_draft, fmt, tmp_path / fmt)
        draft = load_draft(exported, embed=embed.float())
        result = speculative_decode(runner, DraftRunner(draft), prompt, 24, 3, Sampling(), set())
        assert result.tokens == reference.tokens and result.accepted == reference.accepted, fmt


@pytest.mark.parametrize(
    "args,fragment",
    [(["--format", "onnx"], "--format: "), (["--format", "vllm", "--draft", "/nonexistent"], "not a draft")],
)
def test_export_bad_input(tmp_path, capsys, tiny_draft, args, fragment):
    base = {"--draft": str(tiny_draft), "--out": str(tmp_path / "o")}
    for flag in ("--draft",):
        if flag in args:
            base.pop(flag)
    argv = ["export", *[x for kv in base.items() for x in kv], *args]
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and fragment in err and not (tmp_path / "o").exists()


def test_export_refuses_to_clobber(tmp_path, capsys, tiny_draft):
    (tmp_path / "o").mkdir()
    code, _, err = run_cli(["export", "--draft", tiny_draft, "--format", "vllm", "--out", tmp_path / "o"], capsys)
    assert code == 2 and "already exists" in err


def test_eval_report(tmp_path, capsys, tiny_draft, tiny_target):
    prompts = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"id": "a", "prompt": "the cat sat", "category": "animals", "split": "heldout"},
            {"id": "b", "prompt": "two dogs ran past", "category": "animals", "split": "heldout"},
            {"id": "c", "prompt": "one bird sang", "category": "birds", "split": "heldout"},
        ],
    )
    out = tmp_path / "eval"
    code, stdout, err = run_cli(
        eval_args(tiny_draft, tiny_target, prompts, out, "--max-new-tokens", "16", "--depth", "3"),
        capsys,
    )
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["lossless"] is True and report["prompts"] == 3 and report["divergences"] == {}
    assert 1.0 <= report["acceptance_length"] <= 4.0 and len(report["acceptance_by_position"]) == 3
    assert set(report["per_category"]) == {"animals", "birds"}
    assert report["speedup"] > 0 and report["baseline_tokens_per_s"] > 0
    for name in ("report.md", "acceptance_by_position.png", "tau_by_category.png"):
        assert (out / name).is_file()
    assert "lossless True" in stdout


def test_eval_on_other_weights_of_the_target_says_so(tmp_path, capsys, tiny_draft, tiny_target):
    """The target directory rewritten in place by a new fine-tune: the draft still loads and decodes losslessly, and
    eval says its τ is on weights the draft never saw; on the weights it was trained for, nothing is said."""
    import shutil

    from safetensors.torch import load_file, save_file

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "the cat sat", "split": "heldout"}])
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    code, _, err = run_cli(eval_args(tiny_draft, target, prompts, tmp_path / "e0", "--max-new-tokens", "4"), capsys)
    assert code == 0 and "other weights" not in err, err
    tensors = load_file(target / "model.safetensors")
    save_file({n: t * 1.01 for n, t in tensors.items()}, target / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run_cli(eval_args(tiny_draft, target, prompts, tmp_path / "e1", "--max-new-tokens", "4"), capsys)
    assert code == 0 and f"was trained against other weights of target than {target} holds" in err, err
    assert json.loads((tmp_path / "e1" / "report.json").read_text())["lossless"] is True


def test_export_quotes_only_an_eval_report_of_its_own_draft(tmp_path, capsys, tiny_draft, tiny_target):
    """The model card quotes the report's τ and speedup: a report of the draft, or of an export of it, is quoted; a
    report of another draft, or a JSON file that is not an eval report, is one line and nothing is written."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "the cat sat", "split": "heldout"}])
    exported = tmp_path / "exported"
    assert run_cli(["export", "--draft", tiny_draft, "--format", "vllm", "--out", exported], capsys)[0] == 0
    for name, draft in (("own", tiny_draft), ("of-export", exported)):
        code, _, err = run_cli(eval_args(draft, tiny_target, prompts, tmp_path / name, "--max-new-tokens", "8"), capsys)
        assert code == 0, err
        report = json.loads((tmp_path / name / "report.json").read_text())
        out = tmp_path / f"card-{name}"
        export = ["export", "--draft", tiny_draft, "--format", "sglang", "--out", out]
        code, _, err = run_cli([*export, "--report", tmp_path / name / "report.json"], capsys)
        assert code == 0, err
        assert f"τ = {report['acceptance_length']:.2f} accepted tokens" in (out / "README.md").read_text()
    report = json.loads((tmp_path / "own" / "report.json").read_text())
    for bad, message in (
        (report | {"draft_weights_sha256": "0" * 64}, "measured on another draft (weights sha256 000000000000…"),
        ({"a": 1}, "'acceptance_length' is missing"),
        (report | {"speedup": "fast"}, "'speedup': Input should be a valid number"),
        (report | {"settings": report["settings"] | {"mode": "beam"}}, "'settings.mode'"),
    ):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        out = tmp_path / "refused"
        code, _, err = run_cli([*export[:-1], out, "--report", tmp_path / "bad.json"], capsys)
        assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err
        assert not out.exists()


@pytest.mark.parametrize("skip_preflight", [False, True])
def test_eval_refuses_a_prompt_too_long_for_the_target_before_it_loads(
    tmp_path, capsys, tiny_draft, tiny_target, skip_preflight
):
    """The tiny target's context is 512 positions: a ~600-token prompt, or a short one with --max-new-tokens 510,
    would be decoded at positions the target never saw. Refused naming the row; a selection without it runs."""
    rows = [
        {"id": "short", "prompt": "the cat sat", "split": "heldout", "category": "a"},
        {"id": "long", "prompt": "word " * 600, "split": "heldout", "category": "b"},
    ]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    extra = ["--skip-preflight"] if skip_preflight else []
    for options, message in (
        (["--max-new-tokens", "8"], f"{prompts}:2: the prompt is "),
        (["--max-new-tokens", "510", "--max-prompts", "1"], f"{prompts}:1: the prompt is "),
    ):
        code, _, err = run_cli(eval_args(tiny_draft, tiny_target, prompts, tmp_path / "e", *options, *extra), capsys)
        assert code == 2 and message in err and "passes the target's context of 512" in err, err
        assert "Traceback" not in err and not (tmp_path / "e").exists()
    short = write_jsonl(tmp_path / "short.jsonl", rows[:1])
    code, _, err = run_cli(eval_args(tiny_draft, tiny_target, short, tmp_path / "e", "--max-new-tokens", "8"), capsys)
    assert code == 0, err


def test_eval_reports_each_prompt_file_apart_the_shipped_mt_bench_among_them(tmp_path, capsys, tiny_draft, tiny_target):
    """A draft judged on its own held-out prompts and on prompts written elsewhere: τ and speedup per file,
    categories of the same name kept apart, --max-prompts per file spread over its categories."""
    prompts = write_jsonl(
        tmp_path / "own.jsonl",
        [
            {"id": "a", "prompt": "the cat sat", "category": "writing", "split": "heldout"},
            {"id": "b", "prompt": "two dogs ran past", "category": "math", "split": "heldout"},
            {"id": "c", "prompt": "one bird sang", "category": "math", "split": "heldout"},
            {"id": "d", "prompt": "a train prompt", "category": "math", "split": "train"},
        ],
    )
    out = tmp_path / "eval"
    options = ["--prompts", "mt-bench", "--max-prompts", "2", "--max-new-tokens", "8", "--depth", "2"]
    code, _, err = run_cli(eval_args(tiny_draft, tiny_target, prompts, out, *options), capsys)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["prompts"] == 4 and set(report["per_source"]) == {"own.jsonl", "mt-bench"}
    own, mt_bench = report["per_source"]["own.jsonl"], report["per_source"]["mt-bench"]
    assert own["prompts"] == 2 and set(own["per_category"]) == {"writing", "math"}  # round-robin, not the first two
    assert mt_bench["prompts"] == 2 and set(mt_bench["per_category"]) == {"writing", "roleplay"}
    assert set(report["per_category"]) == {
        "own.jsonl: writing",
        "own.jsonl: math",
        "mt-bench: writing",
        "mt-bench: roleplay",
    }
    for row in (own, mt_bench):
        assert row["acceptance_length"] >= 1 and row["speedup"] > 0 and row["baseline_tokens_per_s"] > 0
    assert "| mt-bench | 2 |" in (out / "report.md").read_text()


def test_eval_refuses_a_prompt_file_with_none_of_the_split(tmp_path, capsys, tiny_draft, tiny_target):
    own = write_jsonl(tmp_path / "own.jsonl", [{"id": "a", "prompt": "the cat sat", "split": "heldout"}])
    train_only = write_jsonl(tmp_path / "train.jsonl", [{"id": "b", "prompt": "one bird", "split": "train"}])
    code, _, err = run_cli(eval_args(tiny_draft, tiny_target, own, tmp_path / "x", "--prompts", train_only), capsys)
    assert code == 2 and f"{train_only}: no prompts of the heldout split (it holds 'train' 1)" in err, err
    assert "Traceback" not in err and not (tmp_path / "x").exists()


def test_eval_refuses_a_prompt_that_calls_tools(tmp_path, capsys, tiny_draft, tiny_target):
    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    row = {"id": "t", "split": "heldout", "messages": [{"role": "user", "content": "hi"}, call]}
    prompts = write_jsonl(tmp_path / "tools.jsonl", [row])
    code, _, err = run_cli(eval_args(tiny_draft, tiny_target, prompts, tmp_path / "x"), capsys)
    assert code == 2 and f"{prompts}:1: the prompt calls tools; eval decodes plain prompts" in err, err
    assert not (tmp_path / "x").exists()


def test_batched_eval_gives_the_same_tokens_and_tau_as_one_at_a_time(tmp_path, capsys, tiny_draft, tiny_target):
    prompts = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"id": "a", "prompt": "the cat sat", "split": "heldout"},
            {"id": "b", "prompt": "two dogs ran past the old barn", "split": "heldout"},
            {"id": "c", "prompt": "one bird", "split": "heldout"},
        ],
    )
    reports = {}
    for batch in ("1", "2"):
        out = tmp_path / f"batch{batch}"
        code, _, err = run_cli(
            eval_args(
                tiny_draft, tiny_target, prompts, out, "--max-new-tokens", "16", "--depth", "3", "--batch-size", batch
            ),
            capsys,
        )
        assert code == 0, err
        reports[batch] = json.loads((out / "report.json").read_text())
    assert reports["2"]["lossless"] is True and reports["2"]["settings"]["batch_size"] == 2
    for key in ("acceptance_length", "acceptance_by_position", "generated_tokens", "target_forwards"):
        assert reports["2"][key] == reports["1"][key], key
    for refused in (["--mode", "tree"], ["--temperature", "0.7"]):
        code, _, err = run_cli(
            eval_args(tiny_draft, tiny_target, prompts, tmp_path / "x", "--batch-size", "2", *refused),
            capsys,
        )
        assert code == 2 and "batched decoding drafts chains greedily" in err and "Traceback" not in err
        assert not (tmp_path / "x").exists()
    for bad, message in ((["--batch-size", "0"], "--batch-size: "), (["--dtype", "fp32"], "--dtype: ")):
        code, _, err = run_cli(
            eval_args(tiny_draft, tiny_target, prompts, tmp_path / "x", *bad),
            capsys,
        )
        assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "x").exists()


def test_eval_refuses_draft_for_another_target(tmp_path, capsys, tiny_draft):
    from conftest import tiny_llama_dir

    other = tiny_llama_dir(tmp_path / "other", tokenizer_family="qwen3", layers=9)
    code, _, err = run_cli(["eval", "--draft", tiny_draft, "--target", other, "--out", tmp_path / "e"], capsys)
    assert code == 2 and "preflight failed for eval: draft: trained for target tiny-target0" in err
    # the stage itself refuses too when preflight is skipped
    code, _, err = run_cli(
        ["eval", "--draft", tiny_draft, "--target", other, "--out", tmp_path / "e", "--skip-preflight"], capsys
    )
    assert code == 2 and "PREFLIGHT SKIPPED" in err and "trained for target tiny-target0" in err


def test_a_draft_moves_between_transformers_releases(tmp_path, capsys, tiny_draft, tiny_target):
    """Trained where one transformers release wrote the target's config.json (it stamps its version in), evaluated
    where another did: the same target."""
    import shutil

    from eaglet.model.target import target_info

    moved = tmp_path / "target"
    shutil.copytree(tiny_target, moved)
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps(config | {"transformers_version": "0.0.1"}))
    here, there = target_info(resolve_target(str(tiny_target))), target_info(resolve_target(str(moved)))
    assert here.config_hash == there.config_hash
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "the cat sat", "split": "heldout"}])
    code, _, err = run_cli(
        eval_args(tiny_draft, moved, prompts, tmp_path / "e", "--max-new-tokens", "4"),
        capsys,
    )
    assert code == 0, err
    config["hidden_size"] = 2 * config["hidden_size"]  # what the model computes changed: another target
    assert config_identity(config) != here.config_hash


def test_a_draft_keeps_its_target_when_another_transformers_hashes_the_tokenizer_differently(
    tmp_path, capsys, tiny_draft, tiny_target
):
    """A tokenizer's hash moves between transformers releases (5.19's and 5.17's differ for the embedded target); a
    draft is the target's by its config identity, so eval and export still take it. Stores keep both hashes."""
    import shutil

    moved = tmp_path / "draft"
    shutil.copytree(tiny_draft, moved)
    config = json.loads((moved / "config.json").read_text())
    config["target"]["tokenizer_hash"] = "0" * 64
    (moved / "config.json").write_text(json.dumps(config))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "the cat sat", "split": "heldout"}])
    code, _, err = run_cli(
        eval_args(moved, tiny_target, prompts, tmp_path / "e", "--max-new-tokens", "4"),
        capsys,
    )
    assert code == 0, err
    code, _, err = run_cli(
        ["export", "--draft", moved, "--format", "speculators", "--target", tiny_target, "--out", tmp_path / "x"],
        capsys,
    )
    assert code == 0, err


def test_eval_tree_mode_is_lossless_and_samples(tmp_path, capsys, tiny_draft, tiny_target):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "the cat sat on", "split": "heldout"}])
    out = tmp_path / "tree"
    code, _, err = run_cli(
        eval_args(
            tiny_draft,
            tiny_target,
            prompts,
            out,
            "--mode",
            "tree",
            "--depth",
            "3",
            "--topk",
            "3",
            "--budget",
            "8",
            "--max-new-tokens",
            "16",
        ),
        capsys,
    )
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["lossless"] is True and report["settings"]["mode"] == "tree" and report["settings"]["budget"] == 8
    code, _, err = run_cli(
        eval_args(
            tiny_draft, tiny_target, prompts, out, "--mode", "tree", "--temperature", "0.7", "--max-new-tokens", "16"
        ),
        capsys,
    )
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["lossless"] is None and report["settings"]["temperature"] == 0.7  # sampled: checked statistically
    assert report["acceptance_length"] >= 1.0


def test_two_layer_draft_trains_exports_for_vllm_and_is_refused_for_sglang(tmp_path, capsys, tiny_store, tiny_target):
    """`--draft-layers 2`: layer 0 keeps the serving name midlayer.*, layer 1 is layers.1.* (vLLM's llama_eagle3
    names); the exported draft decodes like the trained one; SGLang (one layer) is refused by name."""
    from safetensors.torch import load_file

    run = tmp_path / "deep"
    code, _, err = run_cli(
        [
            "train",
            "--store",
            tiny_store,
            "--target",
            tiny_target,
            "--out",
            run,
            "--draft-layers",
            "2",
            "--max-steps",
            "4",
            "--token-budget",
            "128",
            "--eval-every",
            "2",
        ],
        capsys,
    )
    assert code == 0, err
    code, _, err = run_cli(["export", "--draft", run, "--format", "vllm", "--out", tmp_path / "vllm"], capsys)
    assert code == 0, err
    names = set(load_file(str(tmp_path / "vllm" / "model.safetensors")))
    assert {
        "midlayer.self_attn.q_proj.weight",
        "layers.1.self_attn.q_proj.weight",
        "layers.1.mlp.down_proj.weight",
    } <= names
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["num_hidden_layers"] == 2
    target_path = resolve_target(str(tiny_target)).path
    embed = load_head_weights(target_path).embed
    runner = TargetRunner(load_model(target_path, device="cpu"), (2, 4, 5))
    prompt = [5, 17, 33, 8, 90, 12]
    trained = speculative_decode(
        runner,
        DraftRunner(load_draft(run, embed=embed.float()).to(torch.bfloat16).float()),
        prompt,
        16,
        3,
        Sampling(),
        set(),
    )
    exported = speculative_decode(
        runner, DraftRunner(load_draft(tmp_path / "vllm", embed=embed.float())), prompt, 16, 3, Sampling(), set()
    )
    assert exported.tokens == trained.tokens and exported.accepted == trained.accepted
    code, _, err = run_cli(["export", "--draft", run, "--format", "sglang", "--out", tmp_path / "sglang"], capsys)
    assert code == 2 and "loads one decoder layer" in err and not (tmp_path / "sglang").exists()


def test_report_explains_a_failed_lossless_check_outside_float32():
    from eaglet.decode.evaluate import _markdown

    report = {
        "acceptance_length": 2.0,
        "tokens_per_s": 10.0,
        "baseline_tokens_per_s": 8.0,
        "speedup": 1.25,
        "lossless": False,
        "prompts": 1,
        "generated_tokens": 9,
        "per_category": {},
        "per_source": {},
        "acceptance_by_position": [0.5],
        "settings": {
            "draft": "d",
            "target": "t",
            "mode": "chain",
            "depth": 1,
            "temperature": 0.0,
            "split": "heldout",
            "device": "cuda",
            "dtype": "bfloat16",
        },
    }
    assert "--dtype float32" in _markdown(report)
    report["settings"]["dtype"] = "float32"
    assert "--dtype float32" not in _markdown(report)  # in float32 a failure is a real failure: no excuse offered


def test_static_cache_eval_gives_the_dynamic_cache_results(tmp_path, capsys, tiny_draft, tiny_target):
    """`--cuda-graphs on` off the GPU runs the static-cache target eagerly, each greedy round one fused body, the
    draft's part compiled (`--compile-draft on`, as on GPU by default): same tokens, same acceptance."""
    prompts = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"id": "a", "prompt": "the cat sat", "split": "heldout"},
            {"id": "b", "prompt": "two dogs ran past the old barn", "split": "heldout"},
        ],
    )
    reports = {}
    for mode, shape in (("chain", ["--depth", "3"]), ("tree", ["--mode", "tree", "--depth", "3", "--budget", "10"])):
        for graphs in ("off", "on"):
            out = tmp_path / f"{mode}_{graphs}"
            code, _, err = run_cli(
                eval_args(
                    tiny_draft,
                    tiny_target,
                    prompts,
                    out,
                    "--max-new-tokens",
                    "16",
                    "--cuda-graphs",
                    graphs,
                    "--compile-draft",
                    graphs,
                    *shape,
                ),
                capsys,
            )
            assert code == 0, err
            reports[mode, graphs] = json.loads((out / "report.json").read_text())
        static, dynamic = reports[mode, "on"], reports[mode, "off"]
        assert static["settings"]["static_cache"] is True and dynamic["settings"]["static_cache"] is False
        assert static["settings"]["cuda_graphs"] is False  # CPU: the same functions, run eagerly
        assert static["settings"]["static_draft"] is True  # greedy chains and trees draft on static caches
        assert static["settings"]["compiled_draft"] is True and dynamic["settings"]["compiled_draft"] is False
        assert "static KV caches" in (tmp_path / f"{mode}_on" / "report.md").read_text()
        assert static["lossless"] is True
        for key in ("acceptance_length", "acceptance_by_position", "generated_tokens", "target_forwards"):
            assert static[key] == dynamic[key], (mode, key)
    code, _, err = run_cli(
        eval_args(tiny_draft, tiny_target, prompts, tmp_path / "x", "--cuda-graphs", "yes"),
        capsys,
    )
    assert code == 2 and "--cuda-graphs: " in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


def test_compile_draft_on_without_a_compiler_stops_before_decoding(
    tmp_path, capsys, monkeypatch, tiny_draft, tiny_target
):
    """`--compile-draft on` where torch.compile has no compiler to call: one line naming the fix, exit 1, no
    report; preflight says the same before any weights load, and `auto` on CPU does not compile at all."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "the cat sat", "split": "heldout"}])
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    common = [
        "--draft",
        tiny_draft,
        "--target",
        tiny_target,
        "--prompts",
        prompts,
        "--out",
        tmp_path / "x",
        "--device",
        "cpu",
        "--cuda-graphs",
        "on",
    ]
    for skip in ([], ["--skip-preflight"]):  # preflight's check, then eval's own
        code, _, err = run_cli(["eval", *common, "--compile-draft", "on", *skip], capsys)
        last = err.strip().splitlines()[-1]  # (preflight prints its table first)
        assert code == 2 and "no-such-c++-compiler" in last and "--compile-draft off" in last, err
        assert "Traceback" not in err
        assert not (tmp_path / "x" / "report.json").exists()
    checks = {}
    for mode in ("on", "auto"):
        code, stdout, err = run_cli(["preflight", "--json", "eval", *common, "--compile-draft", mode], capsys)
        checks[mode] = {c["name"]: c for c in json.loads(stdout)["checks"]}
    assert (
        checks["on"]["draft compile"]["status"] == "fail"
        and "--compile-draft off" in checks["on"]["draft compile"]["fix"]
    )
    assert "draft compile" not in checks["auto"]  # auto compiles on GPU only
    code, _, err = run_cli(["eval", *common, "--compile-draft", "maybe"], capsys)
    assert code == 2 and "--compile-draft: " in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (
        err
    )
    assert not (tmp_path / "x").exists()


def test_a_lossless_failure_is_located_and_sized():
    """Where a greedy output leaves the target's own, the report says at which token and by how many logits
    (and rounding units) the target preferred its own choice: near-ties (bf16) read differently from a bug."""
    from test_decode import tiny_pair

    from eaglet.decode.baseline import target_only_decode
    from eaglet.decode.evaluate import _divergence, _divergence_lines
    from eaglet.decode.runners import TargetRunner
    from eaglet.model.sampling import Sampling

    target, _ = tiny_pair()
    layers = (2, 4, 5)
    prompt = [5, 17, 33, 8]
    expected = target_only_decode(TargetRunner(target, layers), prompt, 12, Sampling(), set()).tokens
    got = expected[:5] + [(expected[5] + 1) % 64] + expected[6:]
    record = _divergence(target, layers, prompt, expected, got)
    assert record["position"] == 5 and record["target_token"] == expected[5] and record["speculative_token"] == got[5]
    assert record["logit_gap"] > 0 and record["rounding_units"] > 0  # the target's greedy choice was its argmax
    assert _divergence(target, layers, prompt, expected, expected[:7]) == {"position": 7}  # stopped early: no token
    report = {"lossless_failures": ["a", "b"], "divergences": {"a": record, "b": {"position": 7}}}
    assert f"by at most {record['logit_gap']:.4g} logits" in _divergence_lines(report)[0]


def test_eval_tune_times_each_tree_and_evaluates_with_the_fastest(tmp_path, capsys, tiny_draft, tiny_target):
    prompts = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"id": "t1", "prompt": "a red fox jumped", "category": "animals", "split": "train"},
            {"id": "t2", "prompt": "the sun rose slowly", "category": "sky", "split": "train"},
            {"id": "h1", "prompt": "the cat sat", "category": "animals", "split": "heldout"},
            {"id": "h2", "prompt": "one bird sang", "category": "birds", "split": "heldout"},
        ],
    )
    out = tmp_path / "eval"
    code, stdout, err = run_cli(
        eval_args(
            tiny_draft,
            tiny_target,
            prompts,
            out,
            "--max-new-tokens",
            "12",
            "--mode",
            "tree",
            "--tune",
            "--set",
            "tune_trees=[[2, 2, 4], [3, 3, 9]]",
            "--set",
            "tune_prompts=2",
        ),
        capsys,
    )
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    tuning = report["tuning"]
    assert tuning["prompts"] == 2 and tuning["prompts_from"] == "train split"  # not the held-out prompts judged
    assert [t["tree"] for t in tuning["trees"]] == [[2, 2, 4], [3, 3, 9]]
    fastest = max(tuning["trees"], key=lambda t: t["tokens_per_s"])
    assert tuning["chosen"] == fastest["tree"] and all(t["acceptance_length"] >= 1 for t in tuning["trees"])
    settings = report["settings"]
    assert [settings["depth"], settings["topk"], settings["budget"]] == fastest["tree"]
    assert len(report["acceptance_by_position"]) == fastest["tree"][0] and report["prompts"] == 2
    assert report["lossless"] is True
    assert f"{'/'.join(map(str, fastest['tree']))} (chosen)" in (out / "report.md").read_text()


def test_eval_tune_without_a_train_split_times_the_first_evaluated_prompts(tmp_path, capsys, tiny_draft, tiny_target):
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"id": "a", "prompt": "the cat sat"}, {"id": "b", "prompt": "one bird"}]
    )
    out = tmp_path / "eval"
    code, _, err = run_cli(
        eval_args(
            tiny_draft,
            tiny_target,
            prompts,
            out,
            "--max-new-tokens",
            "8",
            "--mode",
            "tree",
            "--tune",
            "--set",
            "tune_trees=[[2, 2, 4]]",
            "--set",
            "tune_prompts=1",
        ),
        capsys,
    )
    assert code == 0, err
    tuning = json.loads((out / "report.json").read_text())["tuning"]
    assert tuning["prompts_from"] == "evaluated prompts" and tuning["prompts"] == 1 and tuning["chosen"] == [2, 2, 4]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tune"], "--tune times tree shapes; add --mode tree"),
        (
            ["--tune", "--mode", "tree", "--set", "tune_trees=[[0, 2, 4]]"],
            "tune_trees [0, 2, 4]: depth 0 is outside 1..16",
        ),
        (["--tune", "--mode", "tree", "--set", "tune_trees=[[2, 2]]"], "--set tune_trees is missing 'tune_trees.0.2'"),
        (["--prompts", "mt-bench", "--prompts", "mt-bench"], "--prompts: mt-bench is given twice"),
    ],
)
def test_eval_tune_bad_settings_refused_before_loading(tmp_path, capsys, tiny_draft, tiny_target, args, message):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "the cat sat"}])
    code, _, err = run_cli(
        eval_args(tiny_draft, tiny_target, prompts, tmp_path / "x", *args),
        capsys,
    )
    assert code == 2 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_a_cards_tau_is_the_one_measured_for_the_command_it_prints(tmp_path, capsys, tiny_draft, tiny_target):
    """Exported with an eval report of a chain of 2 and no --speculative-tokens, the serve command is that chain's;
    asked for another chain length, the card says its τ was measured for another shape than the command serves."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "the cat sat", "split": "heldout"}])
    args = eval_args(tiny_draft, tiny_target, prompts, tmp_path / "eval", "--max-new-tokens", "8", "--depth", "2")
    assert run_cli(args, capsys)[0] == 0
    report = tmp_path / "eval" / "report.json"
    export = ["export", "--draft", tiny_draft, "--format", "vllm", "--report", report]
    assert run_cli([*export, "--out", tmp_path / "same"], capsys)[0] == 0
    card = (tmp_path / "same" / "README.md").read_text()
    assert '"num_speculative_tokens": 2' in card and "a chain of 2 draft tokens" in card and "not measured" not in card
    assert run_cli([*export, "--out", tmp_path / "other", "--speculative-tokens", "5"], capsys)[0] == 0
    card = (tmp_path / "other" / "README.md").read_text()
    assert '"num_speculative_tokens": 5' in card
    assert "a chain of 2 draft tokens" in card and "serves a chain of 5, not measured" in card


def test_a_card_names_no_base_model_for_a_target_known_only_by_its_local_path(tmp_path, monkeypatch):
    """A local directory is nothing on the Hub: the card's metadata leaves base_model out rather than publish it."""
    import yaml

    from eaglet.export import export_format
    from eaglet.export.write import card_front_matter

    fmt = export_format("vllm")
    (tmp_path / "models" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for local in (str(tmp_path / "models" / "mine"), "models/mine"):
        front = yaml.safe_load(card_front_matter(fmt, (local, "a local path")).split("---\n")[1])
        assert "base_model" not in front and front["library_name"] == "vllm"
    hub = yaml.safe_load(card_front_matter(fmt, ("meta-llama/Llama-3.1-8B-Instruct", "hub id")).split("---\n")[1])
    assert hub["base_model"] == "meta-llama/Llama-3.1-8B-Instruct"
