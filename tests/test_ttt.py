"""The TTT fast path equals a naive reference that runs the steps one by one with explicit masks."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from eaglet.formats.draft_config import DraftConfig
from eaglet.model.draft import Eagle3Draft
from eaglet.model.shared_linear import SharedLinear, deferred_weight_grads
from eaglet.train.loss import TeacherHead, soft_cross_entropy
from eaglet.train.ttt import (
    FLEX_MIN_HEAD_DIM,
    TTTAttention,
    TTTInputs,
    acceptance_length,
    documents,
    shift,
    ttt_forward,
)


class NaiveAttention:
    """Test-local reference written with Python loops over positions: the mask spelled out entry by entry."""

    def __init__(self, doc_ids, steps=1):
        self.doc_ids = doc_ids
        self.keys, self.values = [], []

    def __call__(self, q, k, v):
        self.keys.append(k)
        self.values.append(v)
        tokens = q.shape[1]
        groups = q.shape[0] // k.shape[0]
        keys = torch.cat(self.keys, dim=1).repeat_interleave(groups, 0)  # [Hq, T*(k+1), d]
        values = torch.cat(self.values, dim=1).repeat_interleave(groups, 0)
        allowed = torch.zeros(tokens, tokens * len(self.keys), dtype=torch.bool)
        for t in range(tokens):
            for s in range(tokens):
                allowed[t, s] = s <= t and self.doc_ids[s] == self.doc_ids[t]
            for j in range(1, len(self.keys)):
                allowed[t, j * tokens + t] = True
        scores = (q @ keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.softmax(scores, -1) @ values


# a packed batch of whole 128-token blocks (the block layout built from the documents): one-token documents, one
# ending on a block boundary, one starting on a boundary and spanning three blocks, padding at the end
BLOCK_ALIGNED_DOCS = (0, 100, 101, 102, 128, 400, 512)


def tiny_setup(seed=0, head_dim=8, draft_layers=1, doc_offsets=(0, 7, 12, 19)):
    torch.manual_seed(seed)
    vocab, draft_vocab, hidden = 50, 20, 4 * head_dim
    config = DraftConfig(
        hidden_size=hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        intermediate_size=64,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=hidden,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        num_hidden_layers=draft_layers,
    )
    draft = Eagle3Draft(config).double()
    used = torch.sort(torch.randperm(vocab)[:draft_vocab]).values
    d2t = used - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    lm_head = torch.randn(vocab, hidden, dtype=torch.float64)
    draft.init_from_target(torch.randn(vocab, hidden, dtype=torch.float64), lm_head, d2t, t2d)
    doc_offsets = torch.tensor(doc_offsets)
    tokens = int(doc_offsets[-1])
    doc_ids, positions, doc_end = documents(doc_offsets, torch.device("cpu"))
    last = torch.randn(tokens, hidden, dtype=torch.float64)
    teacher_logits, in_vocab = TeacherHead(lm_head, d2t)(last)
    inputs = TTTInputs(
        input_ids=torch.randint(0, vocab, (tokens,)),
        aux=torch.randn(tokens, 3, hidden, dtype=torch.float64),
        loss_mask=torch.rand(tokens) > 0.3,
        doc_ids=doc_ids,
        positions=positions,
        doc_end=doc_end,
        teacher_logits=teacher_logits.double(),
        teacher_in_vocab=in_vocab | (torch.rand(tokens) > 0.5),
    )
    return draft, inputs


def float_inputs(inputs, device=torch.device("cpu")):
    """tiny_setup's float64 inputs in float32 on ``device``."""
    return TTTInputs(**{k: (v.float() if v.is_floating_point() else v).to(device) for k, v in vars(inputs).items()})


def loss_and_grads(draft, inputs, attention, autocast, steps=3, deferred=False, micro_batches=1, laid_out=True):
    """TTT forward + backward: (output, {parameter name: gradient}), the draft's gradients cleared after.
    ``deferred``: the shared layers' weight gradients made once per block (``laid_out``: the LM head's gradients
    written into one buffer for the K calls, as the trainer does; else a slot per call); ``micro_batches``:
    accumulated into ``.grad`` as the trainer does."""
    for _ in range(micro_batches):
        block = deferred_weight_grads(draft, calls_per_layer=steps if laid_out else None)
        with block if deferred else contextlib.nullcontext():
            with autocast():
                out = ttt_forward(draft, inputs, steps, attention_factory=attention)
            out.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    return out, grads


