"""A tiny Kimi-K2.5-shaped checkpoint, made here (never downloaded): the checks' "Kimi".

Built as the real one is laid out (moonshotai/Kimi-K2.5): a ``KimiK25ForConditionalGeneration`` wrapper whose
config.json holds a small ``vision_config`` (MoonViT) and a DeepseekV3 ``text_config`` (MLA attention with Kimi's
head dimensions, one dense first layer, shared + routed experts with sigmoid routing and the router's bias, yarn rope
with mscale), the routed experts in compressed-tensors INT4 (symmetric groups of 32, pack-quantized, made by
compressed-tensors' own compressor) and everything else bf16, the weights under ``language_model.``, ``vision_tower.``
and ``mm_projector.`` in two shards with an index, a tiktoken BPE (``tiktoken.model``, Kimi's split pattern, Kimi's
256 reserved special tokens at the end of the vocabulary) converted to ``tokenizer.json`` by transformers' own
converter, a chat template with Kimi's roles, and the image processor's ``preprocessor_config.json``.

Used by the tests and by the device benchmark (``benchmarks/kimi_vllm_device.sh`` puts this folder on its path):
plain functions, no pytest. ``python tests/kimi.py DIR`` writes one.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

# Kimi-K2's pre-tokenizer split (its tokenization_kimi.py); tiktoken and transformers' converter both read it
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
BPE_RANKS = 1792  # learned byte-pair ranks (Kimi: 163,584); the reserved special tokens follow them
RESERVED_SPECIALS = 256  # as Kimi: ids BPE_RANKS .. BPE_RANKS + 255
VOCAB = BPE_RANKS + RESERVED_SPECIALS
# Kimi-K2.5's named special tokens, by offset from the first reserved id (163,584 in the real vocabulary)
NAMED_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    22: "<think>",
    23: "</think>",
    254: "[UNK]",
    255: "[PAD]",
}
BOS, EOS, IM_END, MEDIA_PAD, PAD = (BPE_RANKS + offset for offset in (0, 1, 2, 21, 255))
DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
# Kimi's roles: <|im_system|>/<|im_user|>/<|im_assistant|>, the role's name, <|im_middle|>, the text, <|im_end|>
CHAT_TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM + "<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

HIDDEN = 256
LAYERS = 8  # the fewest the default aux layer ids (2, N//2, N-3) allow is 7
QUANT_GROUP = 32  # Kimi-K2.5's INT4 group size; vLLM's Marlin MoE kernels take it over widths that divide by 128
# Kimi-K2.5's text_config with its widths cut down; MLA keeps Kimi's head dimensions (vLLM's MLA kernels want them)
TEXT_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": PAD,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "kv_lora_rank": 512,
    "max_position_embeddings": 262144,
    "moe_intermediate_size": 128,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 8,
    "num_experts_per_tok": 4,
    "num_hidden_layers": LAYERS,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "q_lora_rank": 384,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 64.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": VOCAB,
}
# Kimi's quantization_config: Linear layers INT4 but attention, shared experts, the dense MLP and the LM head
QUANTIZATION_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
]
VISION = {"hidden": 64, "heads": 4, "layers": 2, "intermediate": 128, "patch": 14, "pos": 8, "time": 4, "merge": 2}
PREPROCESSOR_CONFIG = {
    "auto_map": {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor"},
    "image_processor_type": "KimiK25VisionProcessor",
    "media_proc_cfg": {
        "in_patch_limit": 16384,
        "patch_size": VISION["patch"],
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "merge_kernel_size": VISION["merge"],
        "fixed_output_tokens": None,
        "patch_limit_on_one_side": 512,
        "in_patch_limit_each_frame": 4096,
        "in_patch_limit_video": None,
        "sample_fps": 2.0,
        "max_num_frames_each_video": None,
        "temporal_merge_kernel_size": VISION["time"],
        "timestamp_mode": "hh:mm:ss.fff",
        "config_type": "media_proc",
    },
}
LM_HEAD_SHARPEN = 40.0  # a random model's next-token distribution is otherwise near-uniform (conftest's, repeated:
# this module runs on the GPU machine without the tests' conftest)


def training_text() -> list[str]:
    """The text the tiny BPE learns from: the shipped prompt files' prompts (deterministic, in the wheel)."""
    root = Path(__file__).resolve().parents[1] / "src" / "eaglet" / "resources"
    texts = []
    for name in ("demo_prompts.jsonl", "mt_bench_prompts.jsonl"):
        for line in (root / name).read_text(encoding="utf-8").splitlines():
            if line.strip():
                texts.append(json.loads(line)["prompt"])
    return texts


def special_tokens() -> dict[str, int]:
    """All 256 reserved special tokens by name (Kimi's names, ``<|reserved_token_N|>`` for the unnamed)."""
    return {
        NAMED_SPECIALS.get(offset, f"<|reserved_token_{offset}|>"): BPE_RANKS + offset
        for offset in range(RESERVED_SPECIALS)
    }


