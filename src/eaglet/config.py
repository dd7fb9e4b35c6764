"""Typed configuration per stage: YAML file + CLI options + dotted ``--set`` overrides.

Precedence, lowest to highest: field defaults < the stage's section of the YAML file < options
given on the command line < ``--set key=value``. Unknown keys anywhere are errors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args, get_origin

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import EagletError, shown
from .export import FORMAT_NAMES
from .formats.store_manifest import STORAGE_FORMATS

DEFAULT_DRAFT_VOCAB_CAP = 32000
GPU_BATCH_TOKENS, CPU_BATCH_TOKENS = 32768, 4096  # extract's tokens per forward when batch_tokens is 0
GPU_GENERATE_BATCH, CPU_GENERATE_BATCH = 64, 8  # regenerate's prompts per batch when batch_size is 0

# Upper bounds of float settings: past them a value is a typo (or an attack), never a setting that trains.
MAX_LR = 1.0
MAX_WEIGHT_DECAY = 10.0
MAX_CLIP = 1e6
MAX_EPOCHS = 1e6
MAX_MINUTES = 1e7
MAX_FEATURE_NOISE = 100.0  # in feature units (the target's hidden states)
MAX_TEMPERATURE = 100.0
MAX_SHARD_MB = 1e6  # a terabyte
MAX_GB = 1e6
SECONDS_PER_DAY = 86400.0
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]  # an Adam moment's decay
MAX_SEED = 2**32 - 1  # numpy's legacy seeds and torch's manual_seed (an int64) both take it
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]

# The vocabularies of the settings, each defined once: the store's storage formats (formats.store), the export
# formats (eaglet.export's registry), where the target's weights go (eaglet.model.placement), compute dtypes.
PLACEMENTS = ("one", "split", "tp")
Placement = Literal[PLACEMENTS]  # type: ignore[valid-type]
StorageDtype = Literal[tuple(STORAGE_FORMATS)]  # type: ignore[valid-type]
ExportFormat = Literal[FORMAT_NAMES]  # type: ignore[valid-type]
ComputeDtype = Literal["auto", "float32", "bfloat16", "float16"]
Split = Literal["all", "train", "heldout"]  # rows whose `split` field matches
OnBadRow = Literal["error", "skip"]
# hf: transformers in this process (eaglet.extract); vllm: eaglet.model.vllm_engine
ExtractBackend = Literal["hf", "vllm"]
EvalBackend = Literal["hf", "vllm"]  # hf: eaglet.decode's own engines; vllm: eaglet.decode.vllm_serving
# vLLM's KV cache dtypes eaglet offers (vLLM's CacheDType; fp8 is e4m3 on NVIDIA GPUs); the extract route stores the
# captured hidden states in its cache layer and takes only the unquantized ones (vllm extract_hidden_states.py)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
KvCacheDtype = Literal[KV_CACHE_DTYPES]  # type: ignore[valid-type]
EXTRACT_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
MAX_VLLM_SEQUENCES = 1 << 20  # past it a typo: vLLM preallocates per sequence
DEFAULT_VLLM_MEMORY_SHARE = 0.85  # of the GPU vLLM takes for weights + KV cache (the norm and encode need the rest)
TARGET_HELP = "'embedded' (SmolLM2-135M-Instruct), an HF model directory, a .gguf file or a hub id"
RECORDED_TARGET_HELP = "the target (default: the one its input records)"
TRUST_HELP = "allow the model's own Python code (off unless asked)"


def _each_once(files: list[str]) -> list[str]:
    """A file list naming no file twice (by its absolute path): its rows would be read twice (prepare and regenerate
    refuse them then as duplicate ids "first at" their own line; eval would decode and count its prompts twice)."""
    seen: dict[str, str] = {}
    for name in files:
        key = os.path.normpath(os.path.abspath(os.path.expanduser(name)))
        if key in seen:
            raise ValueError(f"{name} is given twice" + (f" (also as {seen[key]})" if seen[key] != name else ""))
        seen[key] = name
    return files


FileList = Annotated[list[str], AfterValidator(_each_once)]  # files whose rows are read together


class StrictModel(BaseModel):
    """Unknown keys are errors; assignments are validated; every float is finite (inf and nan are refused); no text
    value is empty (an unset shell variable in `--out $STORE` gave "", which is the current directory)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _no_blank_text(cls, value: Any) -> Any:
        values = value if isinstance(value, list) else [value]
        if any(isinstance(item, str) and not item.strip() for item in values):
            raise ValueError("empty (an unset shell variable?); give a value")
        return value


class PlacementFields(StrictModel):
    """Where the target's weights go, for every stage that runs it (see ``eaglet.model.placement``)."""

    placement: Placement = Field(
        default="one",
        description="one device; split: layers spread over devices by --max-memory (one process); "
        "tp: tensor parallel over the torchrun world (transformers' plan for the architecture)",
    )
    max_memory: dict[str, str] = Field(
        default_factory=dict,
        description="split: memory each device may hold, e.g. cuda:0=60GiB,cuda:1=60GiB,"
        "cpu=200GiB (default: all GPUs, then CPU)",
    )
    offload_dir: str | None = Field(
        default=None, description="split: where weights past --max-memory are memory-mapped from disk"
    )
    # the option that sets how much one target forward holds ({} the value, multiples of the step), named when a
    # layout does not fit; None where the stage has no such option
    FORWARD_OPTION: ClassVar[tuple[str, int] | None] = None


