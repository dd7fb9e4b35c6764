"""Random damage to valid artifacts (seeded, bounded in time): a store, a prepared set and an export, each mutated
in ways that make it wrong — bytes flipped or cut, manifest fields given values of the wrong type or range, tensors
rewritten with their checksum recomputed. Every mutant must be refused in one line (exit 2), never a traceback and
never exit 0: a stage that accepted one would train on, or ship, what its manifest does not describe."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
from conftest import extract_args, run_cli
from helpers import rewrite_shard
from safetensors.torch import load_file

SEED = 20261203
SECONDS_PER_ARTIFACT = 40.0  # each test mutates until this budget is spent (at least MIN_CASES mutants)
MIN_CASES = 6
WRONG_VALUES: list[Any] = [None, "abc", -1, 1.5, True, [], {}, float("nan")]  # each of another type or range
TRAIN = ["--epochs", "1", "--token-budget", "1024", "--seed", "1", "--log-every", "100", "--set", "eval_fraction=0"]

Mutation = Callable[[random.Random, Path], str]  # mutates the artifact at the path; returns what it did


def _set_path(data: Any, path: tuple, value: Any) -> None:
    for part in path[:-1]:
        data = data[part]
    if value is _DELETE:
        del data[path[-1]]
    else:
        data[path[-1]] = value


_DELETE = object()


def _get_path(data: Any, path: tuple) -> Any:
    for part in path:
        data = data[part]
    return data


def mutate_json(file: str, paths: list[tuple], deletable: bool = True) -> Mutation:
    """A field read and checked by eaglet, given a value of another type or range (or removed, where every reader
    needs it)."""

    def mutate(rng: random.Random, root: Path) -> str:
        data = json.loads((root / file).read_text())
        path = rng.choice(paths)
        path = tuple(rng.randrange(len(data["shards"])) if part == "#" else part for part in path)
        old = _get_path(data, path)
        value = rng.choice(
            [v for v in WRONG_VALUES if not (type(v) is type(old) and v == old)] + ([_DELETE] if deletable else [])
        )
        _set_path(data, path, value)
        (root / file).write_text(json.dumps(data))
        return f"{file} {'.'.join(map(str, path))} = {'<deleted>' if value is _DELETE else repr(value)[:40]}"

    return mutate


def _a_file(rng: random.Random, root: Path, pattern: str) -> Path:
    return rng.choice(sorted(root.glob(pattern)))


def flip_bytes(pattern: str) -> Mutation:
    def mutate(rng: random.Random, root: Path) -> str:
        file = _a_file(rng, root, pattern)
        data = bytearray(file.read_bytes())
        position = rng.randrange(len(data))
        data[position] ^= 1 << rng.randrange(8)
        file.write_bytes(bytes(data))
        return f"{file.name}: bit flipped at byte {position}"

    return mutate


def cut(pattern: str) -> Mutation:
    def mutate(rng: random.Random, root: Path) -> str:
        file = _a_file(rng, root, pattern)
        size = rng.randrange(file.stat().st_size)
        file.write_bytes(file.read_bytes()[:size])
        return f"{file.name}: cut to {size} bytes"

    return mutate


def _bump(tensor: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """One element of an integer tensor changed to another value (a loss mask value flipped)."""
    flat = tensor.clone().reshape(-1)
    position = rng.randrange(flat.numel())
    flat[position] = 1 - flat[position] if flat.dtype == torch.uint8 else flat[position] + rng.choice([1, -1, 1000])
    return flat.reshape(tensor.shape)


def rewrite_tensor(rng: random.Random, root: Path) -> str:
    """A shard tensor changed, the file's sha256 recomputed: only content checks can tell."""
    manifest = json.loads((root / "manifest.json").read_text())
    entry = rng.choice([e for e in manifest["shards"] if e["num_samples"] >= 2] or manifest["shards"])
    name = rng.choice(["input_ids", "loss_mask", "offsets", "sample_index", "aux-dtype", "aux-nan", "last-shape"])

    def change(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if name == "aux-dtype":
            return tensors | {"aux": tensors["aux"].float()}
        if name == "aux-nan":  # a whole sample's features: its loss-counted tokens see them
            end = int(tensors["offsets"][1])
            aux = tensors["aux"].float()
            aux[:end] = float("nan")
            return tensors | {"aux": aux.to(tensors["aux"].dtype)}
        if name == "last-shape":
            return tensors | {"last": tensors["last"][:, :-1].contiguous()}
        if name == "offsets":  # a boundary moved: lengths no longer the samples' (or the end past the tokens)
            offsets = tensors["offsets"].clone()
            if len(offsets) > 2 and offsets[2] - offsets[0] > 2:
                offsets[1] = offsets[1] + 1 if offsets[1] + 1 < offsets[2] else offsets[1] - 1
            else:
                offsets[-1] += 1
            return tensors | {"offsets": offsets}
        return tensors | {name: _bump(tensors[name], rng)}

    rewrite_shard(root, entry["index"], change)
    return f"shard {entry['index']}: {name} rewritten, checksum recomputed"


def refused(result: tuple[int, str, str], what: str) -> None:
    code, _, err = result
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2, f"{what}: exit {code}\n{err[-2000:]}"
    assert "Traceback" not in err and lines[-1].startswith("error:"), f"{what}:\n{err[-2000:]}"
    assert sum(line.startswith("error:") for line in lines) == 1, f"{what}:\n{err[-2000:]}"


def fuzz(tmp_path: Path, source: Path, mutations: list[Mutation], check: Callable[[Path, str], None]) -> int:
    """Mutants of ``source`` until the time budget is spent; returns how many were checked."""
    rng = random.Random(SEED)
    started, cases = time.monotonic(), 0
    while cases < MIN_CASES or time.monotonic() - started < SECONDS_PER_ARTIFACT:
        mutant = tmp_path / f"mutant-{cases}"
        shutil.copytree(source, mutant)
        what = rng.choice(mutations)(rng, mutant)
        check(mutant, what)
        shutil.rmtree(mutant)
        cases += 1
    print(f"fuzz {source.name}: {cases} mutants refused in {time.monotonic() - started:.0f} s")
    return cases


STORE_FIELDS = [
    ("schema",),
    ("target",),
    ("target", "num_layers"),
    ("target", "hidden_size"),
    ("target", "vocab_size"),
    ("aux_layer_ids",),
    ("aux_layer_ids", 2),
    ("aux_convention",),
    ("prepared",),
    ("prepared", "samples"),
    ("prepared", "manifest_sha256"),
    ("storage_dtype",),
    ("hidden_size",),
    ("tokens_per_shard",),
    ("sort_window_shards",),
    ("complete",),
    ("num_shards",),
    ("totals", "tokens"),
    ("totals", "bytes"),
    ("shards",),
    ("shards", "#"),
    ("shards", "#", "file"),
    ("shards", "#", "index"),
    ("shards", "#", "tokens"),
    ("shards", "#", "num_samples"),
    ("shards", "#", "bytes"),
    ("shards", "#", "sha256"),
]


def test_mutated_stores_are_refused_by_verify_and_training(tmp_path, capsys, tiny_store, tiny_target):
    def check(store: Path, what: str) -> None:
        refused(run_cli(["store", "verify", store], capsys), f"verify, {what}")
        refused(
            run_cli(
                [
                    "train",
                    "--store",
                    store,
                    "--out",
                    store.with_name(store.name + "-run"),
                    "--target",
                    tiny_target,
                    *TRAIN,
                ],
                capsys,
            ),
            f"train, {what}",
        )

    mutations = [
        mutate_json("manifest.json", STORE_FIELDS),
        flip_bytes("shard-*.safetensors"),
        cut("shard-*.safetensors"),
        rewrite_tensor,
    ]
    assert fuzz(tmp_path, tiny_store, mutations, check) >= MIN_CASES


PREPARED_FIELDS = [
    ("schema",),
    ("target",),
    ("target", "vocab_size"),
    ("target", "tokenizer_hash"),
    ("counts",),
    ("counts", "samples"),
    ("tokens", "assistant"),
    ("files",),
    ("files", "samples.parquet"),
]


def rewrite_rows(rng: random.Random, root: Path) -> str:
    """samples.parquet rewritten with one bad row, its sha256 recorded in the manifest."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(root / "samples.parquet")
    rows = table.to_pylist()
    row = rng.randrange(len(rows))
    kind = rng.choice(["id beyond the vocabulary", "negative id", "mask value 2", "mask shorter than ids", "null ids"])
    if kind == "id beyond the vocabulary":
        rows[row]["input_ids"][0] = 10**6
    elif kind == "negative id":
        rows[row]["input_ids"][-1] = -5
    elif kind == "mask value 2":
        rows[row]["loss_mask"][0] = 2
    elif kind == "mask shorter than ids":
        rows[row]["loss_mask"] = rows[row]["loss_mask"][:-1]
    else:
        rows[row]["input_ids"] = None
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), root / "samples.parquet")
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"]["samples.parquet"] = hashlib.sha256((root / "samples.parquet").read_bytes()).hexdigest()
    (root / "manifest.json").write_text(json.dumps(manifest))
    return f"samples.parquet row {row}: {kind}, sha256 recorded"


def test_mutated_prepared_sets_are_refused_by_extraction_and_online_training(
    tmp_path, capsys, tiny_prepared, tiny_target
):
    def check(prepared: Path, what: str) -> None:
        refused(
            run_cli(extract_args(prepared, prepared.with_name(prepared.name + "-store"), tiny_target), capsys),
            f"extract, {what}",
        )
        refused(
            run_cli(
                [
                    "train",
                    "--prepared",
                    prepared,
                    "--out",
                    prepared.with_name(prepared.name + "-run"),
                    "--target",
                    tiny_target,
                    "--max-steps",
                    "2",
                    "--token-budget",
                    "256",
                ],
                capsys,
            ),
            f"online train, {what}",
        )

    mutations = [
        mutate_json("manifest.json", PREPARED_FIELDS),
        flip_bytes("samples.parquet"),
        cut("samples.parquet"),
        rewrite_rows,
    ]
    assert fuzz(tmp_path, tiny_prepared, mutations, check) >= MIN_CASES


# the sizes both a draft's config and an export's carry; removing one is wrong only where no default stands in
EXPORT_FIELDS = [
    ("hidden_size",),
    ("num_attention_heads",),
    ("num_key_value_heads",),
    ("head_dim",),
    ("intermediate_size",),
    ("vocab_size",),
    ("draft_vocab_size",),
    ("num_hidden_layers",),
    ("target_hidden_size",),
    ("eagle_aux_hidden_state_layer_ids",),
    ("eagle_aux_hidden_state_layer_ids", 0),
]
REQUIRED_EXPORT_FIELDS = [("hidden_size",), ("num_attention_heads",), ("intermediate_size",), ("vocab_size",)]


def reshape_tensor(rng: random.Random, root: Path) -> str:
    """One tensor dropped, or given another shape (a foreign or damaged checkpoint with a valid file format)."""
    from safetensors.torch import save_file

    tensors = load_file(str(root / "model.safetensors"))
    drop = rng.random() < 0.5
    optional = ("d2t", "t2d", "embed_tokens.weight")  # a full-vocabulary draft may leave the mapping out
    name = rng.choice(sorted(n for n in tensors if not (drop and n in optional)))
    if drop:
        del tensors[name]
        what = "dropped"
    else:
        tensors[name] = torch.zeros(*[max(1, d - 1) for d in tensors[name].shape], 2, dtype=tensors[name].dtype)
        what = "reshaped"
    save_file(tensors, str(root / "model.safetensors"))
    return f"model.safetensors: {name} {what}"


def test_mutated_exports_fail_the_check(tmp_path, capsys, tiny_draft):
    export = tmp_path / "export"
    assert run_cli(["export", "--draft", tiny_draft, "--format", "vllm", "--out", export], capsys)[0] == 0

    def check(directory: Path, what: str) -> None:
        refused(run_cli(["export", "--check", directory], capsys), f"export --check, {what}")

    mutations = [
        mutate_json("config.json", EXPORT_FIELDS, deletable=False),
        mutate_json("config.json", REQUIRED_EXPORT_FIELDS),
        reshape_tensor,
        cut("model.safetensors"),
    ]
    assert fuzz(tmp_path, export, mutations, check) >= MIN_CASES


def test_mutated_drafts_are_not_exported(tmp_path, capsys, tiny_draft):
    def check(draft: Path, what: str) -> None:
        out = draft.with_name(draft.name + "-export")
        refused(run_cli(["export", "--draft", draft, "--format", "vllm", "--out", out], capsys), f"export, {what}")
        assert not out.exists()

    mutations = [
        mutate_json("config.json", EXPORT_FIELDS, deletable=False),
        mutate_json("config.json", REQUIRED_EXPORT_FIELDS),
        reshape_tensor,
        cut("model.safetensors"),
    ]
    assert fuzz(tmp_path, tiny_draft, mutations, check) >= MIN_CASES
