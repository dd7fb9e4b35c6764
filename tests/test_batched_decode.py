"""Batched greedy chain decoding: every row's output is the target's own greedy decoding, and every row
drafts and accepts exactly what the batch-1 engine does for that prompt alone."""

from __future__ import annotations

import torch
from test_decode import tiny_pair

from eaglet.decode.baseline import target_only_decode
from eaglet.decode.batched import BatchDraft, BatchTarget, batched_speculative_decode, batched_target_only_decode
from eaglet.decode.chain import speculative_decode
from eaglet.decode.runners import DraftRunner, TargetRunner
from eaglet.model.capture import FeatureCapture
from eaglet.model.sampling import Sampling
from eaglet.train.loss import TeacherHead
from eaglet.train.ttt import TTTInputs, documents, ttt_forward

LAYERS = (2, 4, 5)
PROMPTS = [[5, 17, 33, 8, 26, 12], [3, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [7], [60, 2, 2, 60]]
NEW_TOKENS = 24
TRAIN_STEPS = 200


def trained_pair():
    """The tiny pair, with the draft fitted to the target's greedy continuations of PROMPTS: high
    acceptance, so rows accept different, non-zero numbers of tokens (the case batching must get right)."""
    target, draft = tiny_pair()
    capture = FeatureCapture(target, LAYERS)
    with torch.no_grad():
        sequences = [
            target.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS + 8, do_sample=False, pad_token_id=0)[0]
            for p in PROMPTS
        ]
    ids = torch.cat(sequences)
    offsets = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0)
    features = [capture(s[None]) for s in sequences]
    aux, last = torch.cat([a[0] for a, _ in features]), torch.cat([h[0] for _, h in features])
    teacher_logits, in_vocab = TeacherHead(target.lm_head.weight.detach(), draft.d2t)(last)
    doc_ids, positions, doc_end = documents(offsets, torch.device("cpu"))
    inputs = TTTInputs(
        input_ids=ids,
        aux=aux.clone(),
        loss_mask=torch.ones(len(ids), dtype=torch.bool),
        doc_ids=doc_ids,
        positions=positions,
        doc_end=doc_end,
        teacher_logits=teacher_logits,
        teacher_in_vocab=in_vocab,
    )
    draft.train()
    optimizer = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(TRAIN_STEPS):
        optimizer.zero_grad()
        ttt_forward(draft, inputs, 3).loss.backward()
        optimizer.step()
    return target, draft.eval()


def test_batched_rows_equal_the_batch_one_engine():
    target, draft = trained_pair()
    single_target, single_draft = TargetRunner(target, LAYERS), DraftRunner(draft)
    batch_target, batch_draft = BatchTarget(target, LAYERS), BatchDraft(draft)
    greedy = [target_only_decode(single_target, p, NEW_TOKENS, Sampling(), set()) for p in PROMPTS]
    alone = [speculative_decode(single_target, single_draft, p, NEW_TOKENS, 3, Sampling(), set()) for p in PROMPTS]
    baseline = batched_target_only_decode(batch_target, PROMPTS, NEW_TOKENS, set())
    together = batched_speculative_decode(batch_target, batch_draft, PROMPTS, NEW_TOKENS, 3, set())
    for reference, one, base, row in zip(greedy, alone, baseline, together):
        assert base.tokens == reference.tokens and row.tokens == reference.tokens  # lossless, row by row
        assert row.accepted == one.accepted  # same proposals, same acceptance as decoding the prompt alone
    accepted = [sum(r.accepted) for r in together]
    assert len(set(accepted)) >= 3 and sum(accepted) >= 10  # rows accepted different, non-zero numbers of tokens


def test_batched_rows_stop_at_their_own_stop_token():
    target, draft = tiny_pair()
    batch_target, batch_draft = BatchTarget(target, LAYERS), BatchDraft(draft)
    free = batched_target_only_decode(batch_target, PROMPTS, NEW_TOKENS, set())
    stop = free[0].tokens[5]
    stopped = batched_speculative_decode(batch_target, batch_draft, PROMPTS, NEW_TOKENS, 3, {stop})
    for row, reference in zip(stopped, free):
        cut = reference.tokens.index(stop) + 1 if stop in reference.tokens else NEW_TOKENS
        assert row.tokens == reference.tokens[:cut]