class GenerationFields(StrictModel):
    """How an in-process transformers target writes text (``regenerate --backend hf``, ``synthesize``)."""

    hf_engine: Literal["auto", "static", "generate"] = Field(
        default="auto",
        description="hf: static (a preallocated KV cache, each new token one CUDA graph on a GPU), generate "
        "(transformers' generate), auto: static on a GPU where the target allows it, else generate",
    )


class VllmFields(StrictModel):
    """How vLLM holds the target, for every stage with a vllm backend (``model.vllm_engine.EngineHold``)."""

    tensor_parallel_size: int = Field(default=1, ge=1, description="vllm: GPUs vLLM splits the target over")
    gpu_memory_utilization: float = Field(
        default=DEFAULT_VLLM_MEMORY_SHARE, gt=0, lt=1, description="vllm: share of each GPU vLLM may take"
    )
    enable_expert_parallel: bool = Field(
        default=False,
        description="vllm: a MoE target's experts spread whole over the tensor-parallel GPUs instead of each split",
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, le=MAX_VLLM_SEQUENCES, description="vllm: sequences vLLM runs at once (default: vLLM's)"
    )
    kv_cache_dtype: KvCacheDtype = Field(
        default="auto",
        description="vllm: the KV cache's dtype (fp8: half the cache; generation only: the extract route keeps "
        "hidden states in it and takes auto, bfloat16 or float16)",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        description="vllm: tokens a request may hold, prompt and answer (default: the target's own context, whose KV "
        "cache vLLM must hold at start; extraction sets it to the longest sample)",
    )
    language_model_only: bool = Field(
        default=True,
        description="vllm: a multimodal target (Kimi-K2.5's wrapper) opened for text: its vision tower is not built, "
        "its tokenizer is loaded for vLLM's input processor",
    )

    @model_validator(mode="after")
    def _vllm_places_itself(self) -> "VllmFields":
        backend, placement = getattr(self, "backend"), getattr(self, "placement")
        if backend == "vllm" and placement != "one":
            raise ValueError(
                f"--placement {placement} is the hf backend's; vLLM places the target itself "
                "(use --tensor-parallel-size)"
            )
        if backend != "vllm" and self.tensor_parallel_size != 1:
            raise ValueError("--tensor-parallel-size is the vllm backend's; the hf backend uses --placement tp")
        vllm_only = {
            "--enable-expert-parallel": self.enable_expert_parallel,
            "--max-num-seqs": self.max_num_seqs is not None,
            "--kv-cache-dtype": self.kv_cache_dtype != "auto",
            "--max-model-len": self.max_model_len is not None,
        }
        given = next((option for option, set_ in vllm_only.items() if set_), None)
        if backend != "vllm" and given:
            raise ValueError(f"{given} is the vllm backend's; --backend {backend} does not start vLLM")
        if backend != "hf" and getattr(self, "hf_engine", "auto") != "auto":
            raise ValueError(f"--hf-engine is the hf backend's; --backend {backend} generates its own way")
        return self


class PrepareConfig(StrictModel):
    inputs: FileList = Field(min_length=1, description="conversation files (.jsonl, .json, .parquet)")
    out: str = Field(description="output directory (written atomically)")
    target: str = Field(default="embedded", description=TARGET_HELP)
    chat_template: str | None = Field(default=None, description="a .jinja file replacing the target's template")
    max_len: int = Field(default=2048, ge=8, description="tokens per sample; longer samples are truncated")
    draft_vocab: int | None = Field(default=None, ge=1, description="draft vocabulary size (default: min(32000, V))")
    split: Split = Field(
        default="train",
        description="rows whose `split` field matches (none: train); held-out rows are what eval scores, so they "
        "are left out of training unless asked",
    )
    on_bad_row: OnBadRow = Field(default="error", description="skip: skipped rows are listed in the manifest")
    overwrite: bool = Field(default=False, description="replace an existing --out")
    trust_remote_code: bool = Field(default=False, description=TRUST_HELP)


