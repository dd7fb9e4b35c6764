"""Exports as their consumers read them: speculators' own model class run beside eaglet's draft, and vLLM's and
SGLang's loaders run from their released source (src/eaglet/resources/consumers, scripts/refresh_consumer_fixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file, save_file

from eaglet.consumers import speculators_library as speculators
from eaglet.consumers.export_check import FAIL, PASS, check_export
from eaglet.consumers.fixtures import ENGINES, fixtures
from eaglet.export.write import export_draft
from eaglet.formats.draft_config import EAGLE_VARIANTS, DraftConfig
from eaglet.model.draft import Eagle3Draft, save_draft
from eaglet.model.target import load_head_weights, read_config, resolve_target, target_info, target_record

CUSTOM_LAYERS = (1, 3, 6)  # not the defaults (2, 4, 5) of the 8-layer tiny target: a wrong reading shows


def random_draft(
    root: Path,
    target: Path,
    draft_vocab: int | None,
    layers=CUSTOM_LAYERS,
    seed: int = 0,
    hub_id: str | None = None,
    norms: dict[str, bool] | None = None,
) -> Path:
    """An eaglet draft directory with random weights (no training) for ``target``; ``draft_vocab`` None = the
    target's whole vocabulary."""
    resolved = resolve_target(str(target))
    info = target_info(resolved)
    record = {
        "name": info.name,
        "config_hash": info.config_hash,
        "tokenizer_hash": info.tokenizer_hash,
        **target_record(resolved, info),
    } | ({"hub_id": hub_id} if hub_id else {})
    vocab = info.vocab_size if draft_vocab is None else draft_vocab
    config = DraftConfig.from_target(read_config(target), vocab, layers, record)
    config = DraftConfig(**config.to_dict() | EAGLE_VARIANTS["3"] | (norms or {}))
    torch.manual_seed(seed)
    draft = Eagle3Draft(config)
    used = torch.sort(torch.randperm(info.vocab_size)[:vocab]).values
    t2d = torch.zeros(info.vocab_size, dtype=torch.bool)
    t2d[used] = True
    head = load_head_weights(target)
    draft.init_from_target(
        head.embed.float(), head.lm_head.float(), used - torch.arange(vocab), t2d, head.final_norm.float()
    )
    with torch.no_grad():
        for parameter in draft.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    save_draft(config, draft.serving_state_dict(), root)
    return root


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, tiny_target):
    root = tmp_path_factory.mktemp("consumer-drafts")
    return {
        "subset": random_draft(root / "subset", tiny_target, 300),
        "full": random_draft(root / "full", tiny_target, None),
        "eagle3.1": random_draft(root / "eagle3.1", tiny_target, 300, norms=EAGLE_VARIANTS["3.1"]),
        # speculators' own default: one norm over the concatenated aux features, the normed state fed back
        "speculators-norms": random_draft(
            root / "speculators-norms", tiny_target, 300, norms={"norm_before_fc": True, "norm_output": True}
        ),
    }


def _by_engine(results) -> dict[str, object]:
    return {r.consumer.split()[0]: r for r in results}


def test_shipped_fixtures_name_their_wheel():
    for engine in ENGINES:
        shipped = fixtures(engine)
        assert shipped, engine
        for fixture in shipped:
            assert fixture.wheel.startswith(f"{engine}-{fixture.version}-") and len(fixture.wheel_sha256) == 64
            assert all(text.strip() for text in fixture.sources.values())


@pytest.mark.parametrize("vocab", ["subset", "full", "eagle3.1", "speculators-norms"])
def test_speculators_model_class_gives_eaglets_logits_at_every_ttt_step(tmp_path, drafts, vocab):
    out = export_draft(drafts[vocab], "speculators", tmp_path / "spec")
    model, load = speculators.load(out)
    assert load.missing == [] and load.unexpected == [] and load.mismatched == [] and load.unset == []
    assert (model.d2t is None) == (vocab == "full")
    differences = speculators.compare_logits(out, steps=4)
    assert len(differences) == 4 and max(differences) < 1e-4, differences


