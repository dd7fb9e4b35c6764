"""The draft vocabulary: the ``Vd`` target tokens seen most often in assistant (loss-masked) text.

``d2t[i] = used[i] - i`` maps draft index ``i`` to target id ``i + d2t[i]``; ``t2d`` marks the target
ids inside the draft vocabulary. These are the names and layouts vLLM and SGLang read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import DEFAULT_DRAFT_VOCAB_CAP
from ..errors import EagletError


@dataclass
class DraftVocab:
    d2t: np.ndarray  # [Vd] int64
    t2d: np.ndarray  # [V] bool
    counts: np.ndarray  # [V] int64, assistant-token frequencies
    coverage: float  # share of assistant tokens whose id is in the draft vocab

    @property
    def size(self) -> int:
        return len(self.d2t)

    def save(self, path: str | Path) -> None:
        from ..model.shards import write_safetensors

        write_safetensors(
            Path(path),
            {
                "d2t": torch.from_numpy(self.d2t),
                "t2d": torch.from_numpy(self.t2d),
                "counts": torch.from_numpy(self.counts),
            },
        )

    @classmethod
    def load(cls, path: str | Path) -> "DraftVocab":
        """The vocabulary `eaglet prepare` wrote (or ``--set draft_vocab_file``), refused in one line when it is
        missing or not one: the sizes and the mapping must agree."""
        from safetensors.torch import load_file

        path = Path(path)
        fix = "prepare again, or pass --set draft_vocab_file=PATH"
        if not path.is_file():
            raise EagletError(f"{path}: no draft vocabulary here; {fix}")
        try:
            tensors = load_file(str(path))
        except Exception as exc:  # safetensors' own error for a damaged file
            raise EagletError(f"{path}: unreadable ({str(exc).splitlines()[0]}); {fix}") from None
        if not {"d2t", "t2d", "counts"} <= set(tensors):
            raise EagletError(f"{path}: needs tensors d2t, t2d and counts, has {sorted(tensors)}; {fix}")
        d2t, t2d, counts = tensors["d2t"].numpy(), tensors["t2d"].numpy().astype(bool), tensors["counts"].numpy()
        used = np.arange(len(d2t)) + d2t
        if (
            len(t2d) != len(counts)
            or int(t2d.sum()) != len(d2t)
            or len(used)
            and (used.min() < 0 or used.max() >= len(t2d) or not t2d[used].all())
        ):
            raise EagletError(f"{path}: d2t and t2d do not describe the same {len(d2t)}-token vocabulary; {fix}")
        return cls(d2t, t2d, counts, coverage_of(counts, t2d))


def default_draft_vocab_size(target_vocab: int) -> int:
    return min(DEFAULT_DRAFT_VOCAB_CAP, target_vocab)


def coverage_of(counts: np.ndarray, t2d: np.ndarray) -> float:
    total = int(counts.sum())
    return float(counts[t2d].sum() / total) if total else 0.0


def build_draft_vocab(counts: np.ndarray, size: int) -> DraftVocab:
    """Top-``size`` ids by count; ties (and zero counts) broken by the lower id, so it is deterministic."""
    counts = np.asarray(counts, dtype=np.int64)
    size = min(size, len(counts))
    order = np.lexsort((np.arange(len(counts)), -counts))  # count desc, then id asc
    used = np.sort(order[:size])
    t2d = np.zeros(len(counts), dtype=bool)
    t2d[used] = True
    d2t = used - np.arange(size, dtype=np.int64)
    return DraftVocab(d2t=d2t, t2d=t2d, counts=counts, coverage=coverage_of(counts, t2d))