def assert_close_to_bf16(compiled, compiled_grads, eager, eager_grads):
    """Fused kernels keep float32 between ops where eager rounds to bfloat16: agreement to bf16 precision."""
    assert compiled_grads.keys() == eager_grads.keys()
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=2e-3, atol=0)
    for name, grad in eager_grads.items():
        assert (compiled_grads[name] - grad).norm() <= 2e-2 * grad.norm(), name


@pytest.mark.parametrize("steps,draft_layers", [(1, 1), (3, 1), (5, 1), (3, 2)])
def test_fast_path_equals_naive_reference(steps, draft_layers):
    draft, inputs = tiny_setup(draft_layers=draft_layers)
    fast = ttt_forward(draft, inputs, steps, attention_factory=TTTAttention)
    fast.loss.backward()
    fast_grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    naive = ttt_forward(draft, inputs, steps, attention_factory=NaiveAttention)
    naive.loss.backward()
    torch.testing.assert_close(fast.loss, naive.loss, rtol=1e-10, atol=1e-10)
    for name, grad in fast_grads.items():
        torch.testing.assert_close(grad, dict(draft.named_parameters())[name].grad, rtol=1e-8, atol=1e-10, msg=name)
    assert "embed_tokens.weight" not in fast_grads  # frozen
    for a, b in zip(fast.step_counts, naive.step_counts):
        assert int(a) == int(b)


def autograd_reference(draft, inputs, steps, decay=0.8):
    """The loss written the plain way (autograd through log-softmax, the teacher shifted by copies): the
    fused soft cross-entropy must give its loss, gradients and accuracy counts."""
    attends = [TTTAttention(inputs.doc_ids, steps) for _ in range(draft.config.num_hidden_layers)]
    hidden = draft.fuse(inputs.aux)
    index = torch.arange(len(inputs.input_ids))
    total, correct = 0.0, []
    for k in range(steps):
        ids = torch.where(index + 1 + k < inputs.doc_end, shift(inputs.input_ids, 1 + k), 0)
        cos, sin = draft.rope(inputs.positions + k)
        hidden, logits = draft.step(ids, hidden, cos, sin, attends)
        teacher = shift(inputs.teacher_logits, 1 + k)
        mask = (
            (index + 2 + k < inputs.doc_end)
            & shift(inputs.loss_mask, 2 + k, False)
            & shift(inputs.teacher_in_vocab, 1 + k, False)
        )
        cross_entropy = -(torch.softmax(teacher, -1) * torch.log_softmax(logits, -1)).sum(-1)
        total = total + decay**k * (cross_entropy * mask).sum() / mask.sum().clamp_min(1)
        correct.append(int(((logits.argmax(-1) == teacher.argmax(-1)) & mask).sum()))
    return total, correct


@pytest.mark.parametrize("steps", [1, 4])
def test_fused_soft_cross_entropy_equals_autograd_through_log_softmax(steps):
    draft, inputs = tiny_setup(seed=3)
    fused = ttt_forward(draft, inputs, steps)
    fused.loss.backward()
    fused_grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    loss, correct = autograd_reference(draft, inputs, steps)
    loss.backward()
    torch.testing.assert_close(fused.loss, loss, rtol=1e-10, atol=1e-10)
    for name, grad in fused_grads.items():
        torch.testing.assert_close(grad, dict(draft.named_parameters())[name].grad, rtol=1e-8, atol=1e-10, msg=name)
    assert [int(c) for c in fused.step_correct] == correct


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_soft_cross_entropy_equals_torch_cross_entropy_with_probability_targets(dtype):
    """Against the library: F.cross_entropy with probability targets, weighted rows, zero-weight rows whose
    teacher rows are zeros (past a batch's end); loss and gradient, in the logits' dtype."""
    torch.manual_seed(0)
    logits = (torch.randn(12, 40, dtype=torch.float64) * 3).to(dtype).requires_grad_()
    probs = torch.softmax(torch.randn(12, 40, dtype=torch.float64) * 2, -1)
    probs[-3:] = 0
    weights = torch.rand(12, dtype=torch.float64)
    weights[-3:] = 0
    loss, predicted = soft_cross_entropy(logits, probs, weights)
    (loss * 0.7).backward()
    expected_logits = logits.detach().double().requires_grad_()
    expected = (F.cross_entropy(expected_logits, probs, reduction="none") * weights).sum()
    (expected * 0.7).backward()
    tolerance = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(loss.double(), expected, **tolerance)
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.double(), expected_logits.grad, **tolerance)
    assert torch.equal(predicted, logits.detach().argmax(-1))