class RegenerateConfig(GenerationFields, VllmFields, PlacementFields):
    FORWARD_OPTION: ClassVar[tuple[str, int] | None] = ("--batch-size {}", 1)

    prompts: FileList = Field(
        min_length=1,
        description="prompt or conversation files; 'demo' = the shipped demo prompts, 'mt-bench' = MT-Bench's 80 questions",
    )
    out: str = Field(description="output .jsonl (resumable)")
    target: str = Field(default="embedded", description=TARGET_HELP)
    backend: Literal["hf", "vllm", "openai"] = Field(
        default="hf",
        description="hf: transformers in process; vllm: vLLM in process (continuous batching, native quantized "
        "weights, --tensor-parallel-size); openai: an OpenAI-compatible server",
    )
    max_new_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=MAX_TEMPERATURE, description="0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, description="answers per prompt")
    seed: Seed = 0
    batch_size: int = Field(
        default=0,
        ge=0,
        description="prompts per batch, each written when done (0: hf 64 on GPU, 8 on CPU; vllm: 2048 in vLLM at "
        "once, the next added as one is answered)",
    )
    max_prompts: int | None = Field(default=None, ge=1, description="only the first N selected prompts")
    split: Split = Field(default="all", description="rows whose `split` field matches")
    device: str = Field(default="auto", description="hf: auto, cpu, cuda, cuda:1 ...")
    dtype: ComputeDtype = "auto"
    # openai backend
    base_url: str = Field(default="http://127.0.0.1:8000/v1", description="openai: server URL")
    model: str | None = Field(default=None, description="openai: model name sent to the server")
    api_key_env: str = Field(default="OPENAI_API_KEY", description="openai: the environment variable holding the key")
    concurrency: int = Field(default=16, ge=1, description="openai: requests in flight")
    timeout_s: float = Field(
        default=120.0, gt=0, le=SECONDS_PER_DAY, description="openai: seconds a request may take in all (then retried)"
    )
    max_retries: int = Field(default=5, ge=0, description="openai: retries on timeouts, 429 and 5xx")
    on_bad_row: OnBadRow = "error"
    trust_remote_code: bool = Field(default=False, description=TRUST_HELP)

    @model_validator(mode="after")
    def _samples_that_differ(self) -> "RegenerateConfig":
        if self.n > 1 and self.temperature == 0:
            raise ValueError(
                f"--n {self.n} at --temperature 0 writes the same greedy answer {self.n} times (training would "
                f"weigh each prompt {self.n} times over); pass --temperature > 0 to sample different answers, or --n 1"
            )
        return self


class SynthesizeConfig(GenerationFields, PlacementFields):
    """`eaglet synthesize`: user prompts written by the target from its chat template's user prefix (Magpie)."""

    FORWARD_OPTION: ClassVar[tuple[str, int] | None] = ("--batch-size {}", 1)

    out: str = Field(description="output .jsonl of prompts (id, prompt, split, category), resumable")
    target: str = Field(default="embedded", description=TARGET_HELP)
    count: int = Field(default=1000, ge=1, description="prompts to keep")
    heldout_fraction: float = Field(default=0.1, ge=0, lt=1, description="share of the prompts in the held-out split")
    max_new_tokens: int = Field(default=128, ge=1, description="tokens a user message may take to close its turn")
    temperature: float = Field(default=1.0, gt=0, le=MAX_TEMPERATURE)
    top_p: float = Field(default=0.99, gt=0, le=1)
    min_words: int = Field(default=4, ge=1, description="shorter messages are dropped")
    max_similarity: float = Field(
        default=0.6,
        ge=0,
        le=1,
        description="a message whose word trigrams overlap a kept "
        "one's more than this (Jaccard) is a near duplicate, dropped",
    )
    max_opening_share: float = Field(
        default=0.1,
        gt=0,
        le=1,
        description="at most this share of the prompts may open with the same two words (1 = no cap)",
    )
    max_batches: int = Field(default=1000, ge=1, description="give up after this many batches")
    batch_size: int = Field(default=0, ge=0, description="messages per batch (0 = 64 on GPU, 8 on CPU)")
    seed: Seed = 0
    device: str = Field(default="auto", description="auto, cpu, cuda, cuda:1 ...")
    dtype: ComputeDtype = "auto"
    trust_remote_code: bool = Field(default=False, description=TRUST_HELP)

    @model_validator(mode="after")
    def _room_for_a_message(self) -> "SynthesizeConfig":
        # a word takes at least one token (tokenizers split at spaces), and the turn's end one more
        if self.max_new_tokens < self.min_words + 1:
            raise ValueError(
                f"--max-new-tokens {self.max_new_tokens} cannot hold a message of --min-words {self.min_words} and "
                f"its turn's end: every message would be dropped; raise --max-new-tokens (default 128)"
            )
        return self


ConfigT = TypeVar("ConfigT", bound=StrictModel)


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """``tree[a][b] = value`` for ``a.b``, making sections on the way (a key holding a value is not a section)."""
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise EagletError(f"--set {dotted}: '{part}' is not a section")
        node = child
    node[parts[-1]] = value


# Bounds on what a config may hold: a real one has tens of keys. Aliases are shared references in the loaded
# value, so a 1 KB file of nested aliases expands to billions of nodes for whatever walks it (validation, an
# error message): the expanded size is counted on the composed node graph before anything is constructed.
MAX_CONFIG_BYTES = 1 << 20
MAX_YAML_NODES = 100_000  # scalars, lists and mappings once aliases are expanded
MAX_YAML_DEPTH = 32


class _YamlTooLarge(Exception):
    pass


def _expanded_size(node: yaml.Node, depth: int, sizes: dict[int, int]) -> int:
    """Nodes under ``node`` with every alias expanded, memoised per distinct node (linear in the file)."""
    if depth > MAX_YAML_DEPTH:
        raise _YamlTooLarge(f"nested deeper than {MAX_YAML_DEPTH} levels")
    if id(node) in sizes:
        return sizes[id(node)]
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = list(node.value)
    elif isinstance(node, yaml.MappingNode):
        _refuse_duplicate_keys(node)
        children = [part for pair in node.value for part in pair]
    size = 1
    for child in children:
        size += _expanded_size(child, depth + 1, sizes)
        if size > MAX_YAML_NODES:
            raise _YamlTooLarge(f"more than {MAX_YAML_NODES:,} values once its aliases are expanded")
    sizes[id(node)] = size
    return size


