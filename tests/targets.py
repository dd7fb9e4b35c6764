"""Tiny random targets of the architectures big models use (MoE, MLA), and quantized checkpoints of them, made
with transformers and compressed-tensors the way real ones are: saved, then loaded back by eaglet."""

from __future__ import annotations

from pathlib import Path

from conftest import LM_HEAD_SHARPEN, build_tokenizer

HIDDEN = 64
LAYERS = 8  # the fewest the default aux layer ids (2, N//2, N-3) allow is 7


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
