"""Feature capture equals HF's own hidden states, for many decoder-only architectures (tiny random configs)."""

from __future__ import annotations

import pytest
import torch

from eaglet.model.capture import FeatureCapture, decoder_layers, teacher_logits

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def tiny(kind: str):
    import transformers as tf

    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON))
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON))
    if kind == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, head_dim=16))
    if kind == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**COMMON))
    if kind == "phi3":
        return tf.Phi3ForCausalLM(tf.Phi3Config(**COMMON, pad_token_id=0))
    if kind == "gemma2":
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**COMMON, head_dim=16))
    if kind == "gemma3":
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**COMMON, head_dim=16))
    if kind == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(
            tf.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        )
    if kind == "deepseek_v3":
        return tf.DeepseekV3ForCausalLM(
            tf.DeepseekV3Config(
                **{**COMMON, "num_key_value_heads": 4},
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                first_k_dense_replace=1,
                n_group=1,
                topk_group=1,
                kv_lora_rank=16,
                q_lora_rank=32,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=16,
            )
        )
    raise ValueError(kind)


KINDS = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "qwen3_moe", "deepseek_v3"]


@pytest.mark.parametrize("kind", KINDS)
def test_capture_equals_hidden_states(kind):
    torch.manual_seed(0)
    model = tiny(kind).eval()
    ids = (2, 4, 5)
    capture = FeatureCapture(model, ids)
    assert len(decoder_layers(model)) == 8
    input_ids = torch.randint(0, 128, (2, 12))
    aux, last = capture(input_ids)
    with torch.inference_mode():
        reference = model.model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    assert aux.shape == (2, 12, 3, 64) and last.shape == (2, 12, 64)
    for slot, layer in enumerate(ids):
        torch.testing.assert_close(aux[:, :, slot], reference.hidden_states[layer], rtol=0, atol=0)
    torch.testing.assert_close(last, reference.last_hidden_state, rtol=0, atol=0)
    # the captured last state gives the model's own logits through its LM head
    with torch.inference_mode():
        logits = model(input_ids=input_ids).logits
        torch.testing.assert_close(teacher_logits(model, last), logits, rtol=1e-5, atol=1e-5)


def test_right_padding_does_not_change_real_tokens():
    """Right-padded batches (what extraction uses) give the same features for the real tokens."""
    torch.manual_seed(0)
    model = tiny("llama").eval()
    capture = FeatureCapture(model, (2, 4, 5))
    short = torch.randint(0, 128, (1, 7))
    long = torch.randint(0, 128, (1, 12))
    padded = torch.cat([torch.cat([short, torch.zeros(1, 5, dtype=torch.long)], 1), long])
    aux_b, last_b = capture(padded)
    aux_s, last_s = capture(short)
    torch.testing.assert_close(aux_b[0, :7], aux_s[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last_b[0, :7], last_s[0], rtol=1e-5, atol=1e-5)


def test_concurrent_captures_get_their_own_features():
    """Online training computes features in its prefetch thread while the held-out evaluation computes others on the
    main thread, through one FeatureCapture: each call returns its own input's features, never the other's."""
    import threading

    torch.manual_seed(0)
    model = tiny("llama").eval()
    capture = FeatureCapture(model, (2, 4, 5))
    inputs = [torch.randint(0, 128, (1, length)) for length in (9, 12)]
    expected = [capture(ids) for ids in inputs]
    wrong: list[str] = []

    def run(which: int) -> None:
        for _ in range(200):
            try:
                aux, last = capture(inputs[which])
            except RuntimeError as exc:  # another call's tensor of another length in this call's slots
                wrong.append(f"input {which}: {exc}")
                return
            if not (torch.equal(aux, expected[which][0]) and torch.equal(last, expected[which][1])):
                wrong.append(f"input {which}: another input's features")
                return

    threads = [threading.Thread(target=run, args=(which,)) for which in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong
