"""An eaglet store as speculators 0.9.0's trainer reads its offline data, so both trainers learn from the same hidden
states of the same target (issue 59: the same data through speculators' own trainer).

speculators' ``ArrowDataset`` reads ``load_from_disk(DATA)`` (rows of ``input_ids``, ``loss_mask``, ``seq_len``, in
torch format) and, for row i, ``DATA/hidden_states/hs_{i}.safetensors`` holding ``token_ids`` [T] and
``hidden_states`` [T, 4, H]: the three aux layers, then the verifier's last hidden state *before* its final norm (the
trainer applies ``verifier_norm`` and ``verifier_lm_head`` for its teacher). An eaglet store keeps that state after the
norm (``lm_head(last)`` is the teacher); it is written here divided by the norm's weight, whose RMS-normalised form
with that weight is eaglet's ``last`` again (to the norm's epsilon). The draft vocabulary goes with it as speculators'
``d2t-<Vd>.npy`` / ``t2d-<Vd>.npy``. speculators holds out the last rows of DATA for validation
(``--train-data-ratio``): ``--heldout`` appends a held-out store's rows after the training store's and prints the
ratio that makes exactly those the validation split.

    python benchmarks/speculators_same_data.py convert STORE DATA [--heldout STORE2]   # write DATA
    python benchmarks/speculators_same_data.py check STORE DATA     # read DATA back through speculators' own
                                                                    # ArrowDataset and verifier norm: JSON on stdout

``check`` needs speculators 0.9.0 with ``datasets`` and ``hs_connectors`` (its dependencies); ``convert`` needs
``datasets``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from eaglet.data.vocab import DraftVocab
from eaglet.formats.files import VOCAB_FILE
from eaglet.formats.store_manifest import prepared_path, read_manifest
from eaglet.formats.target_record import target_of_store
from eaglet.model.shards import store_samples
from eaglet.model.sizing import text_config
from eaglet.model.target import load_head_weights, read_config, resolve_target

HIDDEN_STATES_DIR = "hidden_states"
CHECK_TOLERANCE = 0.02  # bf16 storage of both sides, each element's |Δ| relative to its size (relative_difference)


def samples(store: Path):
    """(sample index, input ids [T], loss mask [T], aux [T, 3, H], last [T, H]) for every sample, in store order."""
    for sample, row in store_samples(store):
        yield sample, row["input_ids"], row["loss_mask"], row["aux"], row["last"]


def final_norm(store: Path) -> tuple[torch.Tensor, float]:
    """The store's target's final norm: (weight [H], epsilon)."""
    path = resolve_target(target_of_store(store)).path
    weight = load_head_weights(path).final_norm
    if weight is None or bool((weight == 0).any()):
        raise SystemExit(f"{store}: its target's final norm is absent or has a zero weight; cannot undo it")
    return weight.float(), float(text_config(read_config(path)).get("rms_norm_eps", 1e-6))


def rows_of(store: Path, heldout: Path | None):
    """(held out?, ids, mask, aux, last): the training store's samples, then the held-out store's (the same target's
    features)."""
    for _, ids, mask, aux, last in samples(store):
        yield False, ids, mask, aux, last
    if heldout is not None:
        if target_of_store(heldout) != target_of_store(store):
            raise SystemExit(f"{heldout}: features of another target than {store}'s")
        for _, ids, mask, aux, last in samples(heldout):
            yield True, ids, mask, aux, last


def convert(store: Path, out: Path, heldout: Path | None = None) -> dict:
    from datasets import Dataset
    from safetensors.torch import save_file

    weight, _ = final_norm(store)
    (out / HIDDEN_STATES_DIR).mkdir(parents=True, exist_ok=False)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    training_rows = 0
    for index, (held_out, ids, mask, aux, last) in enumerate(rows_of(store, heldout)):
        training_rows += not held_out
        states = torch.cat([aux, (last / weight)[:, None]], dim=1).to(torch.bfloat16)  # [T, 4, H]
        save_file(
            {"hidden_states": states.contiguous(), "token_ids": ids.long().contiguous()},
            str(out / HIDDEN_STATES_DIR / f"hs_{index}.safetensors"),
        )
        rows["input_ids"].append(ids.long().tolist())
        rows["loss_mask"].append(mask.long().tolist())
        rows["seq_len"].append(len(ids))
    dataset = Dataset.from_dict(rows)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(out))
    manifest = read_manifest(store)
    vocab = DraftVocab.load(prepared_path(store, manifest) / VOCAB_FILE)
    np.save(out / f"d2t-{vocab.size}.npy", vocab.d2t)
    np.save(out / f"t2d-{vocab.size}.npy", vocab.t2d)
    total = len(rows["seq_len"])
    return {
        "samples": total,
        "training_samples": training_rows,
        # int(total * ratio) == training_rows: speculators' split boundary (its ArrowDataset)
        "train_data_ratio": (training_rows + 0.5) / total if training_rows < total else None,
        "tokens": int(sum(rows["seq_len"])),
        "draft_vocab_size": vocab.size,
        "aux_layer_ids": manifest["aux_layer_ids"],
    }


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest |got - want| of any element, relative to that element's size (floored at the state's RMS, so
    that elements near zero do not count as large differences). A target's last state has outliers tens of RMS
    wide, where one more bf16 rounding (2**-8 of the element) is a large share of the RMS but not of the element."""
    scale = want.abs() + want.pow(2).mean().sqrt()
    return float(((got - want).abs() / scale).max())


