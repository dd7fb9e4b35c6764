"""`eaglet extract` and the store: exact features, crash safety, verify/repair, torchrun, refusals, sources."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import extract_args, run_cli, store_bytes
from safetensors.torch import load_file

from eaglet.formats.prepared import load_prepared
from eaglet.formats.store_manifest import read_manifest
from eaglet.formats.target_record import TargetIdentity
from eaglet.model.capture import FeatureCapture, teacher_logits
from eaglet.model.shards import decode_features, read_shard
from eaglet.model.target import load_model, resolve_target


def test_store_features_equal_direct_capture(tiny_store, tiny_prepared, tiny_target):
    manifest = read_manifest(tiny_store)
    assert manifest["complete"] and manifest["num_shards"] > 3
    assert manifest["aux_layer_ids"] == [2, 4, 5] and manifest["aux_convention"] == "input_of_layer"
    model = load_model(resolve_target(str(tiny_target)).path, device="cpu")
    capture = FeatureCapture(model, (2, 4, 5))
    prep = load_prepared(tiny_prepared)
    for entry in manifest["shards"]:
        tensors = read_shard(tiny_store, entry)
        aux, last = decode_features(tensors)
        offsets = tensors["offsets"].tolist()
        for row, sample in enumerate(tensors["sample_index"].tolist()):
            ids, mask = prep.sample(sample)
            begin, end = offsets[row], offsets[row + 1]
            assert tensors["input_ids"][begin:end].tolist() == ids.tolist()
            assert tensors["loss_mask"][begin:end].tolist() == mask.tolist()
            ref_aux, ref_last = capture(torch.from_numpy(ids.astype(np.int64))[None])
            torch.testing.assert_close(aux[begin:end], ref_aux[0].bfloat16().float(), rtol=0.02, atol=0.02)
            torch.testing.assert_close(last[begin:end], ref_last[0].bfloat16().float(), rtol=0.02, atol=0.02)
    assert sum(e["num_samples"] for e in manifest["shards"]) == len(prep)


def test_verify_names_flipped_byte_and_repair_restores(tmp_path, capsys, tiny_store):
    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    shard = store / "shard-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    code, _, err = run_cli(["store", "verify", store], capsys)
    assert code == 2
    assert f"bad shard {shard}: sha256 mismatch" in err and "shard-00001" not in err
    code, out, err = run_cli(["store", "verify", store, "--repair"], capsys)
    assert code == 0, err
    assert "repaired" in out
    assert store_bytes(store) == store_bytes(tiny_store)


def test_a_store_moved_with_its_prepared_set_verifies_and_repairs(tmp_path, capsys, tiny_prepared, tiny_target):
    """A store and its prepared set moved together (a run directory moved, or copied to another machine): the
    token check and the repair find the prepared set beside the store, and the repaired shard is the original."""
    first = tmp_path / "before"
    shutil.copytree(tiny_prepared, first / "prepared")
    code, _, err = run_cli(extract_args(first / "prepared", first / "store", tiny_target), capsys)
    assert code == 0, err
    moved = tmp_path / "after"
    first.rename(moved)
    shards = {p.name: p.read_bytes() for p in (moved / "store").glob("shard-*.safetensors")}
    shard = moved / "store" / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    code, _, err = run_cli(["store", "verify", moved / "store", "--repair"], capsys)
    assert code == 0 and "not found" not in err, err
    assert {p.name: p.read_bytes() for p in (moved / "store").glob("shard-*.safetensors")} == shards


def test_torchrun_two_cpu_processes_equal_one(tmp_path, tiny_store, tiny_prepared, tiny_target):
    out = tmp_path / "store"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        "29517",
        "-m",
        "eaglet.cli",
        *map(str, extract_args(tiny_prepared, out, tiny_target)),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert store_bytes(out) == store_bytes(tiny_store)


def test_disk_too_small_is_refused_before_any_work(tmp_path, capsys, tiny_prepared, tiny_target):
    out = tmp_path / "store"
    started = time.perf_counter()
    code, _, err = run_cli(extract_args(tiny_prepared, out, tiny_target)[:-2] + ["--reserve-gb", "1000000"], capsys)
    assert code == 2 and "preflight failed for extract: disk:" in err and "GiB free" in err
    assert not out.exists()
    code, _, err = run_cli(
        extract_args(tiny_prepared, out, tiny_target)[:-2] + ["--reserve-gb", "1000000", "--skip-preflight"], capsys
    )
    assert code == 2 and "GiB are free" in err  # the stage's own check, before any model load
    assert not out.exists()
    assert time.perf_counter() - started < 5


def test_other_tokenizer_refused_by_name(tmp_path, capsys, tiny_prepared):
    from conftest import tiny_llama_dir

    other = tiny_llama_dir(tmp_path / "other", tokenizer_family="llama3")
    code, _, err = run_cli(extract_args(tiny_prepared, tmp_path / "s", other), capsys)
    assert code == 2 and "preflight failed for extract: tokenizer: prepared with tokenizer tiny-target0" in err
    code, _, err = run_cli(extract_args(tiny_prepared, tmp_path / "s", other, "--skip-preflight"), capsys)
    assert code == 2 and "prepared with tokenizer tiny-target" in err and "prepare again with --target" in err


def test_resume_with_other_settings_refused(tmp_path, capsys, tiny_store, tiny_prepared, tiny_target):
    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    code, _, err = run_cli(extract_args(tiny_prepared, store, tiny_target, "--layers", "1,3,6"), capsys)
    layers = "made with aux_layer_ids [2, 4, 5], this run asks for [1, 3, 6]; use another --out, or delete it"
    assert code == 2 and "preflight failed for extract: output:" in err and layers in err, err
    code, _, err = run_cli(
        extract_args(tiny_prepared, store, tiny_target, "--layers", "1,3,6", "--skip-preflight"), capsys
    )
    assert code == 2 and "preflight failed" not in err and layers in err, err
    code, _, err = run_cli(extract_args(tiny_prepared, store, tiny_target, "--storage-dtype", "fp8-aux"), capsys)
    assert code == 2 and "made with storage_dtype 'bf16', this run asks for 'fp8-aux'" in err, err
    code, _, err = run_cli(extract_args(tiny_prepared, store, tiny_target, "--shard-mb", "1"), capsys)
    assert code == 2 and "made with tokens_per_shard " in err, err  # every identity field, not only two
    assert store_bytes(store) == store_bytes(tiny_store)  # nothing of the bf16 store touched


def test_a_store_resumes_with_its_target_reached_by_another_path(
    tmp_path, capsys, tiny_store, tiny_prepared, tiny_target
):
    """A target's name is its directory's: the same checkpoint copied or renamed is the same target (its config and
    tokenizer hashes say so), and its store resumes, in the preflight and in the stage."""
    store, renamed = tmp_path / "store", tmp_path / "renamed-target"
    shutil.copytree(tiny_store, store)
    shutil.copytree(tiny_target, renamed)
    for extra in ([], ["--skip-preflight"]):
        code, out, err = run_cli(extract_args(tiny_prepared, store, renamed, *extra), capsys)
        assert code == 0 and "computed 0 shard(s) this run" in out, err
    shards = lambda files: {name: data for name, data in files.items() if name.startswith("shard-")}  # noqa: E731
    assert shards(store_bytes(store)) == shards(store_bytes(tiny_store))  # the manifest now names the new path
    assert json.loads((store / "manifest.json").read_text())["target_source"]["path"] == str(renamed)


def test_a_store_planned_before_tail_pieces_resumes_by_its_own_plan(
    tmp_path, capsys, monkeypatch, tiny_prepared, tiny_target
):
    """A store an earlier eaglet began (no ``tail_pieces`` in its manifest: its last shard whole), killed before its
    last shards: this eaglet finishes it by that store's plan, and training's reader plans it the same way."""
    import json

    import eaglet.formats.store_manifest as store_manifest
    from eaglet.formats.store_manifest import LEGACY_TAIL_PIECES

    monkeypatch.setattr(store_manifest, "TAIL_PIECES", LEGACY_TAIL_PIECES)  # this eaglet as it planned before pieces
    legacy = tmp_path / "legacy"
    code, _, err = run_cli(extract_args(tiny_prepared, legacy, tiny_target), capsys)
    assert code == 0, err
    monkeypatch.undo()
    manifest = json.loads((legacy / "manifest.json").read_text())
    del manifest["tail_pieces"]
    (legacy / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_cli(["store", "verify", legacy], capsys)  # the reader plans it as it was planned
    assert code == 0, err
    whole = store_bytes(legacy)
    last = manifest["num_shards"] - 1
    for name in (f"shard-{last:05d}.safetensors", f"shard-{last:05d}.json", f"shard-{last - 1:05d}.json"):
        (legacy / name).unlink()

    code, _, err = run_cli(extract_args(tiny_prepared, legacy, tiny_target), capsys)
    assert code == 0, err
    assert read_manifest(legacy)["num_shards"] == manifest["num_shards"] and read_manifest(legacy)["complete"]
    assert {k: v for k, v in store_bytes(legacy).items() if k != "manifest.json"} == {
        k: v for k, v in whole.items() if k != "manifest.json"
    }
    assert read_manifest(legacy)["tail_pieces"] == LEGACY_TAIL_PIECES
    code, _, err = run_cli(["store", "verify", legacy], capsys)
    assert code == 0, err


RANKED_FIRST_ULPS = 4  # a stored argmax may trail the float32 top logit by this many ulps of extraction's dtype
RANKED_FIRST_FLOOR = 1e-4  # relative, in float32: a padded batch's kernels may break a near tie another way


def ranked_first_tokens(tensors: dict, model, compute_dtype: str = "float32") -> int:
    """Assert each token's stored ``target_top`` is one the target's own forward (float32, on the CPU) ranks first
    there, to the rounding of the dtype extraction computed in (a tiny random target ties some of its logits; on a
    GPU the store is made in bfloat16 by default); the tokens checked."""
    tolerance = max(RANKED_FIRST_FLOOR, RANKED_FIRST_ULPS * torch.finfo(getattr(torch, compute_dtype)).eps)
    offsets = tensors["offsets"].tolist()
    for row in range(len(tensors["sample_index"])):
        begin, end = offsets[row], offsets[row + 1]
        with torch.no_grad():
            logits = model(input_ids=tensors["input_ids"][begin:end].long()[None]).logits[0]  # [L, V]
        top = tensors["target_top"][begin:end].long()
        margin = logits.max(-1).values - logits.gather(1, top[:, None])[:, 0]
        assert margin.max() <= tolerance * logits.abs().max() and (top == logits.argmax(-1)).float().mean() > 0.9
    return offsets[-1]


def test_the_store_keeps_the_targets_own_argmax(tiny_store, tiny_prepared, tiny_target):
    """Each token's ``target_top`` is the token the target itself ranks first there (its own forward's logits over the
    whole vocabulary): what training's in-draft-vocabulary mask reads instead of multiplying the whole LM head."""
    manifest = read_manifest(tiny_store)
    assert manifest["target_top"] is True
    model = load_model(resolve_target(str(tiny_target)).path, device="cpu")
    dtype = manifest["target"]["compute_dtype"]  # bfloat16 where the tests run on a GPU
    checked = sum(ranked_first_tokens(read_shard(tiny_store, e), model, dtype) for e in manifest["shards"][:3])
    assert checked > 100


