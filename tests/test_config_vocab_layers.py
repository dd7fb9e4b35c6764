"""Config precedence and strictness, the draft vocabulary, and the aux layer-id convention."""

from __future__ import annotations

import numpy as np
import pytest

from eaglet.config import PrepareConfig, RegenerateConfig, build_config
from eaglet.data.vocab import DraftVocab, build_draft_vocab, default_draft_vocab_size
from eaglet.errors import EagletError
from eaglet.formats.layers import default_aux_layer_ids, to_sglang_layer_ids, validate_aux_layer_ids


def test_precedence_file_then_cli_then_set(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("prepare:\n  max_len: 100\n  draft_vocab: 50\n  inputs: [a.jsonl]\n  out: o\n")
    cfg = build_config(PrepareConfig, "prepare", path, {"max_len": 200, "draft_vocab": None}, ["draft_vocab=7"])
    assert (cfg.max_len, cfg.draft_vocab, cfg.inputs) == (200, 7, ["a.jsonl"])


def test_a_bad_value_is_blamed_on_where_it_was_given(tmp_path):
    """A flag over a config file's value is named as the flag, not as the file's key."""
    path = tmp_path / "c.yaml"
    path.write_text("inputs: [a]\nout: o\nmax_len: -3\n")
    with pytest.raises(EagletError, match=r"config .*c.yaml: 'max_len': "):
        build_config(PrepareConfig, "prepare", path)
    with pytest.raises(EagletError, match=r"^command line: --max-len: .*\(got -5\)"):
        build_config(PrepareConfig, "prepare", path, {"max_len": -5}, options={"max_len": "--max-len"})


def test_flat_file_and_unknown_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("inputs: [a]\nout: o\nmax_lenn: 3\n")
    with pytest.raises(EagletError, match=r"config .*c.yaml: unknown key 'max_lenn'"):
        build_config(PrepareConfig, "prepare", path)


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("max_len=abc", "command line: --set max_len: "),
        ("nonsense", "expected KEY=VALUE"),
        ("on_bad_row=maybe", "command line: --set on_bad_row: "),
        ("temperature=-1", "command line: --set temperature: "),
    ],
)
def test_bad_overrides(override, fragment):
    cls, stage = (RegenerateConfig, "regenerate") if "temperature" in override else (PrepareConfig, "prepare")
    base = {"prompts": ["p"], "out": "o.jsonl"} if cls is RegenerateConfig else {"inputs": ["a"], "out": "o"}
    with pytest.raises(EagletError, match=fragment):
        build_config(cls, stage, None, base, [override])


def test_invalid_yaml_names_the_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("inputs: [a\nout: o\n")
    with pytest.raises(EagletError, match=r"c.yaml:\d+: invalid YAML"):
        build_config(PrepareConfig, "prepare", path)


def test_draft_vocab_top_k_with_deterministic_ties(tmp_path):
    counts = np.array([5, 0, 9, 5, 1, 0, 9], dtype=np.int64)
    vocab = build_draft_vocab(counts, 4)
    used = np.arange(4) + vocab.d2t
    assert used.tolist() == [0, 2, 3, 6]  # 9, 9, then the tie 5/5 by lower id... both fit
    assert vocab.t2d.tolist() == [True, False, True, True, False, False, True]
    assert vocab.coverage == pytest.approx(28 / 29)
    vocab.save(tmp_path / "v.safetensors")
    loaded = DraftVocab.load(tmp_path / "v.safetensors")
    assert loaded.d2t.tolist() == vocab.d2t.tolist() and loaded.coverage == vocab.coverage
    assert build_draft_vocab(counts, 3).t2d.tolist() == [True, False, True, False, False, False, True]


def test_default_draft_vocab_size():
    assert default_draft_vocab_size(49152) == 32000
    assert default_draft_vocab_size(600) == 600


def test_layer_convention():
    assert default_aux_layer_ids(30) == (2, 15, 27)
    assert default_aux_layer_ids(32) == (2, 16, 29)
    with pytest.raises(EagletError, match="at least 7"):
        default_aux_layer_ids(6)
    assert default_aux_layer_ids(7) == (2, 3, 4)
    assert to_sglang_layer_ids((2, 16, 29)) == (1, 15, 28)
    assert validate_aux_layer_ids([1, 3, 5], 6) == (1, 3, 5)
    for bad in ([0, 3, 5], [1, 3, 6], [3, 3, 4], [1, 2]):
        with pytest.raises(EagletError):
            validate_aux_layer_ids(bad, 6)
