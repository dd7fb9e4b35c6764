"""Compressed-tensors checkpoints made the way real ones are (compressed-tensors' own compressor), for the tests and
for benchmarks/vllm_extract_parity.py (which puts this folder on its path: no pytest on the GPU machine)."""

from __future__ import annotations

from pathlib import Path

TINY_GROUP = 16  # the tiny test layers' widths (16..128) divide by it; real checkpoints use 32 or 128


def quantized_target(source: Path, root: Path, kind: str, group_size: int = TINY_GROUP) -> Path:
    """``source`` saved as a compressed-tensors checkpoint: ``int4`` (symmetric groups, packed: Kimi-K2's format)
    or ``fp8`` (per-channel float8), the linear layers quantized and the LM head kept. vLLM's INT4 kernels
    (Marlin) take groups of 32, 64 or 128 over widths that divide by 128."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    if kind == "int4":
        args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
        layout = "pack-quantized"
    else:
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
        layout = "float-quantized"
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(
        model,
        QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], quantization_status="initialized"),
    )
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        weight = module.weight.data.float()
        rows = weight.reshape(weight.shape[0], -1, group_size) if kind == "int4" else weight[:, None, :]
        scale, zero = calculate_qparams(rows.amin(-1), rows.amax(-1), module.quantization_scheme.weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=layout)
    compressor.compress_model(model)
    model.save_pretrained(root)
    compressor.update_config(root)
    AutoTokenizer.from_pretrained(source).save_pretrained(root)
    return root