def test_the_compiled_loss_is_one_graph_for_every_step():
    """What GPUs run, compiled here on the CPU: each TTT step reads the teacher through a view at another
    offset of one padded buffer; all K steps (and a second batch) share one compiled graph, equal to eager."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    tokens, vocab, steps = 24, 41, 4  # an odd vocabulary: the views start at unaligned offsets
    probs = torch.zeros(tokens + steps, vocab)
    probs[:tokens] = torch.softmax(torch.randn(tokens, vocab), -1)
    weights = torch.rand(tokens)
    torch._dynamo.reset()
    counters.clear()
    for batch in range(2):
        for k in range(steps):
            logits = torch.randn(tokens, vocab, requires_grad=True)
            view = probs[1 + k : 1 + k + tokens]
            compiled, predicted = soft_cross_entropy(logits, view, weights, compiled=True)
            compiled.backward()
            eager_logits = logits.detach().clone().requires_grad_()
            eager, _ = soft_cross_entropy(eager_logits, view, weights, compiled=False)
            eager.backward()
            torch.testing.assert_close(compiled, eager)
            torch.testing.assert_close(logits.grad, eager_logits.grad)
            assert torch.equal(predicted, logits.detach().argmax(-1))
    assert counters["stats"]["unique_graphs"] == 1


def test_the_compiled_loss_writes_each_steps_gradient_into_the_heads_buffer_in_one_graph():
    """Training's deferred path, compiled here on the CPU: each step's loss writes its logits' gradient into its rows
    of the LM head's buffer (slots at unaligned offsets: an odd vocabulary), one compiled graph for every step; the
    head's and its inputs' gradients equal autograd's through the plain head and loss."""
    from torch._dynamo.utils import counters

    from eaglet.train.loss import head_soft_cross_entropy

    torch.manual_seed(0)
    tokens, hidden, vocab, steps = 24, 16, 41, 4
    probs = torch.softmax(torch.randn(tokens + steps, vocab), -1)  # step k reads rows 1+k..: views at odd offsets
    weights = torch.rand(tokens)
    head = SharedLinear(hidden, vocab)
    inputs = [torch.randn(tokens, hidden, requires_grad=True) for _ in range(steps)]
    torch._dynamo.reset()
    counters.clear()
    with deferred_weight_grads(head, calls_per_layer=steps):
        total = 0
        for k, x in enumerate(inputs):
            loss, predicted = head_soft_cross_entropy(head, x, probs[1 + k : 1 + k + tokens], weights, compiled=True)
            assert torch.equal(predicted, (x @ head.weight.T).argmax(-1))
            total = total + 0.8**k * loss
        total.backward()
    assert counters["stats"]["unique_graphs"] == 1
    deferred = [head.weight.grad.clone()] + [x.grad.clone() for x in inputs]
    head.weight.grad = None
    plain_inputs = [x.detach().clone().requires_grad_() for x in inputs]
    total = 0
    for k, x in enumerate(plain_inputs):
        logits = x @ head.weight.T
        cross_entropy = -(probs[1 + k : 1 + k + tokens] * torch.log_softmax(logits, -1)).sum(-1)
        total = total + 0.8**k * (weights * cross_entropy).sum()
    total.backward()
    for got, expected in zip(deferred, [head.weight.grad] + [x.grad for x in plain_inputs]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_deferred_head_refuses_more_calls_than_its_buffer_was_laid_out_for():
    """A block told K calls whose head is called K + 1 times (or with another row count) stops, instead of writing a
    call's gradient over another's."""
    from eaglet.train.loss import head_soft_cross_entropy

    head = SharedLinear(8, 5)
    probs, weights = torch.full((6, 5), 0.2), torch.ones(6)
    with pytest.raises(RuntimeError, match="does not fit the buffer laid out for 2 calls of 6 rows"):
        with deferred_weight_grads(head, calls_per_layer=2):
            for rows in (6, 6, 6):
                head_soft_cross_entropy(head, torch.randn(rows, 8, requires_grad=True), probs, weights)
    with pytest.raises(RuntimeError, match="laid out for 2 calls of 6 rows"):
        with deferred_weight_grads(head, calls_per_layer=2):
            for rows in (6, 4):
                head_soft_cross_entropy(head, torch.randn(rows, 8, requires_grad=True), probs[:rows], weights[:rows])
    assert head.weight.grad is None


def test_library_reference_attention_equals_the_loop_reference():
    from eaglet.train.ttt import ReferenceAttention

    draft, inputs = tiny_setup()
    a = ttt_forward(draft, inputs, 4, attention_factory=ReferenceAttention)
    b = ttt_forward(draft, inputs, 4, attention_factory=NaiveAttention)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-10, atol=1e-10)