@pytest.mark.skipif(not torch.cuda.is_available(), reason="extraction on a GPU: its copy stream and pinned buffers")
def test_a_store_extracted_on_a_gpu_holds_the_cpu_stores_tokens_and_argmax(
    tmp_path, capsys, tiny_store, tiny_prepared, tiny_target
):
    """The GPU path (features copied out on a side stream into recycled pinned buffers, the argmax among them): the
    CPU store's shards and tokens, each token's argmax one the target ranks first, and a store `verify` passes."""
    store = tmp_path / "gpu"
    code, _, err = run_cli(
        extract_args(tiny_prepared, store, tiny_target, "--device", "cuda", "--dtype", "float32"), capsys
    )
    assert code == 0, err
    assert run_cli(["store", "verify", store], capsys)[0] == 0
    on_cpu = {entry["index"]: entry for entry in read_manifest(tiny_store)["shards"]}
    model = load_model(resolve_target(str(tiny_target)).path, device="cpu")
    for entry in read_manifest(store)["shards"]:
        gpu, cpu = read_shard(store, entry), read_shard(tiny_store, on_cpu[entry["index"]])
        assert torch.equal(gpu["input_ids"], cpu["input_ids"]) and torch.equal(gpu["offsets"], cpu["offsets"])
        ranked_first_tokens(gpu, model)