def _refuse_duplicate_keys(node: yaml.MappingNode) -> None:
    """YAML requires a mapping's keys to be unique; PyYAML keeps the last silently, so `out: a` then `out: b` ran
    with b. Raised as a marked YAML error at the second one."""
    first_line: dict[str, int] = {}
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        if key.value in first_line:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"key {shown(key.value)} set twice in one mapping, first on line {first_line[key.value]}; keep one",
                key.start_mark,
            )
        first_line[key.value] = key.start_mark.line + 1


def load_yaml_text(text: str) -> Any:
    """``yaml.safe_load`` of a bounded document: ``_YamlTooLarge`` when nested or expanded past the bounds."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise _YamlTooLarge(f"nested deeper than {MAX_YAML_DEPTH} levels") from None
    if node is None:
        return None
    _expanded_size(node, 0, {})
    return yaml.safe_load(text)


COMMAND_LINE = "command line"  # where a stage's settings came from when no config file was given


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=3`` -> ("a.b", 3); values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise EagletError(f"--set {shown(text)}: expected KEY=VALUE, e.g. --set max_len=4096")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise EagletError(f"--set {shown(text)}: empty key")
    try:
        value = load_yaml_text(raw) if raw.strip() else ""
    except _YamlTooLarge as exc:
        raise EagletError(f"--set {key}: the value is {exc}; give a plain value") from None
    except yaml.YAMLError:
        value = raw
    return key, value


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise EagletError(f"config {path}: {'not a file' if path.exists() else 'file not found'}")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise EagletError(
            f"config {path}: {path.stat().st_size:,} bytes, more than a config holds "
            f"({MAX_CONFIG_BYTES:,}); pass the config file, not a data file"
        )
    try:
        data = load_yaml_text(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise EagletError(f"config {path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except _YamlTooLarge as exc:
        raise EagletError(f"config {path}: {exc}; a config is a flat or sectioned mapping of plain values") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise EagletError(f"config {path}{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise EagletError(f"config {path}: top level must be a mapping of keys, got {type(data).__name__}")
    return data


def describe_validation_error(
    error: ValidationError,
    source: str,
    model: type[BaseModel] | None = None,
    origins: dict[str, tuple[str, str]] | None = None,
    options: dict[str, str] | None = None,
) -> str:
    """One line for pydantic's first error. ``model``: the config class, whose field descriptions say what a
    missing key is for. For a stage's settings, ``origins``: where each key was given (source, the name the user
    wrote: ``--lr``, ``--set lr`` or ``'lr'``); ``options``: each key's command-line option, for a missing one."""
    first = error.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(root)"
    top = str(first["loc"][0]) if first["loc"] else ""
    source, written = (origins or {}).get(top, (source, f"'{top}'"))
    if first["type"] == "extra_forbidden":
        return f"{source}: unknown key '{loc}' (check the spelling; `eaglet <stage> --help` lists the options)"
    if first["type"] == "missing" and len(first["loc"]) > 1:  # an item of a list or mapping given
        return f"{source}: {written} is missing '{loc}'"
    if first["type"] == "missing":
        field = model.model_fields.get(top) if model is not None else None
        what = f": {field.description}" if field is not None and field.description else ""
        choices = get_args(field.annotation) if field is not None and get_origin(field.annotation) is Literal else ()
        what += f" ({' | '.join(map(str, choices))})" if choices else ""
        option = (options or {}).get(top)
        if option and source == COMMAND_LINE:
            return f"{source}: {option} is required{what}"
        return f"{source}: required key '{loc}' is missing{what}" + (
            f"; set it there or pass {option}" if option else ""
        )
    if first["type"] == "value_error" and not first["loc"]:  # a model validator: settings that contradict
        return f"{source}: {str(first['msg']).removeprefix('Value error, ')}"
    key = written if len(first["loc"]) == 1 else f"'{loc}'"
    return f"{source}: {key}: {str(first['msg']).removeprefix('Value error, ')} (got {shown(first.get('input'))})"


def build_config(
    cls: type[ConfigT],
    stage: str,
    config_file: str | Path | None = None,
    cli_values: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    options: dict[str, str] | None = None,
) -> ConfigT:
    """Merge the layers and validate. A YAML file may be flat or hold a section named ``stage``. ``options``: the
    command-line option of each key given as one (not positionally), for the error's line."""
    options = options or {}
    merged: dict[str, Any] = {}
    origins: dict[str, tuple[str, str]] = {}  # key -> where it was given and as what
    source = COMMAND_LINE
    if config_file is not None:
        path = Path(config_file)
        data = read_yaml(path)
        section = data[stage] if stage in data else data
        if not isinstance(section, dict):
            raise EagletError(f"config {path}: section '{stage}' must be a mapping")
        merged.update(section)
        source = f"config {path}"
        origins |= {str(key): (source, f"'{key}'") for key in section}
    for key, value in (cli_values or {}).items():
        if value is not None:
            merged[key] = value
            origins[key] = (COMMAND_LINE, options.get(key, f"'{key}'"))
    for text in overrides or []:
        key, value = parse_override(text)
        set_dotted(merged, key, value)
        top = key.split(".", 1)[0]
        origins[top] = (COMMAND_LINE, f"--set {top}")
    try:
        return cls.model_validate(merged)
    except ValidationError as exc:
        raise EagletError(describe_validation_error(exc, source, cls, origins, options)) from None