def check(store: Path, data: Path, max_rows: int | None = None) -> dict:
    """Every row as speculators' trainer reads it equals the store's: its ids and mask, the three aux states, and the
    verifier's normed last state (speculators' own RMSNorm with the target's weight) against eaglet's ``last``."""
    from speculators.models.eagle3.model_definitions import model_classes
    from speculators.train.data import ArrowDataset

    weight, eps = final_norm(store)
    dataset = ArrowDataset(max_len=1 << 20, datapath=str(data), on_missing="raise", train_ratio=1.0, split="train")
    norm = model_classes["llama"].norm_class(len(weight), eps=eps)
    with torch.no_grad():
        norm.weight.copy_(weight)
    worst = {"aux": 0.0, "last": 0.0}
    checked = 0
    for index, (_, ids, mask, aux, last) in enumerate(samples(store)):
        if index == max_rows:
            break
        checked += 1
        row = dataset[index]
        if not (torch.equal(row["input_ids"], ids.long()) and torch.equal(row["loss_mask"].long(), mask.long())):
            raise SystemExit(f"row {index}: speculators reads other token ids or loss mask than the store holds")
        got_aux = row["hidden_states"].float().view(len(ids), 3, -1)
        with torch.no_grad():
            normed = norm(row["verifier_last_hidden_states"].float())
        worst["aux"] = max(worst["aux"], relative_difference(got_aux, aux))
        worst["last"] = max(worst["last"], relative_difference(normed, last))
    ok = all(value <= CHECK_TOLERANCE for value in worst.values())
    return {
        "rows": len(dataset),
        "rows_checked": checked,
        "max_relative_difference": worst,
        "tolerance": CHECK_TOLERANCE,
        "equal": ok,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["convert", "check"])
    parser.add_argument("store", type=Path)
    parser.add_argument("data", type=Path)
    parser.add_argument("--heldout", type=Path, help="convert: a held-out store, appended as the validation rows")
    parser.add_argument("--max-rows", type=int, help="check: only the first N rows")
    args = parser.parse_args()
    if args.action == "convert":
        result = convert(args.store, args.data, args.heldout)
    else:
        result = check(args.store, args.data, args.max_rows)
    print(json.dumps(result, indent=1))
    if args.action == "check" and not result["equal"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