def test_a_store_made_before_the_argmax_was_stored_resumes_and_trains_without_it(
    tmp_path, capsys, monkeypatch, tiny_store, tiny_prepared, tiny_target
):
    """A store an earlier eaglet made (no ``target_top`` in its manifest or shards), killed before its last shard:
    this eaglet finishes it without the argmax (every shard of a store holds the same tensors), `store verify` passes,
    and training computes the argmax from ``last`` as it did, to the same losses as on a store that keeps it; only
    then does its teacher hold the whole LM head (the preflight's memory says so too)."""
    import eaglet.formats.store_manifest as store_manifest

    monkeypatch.setattr(store_manifest, "stores_target_top", lambda backend: False)  # this eaglet as it was before
    store = tmp_path / "legacy"
    assert run_cli(extract_args(tiny_prepared, store, tiny_target), capsys)[0] == 0
    monkeypatch.undo()
    manifest = json.loads((store / "manifest.json").read_text())
    del manifest["target_top"]
    (store / "manifest.json").write_text(json.dumps(manifest))
    last = manifest["num_shards"] - 1
    (store / f"shard-{last:05d}.safetensors").unlink()
    (store / f"shard-{last:05d}.json").unlink()

    code, out, err = run_cli(extract_args(tiny_prepared, store, tiny_target), capsys)
    assert code == 0 and "computed 1 shard(s) this run" in out, err
    assert read_manifest(store)["target_top"] is False
    assert "target_top" not in load_file(store / f"shard-{last:05d}.safetensors")
    assert run_cli(["store", "verify", store], capsys)[0] == 0

    losses = {}
    for name, source in (("kept", tiny_store), ("computed", store)):
        run = tmp_path / name
        args = ["train", "--store", source, "--out", run, "--target", tiny_target, "--max-steps", "3"]
        args += ["--token-budget", "128", "--log-every", "1", "--seed", "1", "--set", "eval_fraction=0"]
        code, _, err = run_cli(args, capsys)
        assert code == 0, err
        losses[name] = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["kept"]) == 3
    np.testing.assert_allclose(losses["computed"], losses["kept"], rtol=1e-5)

    # the teacher keeps the whole LM head only where a store read lacks the argmax, and the preflight sizes it so
    from eaglet.config import TrainConfig
    from eaglet.model.distributed import Dist
    from eaglet.preflight.stages import argmax_stored, train_memory
    from eaglet.train.setup import build_model, build_setup

    def config(source, held_out=None):
        held_out = None if held_out is None else str(held_out)
        return TrainConfig(out=str(tmp_path / "m"), store=str(source), target=str(tiny_target), eval_store=held_out)

    kept, computed = config(tiny_store), config(store)
    assert [argmax_stored(c) for c in (kept, computed, config(tiny_store, store))] == [True, False, False]
    models = {}
    for name, train in (("kept", kept), ("computed", computed)):
        setup = build_setup(train, "cpu")
        models[name] = build_model(train, setup, torch.device("cpu"), Dist(rank=0, world=1, local_rank=0))
        assert setup.argmax_stored is (name == "kept")
    assert models["kept"].teacher.lm_head is None and models["computed"].teacher.lm_head is not None
    draft, vocab = models["kept"].draft.config, models["kept"].teacher.vocab_size
    assert models["kept"].teacher.draft_rows.shape == (draft.draft_vocab_size, draft.hidden_size)
    sizes = [train_memory(c, "cpu", 4, draft, vocab, 0)[0] for c in (kept, computed)]
    assert sizes[1] - sizes[0] == vocab * draft.hidden_size * 4