def test_speculators_refuses_the_old_layout(tmp_path, drafts):
    """midlayer.* names and no embedding (what eaglet wrote before): speculators leaves its first layer and its
    embedding at their initial values; the check says so instead of passing."""
    out = export_draft(drafts["subset"], "speculators", tmp_path / "spec")
    tensors = load_file(str(out / "model.safetensors"))
    old = {
        ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
        for k, v in tensors.items()
        if k != "embed_tokens.weight"
    }
    save_file(old, str(out / "model.safetensors"))
    _, load = speculators.load(out)
    assert "layers.0.self_attn.q_proj.weight" in load.missing and "midlayer.self_attn.q_proj.weight" in load.unexpected
    assert "embed_tokens.weight" in load.missing
    result = _by_engine(check_export(out))["speculators"]
    assert result.status == FAIL and any("layers.0.mlp.down_proj.weight" in f for f in result.findings)


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
@pytest.mark.parametrize("vocab", ["subset", "full", "eagle3.1", "speculators-norms"])
def test_both_engines_load_every_tensor_and_read_the_trained_layers(tmp_path, drafts, fmt, vocab):
    out = export_draft(drafts[vocab], fmt, tmp_path / fmt)
    results = _by_engine(check_export(out))
    assert set(results) == {"layout", "vllm", "sglang"}
    for engine, result in results.items():
        assert result.status == PASS, (engine, result.findings)
        assert "aux layers [1, 3, 6]" in result.findings[0]
    shipped = load_file(str(out / "model.safetensors"))
    assert ("d2t" in shipped) == (vocab != "full") and ("t2d" in shipped) == (vocab != "full")
    assert ("fc_norm.2.weight" in shipped) == (vocab == "eagle3.1")
    assert ("input_norm.weight" in shipped) == (vocab == "speculators-norms")


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_an_engine_that_would_feed_back_the_unnormed_state_fails_the_check(tmp_path, drafts, fmt):
    """EAGLE 3.1's norm_output lost from config.json: the engines load every tensor and run the draft on the
    pre-norm hidden state it was not trained on (the mismatch SpecForge #879 shipped); the check names it."""
    out = export_draft(drafts["eagle3.1"], fmt, tmp_path / fmt)
    config = json.loads((out / "config.json").read_text())
    del config["norm_output"]
    (out / "config.json").write_text(json.dumps(config))
    results = _by_engine(check_export(out))
    for engine in ("vllm",) if fmt == "speculators" else ("vllm", "sglang"):
        assert results[engine].status == FAIL, results[engine]
        assert any("un-normed hidden state" in f and "norm_output" in f for f in results[engine].findings)


