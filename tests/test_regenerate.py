"""`eaglet regenerate`: hf backend, kill/resume byte-identical, openai backend with retries."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import pytest
from conftest import run_cli, write_jsonl


def prompts_file(tmp_path, n=24):
    rows = [{"id": f"p{i}", "prompt": f"Question {i}: " + "think " * (i % 5), "category": "math"} for i in range(n)]
    return write_jsonl(tmp_path / "prompts.jsonl", rows)


def regen_args(prompts, out, target, *extra):
    return [
        "regenerate",
        prompts,
        "--out",
        out,
        "--target",
        target,
        "--max-new-tokens",
        "12",
        "--batch-size",
        "4",
        "--device",
        "cpu",
        *extra,
    ]


def test_hf_backend_rows_and_manifest(tmp_path, capsys, tiny_target):
    prompts = prompts_file(tmp_path, 6)
    out = tmp_path / "answers.jsonl"
    code, stdout, err = run_cli(regen_args(prompts, out, tiny_target), capsys)
    assert code == 0, err
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(6)]
    for row in rows:
        assert row["messages"][0]["role"] == "user" and row["messages"][-1]["role"] == "assistant"
        assert row["provenance"]["backend"] == "hf" and row["provenance"]["temperature"] == 0.0
        assert row["category"] == "math"
    manifest = json.loads((tmp_path / "answers.jsonl.manifest.json").read_text())
    assert manifest["counts"]["requests"] == 6 and manifest["new_tokens_this_run"] > 0
    # a second run finds everything done and writes nothing new
    code, stdout, _ = run_cli(regen_args(prompts, out, tiny_target), capsys)
    assert code == 0 and "wrote 0 answers" in stdout and "(6 already there)" in stdout


def test_static_engine_writes_the_answers_generate_writes(tmp_path, capsys, tiny_target):
    """Greedy, the static engine (a preallocated cache, run eagerly on CPU) and transformers' generate write the same
    file; the manifest says which engine ran and why."""
    prompts = prompts_file(tmp_path, 6)
    files = {}
    for engine in ("generate", "static"):
        out = files[engine] = tmp_path / f"{engine}.jsonl"
        code, _, err = run_cli(regen_args(prompts, out, tiny_target, "--hf-engine", engine), capsys)
        assert code == 0, err
        used = json.loads((tmp_path / f"{engine}.jsonl.manifest.json").read_text())["hf_engine"]
        assert list(used) == [engine]
    assert files["static"].read_bytes() == files["generate"].read_bytes()


def test_resume_refuses_other_settings(tmp_path, capsys, tiny_target):
    prompts = prompts_file(tmp_path, 2)
    out = tmp_path / "a.jsonl"
    assert run_cli(regen_args(prompts, out, tiny_target), capsys)[0] == 0
    code, _, err = run_cli(regen_args(prompts, out, tiny_target, "--temperature", "0.7"), capsys)
    assert code == 2 and "written with temperature=0.0, this run asks for 0.7" in err


def test_resume_refuses_answers_to_prompts_edited_since(tmp_path, capsys, tiny_target):
    """The same ids with other prompt text (the user fixed the prompts and ran again): the old answers would stand
    in for the new prompts' and be trained on."""
    out = tmp_path / "a.jsonl"
    assert run_cli(regen_args(prompts_file(tmp_path, 3), out, tiny_target), capsys)[0] == 0
    written = out.read_bytes()
    edited = [{"id": f"p{i}", "prompt": f"Another question {i}"} for i in range(3)]
    edited_file = write_jsonl(tmp_path / "edited.jsonl", edited)
    code, _, err = run_cli(regen_args(edited_file, out, tiny_target), capsys)
    assert code == 2 and f"{out}:1: answers another prompt than id 'p0' holds now ({edited_file}:1)" in err, err
    assert out.read_bytes() == written


def test_resume_refuses_to_drop_answers_to_prompts_no_longer_asked(tmp_path, capsys, tiny_target):
    """Fewer prompts into the same --out (another file, --max-prompts lowered): the finished file holds this run's
    prompts only, so the answers already paid for would be dropped from it."""
    out = tmp_path / "a.jsonl"
    prompts = prompts_file(tmp_path, 3)
    assert run_cli(regen_args(prompts, out, tiny_target), capsys)[0] == 0
    written = out.read_bytes()
    code, _, err = run_cli(regen_args(prompts, out, tiny_target, "--max-prompts", "2"), capsys)
    assert code == 2 and f"{out}:3: an answer to id 'p2', which this run does not ask" in err, err
    assert out.read_bytes() == written


