"""Whether vLLM can build a multimodal wrapper's image processor here, known before the engine starts.

vLLM builds a wrapper's input processor at engine start even when it holds the language model alone
(``language_model_only``). For Kimi-K2.5 (vllm/model_executor/models/kimi_k25.py, ``KimiK25ProcessingInfo``) that is
its own in-process processor when numba imports (0.25.1 on), else the checkpoint's, through transformers'
AutoImageProcessor, which is the checkpoint's remote code (``auto_map`` in preprocessor_config.json): without
``trust_remote_code`` the engine dies at its start ("Failed to load the image processor"). On the H100 (2026-12-07)
numba 0.65 did not import beside numpy 2.5 ("Numba needs NumPy 2.4 or less") and vLLM 0.25.1 died that way.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import EagletError, first_line
from .vllm_releases import release_key

PREPROCESSOR_CONFIG = "preprocessor_config.json"
# wrapper architecture -> the oldest vLLM release whose model builds its image processor in process (with numba)
IN_PROCESS_IMAGE_PROCESSOR_SINCE = {"KimiK25ForConditionalGeneration": "0.25.1"}


def numba_import_error() -> str | None:
    """Why numba does not import in this environment (vLLM's ``is_numba_available`` imports it), or None."""
    try:
        import numba  # noqa: F401
    except ImportError as exc:
        return first_line(exc)
    return None


def processor_is_remote_code(target_path: Path) -> bool:
    """The checkpoint's image processor is its own code (preprocessor_config.json names a class transformers does
    not have, or only an ``auto_map`` entry): transformers runs it only with ``trust_remote_code``."""
    import transformers

    path = Path(target_path) / PREPROCESSOR_CONFIG
    if not path.is_file():
        return False
    try:
        declared = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EagletError(f"{path}: not valid JSON ({first_line(exc)}); restore the checkpoint's own file") from None
    if not isinstance(declared, dict):
        raise EagletError(f"{path}: not a JSON object; restore the checkpoint's own file")
    name = declared.get("image_processor_type")
    if isinstance(name, str) and hasattr(transformers, name):
        return False
    return bool(name) or "AutoImageProcessor" in (declared.get("auto_map") or {})


def image_processor_problem(
    target_path: Path, architecture: str | None, version: str, trust_remote_code: bool, numba_error: str | None
) -> str | None:
    """Why vLLM ``version`` would die building the wrapper ``architecture``'s image processor at engine start, or
    None. ``numba_error``: ``numba_import_error()`` in the environment vLLM runs in."""
    since = IN_PROCESS_IMAGE_PROCESSOR_SINCE.get(architecture or "")
    if since is None or trust_remote_code or not processor_is_remote_code(target_path):
        return None
    remote = (
        f"the checkpoint's own ({PREPROCESSOR_CONFIG}) is remote code, which transformers runs only with "
        "--trust-remote-code"
    )
    if release_key(version) < release_key(since):
        return (
            f"target {target_path}: vLLM {version} builds {architecture}'s image processor at engine start, even for "
            f"its language model alone, and {remote}; pass --trust-remote-code, or install vllm>={since} with numba"
        )
    if numba_error is None:
        return None
    return (
        f"target {target_path}: vLLM {version} builds {architecture}'s image processor at engine start, even for its "
        f"language model alone: its own needs numba, which does not import here ({numba_error}), and {remote}; "
        "install a numba that imports beside this numpy (numba 0.65 needs numpy<=2.4), or pass --trust-remote-code"
    )


def installed_processor_problem(target_path: Path, trust_remote_code: bool) -> str | None:
    """``image_processor_problem`` for the installed vLLM and this environment's numba; None for a text model."""
    from .target import raw_config
    from .vllm_engine import is_multimodal_wrapper, vllm_version

    raw = raw_config(target_path)
    architecture = (raw.get("architectures") or [None])[0]
    version = vllm_version()
    if version is None or not is_multimodal_wrapper(raw) or architecture not in IN_PROCESS_IMAGE_PROCESSOR_SINCE:
        return None
    return image_processor_problem(target_path, architecture, version, trust_remote_code, numba_import_error())
