"""The target loaded to write text in process (`regenerate`'s answers, `synthesize`'s prompts): one load, one set of
stop tokens, one batch size rule, one cut at the first stop token."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..config import CPU_GENERATE_BATCH, GPU_GENERATE_BATCH
from ..errors import EagletError
from ..fsio import GIB

SAMPLER_ROW_STEP = 8  # the static engine's rows are rounded up to this, so batches a row apart share its graphs


@dataclass
class Generator:
    tokenizer: Any
    model: Any
    device: Any  # where input ids go (the first device of a split)
    batch_size: int
    stop_ids: list[int]
    pad_id: int
    writes: bool  # this rank writes (under --placement tp every rank generates, rank 0 writes)
    engine: str = "auto"  # hf_engine: auto, static or generate
    distributed: bool = False  # the target is split over a torchrun world
    used: dict[str, str] = field(default_factory=dict)  # engine -> why it ran (the manifest's record)
    _sampler: Any = None  # the static engine's BatchSampler, reused while batches fit it

    def until_stop(self, tokens: list[int]) -> tuple[list[int], bool]:
        return until_stop(tokens, self.stop_ids)

    def sample(
        self, prompts: list[list[int]], max_new: int, temperature: float, top_p: float, seed: int
    ) -> list[list[int]]:
        """Each prompt's new tokens (greedy at temperature 0), up to ``max_new``; cut them with ``until_stop``.
        Deterministic given ``seed`` and the batch."""
        from ..model.sampling import Sampling

        sampling = Sampling(temperature, top_p)
        width = max(map(len, prompts))
        sampler, why = self._static_sampler(len(prompts), width, max_new, sampling)
        if sampler is None:
            self.used.setdefault("generate", why)
            return self._generate(prompts, max_new, sampling, seed)
        self.used.setdefault("static", why)
        from ..model.batch_sampler import folded_attention_set

        with folded_attention_set(self.model):
            return sampler.generate(prompts, max_new, seed)

    def _static_sampler(self, rows: int, width: int, max_new: int, sampling: Any) -> tuple[Any, str]:
        """The static engine's sampler for a batch of ``rows`` prompts (built or reused: a smaller batch runs in a
        larger sampler, its spare rows stopped), or None and why ``generate`` runs."""
        from ..model.batch_sampler import BatchSampler, cache_length, folded_attention_set, static_sampling_problem

        if self.engine == "generate":
            return None, "asked for (--hf-engine generate)"
        if self.engine == "auto" and not str(self.device).startswith("cuda"):
            return None, "auto on a CPU"
        reusable = self._sampler is not None and self._sampler.sampling == sampling and rows <= self._sampler.rows
        if reusable and self._sampler.fits(width, max_new):
            return self._sampler, "the target allows it"
        self._sampler = None  # its cache and graphs go before a larger one is made
        rows = -(-rows // SAMPLER_ROW_STEP) * SAMPLER_ROW_STEP  # batches of 1,854 and 1,855 share one
        max_len = cache_length(width, max_new)
        problem = "the target is split over a torchrun world" if self.distributed else None
        problem = problem or static_sampling_problem(self.model, rows, max_len)
        if problem:
            if self.engine == "static":
                raise EagletError(f"--hf-engine static: {problem}; use --hf-engine generate")
            return None, problem
        with folded_attention_set(self.model):
            self._sampler = BatchSampler(self.model, rows, max_len, max_new, sampling, self.stop_ids, self.pad_id)
        return self._sampler, "the target allows it"

    def _generate(self, prompts: list[list[int]], max_new: int, sampling: Any, seed: int) -> list[list[int]]:
        """transformers' ``generate`` over the left-padded batch."""
        import torch

        from ..model.batch_sampler import left_padded
        from ..model.target import decoding_attention

        input_ids, real = left_padded(prompts, self.pad_id)
        torch.manual_seed(seed)
        with torch.inference_mode(), decoding_attention():  # no per-key-length cuDNN plans
            output = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=real.long().to(self.device),
                max_new_tokens=max_new,
                do_sample=not sampling.greedy,
                temperature=None if sampling.greedy else sampling.temperature,
                top_p=None if sampling.greedy else sampling.top_p,
                top_k=None,
                eos_token_id=self.stop_ids,
                pad_token_id=self.pad_id,
            )
        return output[:, input_ids.shape[1] :].tolist()


def until_stop(tokens: list[int], stop_ids: list[int]) -> tuple[list[int], bool]:
    """New tokens up to the first stop token, and whether one came."""
    stop_at = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
    return (tokens, False) if stop_at is None else (tokens[:stop_at], True)


def load_generator(config: Any, template_stops: Callable[[Any], set[int]]) -> Generator:
    """The target of ``config`` placed as it says. ``template_stops(tokenizer)`` checks the chat template before
    any weight loads and returns the stop tokens it adds beside the model's and tokenizer's end of sequence."""
    from ..model.distributed import init_distributed
    from ..model.placement import input_device
    from ..model.target import generation_eos, load_model, load_tokenizer, resolve_target

    resolved = resolve_target(config.target, config.trust_remote_code)
    tokenizer = load_tokenizer(resolved.path, config.trust_remote_code)
    ordered = stop_token_ids(generation_eos(resolved.path), tokenizer, set(template_stops(tokenizer)))
    if not ordered:  # before the weights load: every answer would run to --max-new-tokens, and nothing pads
        raise EagletError(
            f"{resolved.path}: names no end-of-sequence token (generation_config.json, config.json, the tokenizer and "
            "the chat template give none): answers could not end; set eos_token_id in its generation_config.json"
        )
    dist = init_distributed()  # --placement tp: every rank generates the same batches; rank 0 writes
    device = dist.device(config.device)
    batch_size = config.batch_size or (GPU_GENERATE_BATCH if device.startswith("cuda") else CPU_GENERATE_BATCH)
    require_batch_fits(resolved.path, config, device, batch_size)
    model = load_model(resolved.path, device, config.dtype, config.trust_remote_code, config, dist.world)
    return Generator(
        tokenizer,
        model,
        input_device(model),
        batch_size,
        ordered,
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ordered[0],
        dist.is_main,
        config.hf_engine,
        dist.world > 1,
    )


def require_batch_fits(target: Path, config: Any, device: str, batch_size: int) -> None:
    """A batch whose KV cache alone passes the device's free memory is refused before the weights load (a
    --batch-size of 1e8 allocated 19 GB before failing); what preflight's memory check counts, without its margin."""
    from ..model.sizing import available_memory, generation_batch_bytes
    from ..model.target import pick_dtype, read_config

    dtype_bytes = pick_dtype(config.dtype, device).itemsize
    needed = generation_batch_bytes(read_config(target), batch_size, config.max_new_tokens, dtype_bytes)
    available, measured = available_memory(device)
    if needed > available:
        raise EagletError(
            f"--batch-size {batch_size:,}: a batch's KV cache needs ~{needed / GIB:,.1f} GiB, {available / GIB:.1f} GiB "
            f"{measured}; lower --batch-size"
        )


def stop_token_ids(generation_eos: int | list[int] | None, tokenizer: Any, template_stops: set[int]) -> list[int]:
    """Where an answer ends: the model's generation config's end(s) of sequence, the tokenizer's, the template's."""
    stops = set(template_stops)
    stops |= set(generation_eos if isinstance(generation_eos, list) else [generation_eos] if generation_eos else [])
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    return sorted(stops)
