"""Where a target's weights live while a stage runs it.

- ``one``: the whole model on one device (a GPU, or the CPU).
- ``split``: a pipeline split in one process — consecutive layers on consecutive devices, as many as each device's
  ``max_memory`` allows (transformers' ``device_map="auto"``); what no device holds is memory-mapped from
  ``offload_dir``. Hidden states hop device to device; the features are gathered on the last one.
- ``tp``: tensor parallel over the torchrun world with the architecture's own plan (transformers'
  ``DistributedConfig(tp_size=world)``). Every rank runs the same batches; rank 0 writes. Data parallelism over
  several TP groups is one torchrun job per group, each told ``replica r/R``; they share the store (shards are
  independent files, each replica takes shards ``r, r+R, ...``).

The checks here read config.json only, so preflight refuses a layout before any weight loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import EagletError
from ..formats.files import TARGET_CONFIG_FILE
from .sizing import text_config, tp_divides

MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*$", re.IGNORECASE)
MEMORY_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory(text: str, where: str = "--max-memory") -> int:
    """'60GiB', '70GB', '512MiB' -> bytes."""
    match = MEMORY.match(str(text))
    if not match:
        raise EagletError(f"{where}: {text!r} is not a memory size; write e.g. 60GiB, 70GB or 512MiB")
    return int(float(match.group(1)) * MEMORY_UNITS[match.group(2).lower()])


def device_key(name: str, where: str = "--max-memory") -> int | str:
    """A --max-memory device as accelerate names it: GPU index, 'cpu' or 'disk'."""
    name = str(name).strip().lower()
    if name in ("cpu", "disk"):
        return name
    index = name.removeprefix("cuda:").removeprefix("cuda")
    if index.isdigit():
        return int(index)
    raise EagletError(f"{where}: unknown device {name!r}; use cuda:N, cpu or disk")


@dataclass(frozen=True)
class Topology:
    """This process among those running one target: which replica it is (which shards or prompts it takes) and its
    rank inside the replica's tensor-parallel group (rank 0 of a group writes)."""

    replica: int = 0
    replicas: int = 1
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def writes(self) -> bool:
        return self.tp_rank == 0


def topology(config: Any, rank: int, world: int) -> Topology:
    """``one``/``split``: every torchrun rank is its own replica. ``tp``: the world is one TP group, the config's
    ``replicas`` (r, R; checked by the config) place it among the groups."""
    if config.placement != "tp":
        return Topology(rank, world, 0, 1)
    replica, replicas = config.replicas
    return Topology(replica, replicas, rank, world)


def causal_lm_problem(target_path: Path, trust_remote_code: bool) -> str | None:
    """Why transformers would refuse to load the target's config.json as a causal LM (the whole file: a multimodal
    wrapper's own model_type decides the class), or None: its model_type has a causal-LM class in this transformers,
    it is a wrapper whose language model transformers loads alone (``model.text_model``), or the model's own code
    provides one and is allowed."""
    import json

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from .target import wrapped_language_model_of

    target_config = json.loads((target_path / TARGET_CONFIG_FILE).read_text(encoding="utf-8"))  # read_config checked it
    model_type = str(target_config.get("model_type", "?"))
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or wrapped_language_model_of(target_path) is not None:
        return None  # transformers' class for it, or for the language model a wrapper holds (model.text_model)
    if "AutoModelForCausalLM" in (target_config.get("auto_map") or {}):
        if trust_remote_code:
            return None
        return (
            f"model_type {model_type!r}: transformers has no causal-LM class for it and its own code (auto_map) is "
            "not allowed; pass --trust-remote-code if you trust that code"
        )
    return f"model_type {model_type!r}: transformers has no causal-LM class for it (AutoModelForCausalLM refuses it)"


def tp_plan_problem(target_config: dict[str, Any], tp_size: int) -> str | None:
    """``check_tp_plan``'s refusal as a finding (None: transformers can shard it over ``tp_size`` ranks)."""
    try:
        check_tp_plan(target_config, tp_size)
    except EagletError as exc:
        return exc.message
    return None


# quantizers whose layers do not run from accelerate's disk offload: compressed-tensors' layers lose the offload hook
# at their first forward (AttributeError '_hf_hook' inside accelerate, measured with a tiny INT4 Llama split over
# --max-memory cpu=100KB with --offload-dir)
NO_DISK_OFFLOAD_QUANTIZATION = ("compressed-tensors",)


