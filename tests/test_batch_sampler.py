"""The static engine `regenerate` and `synthesize` write text with on a GPU (``model/batch_sampler.py``), run
eagerly here: greedy rows equal transformers' ``generate`` token for token (left padding, grouped key heads,
rows that stop early), sampling is reproducible and follows temperature and nucleus, and the engine is picked
only where the target allows it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglet.data.generation import Generator
from eaglet.errors import EagletError
from eaglet.model.batch_sampler import (
    STOP_CHECK_EVERY,
    BatchSampler,
    cache_length,
    draw,
    folded_attention_set,
    static_sampling_problem,
)
from eaglet.model.sampling import Sampling

PROMPTS = [[5, 9, 13], [7, 3, 3, 8, 21, 2, 40], [11], [4, 4, 6, 30, 31]]  # ragged: left padding on three rows
NEW = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from conftest import tiny_llama_dir

    path = tiny_llama_dir(tmp_path_factory.mktemp("sampler-target"))  # 4 query heads over 2 key heads
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_generate(model, prompts, stop_ids, new=NEW):
    generator = Generator(None, model, torch.device("cpu"), len(prompts), stop_ids, 0, True, engine="generate")
    return generator.sample(prompts, new, 0.0, 1.0, seed=0)


def sampler_for(model, rows, sampling=Sampling(), stop_ids=(), new=NEW, **extra):
    width = max(map(len, PROMPTS))
    with folded_attention_set(model) as folded:
        assert folded
        return BatchSampler(model, rows, cache_length(width, new), new, sampling, list(stop_ids), 0, **extra)


def until(tokens, stop_ids):
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in stop_ids), tokens)


def test_greedy_rows_equal_transformers_generate(model):
    expected = hf_generate(model, PROMPTS, [])
    sampler = sampler_for(model, rows=len(PROMPTS) + 2)  # two spare rows, stopped from the start
    with folded_attention_set(model):
        got = sampler.generate(PROMPTS, NEW, seed=0)
    assert got == expected
    assert model.config._attn_implementation != "eaglet_folded_sdpa"  # the model's own attention after the block
    expected = hf_generate(model, PROMPTS[::-1], [])
    with folded_attention_set(model):  # a second batch on the same cache: nothing of the first is seen
        assert sampler.generate(PROMPTS[::-1], NEW, seed=0) == expected


def test_steps_read_only_the_keys_written_so_far(model):
    """Key lengths in buckets of 4: the steps cross five of them (7-token prompts + 12 new) and still equal
    ``generate``; each step's bucket holds every key written so far and no more than a bucket past it."""
    sampler = sampler_for(model, rows=len(PROMPTS), key_bucket=4)
    assert sampler.key_lengths[:3] == [4, 8, 12] and sampler.key_lengths[-1] == sampler.max_len
    assert [sampler.key_length(w) for w in (0, 3, 4, 7, 8)] == [4, 4, 8, 8, 12]
    expected = hf_generate(model, PROMPTS, [])
    with folded_attention_set(model):
        assert sampler.generate(PROMPTS, NEW, seed=0) == expected


def test_rows_stop_at_their_stop_token_and_the_batch_ends_when_all_have(model):
    free = hf_generate(model, PROMPTS, [])
    stops = sorted({row[2] for row in free})  # every row meets one by its third token
    sampler = sampler_for(model, rows=len(PROMPTS), stop_ids=stops, new=40)
    expected = hf_generate(model, PROMPTS, stops, new=40)
    with folded_attention_set(model):
        got = sampler.generate(PROMPTS, 40, seed=0)
    for row, tokens in zip(expected, got):
        cut = until(tokens, set(stops))
        assert cut == until(row, set(stops)) and len(cut) <= 3
        assert all(t == 0 for t in tokens[len(cut) :])  # padding after a stop
    assert len(got[0]) == STOP_CHECK_EVERY  # the first check saw every row stopped: no step after it


def test_sampling_is_reproducible_and_follows_the_nucleus(model):
    sampling = Sampling(temperature=1.0, top_p=0.9)
    sampler = sampler_for(model, rows=len(PROMPTS), sampling=sampling)
    with folded_attention_set(model):
        first = sampler.generate(PROMPTS, NEW, seed=7)
        again = sampler.generate(PROMPTS, NEW, seed=7)
        other = sampler.generate(PROMPTS, NEW, seed=8)
    assert first == again and first != other
    narrow = sampler_for(model, rows=len(PROMPTS), sampling=Sampling(temperature=1.0, top_p=1e-6))
    expected = hf_generate(model, PROMPTS, [])
    with folded_attention_set(model):  # a nucleus of one token: the greedy rows, whatever the draws
        assert narrow.generate(PROMPTS, NEW, seed=3) == expected


