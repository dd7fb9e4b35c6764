"""Drafts made elsewhere: a speculators 0.9.0 save made here by speculators' own model class, and the vLLM/SGLang
EAGLE-3 layout, measured by `eaglet eval` as those engines would run them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli, small_conversations, write_jsonl
from test_consumers import CUSTOM_LAYERS, random_draft

from eaglet.export.write import export_draft
from eaglet.model.target import load_head_weights, read_config

DRAFT_VOCAB = 300


def speculators_save(
    root: Path,
    target: Path,
    norms: dict[str, bool],
    seed: int = 0,
    layers: tuple[int, ...] = CUSTOM_LAYERS,
    vocab=None,
) -> Path:
    """A draft as speculators 0.9.0 writes one (``save_pretrained`` of its ``Eagle3DraftModel``), its weights random
    (seeded), its embedding the target's; its draft vocabulary ``vocab``'s (a DraftVocab), else the target's first
    DRAFT_VOCAB token ids."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    text = read_config(target)
    layer = LlamaConfig(
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"],
        num_attention_heads=text["num_attention_heads"],
        num_key_value_heads=text["num_key_value_heads"],
        num_hidden_layers=1,
        max_position_embeddings=text["max_position_embeddings"],
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
    )
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=DRAFT_VOCAB if vocab is None else vocab.size,
        norm_before_residual=True,  # speculators' trainer default
        eagle_aux_hidden_state_layer_ids=list(layers),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(target), architectures=["LlamaForCausalLM"]),
        ),
        **norms,
    )
    model = Eagle3DraftModel(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in f".{name}":
                parameter.copy_(1 + 0.05 * torch.randn(parameter.shape, generator=generator))
            else:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
        model.embed_tokens.weight.copy_(load_head_weights(target).embed)
        if vocab is None:
            model.d2t.zero_()  # draft id i is target id i
            model.t2d.zero_()
            model.t2d[:DRAFT_VOCAB] = True
        else:
            model.d2t.copy_(torch.from_numpy(vocab.d2t))
            model.t2d.copy_(torch.from_numpy(vocab.t2d))
    model.save_pretrained(str(root))
    return root


def _prompts(tmp_path: Path) -> Path:
    rows = [{"id": str(i), "prompt": f"the cat {i} sat", "split": "heldout"} for i in range(2)]
    return write_jsonl(tmp_path / "prompts.jsonl", rows)


def _eval(draft: Path, target: Path, out: Path, capsys, *extra) -> tuple[int, str]:
    args = ["eval", "--draft", draft, "--target", target, "--out", out, "--prompts", _prompts(out.parent)]
    code, _, err = run_cli([*args, "--max-new-tokens", "8", *extra], capsys)
    return code, err


@pytest.mark.parametrize(
    "norms",
    [{}, {"fc_norm": True, "norm_output": True}, {"norm_before_fc": True, "norm_output": True}],
    ids=["eagle3", "eagle3.1", "speculators-default"],
)
def test_a_speculators_save_runs_as_speculators_runs_it_and_is_evaluated(tmp_path, capsys, tiny_target, norms):
    from eaglet.consumers import speculators_library as speculators

    saved = speculators_save(tmp_path / "speculators", tiny_target, norms)
    assert not (saved / "eaglet_draft.json").exists()
    differences = speculators.compare_logits(saved, steps=3)  # eaglet's load of it vs speculators' own forward
    assert max(differences) < 1e-4, differences
    code, err = _eval(saved, tiny_target, tmp_path / "eval", capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["lossless"] is True and report["acceptance_length"] >= 1.0


def test_the_vllm_layout_without_eaglets_record_is_measured_as_the_same_draft(tmp_path, capsys, tiny_target):
    """An eaglet export with its eaglet_draft.json removed is a draft made elsewhere in vLLM's layout: the same
    τ; without aux layer ids in its config it takes the target's defaults, as vLLM does."""
    draft = random_draft(tmp_path / "draft", tiny_target, DRAFT_VOCAB, norms={"fc_norm": True, "norm_output": True})
    export = export_draft(draft, "vllm", tmp_path / "export")
    assert _eval(export, tiny_target, tmp_path / "ours", capsys)[0] == 0
    foreign = tmp_path / "foreign"
    shutil.copytree(export, foreign)
    (foreign / "eaglet_draft.json").unlink()
    code, err = _eval(foreign, tiny_target, tmp_path / "theirs", capsys)
    assert code == 0, err
    ours, theirs = (json.loads((tmp_path / name / "report.json").read_text()) for name in ("ours", "theirs"))
    for key in ("acceptance_length", "target_forwards", "generated_tokens", "per_category"):
        assert theirs[key] == ours[key], key

    config = json.loads((foreign / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"], config["eagle_config"]
    (foreign / "config.json").write_text(json.dumps(config))
    from eaglet.formats.draft_config import read_draft_config

    assert read_draft_config(foreign, target_layers=8).config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    code, err = _eval(foreign, tiny_target, tmp_path / "defaults", capsys)
    assert code == 0, err


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c | {"vocab_size": c["vocab_size"] + 64}, "token vocabulary;"),
        (lambda c: c | {"model_type": "qwen3"}, "a draft of qwen3 layers"),
        (lambda c: c | {"mlp_bias": True}, "mlp_bias; eaglet's draft has no biases"),
        (lambda c: c | {"fc_norm": True, "norm_before_fc": True}, "fc_norm and norm_before_fc"),
    ],
    ids=["other-vocab", "qwen3-layers", "biases", "both-aux-norms"],
)
def test_a_draft_made_elsewhere_that_eaglet_cannot_run_is_one_line(tmp_path, capsys, tiny_target, edit, message):
    draft = random_draft(tmp_path / "draft", tiny_target, None)
    foreign = export_draft(draft, "vllm", tmp_path / "export")
    (foreign / "eaglet_draft.json").unlink()
    config = edit(json.loads((foreign / "config.json").read_text()))
    (foreign / "config.json").write_text(json.dumps(config))
    code, err = _eval(foreign, tiny_target, tmp_path / "eval", capsys)
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "eval" / "report.json").exists()


def test_training_starts_from_a_speculators_save(tmp_path, capsys, tiny_target):
    """`train --init-from` a speculators save of this run's layers and vocabulary: the run starts from its weights
    (its EAGLE 3.1 norms kept, though --eagle-version was not given); one with another vocabulary mapping is one line."""
    from safetensors.torch import load_file

    from eaglet.data.vocab import DraftVocab

    data = write_jsonl(tmp_path / "c.jsonl", small_conversations(8))
    prepared = tmp_path / "prepared"
    code, _, err = run_cli(
        ["prepare", data, "--out", prepared, "--target", tiny_target, "--draft-vocab", "200"], capsys
    )
    assert code == 0, err
    vocab = DraftVocab.load(prepared / "vocab.safetensors")
    norms = {"fc_norm": True, "norm_output": True}
    saved = speculators_save(tmp_path / "speculators", tiny_target, norms, layers=(2, 4, 5), vocab=vocab)
    out = tmp_path / "run"
    args = ["train", "--prepared", prepared, "--out", out, "--target", tiny_target, "--token-budget", "128"]
    code, _, err = run_cli([*args, "--max-steps", "1", "--lr", "1e-12", "--init-from", saved], capsys)
    assert code == 0, err
    trained, start = load_file(out / "model.safetensors"), load_file(saved / "model.safetensors")
    assert json.loads((out / "config.json").read_text())["fc_norm"] is True
    for name in ("fc.weight", "fc_norm.1.weight", "lm_head.weight", "norm.weight"):
        assert torch.allclose(trained[name], start[name], atol=1e-6), name
    assert torch.allclose(
        trained["midlayer.self_attn.q_proj.weight"], start["layers.0.self_attn.q_proj.weight"], atol=1e-6
    )

    first_ids = np.zeros(len(vocab.t2d), dtype=bool)
    first_ids[: vocab.size] = True  # as many draft tokens, other target tokens: the target's first ids
    assert not np.array_equal(first_ids, vocab.t2d)
    other_vocab = DraftVocab(np.zeros(vocab.size, dtype=np.int64), first_ids, vocab.counts, vocab.coverage)
    other = speculators_save(tmp_path / "other-vocab", tiny_target, norms, layers=(2, 4, 5), vocab=other_vocab)
    code, _, err = run_cli([*args, "--out", tmp_path / "refused", "--init-from", other], capsys)
    assert code == 2 and "d2t differs" in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_vllm_serving_takes_a_speculators_save_and_refuses_a_training_output(tmp_path, tiny_target):
    """`eval --backend vllm` and `bench` hand vLLM the draft directory: vLLM reads its own layout and, through its
    speculators config reader, a speculators save (its trainer's, or `eaglet export --format speculators`); the draft
    directory `eaglet train` writes is neither, refused with the export command that makes one."""
    from eaglet.errors import EagletError
    from eaglet.formats.draft_config import SERVED_BY_VLLM, require_export

    save = speculators_save(tmp_path / "speculators", tiny_target, {"fc_norm": True, "norm_output": True})
    assert require_export(save, SERVED_BY_VLLM).export_format == "speculators"
    trained = random_draft(tmp_path / "trained", tiny_target, DRAFT_VOCAB)
    with pytest.raises(EagletError, match="loads a vllm or speculators export: run `eaglet export .* --format vllm"):
        require_export(trained, SERVED_BY_VLLM)