def test_what_the_engines_did_with_eaglets_earlier_exports(tmp_path, drafts):
    """The failures the readers must catch, on the layouts eaglet wrote before: the mapping tensors of a full
    vocabulary, and each engine's directory read by the other engine."""
    out = export_draft(drafts["full"], "vllm", tmp_path / "full")
    tensors = load_file(str(out / "model.safetensors"))
    vocab = tensors["lm_head.weight"].shape[0]
    save_file(
        tensors | {"d2t": torch.zeros(vocab, dtype=torch.int64), "t2d": torch.ones(vocab, dtype=torch.bool)},
        str(out / "model.safetensors"),
    )
    vllm = _by_engine(check_export(out))["vllm"]
    assert vllm.status == FAIL and any(
        "no module or parameter named 'draft_id_to_target_id'" in f for f in vllm.findings
    )

    only_top = export_draft(drafts["subset"], "vllm", tmp_path / "only-top")
    config = json.loads((only_top / "config.json").read_text())
    del config["eagle_config"]
    (only_top / "config.json").write_text(json.dumps(config))
    sglang = _by_engine(check_export(only_top))["sglang"]  # SGLang falls back to its default layers
    assert sglang.status == FAIL and any("captures the inputs of layers [2, 4, 5]" in f for f in sglang.findings)

    only_nested = export_draft(drafts["subset"], "sglang", tmp_path / "only-nested")
    config = json.loads((only_nested / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (only_nested / "config.json").write_text(json.dumps(config))
    vllm = _by_engine(check_export(only_nested))["vllm"]  # vLLM reads eagle_config's ids without SGLang's +1
    assert vllm.status == FAIL and any("captures the inputs of layers [0, 2, 5]" in f for f in vllm.findings)


def test_speculators_dir_is_read_by_vllm_as_the_same_draft(tmp_path, drafts):
    out = export_draft(drafts["subset"], "speculators", tmp_path / "spec")
    config = json.loads((out / "config.json").read_text())
    assert "model_type" not in config  # vLLM recognises the format by speculators_config only without one
    result = _by_engine(check_export(out))["vllm"]
    assert result.status == PASS and "aux layers [1, 3, 6]" in result.findings[0]
    del config["norm_before_residual"]  # vLLM's speculators reader defaults it to True: eaglet trained without
    (out / "config.json").write_text(json.dumps(config))
    result = _by_engine(check_export(out))["vllm"]
    assert result.status == FAIL and any("norm_before_residual=True" in f for f in result.findings)


def test_verifier_named_by_hub_id_when_known_else_by_path(tmp_path, tiny_target):
    with_hub = random_draft(tmp_path / "hub", tiny_target, 300, hub_id="org/tiny-target")
    spec = json.loads((export_draft(with_hub, "speculators", tmp_path / "a") / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-target"
    assert "vllm serve org/tiny-target" in (export_draft(with_hub, "vllm", tmp_path / "b") / "README.md").read_text()
    local = random_draft(tmp_path / "local", tiny_target, 300)
    card = (export_draft(local, "vllm", tmp_path / "c") / "README.md").read_text()
    assert f"vllm serve {Path(tiny_target).resolve()}" in card and "not portable" in card
    given = export_draft(local, "speculators", tmp_path / "d", verifier="org/given")
    assert (
        json.loads((given / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == "org/given"
    )


def test_export_check_command(tmp_path, capsys, drafts):
    good = export_draft(drafts["subset"], "sglang", tmp_path / "good")
    code, out, err = run_cli(["export", "--check", good, "--json"], capsys)
    assert code == 0, err
    assert {r["status"] for r in json.loads(out)["results"]} == {PASS}
    bad = export_draft(drafts["subset"], "vllm", tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    del config["eagle_config"]
    (bad / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli(["export", "--check", bad], capsys)
    assert code == 2 and "sglang 0.5.23 would not serve it as trained: captures the inputs of layers [2, 4, 5]" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    for broken, message in ((tmp_path / "nothing", "not an export directory"),):
        broken.mkdir()
        code, _, err = run_cli(["export", "--check", broken], capsys)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    # `eaglet train`'s output checked as if exported: its config.json is eaglet's own, which SGLang's loader failed
    # on with "unsupported operand type(s) for +: 'Unknown' and 'int'", blamed on the engine
    code, _, err = run_cli(["export", "--check", drafts["subset"]], capsys)
    assert (
        code == 2 and "an eaglet draft (`eaglet train`'s output), not an export; export it for the engine first" in err
    ), err


def test_export_bad_inputs_write_nothing(tmp_path, capsys, drafts):
    record = json.loads((drafts["subset"] / "config.json").read_text())
    orphan = tmp_path / "orphan"
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes((drafts["subset"] / "model.safetensors").read_bytes())
    (orphan / "config.json").write_text(json.dumps(record | {"target": {"name": "lost"}}))
    cases = [
        (["--draft", orphan, "--format", "speculators"], "does not record its target"),
        (["--draft", drafts["subset"], "--format", "onnx"], "--format: "),
        (["--draft", tmp_path / "none", "--format", "vllm"], "not a draft"),
        (["--draft", drafts["subset"], "--format", "vllm", "--engine", "vllm-0.34"], "expected ENGINE==VERSION"),
    ]
    for args, message in cases:
        code, _, err = run_cli(["export", *args, "--out", tmp_path / "out"], capsys)
        assert code == 2 and message in err and "Traceback" not in err, (args, err)
        assert not (tmp_path / "out").exists()


def test_preflight_warns_for_an_engine_release_the_readers_do_not_cover(tmp_path, capsys, drafts):
    args = ["preflight", "export", "--draft", drafts["subset"], "--format", "vllm", "--out", tmp_path / "o", "--json"]
    code, out, _ = run_cli([*args, "--engine", "vllm==0.33.0"], capsys)
    assert code == 0 and json.loads(out)["status"] == "pass"
    code, out, _ = run_cli([*args, "--engine", "vllm==0.99.0", "--strict"], capsys)
    report = json.loads(out)
    assert code == 1 and report["status"] == "warn"
    warning = next(c for c in report["checks"] if c["status"] == "warn")
    assert "vllm 0.99.0: eaglet's readers cover 0.33.0 only" in warning["detail"]
    assert "refresh_consumer_fixtures.py --vllm 0.99.0" in warning["fix"]