def test_torn_last_line_is_dropped_and_redone(tmp_path, capsys, tiny_target):
    prompts = prompts_file(tmp_path, 4)
    out = tmp_path / "a.jsonl"
    assert run_cli(regen_args(prompts, out, tiny_target), capsys)[0] == 0
    complete = out.read_bytes()
    lines = complete.splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:2]) + lines[2][:25])  # a kill mid-write
    assert run_cli(regen_args(prompts, out, tiny_target), capsys)[0] == 0
    assert out.read_bytes() == complete


@pytest.mark.parametrize(
    "mine,message",
    [
        (b'{"note": 1}\n{"note": 2}', ":1: not a row written by `eaglet regenerate`"),
        (b'{"note": 2}', "holds no complete row of `eaglet regenerate` (11 bytes without a newline)"),
    ],
    ids=["last-line-without-newline", "one-line-without-newline"],
)
def test_a_users_file_as_out_is_refused_untouched(tmp_path, capsys, tiny_target, mine, message):
    """A file of the user's whose last line has no newline looked like a kill's torn row: it was cut, then refused
    (issue 60's data loss). Now nothing is written, truncated or renamed before the file is known to be eaglet's."""
    prompts = prompts_file(tmp_path, 2)
    out = tmp_path / "notes.jsonl"
    out.write_bytes(mine)
    code, _, err = run_cli(regen_args(prompts, out, tiny_target), capsys)
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err
    written = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))  # the writers' lock stays
    assert out.read_bytes() == mine and written == ["notes.jsonl", "prompts.jsonl"]


@pytest.mark.parametrize("skip_preflight", [False, True])
def test_a_prompt_too_long_for_the_target_is_refused_or_skipped_before_the_weights_load(
    tmp_path, capsys, tiny_target, skip_preflight
):
    """The tiny target's context is 512 positions: a prompt of ~600 tokens (or one that with --max-new-tokens passes
    512) would be generated at positions the target never saw. Refused naming its row, or dropped with
    --on-bad-row skip, and the other prompts answered."""
    rows = [
        {"id": "short", "prompt": "Question: think"},
        {"id": "long", "prompt": "word " * 600},
        {"id": "short2", "prompt": "Another question"},
    ]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "a.jsonl"
    extra = ["--skip-preflight"] if skip_preflight else []
    code, _, err = run_cli(regen_args(prompts, out, tiny_target, *extra), capsys)
    assert code == 2 and f"{prompts}:2: the prompt is " in err and "passes the target's context of 512" in err, err
    assert "--on-bad-row skip" in err and "Traceback" not in err and not out.exists()
    code, _, err = run_cli(regen_args(prompts, out, tiny_target, "--on-bad-row", "skip", *extra), capsys)
    assert code == 0, err
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["short", "short2"]
    short = write_jsonl(tmp_path / "short.jsonl", rows[:1])
    code, _, err = run_cli(regen_args(short, tmp_path / "b.jsonl", tiny_target, "--max-new-tokens", "510"), capsys)
    assert code == 2 and "with --max-new-tokens 510 that passes the target's context of 512" in err, err


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling",
    [[], ["--temperature", "0.9", "--top-p", "0.9", "--n", "2"], ["--temperature", "0.9", "--hf-engine", "static"]],
    ids=["greedy", "sampled", "sampled-static"],
)
def test_sigkill_resume_is_byte_identical(tmp_path, capsys, tiny_target, sampling):
    prompts = prompts_file(tmp_path, 40)
    reference = tmp_path / "reference.jsonl"
    assert run_cli(regen_args(prompts, reference, tiny_target, *sampling), capsys)[0] == 0
    out = tmp_path / "killed.jsonl"
    cmd = [sys.executable, "-m", "eaglet.cli", *map(str, regen_args(prompts, out, tiny_target, *sampling))]
    for kill_after_lines in (3, 11, 30):
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= kill_after_lines:
                break
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    assert out.read_bytes() == reference.read_bytes()


