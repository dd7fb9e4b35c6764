"""Aux layer ids: the one place that computes them.

Convention (vLLM's, and eaglet's everywhere): aux layer id ``i`` is the hidden state *entering*
decoder layer ``i``, i.e. HF ``hidden_states[i]`` (the output of layer ``i-1``; ``0`` is the
embedding output). SGLang adds one to explicit ids, so its exporter writes ``i - 1``.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import EagletError

AUX_CONVENTION = "input_of_layer"  # recorded in every manifest that stores layer ids
NUM_AUX_LAYERS = 3
MIN_LAYERS_FOR_DEFAULT_IDS = 7


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and high features: ``(2, N // 2, N - 3)``."""
    ids = (2, num_layers // 2, num_layers - 3)
    if not ids[0] < ids[1] < ids[2]:
        raise EagletError(
            f"target has {num_layers} decoder layers; EAGLE-3's default aux layers (2, N//2, N-3) need at least "
            f"{MIN_LAYERS_FOR_DEFAULT_IDS} (pass explicit --layers for smaller models)"
        )
    return ids


def validate_aux_layer_ids(ids: list[int] | tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Check explicit ids against the target: three, strictly increasing, inside ``[1, N-1]``."""
    ids = tuple(int(i) for i in ids)
    if len(ids) != NUM_AUX_LAYERS:
        raise EagletError(f"need exactly {NUM_AUX_LAYERS} aux layer ids, got {list(ids)}")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise EagletError(f"aux layer ids must be strictly increasing, got {list(ids)}")
    if ids[0] < 1 or ids[-1] > num_layers - 1:
        raise EagletError(
            f"aux layer ids {list(ids)} out of range for a target with {num_layers} layers "
            f"(valid: 1..{num_layers - 1}, the input of a decoder layer)"
        )
    return ids


def resolve_aux_layer_ids(explicit: Sequence[int] | None, num_layers: int) -> tuple[int, ...]:
    """The ids a stage uses: ``explicit`` ones checked against the target, else the defaults."""
    return validate_aux_layer_ids(explicit, num_layers) if explicit else default_aux_layer_ids(num_layers)


def to_sglang_layer_ids(ids: tuple[int, ...]) -> tuple[int, ...]:
    """SGLang captures the output of layer ``j + 1`` for explicit id ``j``; shift so it reads ours."""
    return tuple(i - 1 for i in ids)