def learn_ranks() -> dict[bytes, int]:
    """Byte-pair ranks learned on ``training_text`` with Kimi's split pattern: the 256 bytes, then the merges."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_RANKS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    learner.train_from_iterator(training_text(), trainer)
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    vocab = learner.get_vocab()
    assert len(vocab) == BPE_RANKS, len(vocab)
    return {bytes(to_byte[char] for char in token): rank for token, rank in vocab.items()}


def write_tokenizer(root: Path) -> None:
    """tiktoken.model (Kimi's file: base64 token and rank per line), tokenizer.json (transformers' TikTokenConverter
    over it), tokenizer_config.json with the special tokens and the chat template."""
    import tiktoken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = learn_ranks()
    specials = special_tokens()
    encoding = tiktoken.Encoding(name="kimi-tiny", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    sample = "Hello, Kimi! 你好 123"
    assert encoding.decode(encoding.encode(sample)) == sample
    model_file = root / "tiktoken.model"
    model_file.write_text(
        "".join(
            f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda x: x[1])
        )
    )
    converted = TikTokenConverter(vocab_file=str(model_file), pattern=KIMI_PATTERN, extra_special_tokens=specials)
    converted.converted().save(str(root / "tokenizer.json"))
    added = {
        str(index): {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True}
        for name, index in specials.items()
    }  # fmt: skip
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "added_tokens_decoder": added,
                "bos_token": "[BOS]",
                "eos_token": "[EOS]",
                "pad_token": "[PAD]",
                "unk_token": "[UNK]",
                "model_max_length": TEXT_CONFIG["max_position_embeddings"],
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (root / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": [EOS, IM_END]}))


def text_weights(seed: int) -> dict:
    """The DeepseekV3 text model's tensors (float32, checkpoint names: ``model.*``, ``lm_head.weight``), random."""
    import tempfile

    import torch
    from safetensors.torch import load_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    fields = {key: value for key, value in TEXT_CONFIG.items() if key not in ("architectures", "model_type")}
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**fields)).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SHARPEN)
        model.model.norm.weight.uniform_(0.5, 1.5)  # a trained model's final norm is not all ones
        for name, parameter in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                parameter.uniform_(-0.1, 0.1)  # the router's bias moves which experts win
    with tempfile.TemporaryDirectory() as scratch:
        model.save_pretrained(
            scratch
        )  # transformers writes its fused experts back as the checkpoint's per-expert names
        weights = {}
        for file in sorted(Path(scratch).glob("*.safetensors")):
            weights.update(load_file(file))
    return weights


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def quantized_experts(weights: dict) -> dict:
    """The routed experts' linear weights as compressed-tensors pack-quantized INT4 tensors (``weight_packed``,
    ``weight_scale``, ``weight_shape``), through compressed-tensors' own quantization config and compressor."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    holder = torch.nn.Module()  # one Linear per expert weight, at its checkpoint name
    for name in sorted(n for n in weights if is_routed_expert(n)):
        parent = holder
        *path, leaf, _ = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        out_features, in_features = weights[name].shape
        linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
        linear.weight.data.copy_(weights[name])
        parent.add_module(leaf, linear)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=QUANT_GROUP)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(
        holder, QuantizationConfig(config_groups={"group_0": scheme}, quantization_status="initialized")
    )
    for module in holder.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        weight = module.weight.data.float()
        rows = weight.reshape(weight.shape[0], -1, QUANT_GROUP)
        scale, _ = calculate_qparams(rows.amin(-1), rows.amax(-1), module.quantization_scheme.weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    ModelCompressor.from_pretrained_model(holder, quantization_format="pack-quantized").compress_model(holder)
    return {name: tensor.contiguous() for name, tensor in holder.state_dict().items()}


def vision_weights(seed: int) -> dict:
    """The MoonViT tower and its projector at vLLM's checkpoint names (the real checkpoint's), random, bf16."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    hidden, mlp, merged, text = (
        VISION["hidden"],
        VISION["intermediate"],
        VISION["hidden"] * VISION["merge"] ** 2,
        HIDDEN,
    )

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    tensors = {
        "vision_tower.patch_embed.proj.weight": rand(hidden, 3, VISION["patch"], VISION["patch"]),
        "vision_tower.patch_embed.proj.bias": rand(hidden),
        "vision_tower.patch_embed.pos_emb.weight": rand(VISION["pos"], VISION["pos"], hidden),
        "vision_tower.encoder.final_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "vision_tower.encoder.final_layernorm.bias": rand(hidden),
        "mm_projector.pre_norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "mm_projector.pre_norm.bias": rand(hidden),
        "mm_projector.proj.0.weight": rand(merged, merged),
        "mm_projector.proj.0.bias": rand(merged),
        "mm_projector.proj.2.weight": rand(text, merged),
        "mm_projector.proj.2.bias": rand(text),
    }
    for block in range(VISION["layers"]):
        prefix = f"vision_tower.encoder.blocks.{block}."
        tensors |= {
            prefix + "norm0.weight": torch.ones(hidden, dtype=torch.bfloat16),
            prefix + "norm0.bias": rand(hidden),
            prefix + "norm1.weight": torch.ones(hidden, dtype=torch.bfloat16),
            prefix + "norm1.bias": rand(hidden),
            prefix + "wqkv.weight": rand(3 * hidden, hidden),
            prefix + "wqkv.bias": rand(3 * hidden),
            prefix + "wo.weight": rand(hidden, hidden),
            prefix + "wo.bias": rand(hidden),
            prefix + "mlp.fc0.weight": rand(mlp, hidden),
            prefix + "mlp.fc0.bias": rand(mlp),
            prefix + "mlp.fc1.weight": rand(hidden, mlp),
            prefix + "mlp.fc1.bias": rand(hidden),
        }
    return tensors


