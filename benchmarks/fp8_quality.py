"""What fp8 storage does to the features and to the teacher: cosine similarity and top-1 agreement.

Extracts the same prepared set once per storage format (bf16, fp8, fp8-aux) beside a float32 reference
captured directly, and compares per token: cosine of every aux feature and of `last`, and whether the teacher's
argmax (lm_head(last)) is unchanged. Usage:
  python benchmarks/fp8_quality.py --prepared DIR [--target embedded] [--max-samples 64] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepared", required=True)
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--max-samples", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import numpy as np
    import torch
    from rich.console import Console

    from eaglet.config import ExtractConfig
    from eaglet.extract.extractor import run_extract
    from eaglet.formats.layers import default_aux_layer_ids
    from eaglet.formats.prepared import load_prepared
    from eaglet.formats.store_manifest import STORAGE_FORMATS, read_manifest
    from eaglet.model.capture import FeatureCapture, teacher_logits
    from eaglet.model.shards import decode_features, read_shard
    from eaglet.model.target import load_model, resolve_target

    quiet = Console(stderr=True, quiet=True)
    model = load_model(resolve_target(args.target).path, device="cpu", dtype="float32")
    layers = default_aux_layer_ids(model.config.num_hidden_layers)
    prepared = load_prepared(args.prepared, args.max_samples)
    capture = FeatureCapture(model, layers)
    stats = {}
    with tempfile.TemporaryDirectory() as tmp:
        features = {}
        for dtype in STORAGE_FORMATS:
            store = Path(tmp) / dtype
            run_extract(
                ExtractConfig(
                    prepared=args.prepared,
                    out=str(store),
                    target=args.target,
                    storage_dtype=dtype,
                    max_samples=args.max_samples,
                    reserve_gb=0,
                    dtype="float32",
                ),
                quiet,
            )
            per_sample = {}
            for entry in read_manifest(store)["shards"]:
                tensors = read_shard(store, entry)
                aux, last = decode_features(tensors)
                offsets = tensors["offsets"].tolist()
                for row, sample in enumerate(tensors["sample_index"].tolist()):
                    per_sample[sample] = (aux[offsets[row] : offsets[row + 1]], last[offsets[row] : offsets[row + 1]])
            features[dtype] = per_sample
        reference = {}
        for sample in range(len(prepared)):
            ids = torch.from_numpy(prepared.sample(sample)[0].astype(np.int64))[None]
            aux, last = capture(ids)
            reference[sample] = (aux[0], last[0])
    order = sorted(reference)
    ref_aux = torch.cat([reference[s][0] for s in order])
    ref_last = torch.cat([reference[s][1] for s in order])
    with torch.inference_mode():
        ref_top1 = teacher_logits(model, ref_last).argmax(-1)
        for dtype in STORAGE_FORMATS:
            aux = torch.cat([features[dtype][s][0] for s in order])
            last = torch.cat([features[dtype][s][1] for s in order])
            cos_aux = torch.nn.functional.cosine_similarity(aux, ref_aux, dim=-1)  # [T, 3]
            cos_last = torch.nn.functional.cosine_similarity(last, ref_last, dim=-1)
            top1 = teacher_logits(model, last).argmax(-1)
            stats[dtype] = {
                "aux_cosine_mean_by_layer": [round(float(c), 6) for c in cos_aux.mean(0)],
                "aux_cosine_min": round(float(cos_aux.min()), 6),
                "last_cosine_mean": round(float(cos_last.mean()), 6),
                "last_cosine_min": round(float(cos_last.min()), 6),
                "teacher_top1_agreement_vs_fp32": round(float((top1 == ref_top1).float().mean()), 6),
            }
    record = {
        "benchmark": "fp8_quality",
        "target": args.target,
        "samples": len(prepared),
        "tokens": int(ref_last.shape[0]),
        "aux_layer_ids": list(layers),
        "vs_float32_reference": stats,
    }
    print(json.dumps(record, indent=2))
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