def test_masks_respect_documents_and_shift():
    """Step k counts position t only if t+2+k is inside t's document, an assistant token, with an in-vocab teacher."""
    draft, inputs = tiny_setup()
    inputs.loss_mask[:] = True
    inputs.teacher_in_vocab[:] = True
    out = ttt_forward(draft, inputs, 3)
    lengths = [7, 5, 7]
    for k, count in enumerate(out.step_counts):
        assert int(count) == sum(max(0, length - 2 - k) for length in lengths)


def test_documents_helper():
    doc_ids, positions, doc_end = documents(torch.tensor([0, 3, 5]), torch.device("cpu"))
    assert doc_ids.tolist() == [0, 0, 0, 1, 1] and positions.tolist() == [0, 1, 2, 0, 1]
    assert doc_end.tolist() == [3, 3, 3, 5, 5]


def test_acceptance_length_counts_the_targets_own_token_as_vllm_does():
    assert acceptance_length([1.0, 1.0, 1.0]) == 4.0  # 3 accepted + the bonus token, every round
    assert acceptance_length([0.5, 0.5]) == pytest.approx(1.75)
    assert acceptance_length([0.0, 1.0]) == 1.0  # nothing past a rejection is accepted
    assert acceptance_length([]) == 1.0


@pytest.mark.parametrize("doc_offsets", [(0, 7, 12, 19), BLOCK_ALIGNED_DOCS])
def test_flex_attention_mask_matches_dense_forward(doc_offsets):
    """FlexAttention's block mask (the GPU path) gives the dense path's outputs; forward only on CPU. A batch of
    whole 128-token blocks gets its block mask built from the documents, any other from create_block_mask."""
    from eaglet.train.ttt import FlexTTTAttention

    draft, inputs = tiny_setup(doc_offsets=doc_offsets)
    draft = draft.float()
    inputs.aux = inputs.aux.float()
    inputs.teacher_logits = inputs.teacher_logits.float()
    with torch.no_grad():
        dense = ttt_forward(draft, inputs, 3, attention_factory=TTTAttention)
        flex = ttt_forward(draft, inputs, 3, attention_factory=FlexTTTAttention)
    torch.testing.assert_close(flex.loss, dense.loss, rtol=1e-4, atol=1e-4)
    for flex_loss, dense_loss in zip(flex.step_losses, dense.step_losses):
        torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("key_steps", ["all", "filled"])