class ExtractConfig(VllmFields, PlacementFields):
    FORWARD_OPTION: ClassVar[tuple[str, int] | None] = ("--batch-tokens {}", 256)

    prepared: str = Field(description="a prepared set directory (`eaglet prepare`)")
    out: str = Field(description="store directory; an existing incomplete store with the same settings is resumed")
    target: str | None = Field(default=None, description=RECORDED_TARGET_HELP)
    layers: list[int] | None = Field(default=None, description="aux layer ids, e.g. 2,15,27 (default: 2,N//2,N-3)")
    storage_dtype: StorageDtype = Field(
        default="bf16",
        description="fp8: e4m3 with per-token scales, 0.5x the disk; "
        "fp8-aux: aux fp8, the teacher's last feature bf16, 0.63x the disk",
    )
    shard_mb: float = Field(default=512.0, gt=0, le=MAX_SHARD_MB, description="approximate shard size on disk, MB")
    batch_tokens: int = Field(default=0, ge=0, description="tokens per forward pass (0 = 32768 on GPU, 4096 on CPU)")
    max_samples: int | None = Field(default=None, ge=1, description="only the first N prepared samples")
    device: str = Field(default="auto", description="auto (this rank's GPU, else cpu), cpu, cuda:1 ...")
    dtype: ComputeDtype = Field(default="auto", description="compute dtype (auto: bf16 on GPU, fp32 on CPU)")
    reserve_gb: float = Field(
        default=1.0, ge=0, le=MAX_GB, description="free disk to keep beyond the store's estimated size"
    )
    backend: ExtractBackend = Field(
        default="hf",
        description="hf: transformers in this process; vllm: vLLM's extract_hidden_states route "
        "(native quantized weights, vLLM's own tensor parallelism)",
    )
    spool_dir: str | None = Field(
        default=None,
        description="vllm: where vLLM's worker writes each shard's hidden states before they go into "
        "the store (default: .STORE.vllm-spool beside --out, removed when the stage ends)",
    )
    trust_remote_code: bool = Field(default=False, description=TRUST_HELP)
    replica: str = Field(
        default="0/1",
        pattern=r"^\d+/\d+$",
        description="tp: this torchrun job is replica r of R "
        "(data parallel over tensor-parallel groups: one torchrun per group, all into one store)",
    )

    @property
    def replicas(self) -> tuple[int, int]:
        """(r, R): which of the R tensor-parallel groups sharing the store this job is."""
        index, total = (int(part) for part in self.replica.split("/"))
        return index, total

    @model_validator(mode="after")
    def _replica_of_tensor_parallel_groups(self) -> "ExtractConfig":
        index, total = self.replicas
        if not 0 <= index < total:
            raise ValueError(
                f"--replica {self.replica}: expected r/R with 0 <= r < R, e.g. 0/2 and 1/2 for two TP groups"
            )
        if total > 1 and self.placement != "tp":
            raise ValueError(
                f"--replica {self.replica} is for tensor-parallel groups (--placement tp); without it, torchrun's "
                "ranks already split the work"
            )
        if self.kv_cache_dtype not in EXTRACT_KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype}: vLLM's extract route keeps the hidden states it captures in "
                f"its KV cache and refuses a quantized one; use {' or '.join(EXTRACT_KV_CACHE_DTYPES)}"
            )
        return self


