"""`eaglet regenerate`: the target writes the assistant answers (self-distillation data).

A draft learns to predict what the *target* would write; answers written by another model teach it
the wrong distribution. Each prompt (the conversation up to its last user turn) is answered ``n``
times, greedily or by sampling. Output rows are OpenAI ``messages`` plus provenance.

Crash safety: rows are appended in groups with fsync (a batch; the vllm backend's answers of the last second; a
server's each answer); a restarted run reads the file, drops a torn last line, and skips every (prompt id, sample)
already written. The finished file is rewritten once in plan order, so a resumed run ends byte-identical to an
uninterrupted one.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from rich.console import Console

from .. import __version__
from ..config import RegenerateConfig
from ..errors import EagletError
from ..formats.files import answers_manifest
from ..fsio import (
    append_lines_durable,
    check_output_apart,
    check_output_dir,
    output_lock,
    sha256_file,
    write_bytes_atomic,
    write_json_atomic,
)
from ..progress import progress_bar
from ..resources import resolve_input
from .generation import load_generator, stop_token_ids, until_stop
from .readers import BadRow, describe_splits, fail_on_bad_rows, read_conversations


@dataclass(frozen=True)
class Request:
    order: int  # position in the plan (prompt order x sample index)
    prompt_id: str
    sample_index: int
    messages: list[dict[str, str]]  # the prompt: everything before the answer to write
    category: str | None
    source: str = ""  # "file:line" of the prompt's row
    split: str | None = None  # the prompt row's split, kept on its answers (prepare leaves held-out ones out)

    @property
    def key(self) -> tuple[str, int]:
        return (self.prompt_id, self.sample_index)


TOOLS_NOT_ANSWERED = (
    "the conversation calls tools: regenerate answers plain conversations (prepare trains on it as written)"
)
BLANK = "blank"  # the finish reason of an answer that is only whitespace (left out of the finished file)


@dataclass
class Answer:
    text: str
    finish_reason: str  # "stop" | "length" (a row's provenance says "blank" where the text is only whitespace)
    new_tokens: int


def settings_of(config: RegenerateConfig) -> dict[str, Any]:
    """The settings that decide the answers; a resumed run must use the same ones."""
    return {
        "target": config.target if config.backend != "openai" else (config.model or config.target),
        "backend": config.backend,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "max_new_tokens": config.max_new_tokens,
        "seed": config.seed,
    }


def plan_requests(config: RegenerateConfig, console: Console) -> list[Request]:
    requests: list[Request] = []
    bad: list[BadRow] = []
    prompts = 0
    other_splits: Counter[str] = Counter()  # rows left out for their split, for a selection that is empty
    for item in read_conversations([resolve_input(p) for p in config.prompts]):
        if isinstance(item, BadRow):
            bad.append(item)
            continue
        split = item.meta.get("split")  # the row's own, kept on its answers (None: it names none)
        selected_as = "train" if split is None else split
        if config.split != "all" and selected_as != config.split:
            other_splits[selected_as] += 1
            continue
        if item.uses_tools:
            bad.append(BadRow(item.source, TOOLS_NOT_ANSWERED))
            continue
        if config.max_prompts is not None and prompts >= config.max_prompts:
            break
        prompt = item.prompt_messages
        for sample in range(config.n):
            requests.append(
                Request(
                    len(requests),
                    item.id,
                    sample,
                    prompt,
                    item.meta.get("category"),
                    item.source,
                    split,
                )
            )
        prompts += 1
    if bad:
        if config.on_bad_row == "error":
            fail_on_bad_rows(bad, console)
        console.print(f"[yellow]skipped {len(bad)} bad row(s)[/]; first: {bad[0]}")
    if not requests:
        seen = describe_splits(other_splits)
        where = ", ".join(config.prompts)
        if seen:
            raise EagletError(
                f"{where}: no prompts of --split {config.split} (the rows' splits: {seen}); pass --split all, or "
                "the split they have"
            )
        raise EagletError(f"{where}: no prompts to answer" + (f" ({len(bad):,} bad rows skipped)" if bad else ""))
    return requests


def context_problems(requests: list[Request], tokenizer: Any, context: int | None, max_new_tokens: int) -> list[BadRow]:
    """The prompts whose tokens in the chat template plus ``max_new_tokens`` pass the target's context: transformers
    would generate at positions the target never saw (text of no use to a draft), vLLM refuses them mid-run."""
    from ..model.target import past_context

    if context is None:
        return []
    bad, seen = [], set()
    for request in requests:
        if request.prompt_id in seen:  # the n samples of one prompt share its length
            continue
        seen.add(request.prompt_id)
        problem = past_context(len(encode_prompt(tokenizer, request)), max_new_tokens, context)
        if problem:
            bad.append(
                BadRow(request.source or request.prompt_id, f"{problem} (shorten the prompt or lower --max-new-tokens)")
            )
    return bad


def too_long_prompts(config: RegenerateConfig, requests: list[Request], target_path: Path) -> list[BadRow]:
    """``context_problems`` for the target at ``target_path``, from its tokenizer and config.json (no weights)."""
    from ..model.target import context_length, load_tokenizer

    tokenizer = load_tokenizer(target_path, config.trust_remote_code)
    _needs_template(tokenizer, config.target)
    return context_problems(requests, tokenizer, context_length(target_path), config.max_new_tokens)


def within_context(config: RegenerateConfig, requests: list[Request], console: Console) -> list[Request]:
    """``requests`` less the prompts too long for the target (refused, or dropped with --on-bad-row skip), found
    before any weights load."""
    from ..model.target import resolve_target

    bad = too_long_prompts(config, requests, resolve_target(config.target, config.trust_remote_code).path)
    if not bad:
        return requests
    if config.on_bad_row == "error":
        fail_on_bad_rows(bad, console)
    console.print(f"[yellow]skipped {len(bad)} prompt(s) too long for the target[/]; first: {bad[0]}")
    dropped = {row.source for row in bad}
    kept = [r for r in requests if (r.source or r.prompt_id) not in dropped]
    if not kept:
        raise EagletError(f"{', '.join(config.prompts)}: every selected prompt is too long for the target")
    return [replace(request, order=order) for order, request in enumerate(kept)]


# ---------------------------------------------------------------------------------------------
# Output file: append, resume, finalize


def output_row(request: Request, answer: Answer, settings: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": request.prompt_id if request.sample_index == 0 else f"{request.prompt_id}#{request.sample_index}",
        "messages": request.messages + [{"role": "assistant", "content": answer.text}],
    }
    if request.category:
        row["category"] = request.category
    if request.split:
        row["split"] = request.split
    row["provenance"] = settings | {
        "prompt_id": request.prompt_id,
        "sample_index": request.sample_index,
        "finish_reason": BLANK if not answer.text.strip() else answer.finish_reason,
        "new_tokens": answer.new_tokens,
        "eaglet_version": __version__,
    }
    return row


def load_done(out: Path, settings: dict[str, Any], requests: list[Request]) -> dict[tuple[str, int], str]:
    """Rows already written, keyed by (prompt id, sample); a torn trailing line is cut off, once every complete line
    is known to be this stage's (a file of the user's is refused untouched). A row that answers another prompt than
    the request of its id now holds (the prompts edited since) is refused: kept, it would train the draft on an
    answer to a question nobody asks any more; so is a row no request asks for: finishing would drop an answer that
    may have cost hours."""
    asked = {request.key: request for request in requests}
    if not out.exists():
        return {}
    data = out.read_bytes()
    complete = len(data) if data.endswith(b"\n") else data.rfind(b"\n") + 1  # the torn tail starts here
    torn, data = data[complete:], data[:complete]
    done: dict[tuple[str, int], str] = {}
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EagletError(
            f"{out}: not UTF-8 text (byte {exc.start}): not written by `eaglet regenerate`; use another "
            "--out or delete the file"
        ) from None
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            row = json.loads(line)
            provenance = row["provenance"]
            if not isinstance(provenance, dict):
                raise TypeError(provenance)
            key = (str(provenance["prompt_id"]), int(provenance["sample_index"]))
        except (KeyError, TypeError, ValueError, RecursionError):  # ValueError: JSONDecodeError too
            raise EagletError(
                f"{out}:{number}: not a row written by `eaglet regenerate`; use another --out or delete the file"
            ) from None
        differing = {k: (provenance.get(k), v) for k, v in settings.items() if provenance.get(k) != v}
        if differing:
            name, (was, now) = next(iter(differing.items()))
            raise EagletError(
                f"{out}:{number}: written with {name}={was!r}, this run asks for {now!r}; "
                "use another --out or the same settings to resume"
            )
        request = asked.get(key)
        if request is None:  # the finished file holds this run's prompts only: the answer would be dropped
            sample = f" (sample {key[1]})" if key[1] else ""
            raise EagletError(
                f"{out}:{number}: an answer to id {key[0]!r}{sample}, which this run does not ask (other prompts, "
                "split, --max-prompts or --n); finishing would drop it from the file: use another --out, or delete "
                "it to start over"
            )
        if not answers(row, request):
            raise EagletError(
                f"{out}:{number}: answers another prompt than id {key[0]!r} holds now ({request.source}): the "
                "prompts changed since it was written; use another --out, or delete it to answer them again"
            )
        done[key] = line
    if torn:
        if not done:  # nothing shows the file is eaglet's: a kill's first row, or the user's own one-line file
            raise EagletError(
                f"{out}: holds no complete row of `eaglet regenerate` ({len(torn)} bytes without a newline); use "
                "another --out, or delete the file to start over"
            )
        with open(out, "r+b") as handle:  # every complete line was this stage's: the torn one is its own too
            handle.truncate(complete)
            os.fsync(handle.fileno())
    return done


def is_blank(line: str) -> bool:
    return json.loads(line)["provenance"]["finish_reason"] == BLANK


def finalize(out: Path, requests: list[Request], done: dict[tuple[str, int], str]) -> list[str]:
    """Rewrite the file in plan order (atomically), without blank answers; returns those (the manifest lists them).
    A blank answer (the target ended its turn at once, or wrote only whitespace) teaches no token and is a bad row
    for ``prepare``; it stays in the file until here, so a killed run resumes past it."""
    lines = [done[r.key] for r in requests if r.key in done]
    blanks = [is_blank(line) for line in lines]  # each line parsed once
    blank = [line for line, empty in zip(lines, blanks) if empty]
    kept = [line for line, empty in zip(lines, blanks) if not empty]
    write_bytes_atomic(out, "".join(line + "\n" for line in kept).encode("utf-8"))
    return blank


def blank_done(out: Path, settings: dict[str, Any], requests: list[Request]) -> dict[tuple[str, int], str]:
    """The blank answers a finished run left out of ``out`` (its manifest lists them), so a rerun does not ask again."""
    try:
        manifest = json.loads(answers_manifest(out).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(manifest, dict) or manifest.get("settings") != settings:
        return {}
    asked = {request.key: request for request in requests}
    blank = {}
    for row in manifest.get("blank_answers") or []:
        key = (str(row["provenance"]["prompt_id"]), int(row["provenance"]["sample_index"]))
        if key in asked and answers(row, asked[key]):  # a prompt edited since is asked again
            blank[key] = json.dumps(row)
    return blank


def answers(row: dict[str, Any], request: Request) -> bool:
    """Whether a written row is the answer to ``request``'s prompt (everything before its last message)."""
    messages = row.get("messages")
    return isinstance(messages, list) and messages[:-1] == request.messages