def offload_problem(target_config: dict[str, Any], config: Any) -> str | None:
    """A split whose --max-memory leaves part of a compressed-tensors target to --offload-dir fails at the first
    forward, after the store exists: refused from config.json (the weights as loaded against the memory given)."""
    from .sizing import weights_of

    method = str((text_config(target_config).get("quantization_config") or {}).get("quant_method", ""))
    if (
        getattr(config, "placement", "one") != "split"
        or not config.max_memory
        or method not in NO_DISK_OFFLOAD_QUANTIZATION
    ):
        return None
    room = sum(parse_memory(size) for size in config.max_memory.values())
    needed = weights_of(target_config).bytes
    if needed <= room:
        return None
    return (
        f"--placement split: the target holds {_binary_size(needed)} as loaded and --max-memory gives "
        f"{_binary_size(room)}; the rest would run from --offload-dir, which {method} layers do not survive (their "
        "first forward loses accelerate's offload hook): give --max-memory room for the whole target"
    )


def _binary_size(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:,.1f} {unit}"
    return f"{count} B"


# quantizers whose layers transformers cannot shard (quantizer_compressed_tensors.py: "TODO: Implement proper TP
# support for compressed tensors quantization"; a 4-bit MoE under TP over gloo crashed inside transformers)
NO_TP_QUANTIZATION = ("compressed-tensors",)


def check_tp_plan(target_config: dict[str, Any], tp_size: int) -> None:
    """The architecture has a tensor-parallel plan in this transformers, its quantization can be sharded, and every
    size it splits divides."""
    from transformers import AutoConfig

    text = text_config(target_config)
    model_type = str(text.get("model_type", "?"))
    method = str((text.get("quantization_config") or {}).get("quant_method", ""))
    if method in NO_TP_QUANTIZATION:
        raise EagletError(
            f"--placement tp: transformers cannot shard {method} weights (its quantizer has no tensor-parallel "
            "support); use --placement split"
        )
    try:
        config_class = type(AutoConfig.for_model(model_type))
    except ValueError:
        raise EagletError(
            f"target architecture {model_type!r}: transformers has no config class for it, so no "
            "tensor-parallel plan; use --placement split"
        ) from None
    if not getattr(config_class, "base_model_tp_plan", None):
        raise EagletError(
            f"target architecture {model_type!r} has no tensor-parallel plan in transformers; use "
            "--placement split (layers over the GPUs in one process)"
        )
    key = tp_divides(target_config, tp_size)
    if key is not None:
        choices = [n for n in range(2, 65) if tp_divides(target_config, n) is None][:6]
        raise EagletError(
            f"--placement tp over {tp_size} ranks: the target's {key} ({text[key]}) does not divide by "
            f"{tp_size}; run torchrun with {' or '.join(map(str, choices)) or 'another number of'} "
            "processes, or use --placement split"
        )


def load_kwargs(config: Any, world: int) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments for the placement (``one`` moves the model afterwards instead)."""
    if config.placement == "split":
        kwargs: dict[str, Any] = {"device_map": "auto"}
        if config.max_memory:
            kwargs["max_memory"] = {device_key(name): parse_memory(size) for name, size in config.max_memory.items()}
        if config.offload_dir:
            kwargs["offload_folder"] = config.offload_dir
        return kwargs
    if config.placement == "tp":
        from transformers import DistributedConfig

        if world < 2:
            raise EagletError("--placement tp needs torchrun with 2 or more processes (one per GPU of the group)")
        return {"distributed_config": DistributedConfig(tp_size=world)}
    return {}


def _runs_on(module: torch.nn.Module) -> torch.device:
    """The device a module computes on: its offload hook's execution device, else its weights' device."""
    execution = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if execution is not None:
        return torch.device(f"cuda:{execution}" if isinstance(execution, int) else execution)
    weight = next(module.parameters())
    return (weight.to_local() if hasattr(weight, "to_local") else weight).device


def input_device(model: torch.nn.Module) -> torch.device:
    """Where input ids go: the input embedding's device."""
    return _runs_on(model.get_input_embeddings())


def output_device(model: torch.nn.Module) -> torch.device:
    """Where the base model's last hidden state comes out: the device of its last module with weights (the final
    norm)."""
    base = getattr(model, "base_model", model)
    last = [module for module in base.modules() if next(module.parameters(recurse=False), None) is not None][-1]
    return _runs_on(last)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel output as a plain tensor holding all of it (plain tensors pass through)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def describe(model: torch.nn.Module) -> str:
    """Where a placed model's parts went, for the log: 'cpu: model.embed_tokens … model.layers.1; disk: …'."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return str(input_device(model))
    runs: list[tuple[str, list[str]]] = []
    for name, device in device_map.items():
        device = f"cuda:{device}" if isinstance(device, int) else str(device)
        if runs and runs[-1][0] == device:
            runs[-1][1].append(name)
        else:
            runs.append((device, [name]))
    return "; ".join(f"{device}: {names[0]}" + (f" … {names[-1]}" if len(names) > 1 else "") for device, names in runs)