def wrapper_config() -> dict:
    """config.json as Kimi-K2.5's: the wrapper's fields, the vision config (Kimi's ``vt_*`` names and the plain ones
    vLLM's config class reads), the text config with the quantization config inside it."""
    quantization = {
        "config_groups": {
            "group_0": {
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": QUANT_GROUP,
                    "num_bits": 4,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "strategy": "group",
                    "symmetric": True,
                    "type": "int",
                },
            }
        },
        "format": "pack-quantized",
        "ignore": QUANTIZATION_IGNORE,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }
    vision = {
        "init_pos_emb_height": VISION["pos"],
        "init_pos_emb_time": VISION["time"],
        "init_pos_emb_width": VISION["pos"],
        "merge_kernel_size": [VISION["merge"], VISION["merge"]],
        "merge_type": "sd2_tpool",
        "mm_hidden_size": VISION["hidden"],
        "mm_projector_type": "patchmerger",
        "patch_size": VISION["patch"],
        "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-05,
        "text_hidden_size": HIDDEN,
        "video_attn_type": "spatial_temporal",
        "vt_hidden_size": VISION["hidden"],
        "vt_intermediate_size": VISION["intermediate"],
        "vt_num_attention_heads": VISION["heads"],
        "vt_num_hidden_layers": VISION["layers"],
        "hidden_size": VISION["hidden"],
        "intermediate_size": VISION["intermediate"],
        "num_attention_heads": VISION["heads"],
        "num_hidden_layers": VISION["layers"],
    }
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "ignore_index": -100,
        "media_placeholder_token_id": MEDIA_PAD,
        "model_type": "kimi_k25",
        "pad_token_id": PAD,
        "text_config": TEXT_CONFIG | {"quantization_config": quantization},
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "vision_config": vision,
    }


def write_weights(root: Path, tensors: dict, shards: int = 2) -> None:
    """``tensors`` in ``shards`` safetensors files with the index transformers and vLLM read (the real checkpoint's
    layout: model-0000N-of-0000M.safetensors)."""
    from safetensors.torch import save_file

    names = sorted(tensors)
    per_shard = -(-len(names) // shards)
    weight_map, total = {}, 0
    for index in range(shards):
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {name: tensors[name] for name in names[index * per_shard : (index + 1) * per_shard]}
        save_file(chunk, str(root / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(chunk, file)
        total += sum(tensor.numel() * tensor.element_size() for tensor in chunk.values())
    index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2))


def kimi_target(root: Path, seed: int = 0, int4_experts: bool = True) -> Path:
    """Write the tiny Kimi-K2.5-shaped checkpoint into ``root`` (created); returns it. ``int4_experts=False``: every
    weight bf16 and no quantization config (vLLM's CPU build has no INT4 MoE kernel; the rest of the path runs)."""
    import torch

    root.mkdir(parents=True, exist_ok=True)
    write_tokenizer(root)
    text = text_weights(seed)
    quantized = quantized_experts(text) if int4_experts else {}
    kept = {
        name: tensor.to(torch.bfloat16) for name, tensor in text.items() if not (quantized and is_routed_expert(name))
    }
    renamed = {f"language_model.{name}": tensor for name, tensor in (kept | quantized).items()}
    write_weights(root, renamed | vision_weights(seed))
    config = wrapper_config()
    if not int4_experts:
        del config["text_config"]["quantization_config"]
    (root / "config.json").write_text(json.dumps(config, indent=2))
    (root / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    return root


if __name__ == "__main__":  # python tests/kimi.py DIR [bf16]
    print(kimi_target(Path(sys.argv[1]), int4_experts=sys.argv[2:] != ["bf16"]))
