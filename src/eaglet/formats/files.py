"""Every file and directory name eaglet writes or reads, and the schema ids its manifests carry."""

from __future__ import annotations

from pathlib import Path

MANIFEST_FILE = "manifest.json"  # prepared sets and stores

# prepared set (`eaglet prepare`)
PREPARED_SCHEMA = "eaglet.prepared/1"
SAMPLES_FILE = "samples.parquet"
VOCAB_FILE = "vocab.safetensors"

# hidden-state store (`eaglet extract`)
STORE_SCHEMA = "eaglet.model.shards/2"


# the directories eaglet writes a manifest.json into, by the schema it carries: (what it is, the command making it)
MANIFEST_KINDS = {PREPARED_SCHEMA: ("a prepared set", "eaglet prepare"), STORE_SCHEMA: ("a store", "eaglet extract")}


def other_kind(directory: Path, found: object, wanted: str) -> str | None:
    """The refusal when ``directory`` holds another of eaglet's manifests (schema ``found``) where one of schema
    ``wanted`` is expected — a prepared set passed as a store, say: its fix is another path, not a rerun."""
    if found == wanted or not isinstance(found, str) or found not in MANIFEST_KINDS:
        return None
    what, command = MANIFEST_KINDS[found]
    wanted_what, wanted_command = MANIFEST_KINDS[wanted]
    return f"{directory}: {what} (made by `{command}`), not {wanted_what}; pass the --out of `{wanted_command}`"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def record_name(index: int) -> str:
    """A shard's record, written after the shard: its sha256, size and counts."""
    return f"shard-{index:05d}.json"


# a draft (`eaglet train`'s output, and every `eaglet export` directory)
DRAFT_CONFIG_FILE = "config.json"
DRAFT_WEIGHTS_FILE = "model.safetensors"
EXPORTED_DRAFT_CONFIG_FILE = "eaglet_draft.json"  # eaglet's own config, kept inside exported directories
MODEL_CARD_FILE = "README.md"

# a training run (`eaglet train --out RUN`)
TRAIN_CONFIG_FILE = "train_config.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
TRAINER_STATE_FILE = "trainer.json"
CHECKPOINT_WEIGHTS_FILE = "draft.safetensors"
OPTIMIZER_TENSORS_FILE = "optimizer.safetensors"  # the optimizer state's tensors (``train.tensor_tree``)
OPTIMIZER_STATE_FILE = "optimizer.json"  # the rest of it, each tensor a reference into the file above
PICKLED_OPTIMIZER_FILE = "optimizer.pt"  # an earlier eaglet's pickled optimizer state: refused, never unpickled
RNG_FILE = "rng.safetensors"


def checkpoint_dir_name(step: int) -> str:
    return f"step-{step:06d}"


# an evaluation (`eaglet eval --out DIR`)
REPORT_FILE = "report.json"
REPORT_MARKDOWN_FILE = "report.md"

# regenerated answers: ANSWERS.jsonl + ANSWERS.jsonl.manifest.json
ANSWERS_MANIFEST_SUFFIX = ".manifest.json"


def answers_manifest(answers: Path) -> Path:
    """The manifest written beside a regenerated answers file."""
    return answers.with_name(answers.name + ANSWERS_MANIFEST_SUFFIX)


# a run directory (`eaglet run`)
RUN_FILE = "run.json"
RUN_SCHEMA = "eaglet.run/1"

# an HF model directory
TARGET_CONFIG_FILE = "config.json"
