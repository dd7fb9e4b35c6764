"""The target loaded to write text in process (`regenerate`'s answers, `synthesize`'s prompts): one load, one set of
stop tokens, one batch size rule, one cut at the first stop token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..config import CPU_GENERATE_BATCH, GPU_GENERATE_BATCH


@dataclass
class Generator:
    tokenizer: Any
    model: Any
    device: Any  # where input ids go (the first device of a split)
    batch_size: int
    stop_ids: list[int]
    pad_id: int
    writes: bool  # this rank writes (under --placement tp every rank generates, rank 0 writes)

    def until_stop(self, tokens: list[int]) -> tuple[list[int], bool]:
        return until_stop(tokens, self.stop_ids)


def until_stop(tokens: list[int], stop_ids: list[int]) -> tuple[list[int], bool]:
    """New tokens up to the first stop token, and whether one came."""
    stop_at = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
    return (tokens, False) if stop_at is None else (tokens[:stop_at], True)


def load_generator(config: Any, template_stops: Callable[[Any], set[int]]) -> Generator:
    """The target of ``config`` placed as it says. ``template_stops(tokenizer)`` checks the chat template before
    any weight loads and returns the stop tokens it adds beside the model's and tokenizer's end of sequence."""
    from ..model.distributed import init_distributed
    from ..model.placement import input_device
    from ..model.target import load_model, load_tokenizer, resolve_target

    resolved = resolve_target(config.target, config.trust_remote_code)
    tokenizer = load_tokenizer(resolved.path, config.trust_remote_code)
    stop_ids = set(template_stops(tokenizer))
    dist = init_distributed()  # --placement tp: every rank generates the same batches; rank 0 writes
    device = dist.device(config.device)
    model = load_model(resolved.path, device, config.dtype, config.trust_remote_code, config, dist.world)
    ordered = stop_token_ids(model.generation_config.eos_token_id, tokenizer, stop_ids)
    return Generator(
        tokenizer,
        model,
        input_device(model),
        config.batch_size or (GPU_GENERATE_BATCH if device.startswith("cuda") else CPU_GENERATE_BATCH),
        ordered,
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ordered[0],
        dist.is_main,
    )


def stop_token_ids(generation_eos: int | list[int] | None, tokenizer: Any, template_stops: set[int]) -> list[int]:
    """Where an answer ends: the model's generation config's end(s) of sequence, the tokenizer's, the template's."""
    stops = set(template_stops)
    stops |= set(generation_eos if isinstance(generation_eos, list) else [generation_eos] if generation_eos else [])
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    return sorted(stops)