class TrainConfig(PlacementFields):
    FORWARD_OPTION: ClassVar[tuple[str, int] | None] = ("--set online_forward_tokens={}", 256)

    out: str = Field(
        description="run directory: the draft, metrics, plots and checkpoints (resumed from its last checkpoint)"
    )
    store: str | None = Field(default=None, description="offline: a store from `eaglet extract`")
    prepared: str | None = Field(default=None, description="online: a prepared set; the target computes features live")
    target: str | None = Field(default=None, description=RECORDED_TARGET_HELP)
    ttt_steps: int = Field(default=7, ge=1, le=32, description="training-time-test unroll K")
    attention_kernels: Literal["split", "one", "per_step"] = Field(
        default="split",
        description="GPU FlexAttention: step-0 keys alone, each step's own-position keys merged in (split; "
        "72.7 ms/step at the 8B shape on an H100), one kernel over all TTT steps' keys (one; 74.3 ms), or "
        "one kernel per step count (per_step: K compiles)",
    )
    compile_pointwise: bool = Field(
        default=True, description="GPU: fuse the draft's norms, RoPE, SwiGLU and residuals with torch.compile"
    )
    cuda_graphs: bool = Field(
        default=True,
        description="GPU, one process, one micro-batch a step, from a store: replay each step as two recorded CUDA "
        "graphs (forward+backward, AdamW) instead of launching its ~1,200 kernels from Python",
    )
    draft_layers: int = Field(
        default=1, ge=1, le=8, description="decoder layers in the draft (1 = EAGLE-3's; SGLang serves 1 only)"
    )
    eagle_version: Literal["3", "3.1"] | None = Field(
        default=None,
        description="3.1: an RMSNorm on each aux feature before fc and the normed hidden state fed back to the next "
        "step (arXiv 2605.09992; vLLM, SGLang and speculators serve both); 3: EAGLE-3's. Default: 3.1, or --init-from's",
    )
    init_from: str | None = Field(
        default=None,
        description="start from this draft's weights: eaglet's, an export, or one made elsewhere (vLLM/SGLang "
        "layout, a speculators save); its aux layers, vocabulary and depth must be this run's, its norms are kept",
    )
    layers: list[int] | None = Field(
        default=None,
        description="online: aux layer ids, e.g. 2,15,27 (default: 2,N//2,N-3); offline the store's are used",
    )
    loss_decay: float = Field(default=0.8, gt=0, le=1, description="weight of TTT step k is loss_decay**k")
    token_budget: int = Field(default=4096, ge=16, description="tokens per packed micro-batch")
    grad_accum: int = Field(default=1, ge=1, description="micro-batches per optimizer step and rank")
    parallel: Literal["ddp", "fsdp2"] = Field(
        default="ddp", description="under torchrun: replicate (ddp) or shard (fsdp2) the draft and optimizer"
    )
    lr: float = Field(default=3e-4, gt=0, le=MAX_LR, description="peak learning rate")
    betas: tuple[Beta, Beta] = Field(default=(0.9, 0.95), description="AdamW's moment decays, e.g. 0.9,0.95")
    weight_decay: float = Field(default=0.0, ge=0, le=MAX_WEIGHT_DECAY)
    schedule: Literal["cosine", "linear", "constant"] = Field(
        default="cosine", description="learning-rate decay after the warmup"
    )
    warmup_steps: int = Field(default=20, ge=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="the schedule's floor, a share of --lr")
    clip: float = Field(default=0.5, gt=0, le=MAX_CLIP, description="gradient norm clip")
    max_steps: int | None = Field(default=None, ge=1, description="stop after N optimizer steps")
    epochs: float | None = Field(
        default=None, gt=0, le=MAX_EPOCHS, description="stop after E epochs (1 when no other limit is given)"
    )
    tokens: int | None = Field(default=None, ge=1, description="stop after this many training tokens")
    max_minutes: float | None = Field(
        default=None, gt=0, le=MAX_MINUTES, description="stop (with a checkpoint) after this long"
    )
    eval_store: str | None = Field(
        default=None, description="evaluate on this store (e.g. held-out prompts) instead of a held-out fraction"
    )
    feature_noise_std: float = Field(
        default=0.0, ge=0, le=MAX_FEATURE_NOISE, description="Gaussian noise added to the aux features while training"
    )
    freeze_lm_head: bool = Field(
        default=False, description="keep the head the target's rows (less to fit on little data)"
    )
    eval_fraction: float = Field(
        default=0.05, ge=0, lt=1, description="samples held out for the held-out τ (acceptance length)"
    )
    eval_every: int = Field(default=100, ge=1, description="held-out evaluation every N steps")
    log_every: int = Field(default=10, ge=1, description="metrics every N steps")
    save_every: int = Field(default=200, ge=1, description="checkpoint every N steps")
    keep_last: int = Field(default=2, ge=1, description="checkpoints kept")
    seed: Seed = Field(default=0, description="data order, init and noise")
    device: str = Field(default="auto", description="auto (this rank's GPU, else cpu), cpu, cuda:1 ...")
    precision: Literal["auto", "bf16", "fp32"] = Field(default="auto", description="auto: bf16 autocast on GPU")
    online_chunk_tokens: int = Field(
        default=262144, ge=1, description="online: samples shuffled in chunks of this many tokens"
    )
    online_forward_tokens: int = Field(default=8192, ge=1, description="online: tokens per target forward")
    online_cache_gb: float = Field(
        default=8.0,
        ge=0,
        le=MAX_GB,
        description="online: host memory for features kept across "
        "epochs (computed once per sample while they fit; 0: every epoch recomputes)",
    )
    draft_vocab_file: str | None = Field(default=None, description="vocab.safetensors (default: the prepared set's)")
    trust_remote_code: bool = Field(default=False, description=TRUST_HELP)

    def warmup_problem(self, steps: int) -> tuple[str, str] | None:
        """(why, fix) when the warm-up swallows a run of ``steps`` optimizer steps, or None: the learning rate would
        still be rising at the last step (at most steps/(warmup+1) of --lr) and the schedule's decay never run."""
        if self.warmup_steps < steps:
            return None
        return (
            f"--warmup-steps {self.warmup_steps} is as long as the run ({steps} steps): the learning rate peaks at "
            f"{steps / (self.warmup_steps + 1):.0%} of --lr and never decays",
            f"lower --warmup-steps, e.g. to {steps // 10}",
        )

    def records_step(self, device: str, world: int) -> bool:
        """Whether the run records its step as CUDA graphs (``train.graphed``): asked for (the default), on a GPU,
        one process, one micro-batch a step, features from a store (online training runs the target in the
        prefetch thread on the same GPU: not recorded)."""
        return (
            self.cuda_graphs and device.startswith("cuda") and world == 1 and self.grad_accum == 1 and bool(self.store)
        )