def nucleus_reference(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Temperature then top-p written out token by token: each row's most likely tokens until their mass reaches
    top-p (the one crossing it kept), renormalised."""
    out = torch.zeros_like(logits)
    for row, values in enumerate(torch.softmax(logits / sampling.temperature, dim=-1)):
        mass = 0.0
        for token in sorted(range(len(values)), key=lambda t: -float(values[t])):
            if mass >= sampling.top_p:
                break
            out[row, token] = values[token]
            mass += float(values[token])
    return out / out.sum(-1, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_draws_follow_the_distribution_sampling_defines(dtype, top_p):
    """The engine's draw (sorted in the logits' own dtype, raced without scattering back) lands on each token as
    often as ``Sampling.probs`` says, and never outside the nucleus: 200,000 draws over 4 rows of 12 tokens."""
    sampling = Sampling(temperature=0.7, top_p=top_p)
    logits = torch.tensor(
        [
            [2.0, 1.5, 1.2, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0, -3.0, -4.0, -9.0],
            list(range(12)),
            [0.0] * 12,
            [5.0] + [0.0] * 11,
        ]
    ).to(dtype)
    draws = 50_000
    torch.manual_seed(0)
    tokens = draw(logits.repeat_interleave(draws, 0), sampling).view(4, draws)  # [rows, draws]
    counts = torch.stack([torch.bincount(row, minlength=12) for row in tokens]).double()
    expected = nucleus_reference(logits.double(), sampling)  # [rows, 12]
    assert torch.allclose(sampling.probs(logits).double(), expected, atol=1e-6)  # the decoders' distribution too
    assert (counts[expected == 0] == 0).all()  # nothing outside the nucleus
    assert (expected == 0).any() == (top_p < 1)  # (the rows do have tokens outside it)
    spread = (expected * (1 - expected) / draws).sqrt()  # one draw-frequency standard deviation per token
    assert ((counts / draws - expected).abs() <= 5 * spread + 1e-12).all()


def test_generator_picks_the_engine_and_says_why(model):
    static = Generator(None, model, torch.device("cpu"), 8, [], 0, True, engine="static")
    assert static.sample(PROMPTS, NEW, 0.0, 1.0, seed=0) == hf_generate(model, PROMPTS, [])
    assert list(static.used) == ["static"]
    auto = Generator(None, model, torch.device("cpu"), 8, [], 0, True, engine="auto")
    auto.sample(PROMPTS, 2, 0.0, 1.0, seed=0)
    assert auto.used == {"generate": "auto on a CPU"}
    split = Generator(None, model, torch.device("cpu"), 8, [], 0, True, engine="static", distributed=True)
    with pytest.raises(EagletError, match="--hf-engine static: the target is split over a torchrun world"):
        split.sample(PROMPTS, 2, 0.0, 1.0, seed=0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_big_targets_architectures_decode_as_generate_does(tmp_path, arch):
    """The architectures big targets use — routed experts, and DeepseekV3's MLA, whose values are narrower than its
    keys — on the static engine (eagerly; on a GPU auto keeps MoE on generate: routing reads the host)."""
    from targets import tiny_target

    target = AutoModelForCausalLM.from_pretrained(tiny_target(tmp_path / arch, arch), dtype=torch.float32).eval()
    static = Generator(None, target, torch.device("cpu"), 8, [], 0, True, engine="static")
    assert static.sample(PROMPTS, NEW, 0.0, 1.0, seed=0) == hf_generate(target, PROMPTS, [])


def test_targets_the_engine_cannot_run_are_named(tmp_path):
    from targets import tiny_target

    moe = AutoModelForCausalLM.from_pretrained(tiny_target(tmp_path / "gpt-oss", "gpt_oss"))
    assert "sliding-window" in static_sampling_problem(moe, 4, 256)


def test_the_cache_size_is_counted_as_the_layers_store_it(tmp_path):
    """What the GPU fit check counts per cache position is what StaticCache allocates, or more for MLA (whose cache
    transformers may compress): the check never lets a cache past the memory it saw."""
    from targets import tiny_target

    from eaglet.model.batch_sampler import cache_bytes_per_position

    for arch in ("llama", "deepseek_v3"):
        target = AutoModelForCausalLM.from_pretrained(tiny_target(tmp_path / arch, arch), dtype=torch.float32).eval()
        sampler = sampler_for(target, rows=len(PROMPTS))
        with folded_attention_set(target):
            sampler.generate(PROMPTS, NEW, seed=0)  # the layers' tensors are made at their first write
        allocated = sum(
            t.numel() * t.element_size() for layer in sampler.cache.layers for t in (layer.keys, layer.values)
        )
        counted = len(PROMPTS) * sampler.max_len * cache_bytes_per_position(target.config, torch.float32)
        assert allocated == counted if arch == "llama" else allocated <= counted