def test_block_mask_from_documents_equals_create_block_mask(key_steps):
    """The block layout built from the document structure lists exactly the blocks (full and partial) that
    torch's create_block_mask finds by evaluating the mask at every point, for every step."""
    from torch.nn.attention.flex_attention import create_block_mask

    from eaglet.train.ttt import FlexTTTAttention, ttt_block_mask

    steps = 4
    doc_ids, _, _ = documents(torch.tensor(BLOCK_ALIGNED_DOCS), torch.device("cpu"))
    attention = FlexTTTAttention(doc_ids, steps)

    def listed(counts, indices, width):
        dense = torch.zeros(counts.shape[-1], width, dtype=torch.bool)
        for row, (count, row_indices) in enumerate(zip(counts[0, 0], indices[0, 0])):
            dense[row, row_indices[: int(count)].long()] = True
        return dense

    tokens = len(doc_ids)
    for filled in range(1, steps + 1):
        width = steps if key_steps == "all" else filled
        allowed = attention.mask_mod(filled)
        ours = ttt_block_mask(doc_ids, filled, width, allowed)
        theirs = create_block_mask(allowed, None, None, tokens, tokens * width, device="cpu")
        blocks = tokens * width // 128
        for counts, indices in [("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")]:
            torch.testing.assert_close(
                listed(getattr(ours, counts), getattr(ours, indices), blocks),
                listed(getattr(theirs, counts), getattr(theirs, indices), blocks),
            )
        torch.testing.assert_close(ours.to_dense(), theirs.to_dense())