def test_resuming_a_store_across_the_weights_fingerprint(tmp_path, capsys, tiny_prepared, tiny_target):
    """A store an earlier eaglet began (its manifest records no weights fingerprint) resumes; one whose target was
    rewritten in place since (a new fine-tune: its weights fingerprint differs) is refused, shards computed from the
    old weights kept apart from the new."""
    from safetensors.torch import load_file, save_file

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    store = tmp_path / "store"
    assert run_cli(extract_args(tiny_prepared, store, target), capsys)[0] == 0
    manifest = json.loads((store / "manifest.json").read_text())
    last = manifest["num_shards"] - 1
    (store / f"shard-{last:05d}.safetensors").unlink()
    (store / f"shard-{last:05d}.json").unlink()
    before = dict(manifest, target={k: v for k, v in manifest["target"].items() if k != "weights_hash"})
    (store / "manifest.json").write_text(json.dumps(before))
    code, out, err = run_cli(extract_args(tiny_prepared, store, target), capsys)
    assert code == 0 and "computed 1 shard(s) this run" in out, err

    (store / f"shard-{last:05d}.safetensors").unlink()
    (store / f"shard-{last:05d}.json").unlink()
    tensors = load_file(target / "model.safetensors")
    save_file({n: t * 1.01 for n, t in tensors.items()}, target / "model.safetensors", metadata={"format": "pt"})
    for extra in ([], ["--skip-preflight"]):
        code, _, err = run_cli(extract_args(tiny_prepared, store, target, *extra), capsys)
        assert code == 2 and "made with target.weights_hash" in err and "Traceback" not in err, err