class ExportConfig(StrictModel):
    draft: str = Field(description="a draft directory (`eaglet train` output)")
    format: ExportFormat = Field(description="the consumer the directory is written for")
    out: str = Field(description="output directory (written atomically)")
    verifier: str | None = Field(
        default=None, description="how configs name the target (default: its hub id when known, else its local path)"
    )
    target: str | None = Field(
        default=None,
        description="the target (default: the one the draft records); the speculators format carries its embedding",
    )
    speculative_tokens: int | None = Field(
        default=None,
        ge=1,
        le=16,
        description="draft tokens per step recorded for serving (default: the chain length --report measured, else 3)",
    )
    report: str | None = Field(
        default=None, description="an `eaglet eval` report.json whose τ goes into the model card"
    )
    overwrite: bool = Field(default=False, description="replace an existing --out")
    engines: list[str] = Field(
        default_factory=list,
        description="an engine release the export will be served with, "
        "ENGINE==VERSION (repeatable): preflight warns when eaglet's readers of its loader do "
        "not cover it",
    )


# The tree shapes `eval --tune` times by default: depth, top-k, budget. The fastest three measured for the embedded
# target's best draft on the H200 (benchmarks/RESULTS.md, "A round's kernels cut"): 7/8/56, 8/8/64, 10/10/96.
TUNE_TREES = ((7, 8, 56), (8, 8, 64), (10, 10, 96))
TREE_LIMITS = {"depth": (1, 16), "topk": (1, 64), "budget": (1, 512)}  # the bounds of a tree's (and chain's) shape


def served_context(longest_prompt: int, max_new_tokens: int, depth: int) -> int:
    """The context vLLM must give a request: the longest prompt, its answer and one draft round past it."""
    return longest_prompt + max_new_tokens + depth + 1


SIZE_IT = "raise it or leave it out (it is sized to the prompts)"


def served_model_len(config: Any, longest_prompt: int) -> tuple[int, str | None]:
    """(the context vLLM gives each request: --max-model-len or what the prompts need, why --max-model-len cannot
    hold them or None) for eval --backend vllm and bench (vLLM keeps a KV cache for one request of it at start, and
    Kimi's whole 262,144 tokens take GiBs the answers never use)."""
    needed = config.served_length(longest_prompt)
    if config.max_model_len is not None and config.max_model_len < needed:
        return needed, (
            f"--max-model-len {config.max_model_len}: the longest prompt with --max-new-tokens "
            f"{config.max_new_tokens} and a draft round needs {needed:,}"
        )
    return config.max_model_len or needed, None


class EvalConfig(VllmFields, PlacementFields):
    draft: str = Field(
        description="a draft directory (`eaglet train` output or an `eaglet export` directory; --backend vllm: "
        "an `eaglet export --format vllm` one)"
    )
    backend: EvalBackend = Field(
        default="hf",
        description="hf: eaglet's own decoder on transformers' target; vllm: vLLM serves the target with the "
        "exported draft (τ from vLLM's own counters, tok/s with and without it)",
    )
    out: str = Field(description="report directory")
    prompts: FileList = Field(
        default_factory=lambda: ["demo"],
        description="prompt files; 'demo' = the shipped demo prompts, 'mt-bench' = MT-Bench's 80 questions",
    )
    target: str | None = Field(default=None, description=RECORDED_TARGET_HELP)
    split: Split = Field(default="heldout", description="rows whose `split` field matches")
    max_prompts: int | None = Field(
        default=None, ge=1, description="only N prompts of each prompt file, taken round-robin over its categories"
    )
    mode: Literal["chain", "tree"] = Field(default="chain", description="tree: EAGLE-2's dynamic tree")
    depth: int = Field(
        default=4,
        ge=TREE_LIMITS["depth"][0],
        le=TREE_LIMITS["depth"][1],
        description="draft steps per verification (chain length / tree depth)",
    )
    topk: int = Field(
        default=8,
        ge=TREE_LIMITS["topk"][0],
        le=TREE_LIMITS["topk"][1],
        description="tree: children per expanded node and nodes expanded per level",
    )
    budget: int = Field(
        default=48,
        ge=TREE_LIMITS["budget"][0],
        le=TREE_LIMITS["budget"][1],
        description="tree: draft tokens verified per target forward",
    )
    tune: bool = Field(
        default=False,
        description="tree: first time each of tune_trees on tune_prompts prompts (the "
        "train split's when the held-out ones are evaluated) and evaluate with the fastest",
    )
    tune_trees: list[tuple[int, int, int]] = Field(
        default_factory=lambda: list(TUNE_TREES),
        min_length=1,
        description="tree shapes --tune times: [depth, top-k, budget] each",
    )
    tune_prompts: int = Field(default=4, ge=1, description="prompts each tree shape is timed on")
    temperature: float = Field(default=0.0, ge=0, le=MAX_TEMPERATURE, description="0 = greedy, checked lossless")
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_new_tokens: int = Field(default=128, ge=1)
    batch_size: int = Field(
        default=1, ge=1, le=1024, description="prompts decoded together (greedy chain only when > 1)"
    )
    seed: Seed = Field(default=0, description="sampling seed")
    device: str = Field(default="auto", description="auto, cpu, cuda, cuda:1 ...")
    dtype: ComputeDtype = Field(
        default="float32",
        description="target and draft; float32 makes the greedy lossless check exact (bf16 rounds "
        "a k-token verify differently from a 1-token step, so near-ties flip); auto = bf16 on GPU "
        "(--backend vllm: auto unless given)",
    )
    hf_generate_baseline: bool = Field(default=False, description="also time plain HF generate")
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="batch 1: target and draft on static KV caches, their forwards (greedy: the "
        "draft's whole rounds) replayed as CUDA graphs (auto: on GPU; on: also on CPU, run eagerly; off: dynamic caches)",
    )
    compile_draft: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="greedy rounds on static caches: the draft's part of each round through "
        "torch.compile (fused kernels inside the round's CUDA graph; auto: on GPU)",
    )
    trust_remote_code: bool = Field(default=False, description=TRUST_HELP)

    def served_length(self, longest_prompt: int) -> int:
        """The context `eval --backend vllm` needs of vLLM (unless --max-model-len says): the longest prompt, its
        answer and a draft round past it (vLLM keeps a KV cache for one request of it at start)."""
        return served_context(longest_prompt, self.max_new_tokens, self.depth)

    def decoding_problem(self) -> str | None:
        """Settings no decoder runs, found from the settings alone (before any stage of a run, any model load)."""
        if self.backend == "vllm":
            return self._vllm_problem()
        if self.batch_size > 1 and (self.mode != "chain" or self.temperature > 0):
            return (
                f"--batch-size {self.batch_size}: batched decoding drafts chains greedily; use --mode chain and "
                "temperature 0, or --batch-size 1 for trees and sampling"
            )
        if self.placement != "one" and (self.batch_size > 1 or self.cuda_graphs == "on"):
            return (
                f"--placement {self.placement}: the target runs on dynamic caches, one prompt at a time; drop "
                "--batch-size and --cuda-graphs on (static caches and graphs need the whole target on one GPU)"
            )
        if self.tune and self.mode != "tree":
            return "--tune times tree shapes; add --mode tree (a chain has only --depth to choose)"
        for shape in self.tune_trees if self.tune else ():
            for (name, (low, high)), value in zip(TREE_LIMITS.items(), shape):
                if not low <= value <= high:
                    return (
                        f"tune_trees {list(shape)}: {name} {value} is outside {low}..{high}; give each shape as "
                        "[depth, top-k, budget]"
                    )
        return None

    def _vllm_problem(self) -> str | None:
        """eaglet's own engines' settings vLLM's eagle3 route has no counterpart for."""
        if self.mode != "chain":
            return "--backend vllm drafts chains of --depth tokens (vLLM's eagle3 route); use --mode chain"
        given = [
            option
            for option, set_ in (
                ("--tune", self.tune),
                ("--cuda-graphs", self.cuda_graphs != "auto"),
                ("--compile-draft", self.compile_draft != "auto"),
                ("--hf-generate-baseline", self.hf_generate_baseline),
            )
            if set_
        ]
        if given:
            return f"{given[0]} is the hf backend's; vLLM compiles and graphs the target and draft itself"
        return None


