"""The static-cache target (what CUDA graphs replay on GPU), run eagerly here: the same tokens, the same
acceptance and the same logits as the dynamic-cache engine, for plain decoding, chains and trees."""

from __future__ import annotations

import pytest
import torch
from test_batched_decode import LAYERS, NEW_TOKENS, PROMPTS, trained_pair
from test_decode import tiny_pair

from eaglet.decode.baseline import GreedyTargetSteps, static_target_decode, target_only_decode
from eaglet.decode.chain import ChainRounds, StaticChainDraft, speculative_decode, static_chain_decode
from eaglet.decode.common import Tree
from eaglet.decode.runners import DraftRunner, TargetRunner
from eaglet.decode.static import GRAPH_BUCKETS, StaticTarget, bucket_for, buckets_for
from eaglet.decode.tree import StaticTreeDraft, TreeRounds, expand_tree, static_tree_decode, tree_decode
from eaglet.errors import EagletError
from eaglet.model.sampling import Sampling

LONG_PROMPT = [(7 * i) % 60 + 2 for i in range(GRAPH_BUCKETS[-1] + 9)]  # past the largest bucket: runs unbucketed
MAX_LEN = len(LONG_PROMPT) + NEW_TOKENS + GRAPH_BUCKETS[-1] + 1


@pytest.fixture(scope="module")
def pair():
    return trained_pair()


def test_bucket_sizes():
    assert bucket_for(1) == 1 and bucket_for(5) == 8 and bucket_for(GRAPH_BUCKETS[-1]) == GRAPH_BUCKETS[-1]
    assert bucket_for(GRAPH_BUCKETS[-1] + 1) is None
    assert buckets_for(GRAPH_BUCKETS[-1]) == GRAPH_BUCKETS  # verifications that fit add no bucket
    assert bucket_for(97, buckets_for(97)) == 97 and bucket_for(98, buckets_for(97)) is None


def test_plain_decoding_equals_the_dynamic_cache(pair):
    """The baseline both ways: forwards through ``StaticTarget`` and one fused step per token (argmax and the
    next input on the device)."""
    target, _ = pair
    dynamic, static = TargetRunner(target, LAYERS), StaticTarget(target, LAYERS, MAX_LEN)
    for prompt in PROMPTS + [LONG_PROMPT]:
        expected = target_only_decode(dynamic, prompt, NEW_TOKENS, Sampling(), set())
        assert target_only_decode(static, prompt, NEW_TOKENS, Sampling(), set()).tokens == expected.tokens
        fused = static_target_decode(static, prompt, NEW_TOKENS, set())
        assert fused.tokens == expected.tokens and static.length == len(prompt) + NEW_TOKENS - 1
    stop = expected.tokens[3]
    stopped = static_target_decode(static, LONG_PROMPT, NEW_TOKENS, {stop})
    assert stopped.tokens == expected.tokens[: expected.tokens.index(stop) + 1]