def test_store_from_other_target_refused_by_source(tiny_store):
    from eaglet.errors import EagletError
    from eaglet.train.data import StoreSource

    manifest = read_manifest(tiny_store)
    other = TargetIdentity.model_validate(dict(manifest["target"], config_hash="0" * 64, name="OtherModel"))
    with pytest.raises(EagletError, match=r"extracted from target tiny-target0 .* but this run uses OtherModel"):
        StoreSource(tiny_store, token_budget=128, expect_target=other)


def test_non_finite_features_name_the_sample(tmp_path, tiny_prepared, tiny_target):
    from eaglet.config import ExtractConfig
    from eaglet.errors import EagletError
    from eaglet.extract.extractor import run_extract

    model = load_model(resolve_target(str(tiny_target)).path, device="cpu")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    config = ExtractConfig(prepared=str(tiny_prepared), out=str(tmp_path / "s"), target=str(tiny_target), reserve_gb=0)
    with pytest.raises(EagletError, match=r"non-finite features for sample 'c\d+'"):
        run_extract(config, model=model)


def test_fp8_storage_quality_size_and_training(tmp_path, tiny_prepared, tiny_target):
    """fp8 and fp8-aux stores: features close to bf16's (fp8-aux: the teacher's `last` bit-equal), the sizes the
    disk check predicts, and a draft trains on each."""
    from rich.console import Console

    from eaglet.config import ExtractConfig, TrainConfig
    from eaglet.extract.extractor import run_extract
    from eaglet.formats.store_manifest import STORAGE_FORMATS, bytes_per_token
    from eaglet.train import run_train
    from eaglet.train.metrics import read_metrics

    outs, sizes = {}, {}
    for dtype in STORAGE_FORMATS:
        run_extract(
            ExtractConfig(
                prepared=str(tiny_prepared),
                out=str(tmp_path / dtype),
                target=str(tiny_target),
                storage_dtype=dtype,
                reserve_gb=0,
                max_samples=20,
            )
        )
        outs[dtype] = decode_features(load_file(next((tmp_path / dtype).glob("*.safetensors"))))
        totals = read_manifest(tmp_path / dtype)["totals"]
        sizes[dtype] = totals["bytes"]
        assert (
            0 <= totals["bytes"] - totals["tokens"] * bytes_per_token(64, dtype, True) < 4096
        )  # + headers and offsets
    aux16, last16 = outs["bf16"]
    model = load_model(resolve_target(str(tiny_target)).path, device="cpu")
    for dtype in ("fp8", "fp8-aux"):
        aux, last = outs[dtype]
        assert torch.nn.functional.cosine_similarity(aux16.flatten(0, 1), aux.flatten(0, 1), dim=-1).min() > 0.99
        with torch.inference_mode():
            agree = (teacher_logits(model, last16).argmax(-1) == teacher_logits(model, last).argmax(-1)).float().mean()
        assert agree > 0.95
    assert torch.equal(outs["fp8-aux"][1], last16) and torch.equal(outs["fp8-aux"][0], outs["fp8"][0])
    assert sizes["fp8"] < 0.6 * sizes["bf16"] and sizes["fp8"] < sizes["fp8-aux"] < 0.7 * sizes["bf16"]
    for dtype in ("fp8", "fp8-aux"):
        draft = tmp_path / f"draft-{dtype}"
        run_train(
            TrainConfig(
                out=str(draft),
                store=str(tmp_path / dtype),
                target=str(tiny_target),
                max_steps=3,
                token_budget=128,
                log_every=1,
                seed=1,
            ),
            Console(quiet=True),
        )
        losses = [r["loss"] for r in read_metrics(draft) if r["kind"] == "train"]
        assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)


