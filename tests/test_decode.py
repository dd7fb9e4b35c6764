"""The speculative decoder: greedy output identical to the target's own; sampling distribution equal to the target's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eaglet.decode.baseline import target_only_decode
from eaglet.decode.chain import speculative_decode
from eaglet.decode.runners import DraftRunner, TargetRunner
from eaglet.errors import EagletError
from eaglet.formats.draft_config import DraftConfig
from eaglet.model.draft import Eagle3Draft
from eaglet.model.sampling import Sampling


def tiny_pair(vocab=64, seed=0, draft_layers=1):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(30)  # a peaked target, so drafts sometimes agree
    draft_config = DraftConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=vocab,
        draft_vocab_size=vocab // 2,
        target_hidden_size=32,
        eagle_aux_hidden_state_layer_ids=[2, 4, 5],
        num_hidden_layers=draft_layers,
    )
    draft = Eagle3Draft(draft_config).eval()
    used = torch.arange(0, vocab, 2)  # every other token
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    draft.init_from_target(target.model.embed_tokens.weight, target.lm_head.weight, used - torch.arange(len(used)), t2d)
    return target, draft


class OracleDraft:
    """Proposes the target's own greedy continuation (by running a second copy of the target):
    every proposal is accepted, which exercises the cache bookkeeping at full acceptance."""

    def __init__(self, target, layer_ids, vocab):
        self.runner = TargetRunner(target, layer_ids)
        self.vocab = vocab
        self.used = torch.arange(vocab)  # draft index -> target id: the whole vocabulary
        self.sequence: list[int] = []
        self.length = 0

    def reset(self):
        self.runner.reset()
        self.sequence = []

    def extend(self, tokens, aux):
        if not self.sequence:  # first call: tokens are prompt[1:] + [x_n]; recover the prompt's first token lazily
            self.sequence = [self.first] + list(tokens)
            self.runner.reset()
            logits, _ = self.runner.forward(self.sequence)
        else:
            self.sequence += list(tokens)
            self.runner.crop(len(self.sequence) - len(tokens))
            logits, _ = self.runner.forward(list(tokens))
        self.spec = []
        return None, logits[-1]

    def speculate(self, token, hidden):
        self.spec.append(token)
        logits, _ = self.runner.forward(token if isinstance(token, torch.Tensor) else [token])
        return None, logits[-1]

    def crop(self, length):
        self.runner.crop(len(self.sequence))
        self.spec = []

    def to_target_logits(self, logits, vocab):
        return logits


def test_greedy_is_lossless_with_an_untrained_draft():
    target, draft = tiny_pair()
    runner, draft_runner = TargetRunner(target, (2, 4, 5)), DraftRunner(draft)
    for prompt in ([1, 5, 9, 2], [7] * 12, list(range(3, 40, 3))):
        base = target_only_decode(runner, prompt, 40, Sampling(), stop_ids=set())
        spec = speculative_decode(runner, draft_runner, prompt, 40, depth=4, sampling=Sampling(), stop_ids=set())
        assert spec.tokens == base.tokens and len(spec.tokens) == 40
        assert spec.forwards <= 40 and 1.0 <= spec.acceptance_length <= 5.0


def test_greedy_is_lossless_at_full_acceptance():
    target, _ = tiny_pair()
    runner = TargetRunner(target, (2, 4, 5))
    prompt = [1, 5, 9, 2, 11]
    oracle = OracleDraft(target, (2, 4, 5), 64)
    oracle.first = prompt[0]
    base = target_only_decode(runner, prompt, 30, Sampling(), stop_ids=set())
    spec = speculative_decode(runner, oracle, prompt, 30, depth=4, sampling=Sampling(), stop_ids=set())
    assert spec.tokens == base.tokens
    assert all(a == 4 for a in spec.accepted[:-1]) and spec.acceptance_length > 4


def test_stop_token_ends_generation():
    target, draft = tiny_pair()
    runner, draft_runner = TargetRunner(target, (2, 4, 5)), DraftRunner(draft)
    base = target_only_decode(runner, [1, 2, 3], 30, Sampling(), stop_ids=set())
    stop = base.tokens[7]
    first = base.tokens.index(stop)
    spec = speculative_decode(runner, draft_runner, [1, 2, 3], 30, depth=3, sampling=Sampling(), stop_ids={stop})
    assert spec.tokens == base.tokens[: first + 1]


@pytest.mark.slow
def test_sampling_matches_the_target_distribution():
    """Second generated token (the first one the draft proposes): speculative vs plain sampling, 1,500 draws each."""
    target, draft = tiny_pair(vocab=16, seed=3)
    runner, draft_runner = TargetRunner(target, (2, 4, 5)), DraftRunner(draft)
    sampling = Sampling(temperature=1.0, top_p=1.0)
    counts = {"plain": np.zeros(16), "spec": np.zeros(16)}
    generator = torch.Generator().manual_seed(0)
    prompt = [3, 1, 4, 1, 5]
    for _ in range(1500):
        counts["plain"][target_only_decode(runner, prompt, 2, sampling, set(), generator).tokens[1]] += 1
        counts["spec"][
            speculative_decode(runner, draft_runner, prompt, 2, 2, sampling, set(), generator).tokens[1]
        ] += 1
    tv = 0.5 * np.abs(counts["plain"] / 1500 - counts["spec"] / 1500).sum()
    assert tv < 0.07


def test_walking_tree_candidates_keeps_the_target_distribution():
    """Candidates proposed deterministically (a node's top-k children), accepted or passed over one by one:
    the emitted token is distributed as the target's p, whatever the candidates are."""
    from eaglet.decode.sampling import walk_candidates

    p = torch.tensor([0.05, 0.4, 0.25, 0.0, 0.2, 0.1])
    generator = torch.Generator().manual_seed(0)
    for candidates in ([1, 2], [3, 0, 5], [4, 1, 2, 0, 5]):
        counts = np.zeros(len(p))
        accepted_as_candidate = 0
        for _ in range(20000):
            index, token = walk_candidates(p, candidates, generator)
            counts[token] += 1
            if index is not None:
                assert candidates[index] == token
                accepted_as_candidate += 1
        assert 0.5 * np.abs(counts / 20000 - p.numpy()).sum() < 0.015, candidates
        assert counts[3] == 0  # a zero-probability candidate is never emitted
        expected = float(p[candidates].sum())  # a candidate is emitted exactly when the draw lands on one
        assert abs(accepted_as_candidate / 20000 - expected) < 0.015


@pytest.mark.slow
def test_tree_sampling_matches_the_target_distribution():
    """Second and third generated tokens (drawn through the tree): speculative vs plain sampling."""
    from eaglet.decode.tree import tree_decode

    target, draft = tiny_pair(vocab=16, seed=3)
    runner, draft_runner = TargetRunner(target, (2, 4, 5)), DraftRunner(draft)
    sampling = Sampling(temperature=1.0, top_p=1.0)
    counts = {"plain": np.zeros((16, 16)), "tree": np.zeros((16, 16))}
    generator = torch.Generator().manual_seed(0)
    prompt = [3, 1, 4, 1, 5]
    draws = 1500
    for _ in range(draws):
        plain = target_only_decode(runner, prompt, 3, sampling, set(), generator).tokens
        tree = tree_decode(
            runner,
            draft_runner,
            prompt,
            3,
            depth=2,
            topk=3,
            budget=6,
            stop_ids=set(),
            sampling=sampling,
            generator=generator,
        ).tokens
        counts["plain"][plain[1], plain[2]] += 1
        counts["tree"][tree[1], tree[2]] += 1
    for axis in (1, 0):  # the marginals of the 2nd and of the 3rd token
        tv = 0.5 * np.abs(counts["plain"].sum(axis) / draws - counts["tree"].sum(axis) / draws).sum()
        assert tv < 0.07


@pytest.mark.parametrize("draft_layers", [1, 2])
def test_decoder_draft_steps_equal_the_training_time_test(draft_layers):
    """The decoder's incremental draft (cache of real positions, then speculative steps after the last one)
    computes what training computed: step 0 over the prefix, step k at the last position with RoPE position
    t + k (vLLM and SGLang advance the draft's position by one per step), every layer."""
    from eaglet.train.ttt import TTTAttention, documents

    torch.manual_seed(1)
    target, draft = tiny_pair(draft_layers=draft_layers)
    draft = draft.double()
    n, steps = 9, 3
    tokens = torch.randint(0, 64, (n + steps,))  # x_0 .. x_{n+steps-1}
    aux = torch.randn(n, 3, 32, dtype=torch.float64)
    doc_ids, positions, _ = documents(torch.tensor([0, n]), torch.device("cpu"))
    attends = [TTTAttention(doc_ids) for _ in range(draft_layers)]
    trained, hidden = [], draft.fuse(aux)
    with torch.no_grad():
        for k in range(steps):
            cos, sin = draft.rope(positions + k)
            hidden, logits = draft.step(tokens[1 + k : n + 1 + k], hidden, cos.double(), sin.double(), attends)
            trained.append(logits[-1])
    runner = DraftRunner(draft)
    hidden, logits = runner.extend(tokens[1 : n + 1].tolist(), aux)
    torch.testing.assert_close(logits.double(), trained[0], rtol=1e-5, atol=1e-5)  # the runner returns float32 logits
    for k in range(1, steps):
        hidden, logits = runner.speculate(int(tokens[n + k]), hidden)
        torch.testing.assert_close(logits.double(), trained[k], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("draft_layers", [1, 2])
def test_tree_greedy_is_lossless(draft_layers):
    from eaglet.decode.tree import tree_decode

    target, draft = tiny_pair(draft_layers=draft_layers)
    runner, draft_runner = TargetRunner(target, (2, 4, 5)), DraftRunner(draft)
    for prompt in ([1, 5, 9, 2], list(range(3, 40, 3))):
        base = target_only_decode(runner, prompt, 40, Sampling(), stop_ids=set())
        chain = speculative_decode(runner, draft_runner, prompt, 40, depth=4, sampling=Sampling(), stop_ids=set())
        tree = tree_decode(runner, draft_runner, prompt, 40, depth=4, topk=3, budget=12, stop_ids=set())
        assert tree.tokens == base.tokens
        # a tree holding the chain's path accepts at least as much per round on average
        assert tree.acceptance_length >= chain.acceptance_length - 0.25


def test_tree_structure():
    from eaglet.decode.common import Tree

    tree = Tree(tokens=[7, 1, 2, 3, 4], parents=[-1, 0, 0, 1, 3], depths=[0, 1, 1, 2, 3])
    mask = tree.ancestor_mask()
    assert mask[4].tolist() == [True, True, False, True, True]
    assert mask[2].tolist() == [True, False, True, False, False]
    assert tree.child(1, 3) == 3 and tree.child(0, 9) is None


def test_draft_tree_expansion_shape():
    from eaglet.decode.tree import expand_tree

    target, draft = tiny_pair()
    runner, draft_runner = TargetRunner(target, (2, 4, 5)), DraftRunner(draft)
    runner.reset()
    logits, aux = runner.forward([1, 5, 9, 2])
    hidden, draft_logits = draft_runner.extend([5, 9, 2, 11], aux)
    tree = expand_tree(draft_runner, 11, hidden, draft_logits, topk=3, depth=4, budget=10)
    assert len(tree.tokens) == 11 and tree.tokens[0] == 11 and tree.parents[0] == -1
    assert all(tree.parents[i] < i and tree.depths[i] == tree.depths[tree.parents[i]] + 1 for i in range(1, 11))
    assert max(tree.depths) <= 4 and sum(d == 1 for d in tree.depths) <= 3


def test_tree_of_width_one_is_the_chain():
    from eaglet.decode.tree import tree_decode

    target, draft = tiny_pair(seed=2)
    runner, draft_runner = TargetRunner(target, (2, 4, 5)), DraftRunner(draft)
    prompt = [4, 8, 15, 16, 23, 42]
    chain = speculative_decode(runner, draft_runner, prompt, 30, depth=4, sampling=Sampling(), stop_ids=set())
    tree = tree_decode(runner, draft_runner, prompt, 30, depth=4, topk=1, budget=4, stop_ids=set())
    assert tree.tokens == chain.tokens and tree.accepted == chain.accepted


LLAMA31_TARGET = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 64,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    },
}


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        LLAMA31_TARGET["rope_scaling"],
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    ],
)
def test_the_draft_rotates_like_the_target(scaling):
    """The draft inherits the target's RoPE, scaling included (vLLM and SGLang serve it with the config's
    rope_scaling): its cos/sin equal transformers' own Llama rotary embedding, at long positions too."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    target = {**LLAMA31_TARGET, "rope_scaling": scaling}
    config = DraftConfig.from_target(target, 32, (1, 2, 3))
    assert config.rope_scaling == scaling
    positions = torch.tensor([0, 1, 7, 1000, 20000, 100000])
    cos, sin = Eagle3Draft(config).rope(positions)
    reference = LlamaRotaryEmbedding(
        LlamaConfig(
            **{k: v for k, v in target.items() if k != "rope_scaling"}, rope_scaling=dict(scaling) if scaling else None
        )
    )  # (it edits it)
    expected_cos, expected_sin = reference(torch.zeros(1, len(positions), 16), positions[None])
    torch.testing.assert_close(cos, expected_cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, expected_sin[0], rtol=1e-5, atol=1e-5)


def test_rope_scaling_in_transformers_5_configs_and_bf16_drafts():
    """A config.json in transformers 5's form (theta and scaling in `rope_parameters`) gives the same draft
    RoPE; casting the draft to bf16 leaves its frequencies in float32 (a bf16 inverse frequency would put
    position 20,000 radians off)."""
    legacy = DraftConfig.from_target(LLAMA31_TARGET, 32, (1, 2, 3))
    parameters = {"rope_theta": 500000.0, **LLAMA31_TARGET["rope_scaling"]}
    modern = DraftConfig.from_target(
        {k: v for k, v in LLAMA31_TARGET.items() if k not in ("rope_theta", "rope_scaling")}
        | {"rope_parameters": parameters},
        32,
        (1, 2, 3),
    )
    assert (modern.rope_theta, modern.rope_scaling) == (legacy.rope_theta, legacy.rope_scaling)
    positions = torch.tensor([3, 20000])
    draft = Eagle3Draft(legacy)
    expected = draft.rope(positions)
    draft = draft.to(torch.bfloat16)
    for got, want in zip(draft.rope(positions), expected):
        assert got.dtype == torch.float32 and torch.equal(got, want)


def test_an_unknown_rope_type_is_a_one_line_error():
    config = DraftConfig.from_target(
        {**LLAMA31_TARGET, "rope_scaling": {"rope_type": "spiral", "factor": 2.0}}, 32, (1, 2, 3)
    )
    with pytest.raises(EagletError, match="RoPE type 'spiral' is not one transformers"):
        Eagle3Draft(config).rope(torch.arange(4))