@pytest.mark.parametrize("one_tensor", [True, False])
def test_tree_forward_gives_the_dynamic_cache_logits_and_features(pair, one_tensor):
    """A padded tree forward (5 tokens in a bucket of 8) after a prompt, then the accepted path kept and one
    more token: logits and aux features equal the dynamic cache's at every step — with the layers' entries in one
    tensor (one gather moves them all) and layer by layer (targets whose layers differ in shape)."""
    target, _ = pair
    dynamic, static = TargetRunner(target, LAYERS), StaticTarget(target, LAYERS, MAX_LEN)
    assert static._entries is not None
    if not one_tensor:
        static._entries = None
    tree = Tree(tokens=[9, 11, 13, 15, 17], parents=[-1, 0, 0, 1, 3], depths=[0, 1, 1, 2, 3])
    for runner in (dynamic, static):
        runner.reset()
    for step in (lambda r: r.forward(PROMPTS[0]), lambda r: r.forward(tree.tokens, tree=tree)):
        (dynamic_logits, dynamic_aux), (static_logits, static_aux) = step(dynamic), step(static)
        torch.testing.assert_close(static_logits, dynamic_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(static_aux, dynamic_aux, rtol=1e-5, atol=1e-5)
    base = len(PROMPTS[0])
    kept = torch.cat([torch.arange(base), base + torch.tensor([0, 1, 3, 4])])
    for runner in (dynamic, static):
        runner.keep(kept)
    assert static.length == dynamic.length == base + 4
    torch.testing.assert_close(static.forward([21])[0], dynamic.forward([21])[0], rtol=1e-5, atol=1e-5)


def assert_chain_and_tree_match(dynamic, static, drafts, prompt):
    """Chain (depth 3) and tree (depth 4, top-k 3, budget 12) decoding on ``static`` give the dynamic
    cache's tokens and accepted counts; returns (chain, tree) results."""
    expected = speculative_decode(dynamic, drafts, prompt, NEW_TOKENS, 3, Sampling(), set())
    chain = speculative_decode(static, drafts, prompt, NEW_TOKENS, 3, Sampling(), set())
    assert chain.tokens == expected.tokens and chain.accepted == expected.accepted
    expected = tree_decode(dynamic, drafts, prompt, NEW_TOKENS, 4, 3, 12, set())
    tree = tree_decode(static, drafts, prompt, NEW_TOKENS, 4, 3, 12, set())
    assert tree.tokens == expected.tokens and tree.accepted == expected.accepted
    return chain, tree


def test_chain_and_tree_decoding_equal_the_dynamic_cache(pair):
    target, draft = pair
    dynamic, static, drafts = TargetRunner(target, LAYERS), StaticTarget(target, LAYERS, MAX_LEN), DraftRunner(draft)
    accepted = 0
    for prompt in PROMPTS:
        _, tree = assert_chain_and_tree_match(dynamic, static, drafts, prompt)
        accepted += sum(tree.accepted)
    assert accepted >= 10  # paths of several tokens were kept (the compaction was exercised)


@pytest.mark.parametrize("depth", [1, 3, 5])
def test_static_draft_rounds_equal_the_dynamic_engine(pair, depth):
    """Both models on static caches, each round one draft pass and one verification: the dynamic engine's
    tokens and its accepted counts, prompt by prompt (one-token and past-the-largest-bucket prompts too)."""
    target, draft = pair
    dynamic, drafts = TargetRunner(target, LAYERS), DraftRunner(draft)
    static, static_draft = StaticTarget(target, LAYERS, MAX_LEN), StaticChainDraft(draft, MAX_LEN, depth)
    rounds = ChainRounds(static, static_draft)
    accepted = 0
    for prompt in PROMPTS + [LONG_PROMPT]:
        expected = speculative_decode(dynamic, drafts, prompt, NEW_TOKENS, depth, Sampling(), set())
        result = static_chain_decode(static, static_draft, prompt, NEW_TOKENS, set(), rounds)
        assert result.tokens == expected.tokens and result.accepted == expected.accepted
        # the draft trails the target by the last round's accepted tokens + correction (the next round's rows)
        assert static.length - static_draft.length == result.accepted[-1] + 1
        accepted += sum(result.accepted)
    assert accepted >= 10
    stop = expected.tokens[4]
    stopped = static_chain_decode(static, static_draft, LONG_PROMPT, NEW_TOKENS, {stop})
    assert stopped.tokens == expected.tokens[: expected.tokens.index(stop) + 1]


@pytest.mark.parametrize("depth,topk,budget", [(4, 3, 12), (3, 2, 100), (1, 4, 2), (5, 4, 20)])
def test_static_tree_rounds_equal_the_dynamic_engine(pair, depth, topk, budget):
    """The tree drafted on the device (fixed shapes, stable sorts) is the host-built EAGLE-2 tree: the same
    tokens and accepted counts as ``tree_decode`` with the dynamic caches, prompt by prompt."""
    target, draft = pair
    dynamic, drafts = TargetRunner(target, LAYERS), DraftRunner(draft)
    static, tree_draft = StaticTarget(target, LAYERS, MAX_LEN), StaticTreeDraft(draft, MAX_LEN, depth, topk, budget)
    rounds = TreeRounds(static, tree_draft)
    accepted = 0
    for prompt in PROMPTS + [LONG_PROMPT]:
        expected = tree_decode(dynamic, drafts, prompt, NEW_TOKENS, depth, topk, budget, set())
        result = static_tree_decode(static, tree_draft, prompt, NEW_TOKENS, set(), rounds)
        assert result.tokens == expected.tokens and result.accepted == expected.accepted
        assert static.length - tree_draft.length == result.accepted[-1] + 1
        # the draft's cache was extended with each accepted path's own verify features (the dynamic engine's)
        length = tree_draft.length
        for static_keys, dynamic_cache in zip(tree_draft.keys, drafts.caches):
            torch.testing.assert_close(static_keys[:, :length], dynamic_cache.keys[:, :length], rtol=1e-4, atol=1e-5)
        accepted += sum(result.accepted)
    assert accepted >= (5 if depth > 1 else 1)


def test_a_tree_past_the_largest_bucket_verifies_in_its_own_bucket(pair):
    """A budget past the largest bucket (eval's d10/k10/b96 tree on the H200), drafted on the host (as sampled
    trees are), verifies in a bucket of its size (a graph on GPU; it ran as an eager forward every round:
    0.48x), with the dynamic engine's tokens; fused greedy rounds of that size give them too."""
    depth, topk, budget = 6, 4, GRAPH_BUCKETS[-1] + 6  # 4 + 5 * 16 = 84 candidates: the budget is filled
    target, draft = pair
    dynamic, drafts = TargetRunner(target, LAYERS), DraftRunner(draft)
    static = StaticTarget(target, LAYERS, MAX_LEN + budget, verify_tokens=budget + 1)
    tree_draft = StaticTreeDraft(draft, MAX_LEN + budget, depth, topk, budget)
    for prompt in PROMPTS:
        expected = tree_decode(dynamic, drafts, prompt, NEW_TOKENS, depth, topk, budget, set())
        result = tree_decode(static, drafts, prompt, NEW_TOKENS, depth, topk, budget, set())
        assert result.tokens == expected.tokens and result.accepted == expected.accepted
        fused = static_tree_decode(static, tree_draft, prompt, NEW_TOKENS, set())
        assert fused.tokens == expected.tokens and fused.accepted == expected.accepted
    assert static.buckets_used[-1] == budget + 1


def test_rounds_with_the_compiled_draft_give_the_same_tokens(pair):
    """eval's GPU default: the draft's part of a round through torch.compile (one graph per round shape), the
    prompt's rows eager: the dynamic engine's tokens and acceptance, and no compile per prompt length."""
    from torch._dynamo.utils import counters

    target, draft = pair
    dynamic, drafts, static = TargetRunner(target, LAYERS), DraftRunner(draft), StaticTarget(target, LAYERS, MAX_LEN)
    chain_draft = StaticChainDraft(draft, MAX_LEN, 3, compiled=True)
    tree_draft = StaticTreeDraft(draft, MAX_LEN, 4, 3, 12, compiled=True)
    chain_rounds, tree_rounds = ChainRounds(static, chain_draft), TreeRounds(static, tree_draft)
    counters.clear()
    compiled_after = []
    for prompt in [LONG_PROMPT] + PROMPTS[:2]:  # prompts of three lengths
        expected = speculative_decode(dynamic, drafts, prompt, NEW_TOKENS, 3, Sampling(), set())
        result = static_chain_decode(static, chain_draft, prompt, NEW_TOKENS, set(), chain_rounds)
        assert result.tokens == expected.tokens and result.accepted == expected.accepted
        expected = tree_decode(dynamic, drafts, prompt, NEW_TOKENS, 4, 3, 12, set())
        result = static_tree_decode(static, tree_draft, prompt, NEW_TOKENS, set(), tree_rounds)
        assert result.tokens == expected.tokens and result.accepted == expected.accepted
        compiled_after.append(counters["stats"]["unique_graphs"])
    assert compiled_after == [3, 3, 3]  # the chain's round, the tree's and its walk, each whole (fullgraph), once


def test_a_round_past_the_cache_is_refused_before_it_runs(pair):
    """Inside a graph an index past the cache is a device fault; the host refuses the round first, by name."""
    target, draft = pair
    prompt = PROMPTS[0]
    static = StaticTarget(target, LAYERS, len(prompt) + 6)
    with pytest.raises(EagletError, match=f"static cache holds {len(prompt) + 6} positions"):
        static_tree_decode(static, StaticTreeDraft(draft, len(prompt) + 6, 4, 3, 12), prompt, NEW_TOKENS, set())
    with pytest.raises(EagletError, match="static cache holds"):
        static_target_decode(static, prompt, NEW_TOKENS, set())


def test_static_tree_matches_the_host_tree_node_for_node(pair):
    """One round's tree grown on the static caches (inside a round) against the same builder on the dynamic caches,
    from the same state."""
    target, draft = pair
    prompt = PROMPTS[0]
    dynamic, drafts = TargetRunner(target, LAYERS), DraftRunner(draft)
    dynamic.reset()
    drafts.reset()
    logits, aux = dynamic.forward(prompt)
    first = int(logits[-1].argmax())
    hidden, draft_logits = drafts.extend(prompt[1:] + [first], aux)
    expected = expand_tree(drafts, first, hidden, draft_logits, 3, 4, 14)
    tree_draft = StaticTreeDraft(draft, MAX_LEN, 4, 3, 14)
    tree_draft.reset()
    tree_draft.prefill(prompt[1:], aux[:-1])
    rows = tree_draft.rows
    tokens, depths, parents, block = tree_draft.round(
        torch.tensor([first] * rows), aux[-1:].expand(rows, -1, -1), torch.tensor(1)
    )
    assert tokens.tolist() == expected.tokens and depths.tolist() == expected.depths
    assert parents.tolist()[1:] == expected.parents[1:]
    assert torch.equal(block, expected.ancestor_mask())


def test_a_forward_past_the_cache_is_refused():
    target, _ = tiny_pair()
    static = StaticTarget(target, LAYERS, 12)
    static.reset()
    static.forward(list(range(2, 10)))
    with pytest.raises(EagletError, match="static cache holds 12 positions"):
        static.forward(list(range(2, 7)))
    static.forward([2])  # 9 positions
    logits, _ = static.forward([3, 4, 5])  # fits, though its bucket (4) would not: runs unpadded
    assert logits.shape[0] == 3 and static.length == 12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_equal_the_dynamic_cache_on_gpu(pair):
    """Captured mid-decode and replayed with new ids, positions and masks: the same tokens and acceptance; the
    fused rounds (draft, verification, acceptance, compaction in one graph) captured once and replayed for every
    prompt."""
    target, draft = (module.to("cuda") for module in pair)
    try:
        dynamic, graphed, drafts = (
            TargetRunner(target, LAYERS),
            StaticTarget(target, LAYERS, MAX_LEN),
            DraftRunner(draft),
        )
        assert graphed.graphs
        graphed_draft = StaticChainDraft(draft, MAX_LEN, 3, compiled=True)  # eval's GPU default
        graphed_tree = StaticTreeDraft(draft, MAX_LEN, 4, 3, 12, compiled=True)
        steps = GreedyTargetSteps(graphed)
        chain_rounds, tree_rounds = ChainRounds(graphed, graphed_draft), TreeRounds(graphed, graphed_tree)
        for prompt in PROMPTS + [LONG_PROMPT]:
            expected = target_only_decode(dynamic, prompt, NEW_TOKENS, Sampling(), set())
            assert target_only_decode(graphed, prompt, NEW_TOKENS, Sampling(), set()).tokens == expected.tokens
            chain, tree = assert_chain_and_tree_match(dynamic, graphed, drafts, prompt)
            assert static_target_decode(graphed, prompt, NEW_TOKENS, set(), steps).tokens == expected.tokens
            both = static_chain_decode(graphed, graphed_draft, prompt, NEW_TOKENS, set(), chain_rounds)
            assert both.tokens == chain.tokens and both.accepted == chain.accepted
            both = static_tree_decode(graphed, graphed_tree, prompt, NEW_TOKENS, set(), tree_rounds)
            assert both.tokens == tree.tokens and both.accepted == tree.accepted
        assert graphed._graphs and all(g.graph is not None for g in graphed._graphs.values())
        assert all(r.graph.graph is not None for r in (steps, chain_rounds, tree_rounds))  # one capture each
    finally:
        for module in pair:
            module.to("cpu")


def test_sliding_window_targets_are_refused_by_name():
    """A rolling sliding-window cache cannot be moved back after a rejection: refused (eval's auto mode then
    falls back to the dynamic cache), not silently decoded wrong."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
    )
    with pytest.raises(EagletError, match="MistralConfig has sliding-window attention layers.*--cuda-graphs off"):
        StaticTarget(MistralForCausalLM(config).eval(), LAYERS, 64)


def test_mixture_of_experts_targets_are_not_graphed():
    """transformers routes MoE tokens with host reads (nonzero): such targets must not reach a graph capture
    (eval's auto mode falls back; preflight says so from the config); a static cache alone is fine."""
    from transformers import Qwen3MoeConfig

    from eaglet.model.support import static_cache_problem

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
    )
    assert "mixture of experts" in static_cache_problem(config, graphs=True)
    assert static_cache_problem(config, graphs=False) is None