# ---------------------------------------------------------------------------------------------
# Backends


def _needs_template(tokenizer: Any, target: str) -> set[int]:
    if not isinstance(tokenizer.chat_template, str):
        raise EagletError(f"target {target}: no chat template, so prompts cannot be rendered")
    return set()


def encode_prompt(tokenizer: Any, request: Request) -> list[int]:
    """The prompt in the target's chat template, up to the opening of the assistant's turn, as token ids."""
    text = tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def _length_buckets(requests: list[Request], lengths: dict[int, int], batch_size: int) -> list[list[Request]]:
    """Sort by prompt length so a batch pads little, and cut into the fewest batches of at most ``batch_size``, all
    the same size within one (2,736 prompts at 2,048: two of 1,368, not 2,048 and 688 — a batch's step costs what
    its widest batch does on the static engine). The plan is fixed given the inputs."""
    ordered = sorted(requests, key=lambda r: (lengths[r.order], r.order))
    if not ordered:
        return []
    count = -(-len(ordered) // batch_size)
    bounds = [len(ordered) * i // count for i in range(count + 1)]
    return [ordered[start:end] for start, end in zip(bounds, bounds[1:])]


class HFBackend:
    """In-process generation with the target's KV cache, length-bucketed left-padded batches."""

    def __init__(self, config: RegenerateConfig):
        self.config = config
        self.generator = load_generator(config, lambda tokenizer: _needs_template(tokenizer, config.target))
        self.tokenizer = self.generator.tokenizer
        self.writes = self.generator.writes

    def plan(self, requests: list[Request]) -> tuple[list[list[Request]], dict[int, list[int]]]:
        encoded = {r.order: encode_prompt(self.tokenizer, r) for r in requests}
        lengths = {k: len(v) for k, v in encoded.items()}
        return _length_buckets(requests, lengths, self.generator.batch_size), encoded

    def generate(self, batch: list[Request], encoded: dict[int, list[int]], batch_seed: int) -> list[Answer]:
        generator, config = self.generator, self.config
        rows = [encoded[r.order] for r in batch]
        new = generator.sample(rows, config.max_new_tokens, config.temperature, config.top_p, batch_seed)
        answers = []
        for tokens in new:
            kept, stopped = generator.until_stop(tokens)
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            answers.append(Answer(text, "stop" if stopped else "length", len(kept) + stopped))
        return answers


class VllmBackend:
    """vLLM in process, with the target's native weights (quantized, MoE) over ``--tensor-parallel-size`` GPUs: up to
    ``--batch-size`` prompts in vLLM at once, the next added as soon as one is answered (vLLM's continuous batching
    kept full: fixed batches each ended with a few long answers decoding alone). Every request has its own seed, so a
    sampled answer does not depend on what it ran beside."""

    writes = True

    def __init__(self, config: RegenerateConfig):
        from ..model.target import generation_eos, load_tokenizer, pick_dtype, resolve_target
        from ..model.vllm_engine import EngineHold, EngineUse, open_llm, start_problem, vllm_runs_on

        self.config = config
        resolved = resolve_target(config.target, config.trust_remote_code)
        problem = start_problem(resolved.path, config)
        if problem:
            raise EagletError(problem)
        self.tokenizer = load_tokenizer(resolved.path, config.trust_remote_code)
        eos = generation_eos(resolved.path)
        self.stop_ids = stop_token_ids(eos, self.tokenizer, _needs_template(self.tokenizer, config.target))
        self.model = str(resolved.path)
        dtype = str(pick_dtype(config.dtype, vllm_runs_on() or "cuda")).removeprefix("torch.")  # as hf does
        # eaglet renders and decodes with the target's own tokenizer: vLLM loads one only for a multimodal wrapper
        self.llm = open_llm(EngineHold.of(config, resolved.path, dtype, config.seed), EngineUse())

    def answers(self, requests: list[Request]) -> Iterator[tuple[list[Request], list[Answer]]]:
        """The requests' answers, in groups as they finish (each group written durably at once)."""
        from vllm.inputs import tokens_input

        from ..model.vllm_engine import EngineQueue, stream_requests

        queue = EngineQueue(self.llm, self.model)
        in_flight = self.config.batch_size or VLLM_IN_FLIGHT
        doing = f"answering {len(requests)} prompts"
        made = lambda r: (tokens_input(encode_prompt(self.tokenizer, r)), self._params(r))  # noqa: E731
        for group in stream_requests(queue, requests, made, in_flight, doing, WRITE_EVERY_S):
            yield [request for request, _ in group], [self._answer(output) for _, output in group]

    def _params(self, request: Request) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sampling = self.config.temperature > 0
        return SamplingParams(
            max_tokens=self.config.max_new_tokens,
            temperature=self.config.temperature,
            top_p=self.config.top_p if sampling else 1.0,
            seed=self.config.seed * 1_000_003 + request.order if sampling else None,
            stop_token_ids=self.stop_ids,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,  # the answer once, when it is done (as LLM sets)
        )

    def _answer(self, output: Any) -> Answer:
        kept, stopped = until_stop(list(output.outputs[0].token_ids), self.stop_ids)
        text = self.tokenizer.decode(kept, skip_special_tokens=True)
        return Answer(text, "stop" if stopped else "length", len(kept) + stopped)


class RequestCancelled(Exception):
    """A request given up because the run is stopping (Ctrl-C, SIGTERM), between two chunks or two attempts."""


class OpenAIBackend:
    """Any OpenAI-compatible server (vLLM, SGLang, llama.cpp): concurrent requests, retries, timeouts. ``cancel()``
    makes every request in flight give up at its next chunk and every retry at once: a stopped run does not wait
    for slow requests (up to --timeout-s × attempts each) to end."""

    RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
    BACKOFF_BASE_S = 0.5
    BACKOFF_MAX_S = 30.0

    def __init__(self, config: RegenerateConfig):
        import httpx

        self.config = config
        headers = {}
        if os.environ.get(config.api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[config.api_key_env]}"
        self.httpx = httpx
        try:
            self.client = httpx.Client(base_url=config.base_url.rstrip("/"), headers=headers, timeout=config.timeout_s)
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
            raise self._unreachable_url(exc) from None
        self.cancelled = threading.Event()

    def _unreachable_url(self, exc: Exception) -> EagletError:
        """--base-url refused by httpx: when the client is made, or (some malformed hosts) at the first request."""
        return EagletError(f"--base-url {self.config.base_url}: not a URL httpx can reach ({exc})")

    def cancel(self) -> None:
        self.cancelled.set()

    def _post(self, payload: dict[str, Any]) -> tuple[int, bytes]:
        """(status, body) of one request, within --timeout-s in all: each read is bounded by it too, so a server that
        drips its bytes is cut at the deadline instead of holding the run for ever."""
        deadline = time.monotonic() + self.config.timeout_s
        with self.client.stream("POST", "/chat/completions", json=payload) as response:
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if self.cancelled.is_set():
                    raise RequestCancelled()
                if time.monotonic() > deadline:
                    raise self.httpx.ReadTimeout(f"no whole answer within --timeout-s {self.config.timeout_s:g}")
            return response.status_code, bytes(body)

    def _answer(self, body: bytes, request: Request) -> Answer:
        """The answer of an OpenAI chat completion, refused in one line when the reply is of another shape or holds
        more tokens than --max-new-tokens asked for (a server that ignores max_tokens)."""
        not_a_completion = (
            f"{self.config.base_url}: the reply for prompt {request.prompt_id} is not an OpenAI chat completion"
        )
        try:
            reply = json.loads(body)
            choice = reply["choices"][0]
            content = choice["message"]["content"]
            usage = reply.get("usage") or {}
            tokens = usage.get("completion_tokens") or 0
        except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError):
            raise EagletError(not_a_completion) from None
        if isinstance(content, list):  # OpenAI's content parts: the text ones, in order
            texts = [
                part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None for part in content
            ]
            content = "".join(texts) if all(isinstance(text, str) for text in texts) else 0
        if not (content is None or isinstance(content, str)) or type(tokens) is not int or tokens < 0:
            raise EagletError(f"{not_a_completion} (content {type(content).__name__}, usage {usage!r:.80})")
        if tokens > self.config.max_new_tokens:
            raise EagletError(
                f"{self.config.base_url}: answered prompt {request.prompt_id} with {tokens} tokens, more than "
                f"--max-new-tokens {self.config.max_new_tokens}: the server ignores max_tokens; check --base-url"
            )
        finish = "length" if choice.get("finish_reason") == "length" else "stop"
        return Answer(content or "", finish, tokens)

    def complete(self, request: Request) -> Answer:
        payload = {
            "model": self.config.model or self.config.target,
            "messages": request.messages,
            "max_tokens": self.config.max_new_tokens,
            "temperature": self.config.temperature,
            "top_p": self.config.top_p,
            "seed": self.config.seed + request.sample_index,
        }
        last_problem = ""
        for attempt in range(self.config.max_retries + 1):
            if self.cancelled.wait(min(self.BACKOFF_MAX_S, self.BACKOFF_BASE_S * 2 ** (attempt - 1)) if attempt else 0):
                raise RequestCancelled()
            try:
                status, body = self._post(payload)
            except (self.httpx.InvalidURL, self.httpx.UnsupportedProtocol) as exc:
                raise self._unreachable_url(exc) from None
            except self.httpx.HTTPError as exc:  # timeouts (each read, or the whole answer), refused connections
                last_problem = f"{type(exc).__name__}: {exc}"
                continue
            if status in self.RETRY_STATUS:
                last_problem = f"HTTP {status}"
                continue
            if status != 200:
                raise EagletError(
                    f"{self.config.base_url}: HTTP {status} for prompt {request.prompt_id} "
                    f"({body[:200].decode('utf-8', 'replace')}); check --base-url and --model"
                )
            return self._answer(body, request)
        raise EagletError(
            f"{self.config.base_url}: prompt {request.prompt_id} failed after {self.config.max_retries + 1} "
            f"attempts ({last_problem}); is the server up? raise --max-retries or --timeout-s"
        )


IN_PROCESS = {"hf": HFBackend, "vllm": VllmBackend}  # the backends that load the target here
VLLM_IN_FLIGHT = 2048  # the vllm backend's prompts in vLLM at once unless --batch-size says
WRITE_EVERY_S = 1.0  # the vllm backend's answers are written durably at most this often (a kill loses no more)


# ---------------------------------------------------------------------------------------------
# The stage


@dataclass
class RegenerateResult:
    out: Path
    written: int
    skipped_done: int
    new_tokens: int
    seconds: float
    manifest: dict[str, Any]


def _answered(futures: dict[Any, Request]) -> Iterator[tuple[list[Request], list[Answer]]]:
    """The answers of the requests that finished (stopped runs: those that arrived while the rest were cancelled)."""
    for future, request in futures.items():
        if future.done() and not future.cancelled() and future.exception() is None:
            yield [request], [future.result()]


def _write_answers(
    groups: Iterable[tuple[list[Request], list[Answer]]],
    settings: dict[str, Any],
    out: Path,
    done: dict[tuple[str, int], str],
    advance: Callable[[int], None],
    writes: bool = True,
) -> int:
    """Each group of answers appended durably as it comes (a batch, a second's answers, one answer); the new tokens."""
    new_tokens = 0
    for batch, answers in groups:
        lines = []
        for request, answer in zip(batch, answers, strict=True):
            if request.key in done:
                continue
            line = json.dumps(output_row(request, answer, settings), ensure_ascii=False)
            done[request.key] = line
            lines.append(line)
            new_tokens += answer.new_tokens
        if writes:
            append_lines_durable(out, lines)
        advance(len(batch))
    return new_tokens


def run_regenerate(config: RegenerateConfig, console: Console | None = None) -> RegenerateResult:
    """The answers of every selected prompt in ``config.out`` (resumed where a killed run stopped), one writer at a
    time."""
    console = console or Console(stderr=True)
    out = Path(config.out)
    if out.suffix != ".jsonl":
        raise EagletError(f"{out}: --out must be a .jsonl file")
    if out.is_dir():
        raise EagletError(f"--out {out}: a directory; give a .jsonl file path")
    check_output_apart(out, [*config.prompts, config.target])
    check_output_dir(out.parent, "--out's directory")
    with output_lock(out):
        return _regenerate(config, out, console)


def _regenerate(config: RegenerateConfig, out: Path, console: Console) -> RegenerateResult:
    from concurrent.futures import ThreadPoolExecutor, as_completed

    settings = settings_of(config)
    requests = plan_requests(config, console)
    if config.backend in IN_PROCESS:
        requests = within_context(config, requests, console)
    done = load_done(out, settings, requests) | blank_done(out, settings, requests)
    skipped = sum(r.key in done for r in requests)
    todo = [r for r in requests if r.key not in done]
    new_tokens = 0
    backend = IN_PROCESS[config.backend](config) if todo and config.backend in IN_PROCESS else None  # before the clock
    started = time.perf_counter()
    if todo:
        with progress_bar("answers", console) as progress:
            task = progress.add_task("regenerate", total=len(requests), completed=skipped)
            advance = lambda n: progress.advance(task, n)  # noqa: E731
            if isinstance(backend, VllmBackend):
                new_tokens = _write_answers(backend.answers(todo), settings, out, done, advance)
            elif backend is not None:
                batches, encoded = backend.plan(requests)  # plan over all requests: fixed batch seeds
                pending = [(i, b) for i, b in enumerate(batches) if any(r.key not in done for r in b)]
                groups = ((b, backend.generate(b, encoded, config.seed * 1_000_003 + i)) for i, b in pending)
                new_tokens = _write_answers(groups, settings, out, done, advance, backend.writes)
            else:
                client = OpenAIBackend(config)
                with ThreadPoolExecutor(max_workers=config.concurrency) as pool:
                    futures = {pool.submit(client.complete, r): r for r in todo}
                    # each answer written as soon as it arrives
                    arrived = (([futures[f]], [f.result()]) for f in as_completed(futures))
                    try:
                        new_tokens = _write_answers(arrived, settings, out, done, advance)
                    except BaseException:  # Ctrl-C, SIGTERM, a request that failed for good
                        client.cancel()  # requests in flight give up at their next chunk, retries at once
                        pool.shutdown(wait=True, cancel_futures=True)
                        _write_answers(_answered(futures), settings, out, done, advance)  # kept, not asked again
                        raise
    seconds = time.perf_counter() - started
    if backend is not None and not backend.writes:
        return RegenerateResult(out, len(todo), skipped, new_tokens, seconds, {})
    blank = finalize(out, requests, done)
    if blank:
        console.print(
            f"[yellow]warning[/] {len(blank)} blank answer(s) (the target ended its turn at once) left out of {out}; "
            f"listed in {answers_manifest(out).name}",
            highlight=False,
        )
    manifest = {
        "schema": "eaglet.regenerated/1",
        "eaglet_version": __version__,
        "settings": settings,
        "config": config.model_dump(),
        "inputs": [{"path": str(p), "sha256": sha256_file(p)} for p in map(resolve_input, config.prompts)],
        "counts": {
            "requests": len(requests),
            "written_this_run": len(todo),
            "already_done": skipped,
            "blank_left_out": len(blank),
        },
        "new_tokens_this_run": new_tokens,
        "seconds_this_run": round(seconds, 3),
        "tokens_per_s": round(new_tokens / seconds, 1) if seconds > 0 and new_tokens else None,
        "blank_answers": [json.loads(line) for line in blank],  # left out of the file: no token to learn
        "hf_engine": backend.generator.used if isinstance(backend, HFBackend) else None,  # engine -> why it ran
        "output_sha256": sha256_file(out),
    }
    write_json_atomic(answers_manifest(out), manifest)
    return RegenerateResult(out, len(todo), skipped, new_tokens, seconds, manifest)