BENCH_CONCURRENCY = [1, 8, 32]  # requests in flight: one user, a small batch, a busy server
BENCH_TEMPERATURES = [0.0, 0.7]  # greedy, and sampled as chat serving runs


class BenchConfig(VllmFields, PlacementFields):
    """`eaglet bench`: the target served by vLLM with and without the exported draft, at each concurrency and
    temperature, from vLLM's own counters and clocks."""

    draft: str = Field(description="an `eaglet export --format vllm` directory (or an EAGLE-3 draft in that layout)")
    engine: Literal["vllm"] = Field(default="vllm", description="the serving engine measured")
    out: str = Field(description="report directory: bench.json, bench.png")
    target: str | None = Field(default=None, description=RECORDED_TARGET_HELP)
    prompts: FileList = Field(
        default_factory=lambda: ["demo"],
        description="prompt files; 'demo' = the shipped demo prompts, 'mt-bench' = MT-Bench's 80 questions",
    )
    split: Split = Field(default="heldout", description="rows whose `split` field matches")
    max_prompts: int | None = Field(
        default=32, ge=1, description="N prompts of each prompt file (each cell decodes them, cycled to fill it)"
    )
    depth: int = Field(default=3, ge=1, le=TREE_LIMITS["depth"][1], description="draft tokens a round (k)")
    concurrency: list[Annotated[int, Field(ge=1, le=MAX_VLLM_SEQUENCES)]] = Field(
        default_factory=lambda: list(BENCH_CONCURRENCY), min_length=1, description="requests in flight, e.g. 1,8,32"
    )
    temperatures: list[Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)]] = Field(
        default_factory=lambda: list(BENCH_TEMPERATURES), min_length=1, description="0 = greedy, e.g. 0,0.7"
    )
    top_p: float = Field(default=1.0, gt=0, le=1, description="sampled cells' nucleus")
    max_new_tokens: int = Field(default=128, ge=1)
    seed: Seed = Field(default=0, description="sampling seed")
    device: str = Field(default="auto", description="auto, cpu, cuda: where the installed vLLM build must run")
    dtype: ComputeDtype = Field(default="auto", description="vLLM's serving dtype (auto: the target's)")
    trust_remote_code: bool = Field(default=False, description=TRUST_HELP)

    @property
    def backend(self) -> str:  # VllmFields' checks ask which engine holds the target
        return self.engine

    def served_length(self, longest_prompt: int) -> int:
        """The context each engine needs: the longest prompt, its answer and a draft round past it."""
        return served_context(longest_prompt, self.max_new_tokens, self.depth)
