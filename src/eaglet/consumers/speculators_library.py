"""The speculators library as a consumer: its own model class loads eaglet's speculators export and runs it.

speculators installs with pip (it is the test extra's consumer), so nothing is read from source here: its
``Eagle3DraftModel.from_pretrained`` loads the directory, its loading report must show every tensor taken and
nothing left at its initial value, and its forward pass, fed the inputs eaglet's training-time test sees,
must give eaglet's logits at every TTT step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import packages
from ..errors import EagletError

PACKAGE = "speculators"
# the speculators model's tensors that come from the verifier, never from a draft checkpoint
VERIFIER_TENSORS = ("verifier_norm.weight", "verifier_lm_head.weight")
CONFORMANCE_TOKENS = 48  # two documents of a packed batch
CONFORMANCE_SPLIT = 29  # where the second document starts


def installed_version() -> str | None:
    return packages.installed_version(PACKAGE)


@dataclass
class SpeculatorsLoad:
    version: str
    missing: list[str] = field(default_factory=list)  # model tensors the checkpoint did not fill
    unexpected: list[str] = field(default_factory=list)  # checkpoint tensors the model has no place for
    mismatched: list[str] = field(default_factory=list)
    unset: list[str] = field(default_factory=list)  # filled tensors still holding the model's NaN init


def load(directory: Path, attention: str = "eager"):
    """(speculators' model loaded from ``directory`` in float32, what its loader reported)."""
    from safetensors import safe_open
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(str(directory))
    config.transformer_layer_config._attn_implementation = attention  # dense masks: FlexAttention needs a GPU to train
    model = Eagle3DraftModel.from_pretrained(str(directory), config=config, dtype=torch.float32)
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        stored = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    state = model.state_dict()
    report = SpeculatorsLoad(
        installed_version() or "?",
        missing=sorted(set(state) - set(stored) - set(VERIFIER_TENSORS)),
        unexpected=sorted(set(stored) - set(state)),
        mismatched=sorted(n for n in set(stored) & set(state) if stored[n] != tuple(state[n].shape)),
    )
    # speculators fills its embedding and heads with NaN so that a tensor the checkpoint does not fill shows
    report.unset = [
        name
        for name, tensor in state.items()
        if name not in VERIFIER_TENSORS and tensor.is_floating_point() and bool(torch.isnan(tensor).any())
    ]
    return model.eval(), report


@torch.no_grad()
def compare_logits(directory: Path, steps: int = 3, seed: int = 0) -> list[float]:
    """Largest |logit difference| between speculators' model and eaglet's draft, both loaded from the export,
    at each TTT step, over the positions where training counts them (a step's input token inside its document)."""
    from ..model.draft import load_draft
    from ..train.ttt import TTTAttention, documents, unroll

    speculators_model, report = load(directory)
    if report.missing or report.unexpected or report.mismatched or report.unset:
        raise EagletError(f"{directory}: speculators does not load every tensor: {report}")
    draft = load_draft(directory).eval()
    config = draft.config
    generator = torch.Generator().manual_seed(seed)
    tokens = CONFORMANCE_TOKENS
    input_ids = torch.randint(0, config.vocab_size, (tokens,), generator=generator)
    aux = torch.randn(tokens, 3, config.target_hidden_size, generator=generator)
    doc_offsets = torch.tensor([0, CONFORMANCE_SPLIT, tokens])
    doc_ids, positions, doc_end = documents(doc_offsets, torch.device("cpu"))
    head_inputs = unroll(draft, input_ids, aux, doc_ids, positions, doc_end, steps, TTTAttention)
    ours = [draft.lm_head(head_input) for head_input in head_inputs]

    theirs: list[torch.Tensor] = []
    handle = speculators_model.lm_head.register_forward_hook(lambda module, args, out: theirs.append(out[0]))
    try:  # step 0 reads the token after t (eaglet's x[t+1]); later steps shift it themselves
        speculators_model(
            hidden_states=aux.flatten(1)[None],
            input_ids=torch.cat([input_ids[1:], input_ids[:1] * 0])[None],
            document_ids=doc_ids[None],
            position_ids=positions[None],
            ttt_steps=steps,
        )
    finally:
        handle.remove()
    index = torch.arange(tokens)
    return [float((a - b)[index + 1 + k < doc_end].abs().max()) for k, (a, b) in enumerate(zip(ours, theirs))]
