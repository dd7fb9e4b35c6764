"""Online training: each sample's features are computed once and kept for later epochs, rounded as a store rounds
them; on a CPU, preflight says what a step will cost before training starts."""

from __future__ import annotations

import json

import torch
from conftest import run_cli, small_conversations, write_jsonl


def live_source(prepared, target, cache_bytes):
    from eaglet.formats.layers import default_aux_layer_ids
    from eaglet.formats.prepared import load_prepared
    from eaglet.model.target import load_model
    from eaglet.train.data import LiveSource

    model = load_model(target, "cpu")
    return LiveSource(
        load_prepared(prepared),
        model,
        default_aux_layer_ids(model.config.num_hidden_layers),
        128,
        4096,
        seed=0,
        forward_tokens=256,
        cache_bytes=cache_bytes,
    )


def epochs(source, count):
    return [batch for epoch in range(count) for batch in source.batches(epoch)]


def test_features_are_computed_once_per_sample_and_kept_for_later_epochs(tiny_prepared, tiny_target):
    cached, recomputed = live_source(tiny_prepared, tiny_target, 1 << 30), live_source(tiny_prepared, tiny_target, 0)
    first = epochs(cached, 1)
    samples = cached.computed
    both = epochs(cached, 3)
    assert cached.computed == samples == len(cached.lengths)  # epochs 2 and 3 ran no target forward
    again = epochs(recomputed, 3)
    assert recomputed.computed == 3 * samples
    for kept, fresh in zip(both, again):  # cached or computed again (in other padded batches): the same batches
        assert torch.equal(kept.input_ids, fresh.input_ids) and torch.equal(kept.sample_index, fresh.sample_index)
        torch.testing.assert_close(kept.aux.float(), fresh.aux.float(), rtol=1e-2, atol=1e-2)  # bf16 rounding
        torch.testing.assert_close(kept.last.float(), fresh.last.float(), rtol=1e-2, atol=1e-2)
    assert first[0].aux.dtype == torch.bfloat16  # as the default (bf16) store keeps them


def test_the_cache_keeps_what_fits_and_recomputes_the_rest(tiny_prepared, tiny_target):
    from eaglet.formats.prepared import load_prepared

    per_token = 4 * 64 * 2 + 8 + 1  # aux (3H) + last (H) in bf16, the id (int64) and the mask
    half = int(load_prepared(tiny_prepared).lengths.sum()) * per_token // 2
    source = live_source(tiny_prepared, tiny_target, half)
    epochs(source, 1)
    one = source.computed
    epochs(source, 1)
    assert 0 < source.computed - one < one and source.cache.used_bytes <= half


def test_preflight_names_a_cpu_step_that_will_take_long_and_what_cuts_it(tmp_path, capsys, embedded_target):
    data = write_jsonl(tmp_path / "c.jsonl", small_conversations(8))
    assert run_cli(["prepare", data, "--out", tmp_path / "prepared"], capsys)[0] == 0
    code, out, err = run_cli(
        [
            "preflight",
            "train",
            "--prepared",
            tmp_path / "prepared",
            "--out",
            tmp_path / "run",
            "--max-steps",
            "60",
            "--token-budget",
            "4096",
            "--json",
            "--device",
            "cpu",
        ],
        capsys,
    )
    checks = {check["name"]: check for check in json.loads(out)["checks"]}
    step = checks["step time"]
    assert step["status"] == "warn" and "s per step on this CPU" in step["detail"], step
    assert "--token-budget 1024" in step["fix"] and "--draft-vocab 4096" in step["fix"]
    code, out, err = run_cli(
        [
            "preflight",
            "train",
            "--prepared",
            tmp_path / "prepared",
            "--out",
            tmp_path / "run",
            "--token-budget",
            "64",
            "--json",
            "--device",
            "cpu",
        ],
        capsys,
    )
    assert {check["name"]: check for check in json.loads(out)["checks"]}["step time"]["status"] == "pass"


def test_a_negative_online_cache_is_refused_in_one_line(tmp_path, capsys, tiny_prepared, tiny_target):
    code, _, err = run_cli(
        [
            "train",
            "--prepared",
            tiny_prepared,
            "--target",
            tiny_target,
            "--out",
            tmp_path / "run",
            "--device",
            "cpu",
            "--set",
            "online_cache_gb=-1",
        ],
        capsys,
    )
    assert code == 2 and "online_cache_gb" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