@pytest.mark.slow
def test_ctrl_c_says_the_same_command_resumes_and_it_does(tmp_path, capsys, tiny_target):
    prompts = prompts_file(tmp_path, 40)
    reference = tmp_path / "reference.jsonl"
    assert run_cli(regen_args(prompts, reference, tiny_target), capsys)[0] == 0
    out = tmp_path / "interrupted.jsonl"
    cmd = [sys.executable, "-m", "eaglet.cli", *map(str, regen_args(prompts, out, tiny_target))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not (out.exists() and out.read_bytes().count(b"\n") >= 3):
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("interrupted; run the same command again: regenerate,")
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    assert out.read_bytes() == reference.read_bytes()


class StubServer:
    """A local OpenAI-compatible server: answers with the reversed prompt; fails the first call per prompt."""

    def __init__(
        self,
        fail_first: int = 1,
        blank_marker: str | None = None,
        reply: Callable[[str], object] | None = None,
        drip_s: float | None = None,
        drips: Callable[[str], bool] = lambda prompt: True,
    ):
        """``reply(prompt)``: the JSON document to answer with instead; ``drip_s``: send it a byte at a time (the
        prompts ``drips`` says, the others at once)."""
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # /v1/models, as OpenAI-compatible servers answer it
                data = json.dumps({"object": "list", "data": [{"id": "stub", "object": "model"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][-1]["content"]
                with stub.lock:
                    stub.calls[prompt] = stub.calls.get(prompt, 0) + 1
                    attempt = stub.calls[prompt]
                if attempt <= fail_first:
                    self.send_response(503)
                    self.end_headers()
                    return
                answer = " \n " if blank_marker and blank_marker in prompt else prompt[::-1]
                payload = {
                    "choices": [{"message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}],
                    "usage": {"completion_tokens": 5},
                }
                data = json.dumps(reply(prompt) if reply else payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if drip_s is None or not drips(prompt):
                    self.wfile.write(data)
                    return
                for byte in data:  # a server that never stops sending, never finishes
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(drip_s)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __exit__(self, *exc):
        self.server.shutdown()


def test_openai_backend_retries_and_order(tmp_path, capsys):
    prompts = prompts_file(tmp_path, 10)
    out = tmp_path / "a.jsonl"
    with StubServer(fail_first=1) as url:
        code, stdout, err = run_cli(
            [
                "regenerate",
                prompts,
                "--out",
                out,
                "--backend",
                "openai",
                "--base-url",
                url,
                "--model",
                "stub",
                "--concurrency",
                "4",
                "--max-retries",
                "2",
            ],
            capsys,
        )
    assert code == 0, err
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(10)]  # plan order despite concurrency
    assert rows[3]["messages"][-1]["content"] == rows[3]["messages"][0]["content"][::-1]
    assert rows[0]["provenance"]["target"] == "stub"


def test_blank_answers_are_left_out_listed_and_not_asked_again(tmp_path, capsys, tiny_target):
    """An answer of only whitespace (a target that ends its turn at once) teaches no token and is a bad row for
    prepare: the finished file leaves it out, the manifest lists it, a rerun does not ask for it again, and the file
    prepares."""
    rows = [{"id": f"p{i}", "prompt": f"Question {i}" + (" BLANK" if i in (1, 4) else "")} for i in range(6)]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "a.jsonl"
    args = ["regenerate", prompts, "--out", out, "--backend", "openai", "--model", "stub"]
    with StubServer(fail_first=0, blank_marker="BLANK") as url:
        code, stdout, err = run_cli([*args, "--base-url", url], capsys)
        assert code == 0, err
        assert "2 blank answer(s) (the target ended its turn at once) left out of" in err
        assert [json.loads(l)["id"] for l in out.read_text().splitlines()] == ["p0", "p2", "p3", "p5"]
        manifest = json.loads((tmp_path / "a.jsonl.manifest.json").read_text())
        assert [r["id"] for r in manifest["blank_answers"]] == ["p1", "p4"]
        assert manifest["counts"]["blank_left_out"] == 2
        code, stdout, err = run_cli([*args, "--base-url", url], capsys)
        assert code == 0 and "wrote 0 answers" in stdout and "(6 already there)" in stdout, err
    code, _, err = run_cli(["prepare", out, "--out", tmp_path / "prepared", "--target", tiny_target], capsys)
    assert code == 0, err


def _completion(content: object, usage: object = None) -> dict:
    return {
        "choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"completion_tokens": 3} if usage is None else usage,
    }


@pytest.mark.parametrize(
    "reply,message",
    [
        (lambda p: _completion(7), "is not an OpenAI chat completion (content int"),
        (lambda p: _completion("ok", usage=["x"]), "is not an OpenAI chat completion"),
        (lambda p: _completion("ok", usage={"completion_tokens": "many"}), "is not an OpenAI chat completion"),
        (lambda p: {"choices": []}, "is not an OpenAI chat completion"),
        (lambda p: _completion("far too long", usage={"completion_tokens": 500}), "with 500 tokens, more than"),
    ],
    ids=["content-a-number", "usage-a-list", "tokens-a-text", "no-choice", "longer-than-asked"],
)
def test_a_reply_of_another_shape_is_one_line(tmp_path, capsys, reply, message):
    prompts = prompts_file(tmp_path, 1)
    out = tmp_path / "a.jsonl"
    args = ["regenerate", prompts, "--out", out, "--backend", "openai", "--model", "stub", "--max-new-tokens", "64"]
    with StubServer(fail_first=0, reply=reply) as url:
        code, _, err = run_cli([*args, "--base-url", url], capsys)
    last = err.strip().splitlines()[-1]  # after the progress bar
    assert code == 2 and last.startswith("error:") and message in last and err.count("error:") == 1, err
    assert "Traceback" not in err and not out.exists()


def test_openai_content_parts_are_the_answer(tmp_path, capsys):
    """Content as OpenAI's parts (valid OpenAI): the text parts joined are the answer."""
    prompts = prompts_file(tmp_path, 1)
    out = tmp_path / "a.jsonl"
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]
    with StubServer(fail_first=0, reply=lambda p: _completion(parts)) as url:
        code, _, err = run_cli(["regenerate", prompts, "--out", out, "--backend", "openai", "--base-url", url], capsys)
    assert code == 0, err
    assert json.loads(out.read_text())["messages"][-1]["content"] == "Hello there"


def test_a_server_that_drips_its_answer_is_cut_at_the_deadline(tmp_path, capsys):
    """--timeout-s bounds the whole request: a server sending a byte every 0.05 s (each read well inside the
    timeout) is cut at it and retried, then given up on in one line, in seconds rather than for ever."""
    prompts = prompts_file(tmp_path, 1)
    args = ["regenerate", prompts, "--out", tmp_path / "a.jsonl", "--backend", "openai", "--max-retries", "1"]
    started = time.monotonic()
    with StubServer(fail_first=0, drip_s=0.05) as url:
        code, _, err = run_cli([*args, "--timeout-s", "1", "--base-url", url, "--skip-preflight"], capsys)
    assert code == 2 and "failed after 2 attempts (ReadTimeout: no whole answer within --timeout-s 1)" in err, err
    assert time.monotonic() - started < 10


def test_ctrl_c_with_slow_requests_in_flight_stops_at_once_and_keeps_what_arrived(tmp_path):
    """Ctrl-C while requests drip from a slow server (each would take ~20 s, retried up to 3 times): the run stops
    within seconds, not after every request in flight and its retries; the answer that arrived is in the file; the
    same command against a healthy server finishes the rest."""
    prompts = prompts_file(tmp_path, 6)
    first = json.loads(prompts.read_text().splitlines()[0])["prompt"]
    out = tmp_path / "a.jsonl"
    with StubServer(fail_first=0, drip_s=0.1, drips=lambda prompt: prompt != first) as url:
        args = ["regenerate", prompts, "--out", out, "--backend", "openai", "--base-url", url, "--model", "stub"]
        cmd = [sys.executable, "-m", "eaglet.cli", *map(str, args), "--concurrency", "4", "--max-retries", "2"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (out.exists() and out.read_text().strip()):
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before the slow requests were in flight"
        time.sleep(0.3)  # the slow requests mid-answer
        stopped = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - stopped < 5, err
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["messages"][0]["content"] for row in rows] == [first]
    with StubServer(fail_first=0) as url:
        args = ["regenerate", prompts, "--out", out, "--backend", "openai", "--base-url", url, "--model", "stub"]
        assert (
            subprocess.run([sys.executable, "-m", "eaglet.cli", *map(str, args)], capture_output=True).returncode == 0
        )
    assert len(out.read_text().splitlines()) == 6


def test_a_malformed_base_url_is_one_line(tmp_path, capsys):
    prompts = prompts_file(tmp_path, 1)
    args = ["regenerate", prompts, "--out", tmp_path / "a.jsonl", "--backend", "openai", "--base-url", "http://[::1"]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "--base-url http://[::1: not a URL" in err and "Traceback" not in err, err
    code, _, err = run_cli([*args, "--skip-preflight"], capsys)
    assert code == 2 and "--base-url http://[::1: not a URL" in err and "Traceback" not in err, err


def test_openai_backend_gives_up_with_one_line(tmp_path, capsys):
    prompts = prompts_file(tmp_path, 2)
    with StubServer(fail_first=100) as url:
        code, _, err = run_cli(
            [
                "regenerate",
                prompts,
                "--out",
                tmp_path / "a.jsonl",
                "--backend",
                "openai",
                "--base-url",
                url,
                "--max-retries",
                "1",
            ],
            capsys,
        )
    assert code == 2 and "failed after 2 attempts (HTTP 503)" in err


def test_openai_unreachable_server(tmp_path, capsys):
    prompts = prompts_file(tmp_path, 1)
    args = [
        "regenerate",
        prompts,
        "--out",
        tmp_path / "a.jsonl",
        "--backend",
        "openai",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--max-retries",
        "0",
        "--timeout-s",
        "2",
    ]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "preflight failed for regenerate: server: http://127.0.0.1:9/v1: not reachable" in err
    code, _, err = run_cli([*args, "--skip-preflight"], capsys)
    assert code == 2 and "is the server up?" in err


def test_split_and_demo_prompts(tmp_path, capsys):
    from eaglet.data.readers import Conversation, read_conversations
    from eaglet.resources import demo_prompts_path

    rows = [r for r in read_conversations([demo_prompts_path()]) if isinstance(r, Conversation)]
    assert len(rows) >= 1000 and len({r.messages[-1]["content"] for r in rows}) == len(rows)
    categories = {r.meta["category"] for r in rows}
    assert categories == {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    for category in categories:
        assert sum(r.meta["category"] == category and r.meta["split"] == "heldout" for r in rows) >= 10


def test_mt_bench_prompts_are_held_out_apart_from_the_demo_prompts():
    """`mt-bench` is what a draft is judged on as prompts written elsewhere: all 80, all held out, none shared with
    the demo prompts a draft trains on."""
    from eaglet.data.readers import Conversation, read_conversations
    from eaglet.data.synthesize import shingles, similarity
    from eaglet.resources import demo_prompts_path, resolve_input

    rows = [r for r in read_conversations([resolve_input("mt-bench")]) if isinstance(r, Conversation)]
    assert len(rows) == 80 and len({r.id for r in rows}) == 80 and {r.meta["split"] for r in rows} == {"heldout"}
    categories = {r.meta["category"] for r in rows}
    assert all(sum(r.meta["category"] == c for r in rows) == 10 for c in categories) and len(categories) == 8
    demo = [shingles(r.messages[-1]["content"]) for r in read_conversations([demo_prompts_path()])]
    closest = max(similarity(shingles(r.messages[-1]["content"]), other) for r in rows for other in demo)
    assert closest < 0.2


def test_vllm_backend_where_vllm_is_not_installed_is_one_line_and_writes_nothing(tmp_path, capsys, tiny_target):
    prompts = prompts_file(tmp_path, 2)
    out = tmp_path / "answers.jsonl"
    code, _, err = run_cli(["regenerate", prompts, "--out", out, "--target", tiny_target, "--backend", "vllm"], capsys)
    assert code == 2 and "preflight failed for regenerate: vllm: --backend vllm: vLLM is not installed" in err, err
    assert "Traceback" not in err and not out.exists()
    code, out_text, _ = run_cli(
        ["preflight", "regenerate", prompts, "--out", out, "--target", tiny_target, "--backend", "vllm", "--json"],
        capsys,
    )
    checks = {check["name"]: check for check in json.loads(out_text)["checks"]}
    assert code != 0 and checks["vllm"]["status"] == "fail" and "not installed" in checks["vllm"]["detail"]
    assert checks["chat template"]["status"] == "pass"  # the target's template was checked too


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size is the vllm backend's"),
        (["--backend", "vllm", "--placement", "split"], "vLLM places the target itself"),
        (["--backend", "vllm", "--gpu-memory-utilization", "1.2"], "--gpu-memory-utilization: Input should be less"),
        (["--backend", "vllm", "--hf-engine", "static"], "--hf-engine is the hf backend's; --backend vllm generates"),
        (["--backend", "openai", "--hf-engine", "generate"], "--hf-engine is the hf backend's; --backend openai"),
    ],
)
def test_vllm_settings_that_contradict_the_backend_are_refused(tmp_path, capsys, tiny_target, extra, message):
    prompts = prompts_file(tmp_path, 2)
    out = tmp_path / "answers.jsonl"
    code, _, err = run_cli(["regenerate", prompts, "--out", out, "--target", tiny_target, *extra], capsys)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not out.exists()


def test_batches_are_the_fewest_and_even():
    """The static engine pays for its widest batch on every step: 2,736 prompts at 2,048 a batch run as two of
    1,368, not 2,048 and 688; prompts of similar length share a batch; every prompt is in exactly one."""
    from eaglet.data.regenerate import Request, _length_buckets

    requests = [Request(i, str(i), i % 3, [{"role": "user", "content": "x"}], None) for i in range(2736)]
    lengths = {r.order: (r.order * 7919) % 500 for r in requests}
    batches = _length_buckets(requests, lengths, 2048)
    assert [len(b) for b in batches] == [1368, 1368]
    assert max(lengths[r.order] for r in batches[0]) <= min(lengths[r.order] for r in batches[1])
    assert sorted(r.order for b in batches for r in b) == list(range(2736))
    assert [len(b) for b in _length_buckets(requests[:9], lengths, 4)] == [3, 3, 3]
    assert _length_buckets([], lengths, 4) == []


def test_the_engine_is_checked_before_the_weights_load(tmp_path, capsys, tiny_target):
    """Preflight says which engine writes the text; `--hf-engine static` on a target it cannot run (sliding-window
    attention) is refused from config.json, before any weight loads, naming the way out."""
    from targets import tiny_target as tiny_arch

    prompts = prompts_file(tmp_path, 2)
    out = tmp_path / "a.jsonl"

    def engine_check(target, *extra):
        args = ["preflight", "regenerate", prompts, "--out", out, "--target", target, "--device", "cpu", "--json"]
        code, text, _ = run_cli([*args, *extra], capsys)
        return code, {c["name"]: c for c in json.loads(text)["checks"]}["hf engine"]

    assert engine_check(tiny_target)[1]["detail"] == "transformers' generate (auto on a CPU)"
    code, check = engine_check(tiny_target, "--hf-engine", "static")
    assert code == 0 and check["status"] == "pass" and check["detail"].startswith("static:")
    sliding = tiny_arch(tmp_path / "gpt-oss", "gpt_oss")
    code, check = engine_check(sliding, "--hf-engine", "static")
    assert code != 0 and check["status"] == "fail" and "sliding-window" in check["detail"]
    code, _, err = run_cli(regen_args(prompts, out, sliding, "--hf-engine", "static"), capsys)
    assert code == 2 and "preflight failed for regenerate: hf engine: --hf-engine static: GptOssConfig" in err, err
    assert "use --hf-engine generate" in err and not out.exists()


def test_a_split_no_row_has_names_the_splits_the_rows_have(tmp_path, capsys):
    """--split train over rows all marked 'test' said "no prompts selected (split=train)"; it names what is there."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": "hi", "split": "test"} for i in range(3)])
    for skip in ((), ("--skip-preflight",)):
        code, _, err = run_cli(
            ["regenerate", prompts, "--out", tmp_path / "a.jsonl", "--split", "train", *skip], capsys
        )
        assert code == 2 and "no prompts of --split train (the rows' splits: 'test' 3)" in err, err
        assert "pass --split all" in err and not (tmp_path / "a.jsonl").exists()


def test_answers_keep_their_prompts_split_and_prepare_leaves_the_held_out_ones_out(tmp_path, capsys, tiny_target):
    """`eaglet regenerate demo` (every split) then `eaglet prepare` trained on the held-out prompts `eaglet eval`
    scores by default: the answers carry their prompt's split, and prepare leaves the held-out ones out."""
    rows = [{"id": f"p{i}", "prompt": f"Question {i}?", "split": "heldout" if i < 2 else "train"} for i in range(4)]
    rows.append({"id": "p4", "prompt": "No split here?"})
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    answers = tmp_path / "a.jsonl"
    code, _, err = run_cli(regen_args(prompts, answers, tiny_target), capsys)
    assert code == 0, err
    written = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [row.get("split") for row in written] == ["heldout", "heldout", "train", "train", None]
    code, _, err = run_cli(["prepare", answers, "--target", tiny_target, "--out", tmp_path / "prepared"], capsys)
    assert code == 0 and "left out 2 rows" in err, err
    import pyarrow.parquet as pq

    ids = pq.read_table(tmp_path / "prepared" / "samples.parquet").column("id").to_pylist()
    assert ids == ["p2", "p3", "p4"]
