"""The EAGLE-3 loss: the teacher's distribution over the draft vocabulary (the target's frozen LM head) and
the soft cross-entropy of the draft's logits against it, with its gradient made in the same pass."""

from __future__ import annotations

import functools

import torch

from ..model.shared_linear import SharedLinear

TEACHER_CHUNK_TOKENS = 1024  # teacher logits over the full vocab are computed this many tokens at a time


class TeacherHead:
    """The target's frozen LM head: draft-vocab logits and whether the full argmax is in the draft vocab. Where every
    batch carries the target's argmax (a store that keeps it), only the draft vocabulary's rows are kept."""

    def __init__(
        self,
        lm_head: torch.Tensor,
        d2t: torch.Tensor,
        softcap: float | None = None,
        device: torch.device | None = None,
        whole_head: bool = True,
    ):
        device = device or lm_head.device
        self.vocab_size = lm_head.shape[0]
        self.used = (torch.arange(len(d2t)) + d2t.cpu()).to(device)  # [Vd] target ids of the draft vocab
        self.draft_rows = lm_head[self.used.to(lm_head.device)].to(device)  # [Vd, H], contiguous
        self.lm_head = lm_head.to(device) if whole_head else None  # [V, H]
        self.in_vocab = torch.zeros(self.vocab_size, dtype=torch.bool, device=device)
        self.in_vocab[self.used] = True
        self.softcap = softcap

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits

    @torch.no_grad()
    def __call__(self, last: torch.Tensor, target_top: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """last [T, H], the target's stored argmax [T] (or None) -> (logits over the draft vocab [T, Vd] float32,
        in-vocab argmax [T] bool). With the argmax stored, only the draft vocabulary's rows are multiplied (a
        quarter of the head at a 128k vocabulary); without, the whole vocabulary's, a chunk at a time."""
        if target_top is not None:
            logits = self._capped(last.to(self.draft_rows.dtype) @ self.draft_rows.T)  # [T, Vd]
            return logits.float(), self.in_vocab[target_top.long()]
        if self.lm_head is None:
            raise ValueError(
                "a batch without the target's argmax, and the teacher kept only the draft vocabulary's rows"
            )
        draft_logits, in_vocab = [], []
        for chunk in last.split(TEACHER_CHUNK_TOKENS):
            logits = self._capped(chunk.to(self.lm_head.dtype) @ self.lm_head.T)  # [c, V]: one chunk alive at a time
            in_vocab.append(self.in_vocab[logits.argmax(-1)])
            draft_logits.append(logits[:, self.used].float())
        return torch.cat(draft_logits), torch.cat(in_vocab)


def _soft_cross_entropy_rows(
    logits: torch.Tensor, teacher_probs: torch.Tensor, weights: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, Vd], teacher_probs [T, Vd] (rows summing to 1, or 0 where weights are 0), weights [T], grad_out
    [T, Vd] in the logits' dtype -> (Σ_t w_t · H(p_t, softmax(z_t)), argmax z [T]), the gradient dLoss/dz written
    into ``grad_out``. H(p, softmax(z)) = logsumexp(z) - p·z, so its gradient is softmax(z) - p: made here, in one
    pass (compiled, the write into ``grad_out`` is the kernel's own store)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(z, dim=-1, keepdim=True)  # [T, 1]
    loss = (weights * (lse[:, 0] - (teacher_probs * z).sum(-1))).sum()
    grad_out.copy_((torch.exp(z - lse) - teacher_probs) * weights[:, None])
    return loss, z.argmax(-1)


class _FusedSoftCrossEntropy(torch.autograd.Function):
    """The loss and its gradient made together in the forward pass; backward only scales the gradient.
    Autograd through log-softmax keeps two [T, Vd] float32 tensors per TTT step for backward and passes over
    [T, Vd] some twenty times (memory-bound work growing with T·Vd·K); this reads the logits and the teacher
    once and writes one gradient in the logits' dtype (on GPU, compiled into a few fused kernels)."""

    @staticmethod
    def forward(ctx, logits, teacher_probs, weights, row_math):
        grad = torch.empty_like(logits)
        with torch.autocast(logits.device.type, enabled=False):  # the row math picks its own dtypes
            loss, predicted = row_math(logits, teacher_probs, weights, grad)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(predicted)
        return loss, predicted

    @staticmethod
    def backward(ctx, grad_loss, _grad_predicted):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None


@functools.cache
def _compiled_row_math():
    return torch.compile(_soft_cross_entropy_rows)


def _row_math(device: torch.device, compiled: bool | None):
    """The row math compiled on GPU by default (one compile: batches are padded to the token budget); eager on CPU,
    where compiling needs a C++ toolchain at run time."""
    compiled = device.type == "cuda" if compiled is None else compiled
    return _compiled_row_math() if compiled else _soft_cross_entropy_rows


def soft_cross_entropy(
    logits: torch.Tensor, teacher_probs: torch.Tensor, weights: torch.Tensor, compiled: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_t w_t · H(p_t, softmax(z_t)) (differentiable in the logits) and argmax z [T]."""
    return _FusedSoftCrossEntropy.apply(logits, teacher_probs, weights, _row_math(logits.device, compiled))


def head_soft_cross_entropy(
    head: SharedLinear,
    x: torch.Tensor,
    teacher_probs: torch.Tensor,
    weights: torch.Tensor,
    compiled: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``soft_cross_entropy(head(x), ...)``, x [T, H]. Where the head defers its weight gradient, the two are one
    step: the gradient in the logits goes straight into the head's buffer for its one weight-gradient matmul, and
    the TTT decay on this step's loss scales x [T, H] rather than the gradient [T, Vd] (no [T, Vd] pass in the
    backward, no concatenation at the flush)."""
    if head.deferring():
        return head.objective(x, _row_math(x.device, compiled), teacher_probs, weights)
    return soft_cross_entropy(head(x), teacher_probs, weights, compiled)