def test_store_and_live_sources_give_the_same_batches(tiny_store, tiny_prepared, tiny_target):
    from eaglet.train.data import LiveSource, StoreSource

    manifest = read_manifest(tiny_store)
    store_source = StoreSource(tiny_store, token_budget=200, seed=3)
    model = load_model(resolve_target(str(tiny_target)).path, device="cpu")
    live = LiveSource(
        load_prepared(tiny_prepared),
        model,
        (2, 4, 5),
        token_budget=200,
        tokens_per_shard=manifest["tokens_per_shard"],
        seed=3,
    )
    for epoch in (0, 1):
        offline, online = list(store_source.batches(epoch)), list(live.batches(epoch))
        assert len(offline) == len(online) > 3
        for a, b in zip(offline, online):
            assert torch.equal(a.sample_index, b.sample_index) and torch.equal(a.input_ids, b.input_ids)
            assert torch.equal(a.doc_offsets, b.doc_offsets) and a.tokens <= 200
            torch.testing.assert_close(a.aux.float(), b.aux.float(), rtol=0.02, atol=0.02)
    assert not torch.equal(list(store_source.batches(0))[0].sample_index, list(store_source.batches(1))[0].sample_index)
    seen = torch.cat([b.sample_index for b in store_source.batches(0)]).sort().values
    assert seen.tolist() == list(range(60))  # every sample exactly once per epoch


def test_a_file_hashed_from_its_mapping_or_read_in_chunks_has_its_sha256(tmp_path):
    """The two ways eaglet hashes a file (read through one buffer; an own file mapped, hashed in one call) both give
    the file's sha256, for a file of several read chunks and for an empty one."""
    import hashlib

    from eaglet.fsio import HASH_CHUNK_BYTES, sha256_file, sha256_mapped

    data = torch.randint(0, 256, (2 * HASH_CHUNK_BYTES + 123,), dtype=torch.uint8).numpy().tobytes()
    for name, content in (("full", data), ("empty", b"")):
        (tmp_path / name).write_bytes(content)
        expected = hashlib.sha256(content).hexdigest()
        assert sha256_file(tmp_path / name) == expected and sha256_mapped(tmp_path / name) == expected, name


def test_shard_writer_output_reads_back_with_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from eaglet.fsio import sha256_file
    from eaglet.model.shards import write_safetensors

    tensors = {
        "aux": torch.randn(5, 3, 7).bfloat16(),
        "last": torch.randn(5, 7).to(torch.float8_e4m3fn),
        "scale": torch.rand(5),
        "input_ids": torch.arange(5, dtype=torch.int32),
        "loss_mask": torch.tensor([0, 1, 1, 0, 1], dtype=torch.uint8),
        "offsets": torch.tensor([0, 2, 5]),
        "empty": torch.empty(0, dtype=torch.int64),
        "step": torch.tensor(3.0),  # 0-dim: an optimizer's step count in a checkpoint
    }
    size, digest = write_safetensors(tmp_path / "x.safetensors", tensors)
    assert size == (tmp_path / "x.safetensors").stat().st_size and digest == sha256_file(tmp_path / "x.safetensors")
    loaded = load_file(str(tmp_path / "x.safetensors"))
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as handle:
        assert handle.get_slice("aux").get_shape() == [5, 3, 7]


def test_shard_plan_partitions_samples_into_length_sorted_windows():
    """Every sample in exactly one shard; a shard's samples have nearly one length, so the extractor's
    padded batches waste little even when a shard is smaller than one batch (8B-sized features)."""
    from eaglet.formats.store_manifest import plan_shards
    from eaglet.model.capture import batches_by_length

    lengths = np.random.default_rng(0).integers(300, 2048, size=3000)
    plans = plan_shards(lengths, tokens_per_shard=16000)
    stored = [s for p in plans for s in p.samples]
    assert sorted(stored) == list(range(len(lengths)))
    assert [p.index for p in plans] == list(range(len(plans)))
    assert all(p.tokens == int(lengths[list(p.samples)].sum()) for p in plans)
    for plan in plans:
        assert list(lengths[list(plan.samples)]) == sorted(lengths[list(plan.samples)], reverse=True)

    def padding_overhead(plans) -> float:
        padded = sum(
            len(b) * int(lengths[np.asarray(p.samples)][b].max())
            for p in plans
            for b in batches_by_length(lengths[np.asarray(p.samples)], 32768)
        )
        return padded / lengths.sum() - 1

    assert padding_overhead(plans) < 0.02
    assert padding_overhead(plan_shards(lengths, 16000, window_shards=1)) > 0.25  # unsorted shards: the waste
    assert plan_shards(lengths, 16000) == plans  # a pure function of the lengths


