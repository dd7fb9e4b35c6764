"""Tiny random targets of the architectures big models use (MoE, MLA), and quantized checkpoints of them, made
with transformers and compressed-tensors the way real ones are: saved, then loaded back by eaglet."""

from __future__ import annotations

from pathlib import Path

from conftest import LM_HEAD_SHARPEN, build_tokenizer

HIDDEN = 64
LAYERS = 8  # the fewest the default aux layer ids (2, N//2, N-3) allow is 7
QUANT_GROUP = 16  # the tiny layers' widths (16..128) divide by it; real checkpoints use 32 or 128


def _common(tokenizer) -> dict:
    vocab = -(-len(tokenizer) // 64) * 64  # padded like real vocabularies: tensor parallel splits it
    return dict(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )


def moe_config(arch: str, tokenizer):
    import transformers

    common = _common(tokenizer)
    if arch == "deepseek_v3":  # Kimi-K2's architecture: MLA attention, shared + routed experts, a dense first layer
        return transformers.DeepseekV3Config(
            **(common | {"num_key_value_heads": 4}),
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_group=2,
            topk_group=1,
            rope_scaling=None,
        )
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16
        )
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
    if arch == "gpt_oss":
        return transformers.GptOssConfig(
            **common,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=16,
            sliding_window=32,
            layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
        )
    if arch == "llama":
        return transformers.LlamaConfig(**common, intermediate_size=128)
    raise ValueError(arch)


def tiny_target(root: Path, arch: str) -> Path:
    """A random ``arch`` checkpoint with a Qwen3-family tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer("qwen3")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config(arch, tokenizer))
    with torch.no_grad():  # a sharper head: a random model's teacher is otherwise near-uniform
        model.get_output_embeddings().weight.mul_(LM_HEAD_SHARPEN)
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def quantized_target(source: Path, root: Path, kind: str) -> Path:
    """``source`` saved as a compressed-tensors checkpoint: ``int4`` (symmetric groups, packed: Kimi-K2's format)
    or ``fp8`` (per-channel float8), the linear layers quantized and the LM head kept."""
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
        args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=QUANT_GROUP)
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
        rows = weight.reshape(weight.shape[0], -1, QUANT_GROUP) if kind == "int4" else weight[:, None, :]
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