@pytest.mark.parametrize("kernels,compiles", [("one", 1), ("per_step", 5)])
@pytest.mark.parametrize("doc_offsets", [(0, 7, 12, 19), BLOCK_ALIGNED_DOCS])
def test_flex_attention_kernel_count(kernels, compiles, doc_offsets):
    """Each compiled FlexAttention kernel costs ~30 s on an H200: "one" shares a kernel across all K steps
    (same key-buffer shape, the step limit read from a tensor), "per_step" compiles one per key length; both
    equal the dense path. Compiled here on the CPU (forward only: inductor's CPU FlexAttention has no backward)."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    from eaglet.train.ttt import ATTENTION_KERNELS

    compiled = torch.compile(flex_attention, dynamic=False)

    class CompiledOnCpu(ATTENTION_KERNELS[kernels]):
        @classmethod
        def _kernel(cls, device):
            return compiled

    draft, inputs = tiny_setup(doc_offsets=doc_offsets)
    draft = draft.float()
    inputs.aux = inputs.aux.float()
    inputs.teacher_logits = inputs.teacher_logits.float()
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        dense = ttt_forward(draft, inputs, 5, attention_factory=TTTAttention)
        flex = ttt_forward(draft, inputs, 5, attention_factory=CompiledOnCpu)
    assert counters["stats"]["unique_graphs"] == compiles
    torch.testing.assert_close(flex.loss, dense.loss, rtol=1e-4, atol=1e-4)
    for flex_loss, dense_loss in zip(flex.step_losses, dense.step_losses):
        torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("steps", [1, 2, 5])
@pytest.mark.parametrize("doc_offsets", [(0, 7, 12, 19), BLOCK_ALIGNED_DOCS])
def test_split_attention_merges_to_the_dense_attention(steps, doc_offsets):
    """The split layout (step-0 keys in one attention, each earlier step's own-position key merged in through the
    log-sum-exps) gives the dense path's loss and every gradient: its merge under autograd on the CPU, the step-0
    part a dense softmax there (FlexAttention has no CPU backward; the GPU test runs FlexAttention's)."""
    from eaglet.train.ttt import SplitFlexTTTAttention

    draft, inputs = tiny_setup(doc_offsets=doc_offsets)
    draft, inputs = draft.float(), float_inputs(inputs)
    results = {}
    for name, attention in [("dense", TTTAttention), ("split", SplitFlexTTTAttention)]:
        draft.zero_grad()
        out = ttt_forward(draft, inputs, steps, attention_factory=attention)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
        results[name] = out, grads
    (split, split_grads), (dense, dense_grads) = results["split"], results["dense"]
    torch.testing.assert_close(split.loss, dense.loss, rtol=1e-5, atol=1e-6)
    assert split_grads.keys() == dense_grads.keys()
    for name, grad in dense_grads.items():
        torch.testing.assert_close(split_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_merge_diagonal_is_the_softmax_over_the_union():
    """merge_diagonal on its own: an attention over some keys, widened by one key per query (fewer visible than
    slots), equals one softmax over all of them; the hidden slots change nothing, however large their scores."""
    from eaglet.train.ttt import merge_diagonal

    torch.manual_seed(0)
    kv_heads, groups, tokens, slots, head_dim = 2, 3, 5, 4, 8
    q = torch.randn(kv_heads * groups, tokens, head_dim)
    prefix_keys, prefix_values = torch.randn(2, kv_heads, 6, head_dim)
    keys, values = torch.randn(2, kv_heads, tokens, slots, head_dim)
    keys[:, :, 2:] = 50.0  # hidden slots with huge scores
    scale = head_dim**-0.5
    expand = lambda x: x.repeat_interleave(groups, 0)  # noqa: E731
    prefix_scores = q @ expand(prefix_keys).transpose(-1, -2) * scale  # [Hq, T, 6]
    prefix = torch.softmax(prefix_scores, -1) @ expand(prefix_values)
    slot_keys, slot_values = list(keys.unbind(2)), list(values.unbind(2))  # S tensors [Hkv, T, d]
    merged = merge_diagonal(prefix, torch.logsumexp(prefix_scores, -1), q, slot_keys, slot_values, torch.tensor(2))
    own = (q[:, :, None] * expand(keys[:, :, :2])).sum(-1) * scale  # [Hq, T, 2]
    weights = torch.softmax(torch.cat([prefix_scores, own], -1), -1)
    expected = weights[..., :6] @ expand(prefix_values) + (weights[..., 6:, None] * expand(values[:, :, :2])).sum(-2)
    torch.testing.assert_close(merged, expected)


def test_small_heads_use_the_dense_path_on_gpu():
    """FlexAttention's GPU kernels refuse heads under 16 dims: such drafts must still train there."""
    from eaglet.train.ttt import FlexTTTAttention, SplitFlexTTTAttention, attention_for

    assert attention_for(torch.device("cuda"), FLEX_MIN_HEAD_DIM) is SplitFlexTTTAttention
    assert attention_for(torch.device("cuda"), FLEX_MIN_HEAD_DIM, "one") is FlexTTTAttention
    assert attention_for(torch.device("cuda"), FLEX_MIN_HEAD_DIM, "per_step") is not FlexTTTAttention
    assert attention_for(torch.device("cuda"), 8) is TTTAttention
    assert attention_for(torch.device("cpu"), 128) is TTTAttention


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention backward needs a GPU")
@pytest.mark.parametrize("kernels", ["one", "per_step", "split"])
@pytest.mark.parametrize("doc_offsets", [(0, 7, 12, 19), BLOCK_ALIGNED_DOCS])
def test_flex_attention_gradients_match_on_gpu(kernels, doc_offsets):
    from eaglet.train.ttt import ATTENTION_KERNELS

    draft, inputs = tiny_setup(head_dim=FLEX_MIN_HEAD_DIM, doc_offsets=doc_offsets)
    device = torch.device("cuda")
    draft, moved = draft.float().to(device), float_inputs(inputs, device)
    dense = ttt_forward(draft, moved, 3, attention_factory=TTTAttention)
    dense.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    flex = ttt_forward(draft, moved, 3, attention_factory=ATTENTION_KERNELS[kernels])
    flex.loss.backward()
    torch.testing.assert_close(flex.loss, dense.loss, rtol=1e-4, atol=1e-4)
    for name, grad in grads.items():
        torch.testing.assert_close(dict(draft.named_parameters())[name].grad, grad, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("bf16", [False, True])
def test_compiled_pointwise_equals_eager(bf16):
    """What training runs on GPU, compiled here on the CPU: the draft's norms, RoPE, SwiGLU and residuals through
    torch.compile give eager's loss and gradients (under bf16 autocast too: the pieces cast their own outputs), and
    every TTT step and layer reuses one graph per piece."""
    from contextlib import nullcontext

    from torch._dynamo.utils import counters

    draft, inputs = tiny_setup(draft_layers=2)
    draft, inputs = draft.float(), float_inputs(inputs)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else nullcontext
    eager, eager_grads = loss_and_grads(draft, inputs, TTTAttention, autocast)
    torch._dynamo.reset()
    counters.clear()
    draft.compile_pointwise()
    compiled, compiled_grads = loss_and_grads(draft, inputs, TTTAttention, autocast)
    if bf16:
        assert_close_to_bf16(compiled, compiled_grads, eager, eager_grads)
    else:  # fused kernels reorder float sums
        assert compiled_grads.keys() == eager_grads.keys()
        torch.testing.assert_close(compiled.loss, eager.loss, rtol=1e-5, atol=0)
        for name, grad in eager_grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    assert counters["stats"]["unique_graphs"] == 5  # input_mix, rope_pair, residual_norm, swiglu, norm


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention backward needs a GPU")
def test_compiled_pointwise_with_flex_attention_on_gpu():
    """Training's GPU step as it runs (inductor kernels, FlexAttention, bf16 autocast) against eager pieces."""
    from eaglet.train.ttt import FlexTTTAttention

    draft, inputs = tiny_setup(head_dim=FLEX_MIN_HEAD_DIM, doc_offsets=BLOCK_ALIGNED_DOCS)
    device = torch.device("cuda")
    draft, moved = draft.float().to(device), float_inputs(inputs, device)
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    eager, eager_grads = loss_and_grads(draft, moved, FlexTTTAttention, autocast)
    draft.compile_pointwise()
    assert_close_to_bf16(*loss_and_grads(draft, moved, FlexTTTAttention, autocast), eager, eager_grads)


def test_attention_recomputed_in_the_backward_gives_the_kept_gradients(monkeypatch):
    """Above ATTENTION_KEEP_BYTES the dense path recomputes its weights in the backward (memory); the loss and every
    gradient are the ones of keeping them."""
    import contextlib

    import eaglet.train.ttt as ttt

    draft, inputs = tiny_setup()
    kept_out, kept = loss_and_grads(draft, inputs, TTTAttention, contextlib.nullcontext)
    monkeypatch.setattr(ttt, "ATTENTION_KEEP_BYTES", 0)  # every step recomputed
    again_out, again = loss_and_grads(draft, inputs, TTTAttention, contextlib.nullcontext)
    assert torch.equal(again_out.loss, kept_out.loss) and set(again) == set(kept)
    for name in kept:
        torch.testing.assert_close(again[name], kept[name], rtol=0, atol=0)


@pytest.mark.parametrize("laid_out", [True, False])
@pytest.mark.parametrize("steps,draft_layers", [(1, 1), (4, 1), (3, 2)])
def test_deferred_weight_gradients_equal_autograds(steps, draft_layers, laid_out):
    """One matmul over the K calls' rows gives every parameter the gradient autograd gives it call by call (the LM
    head's gradients written by the loss into one buffer, or a slot per call; the TTT decay moved onto its inputs)."""
    draft, inputs = tiny_setup(draft_layers=draft_layers)
    plain, plain_grads = loss_and_grads(draft, inputs, TTTAttention, contextlib.nullcontext, steps)
    deferred, deferred_grads = loss_and_grads(
        draft, inputs, TTTAttention, contextlib.nullcontext, steps, deferred=True, laid_out=laid_out
    )
    assert deferred_grads.keys() == plain_grads.keys()
    assert "lm_head.weight" in deferred_grads and "midlayer.mlp.down_proj.weight" in deferred_grads
    torch.testing.assert_close(deferred.loss, plain.loss, rtol=1e-12, atol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(deferred_grads[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_deferred_weight_gradients_flushed_in_parts_past_the_memory_bound(monkeypatch):
    """A layer whose kept output gradients pass the bound adds them in several matmuls: the same gradient."""
    import eaglet.model.shared_linear as shared_linear

    draft, inputs = tiny_setup()
    plain, plain_grads = loss_and_grads(draft, inputs, TTTAttention, contextlib.nullcontext, 4)
    monkeypatch.setattr(shared_linear, "KEPT_GRAD_BYTES", 19 * 20 * 8)  # two calls' LM-head gradients pass it
    _, deferred_grads = loss_and_grads(draft, inputs, TTTAttention, contextlib.nullcontext, 4, deferred=True)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(deferred_grads[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_deferred_weight_gradients_accumulate_over_micro_batches_and_under_bf16_autocast():
    draft, inputs = tiny_setup()
    draft.float()
    inputs = float_inputs(inputs)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    _, once = loss_and_grads(draft, inputs, TTTAttention, autocast, deferred=True)
    _, twice = loss_and_grads(draft, inputs, TTTAttention, autocast, deferred=True, micro_batches=2)
    for name, grad in once.items():
        torch.testing.assert_close(twice[name], 2 * grad, rtol=1e-6, atol=1e-8, msg=name)
    plain, plain_grads = loss_and_grads(draft, inputs, TTTAttention, autocast)
    for name, grad in plain_grads.items():  # bf16 matmuls either way; one rounding of the sum vs one per call
        assert (once[name] - grad).norm() <= 2e-2 * grad.norm(), name
        assert once[name].dtype == torch.float32


def test_deferred_block_left_by_an_error_adds_nothing_and_plain_calls_follow():
    draft, inputs = tiny_setup()
    with pytest.raises(RuntimeError, match="stopped"):
        with deferred_weight_grads(draft):
            ttt_forward(draft, inputs, 2, attention_factory=TTTAttention).loss.backward()
            raise RuntimeError("stopped")
    shared = [m.weight for m in draft.modules() if isinstance(m, SharedLinear)]
    assert len(shared) == 8 and all(weight.grad is None for weight in shared)
    draft.zero_grad()
    with torch.no_grad():  # outside a block (and without autograd) the layers are plain linear layers
        ttt_forward(draft, inputs, 2, attention_factory=TTTAttention)
    _, grads = loss_and_grads(draft, inputs, TTTAttention, contextlib.nullcontext, 2)
    assert grads["lm_head.weight"].abs().sum() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention backward needs a GPU")
def test_deferred_weight_gradients_on_gpu_with_flex_attention_and_compiled_pointwise():
    """Training's GPU path (FlexAttention, compiled pointwise pieces, bf16 autocast): the deferred weight gradients
    are autograd's to bf16 precision."""
    from eaglet.train.ttt import FlexTTTAttention

    draft, inputs = tiny_setup(head_dim=FLEX_MIN_HEAD_DIM, draft_layers=2)
    device = torch.device("cuda")
    draft, moved = draft.float().to(device), float_inputs(inputs, device)
    draft.compile_pointwise()
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    plain, plain_grads = loss_and_grads(draft, moved, FlexTTTAttention, autocast)
    deferred, deferred_grads = loss_and_grads(draft, moved, FlexTTTAttention, autocast, deferred=True)
    assert_close_to_bf16(deferred, deferred_grads, plain, plain_grads)


@pytest.mark.parametrize(
    "strategy,world,device,tokens,deferred",
    [
        ("ddp", 1, "cuda", 2048, True),
        ("ddp", 1, "cuda", 16384, False),
        ("ddp", 1, "cpu", 2048, False),
        ("ddp", 2, "cuda", 2048, False),
        ("fsdp2", 2, "cuda", 2048, False),
    ],
)
def test_the_trainer_defers_weight_gradients_only_in_one_process_on_a_gpu(strategy, world, device, tokens, deferred):
    """DDP and FSDP2 reduce from autograd's per-weight hooks (a deferred gradient would never be reduced); on the CPU
    deferring measured 4-5% slower, and on the H200 at the demo's 16,384 tokens 4.5-4.8 ms a step slower (RESULTS)."""
    from eaglet.model.distributed import Dist
    from eaglet.train.parallel import Parallel

    draft, _ = tiny_setup()
    parallel = Parallel(strategy, Dist(rank=0, world=world, local_rank=0), torch.device(device))
    with parallel.weight_grads(draft, tokens, ttt_steps=3):
        assert (draft.lm_head.calls is not None) == deferred
    assert draft.lm_head.calls is None