def test_shard_plan_cuts_the_last_shards_worth_into_pieces():
    """After the last forward only one piece of a shard is left to write, hash and move: the last window's shortest
    samples, a shard's worth of tokens, are cut into TAIL_PIECES shards; everything before is planned as without."""
    from eaglet.formats.store_manifest import TAIL_PIECES, plan_shards

    lengths = np.random.default_rng(0).integers(300, 2048, size=3000)
    plans = plan_shards(lengths, tokens_per_shard=16000)
    whole = plan_shards(lengths, tokens_per_shard=16000, tail_pieces=1)
    assert plans[: len(whole) - 2] == whole[: len(whole) - 2]  # all but the last window's last shards as before
    tail: list = []
    while sum(p.tokens for p in tail) + plans[-1 - len(tail)].tokens <= 16000:
        tail.insert(0, plans[-1 - len(tail)])
    assert len(tail) >= TAIL_PIECES - 2 and all(p.tokens < 16000 // TAIL_PIECES + 2048 for p in tail)
    for piece, after in zip(tail, tail[1:]):  # the window's order goes on through the pieces: shortest last
        assert lengths[list(piece.samples)].min() >= lengths[list(after.samples)].max()
    assert sorted(s for p in plans for s in p.samples) == list(range(len(lengths)))
    assert [p.index for p in plans] == list(range(len(plans)))
    a_shard = plan_shards(np.full(80, 100), tokens_per_shard=8000)  # a shard's worth: all of it in pieces
    assert [p.tokens for p in a_shard] == [1000] * TAIL_PIECES
    assert len(plan_shards(np.full(5, 100), tokens_per_shard=8000)) == 1  # less than a piece: one shard


def test_verify_names_shard_holding_other_samples(tmp_path, capsys, tiny_store):
    from eaglet.model.shards import write_safetensors

    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    path = store / "shard-00001.safetensors"
    tensors = {key: value.clone() for key, value in load_file(path).items()}  # the file is mapped
    other = load_file(store / "shard-00000.safetensors")["sample_index"][0]
    tensors["sample_index"][0] = other  # a sample of shard 0 claimed by shard 1
    write_safetensors(path, tensors)
    manifest = read_manifest(store)
    entry = next(e for e in manifest["shards"] if e["index"] == 1)
    from eaglet.fsio import sha256_file, write_json_atomic

    entry["sha256"], entry["bytes"] = sha256_file(path), path.stat().st_size  # a consistent but wrong shard
    write_json_atomic(store / "manifest.json", manifest)
    code, _, err = run_cli(["store", "verify", store], capsys)
    assert code == 2
    assert f"bad shard {path}: sample_index does not match the shard's planned samples" in err


def test_unknown_storage_dtype_refused_before_anything(tmp_path, capsys, tiny_prepared, tiny_target):
    store = tmp_path / "store"
    code, _, err = run_cli(extract_args(tiny_prepared, store, tiny_target, "--storage-dtype", "fp9"), capsys)
    assert code == 2 and "--storage-dtype: Input should be 'bf16', 'fp8' or 'fp8-aux' (got 'fp9')" in err
    assert len(err.strip().splitlines()) == 1 and not store.exists()


def test_a_store_read_whole_yields_every_sample_once_with_its_features(tiny_store, tiny_prepared):
    from eaglet.formats.prepared import load_prepared
    from eaglet.model.shards import store_samples

    prepared = load_prepared(tiny_prepared)
    seen = {}
    for sample, row in store_samples(tiny_store):
        assert sample not in seen
        tokens = len(row["input_ids"])
        assert row["loss_mask"].shape == (tokens,) and row["aux"].shape[:2] == (tokens, 3)
        assert row["last"].shape == (tokens, row["aux"].shape[2]) and row["aux"].dtype == torch.float32
        seen[sample] = tokens
    assert seen == {i: int(length) for i, length in enumerate(prepared.lengths)}
