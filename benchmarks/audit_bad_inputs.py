"""Run `eaglet` on inputs a new user gets wrong and sort each outcome: refused (non-zero exit, one `error:` line, no
traceback), a traceback, accepted (exit 0), or still running at the time limit. Accepted is not always wrong (a
UTF-8 BOM, a JSON array of rows, a conversation ending on a user turn are fine); each case says what it expects, and
the summary counts the cases whose outcome is not that.

    python benchmarks/audit_bad_inputs.py --out benchmarks/results/audit_bad_inputs_cpu.json [--only NAME ...]

Set-up (embedded target, CPU, ~1 min): 4 demo prompts answered, prepared, extracted, a draft trained 2 steps. Each
case runs the real CLI in a scratch directory that is checked afterwards: a refused case must leave it as it was.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASE_LIMIT_S = 240
SET_UP_TOKEN_BUDGET = 256
EAGLET = [sys.executable, "-m", "eaglet.cli"]


def run(args: list[str], cwd: Path, limit: float = CASE_LIMIT_S) -> tuple[str, int | None, str]:
    """(outcome, exit code, output) of one eaglet command."""
    try:
        done = subprocess.run(
            [*EAGLET, *args], capture_output=True, text=True, timeout=limit, cwd=cwd, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return "timeout", None, ""
    output = done.stderr + done.stdout
    eaglet_traceback = "Traceback" in output and "eaglet" in output.split("Traceback", 1)[1][:4000]
    if eaglet_traceback:
        return "traceback", done.returncode, output
    return ("accepted" if done.returncode == 0 else "refused"), done.returncode, output


def train_draft(store: object, draft: object, token_budget: int) -> list:
    """`eaglet train` of the set-up's 2-step draft (another budget: a resume the checkpoint refuses)."""
    return ["train", "--store", store, "--out", draft, "--max-steps", "2", "--token-budget", str(token_budget)] + [
        "--eval-fraction",
        "0",
    ]


def set_up(root: Path) -> dict[str, Path]:
    """A prepared set, a store and a draft of the embedded target, made by the CLI itself."""
    root.mkdir(parents=True)
    answers, prepared, store, draft = root / "answers.jsonl", root / "prepared", root / "store", root / "draft"
    steps = [
        ["regenerate", "demo", "--split", "train", "--max-prompts", "4", "--max-new-tokens", "24", "--out", answers],
        ["prepare", answers, "--out", prepared],
        ["extract", "--prepared", prepared, "--out", store, "--reserve-gb", "0"],
        train_draft(store, draft, SET_UP_TOKEN_BUDGET),
    ]
    for step in steps:
        outcome, code, output = run([str(a) for a in step], root, limit=600)
        if outcome != "accepted":
            raise SystemExit(f"set-up step {step[0]} failed ({outcome}, exit {code}):\n{output[-2000:]}")
    return {"prepared": prepared, "store": store, "draft": draft, "answers": answers}


def cut_vocab(prepared: Path, copy: Path) -> Path:
    """A copy of the prepared set with its draft vocabulary cut to 10 bytes (training reads it after extraction)."""
    shutil.copytree(prepared, copy)
    (copy / "vocab.safetensors").write_bytes((copy / "vocab.safetensors").read_bytes()[:10])
    return copy


def copy_file(source: Path, copy: Path) -> Path:
    shutil.copy(source, copy)
    return copy


def embedded_dir() -> Path:
    """The embedded target's converted directory (the set-up made it)."""
    from eaglet.model.target import resolve_target

    return Path(resolve_target("embedded").path)


def shard_missing(target: Path, copy: Path) -> Path:
    """A copy of ``target`` published as two shards and an index, the second shard not downloaded."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(target, copy, ignore=shutil.ignore_patterns("model.safetensors", "eaglet-target.json"))
    tensors = load_file(target / "model.safetensors")
    first = sorted(tensors)[::2]
    save_file({k: tensors[k] for k in first}, copy / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {
        k: "model-00001-of-00002.safetensors" if k in first else "model-00002-of-00002.safetensors" for k in tensors
    }
    (copy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return copy


def layers_edited(draft: Path, copy: Path) -> Path:
    """A copy of the trained draft whose config.json names the aux layers one lower (an engine's convention
    "fixed" by hand)."""
    shutil.copytree(draft, copy)
    config = json.loads((copy / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def made_elsewhere_other_vocab(draft: Path, copy: Path) -> Path:
    """The draft as another trainer would leave it (no eaglet record), for a vocabulary 64 tokens larger."""
    shutil.copytree(draft, copy)
    config = json.loads((copy / "config.json").read_text())
    config.pop("aux_layer_convention")
    (copy / "config.json").write_text(json.dumps(config | {"vocab_size": config["vocab_size"] + 64}))
    (copy / "train_config.json").unlink(missing_ok=True)
    return copy


def answered_for_other_prompts(answers: Path, copy: Path) -> Path:
    """A prompts file with the ids of the set-up's answers and other text (the prompts edited since)."""
    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    copy.write_text(
        "".join(json.dumps({"id": r["id"], "prompt": f"Edited prompt {i}"}) + "\n" for i, r in enumerate(rows))
    )
    return copy


def longer_context_sibling(target: Path, copy: Path, context: int) -> Path:
    """``target`` with a longer context in config.json (its weights linked): the same tokenizer, another target."""
    copy.mkdir()
    for file in target.iterdir():
        if file.name not in ("eaglet-target.json", "config.json"):
            (copy / file.name).symlink_to(file)
    config = json.loads((target / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"max_position_embeddings": context}))
    return copy


def prepared_past_context(w: Path) -> Path:
    """A set prepared for a 16k-context sibling of the embedded target, one sample of ~9k tokens."""
    sibling = longer_context_sibling(embedded_dir(), w / "sibling", 16384)
    data = w / "long_conversation.jsonl"
    turns = [{"role": "user", "content": "word " * 9000}, {"role": "assistant", "content": "ok then " * 50}]
    data.write_text(json.dumps({"id": "long", "messages": turns}) + "\n")
    out = w / "prepared_16k"
    args = ["prepare", str(data), "--out", str(out), "--target", str(sibling), "--max-len", "16384"]
    outcome, code, output = run(args, w)
    if outcome != "accepted":
        raise SystemExit(f"preparing for the 16k sibling failed ({outcome}, exit {code}):\n{output[-2000:]}")
    return out


def checkpoint_with_nan_moment(draft: Path, copy: Path) -> Path:
    """A copy of the trained draft whose latest checkpoint holds a NaN Adam moment, its checksum recorded anew (as a
    faulty writer would have left it)."""
    import hashlib

    from safetensors.torch import load_file, save_file

    shutil.copytree(draft, copy)
    checkpoint = sorted((copy / "checkpoints").glob("step-*"))[-1]
    tensors = load_file(checkpoint / "optimizer.safetensors")
    moment = next(name for name in sorted(tensors) if name.endswith("/exp_avg"))
    tensors[moment].view(-1)[0] = float("nan")
    save_file(tensors, checkpoint / "optimizer.safetensors")
    trainer = json.loads((checkpoint / "trainer.json").read_text())
    digest = hashlib.sha256((checkpoint / "optimizer.safetensors").read_bytes()).hexdigest()
    trainer.setdefault("files", {})["optimizer.safetensors"] = digest
    (checkpoint / "trainer.json").write_text(json.dumps(trainer))
    return copy


def target_of_a_billion_layers(copy: Path) -> Path:
    """A copy of the embedded target whose config.json claims a billion layers (it hung building them)."""
    shutil.copytree(embedded_dir(), copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 1_000_000_000}))
    return copy


def prepared_with_an_empty_sample(prepared: Path, copy: Path) -> Path:
    """A copy of the prepared set whose fifth sample has no tokens, its checksum recorded anew."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    shutil.copytree(prepared, copy)
    table = pq.read_table(copy / "samples.parquet")
    ids, masks = table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()
    ids[-1], masks[-1] = [], []
    table = table.set_column(1, "input_ids", pa.array(ids, type=pa.list_(pa.int32())))
    pq.write_table(
        table.set_column(2, "loss_mask", pa.array(masks, type=pa.list_(pa.uint8()))), copy / "samples.parquet"
    )
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"]["samples.parquet"] = hashlib.sha256((copy / "samples.parquet").read_bytes()).hexdigest()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def project_with_eval_folder(w: Path) -> Path:
    """A user's project directory with an eval/ folder of their own."""
    (w / "project" / "eval").mkdir(parents=True)
    (w / "project" / "eval" / "score.py").write_text("print('mine')\n")
    return w / "project"


def cases(w: Path, made: dict[str, Path]) -> list[tuple[str, list, str]]:
    """(name, arguments, expected outcome). Files the cases read are written into ``w`` here."""

    def file(name: str, content: str | bytes) -> Path:
        path = w / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    def conversation(*turns: tuple[str, object], row_id: object = "c1") -> str:
        return json.dumps({"id": row_id, "messages": [{"role": r, "content": c} for r, c in turns]}) + "\n"

    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "lookup"}}]}
    trace = [{"role": "user", "content": "find it"}, call, {"role": "tool", "content": "42"}]
    agent_trace = json.dumps({"id": "t1", "messages": trace + [{"role": "assistant", "content": "It is 42."}]}) + "\n"

    import torch

    gpu_demo = "accepted" if torch.cuda.is_available() else "refused"  # without a GPU its sizes would run for hours
    prompt = file("ok.jsonl", json.dumps({"id": "a", "prompt": "Hello there, how are you?"}) + "\n")
    huge = file("huge.jsonl", json.dumps({"id": "h", "prompt": "word " * 9000}) + "\n")
    sharegpt = file(
        "sg.jsonl",
        json.dumps({"id": "s", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})
        + "\n",
    )
    config_only = w / "config_only"
    file("config_only/config.json", json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}))
    yaml_base = "target: embedded\nregenerate:\n  prompts: [demo]\n  max_prompts: 2\n"
    store, draft, prepared = (str(made[k]) for k in ("store", "draft", "prepared"))
    return [
        # synthesize
        ("synthesize --count 0", ["synthesize", "--out", w / "s0.jsonl", "--count", "0"], "refused"),
        (
            "synthesize --heldout-fraction 1.5",
            ["synthesize", "--out", w / "s1.jsonl", "--heldout-fraction", "1.5"],
            "refused",
        ),
        ("synthesize --top-p 0", ["synthesize", "--out", w / "s2.jsonl", "--top-p", "0"], "refused"),
        ("synthesize --out a directory", ["synthesize", "--out", w], "refused"),
        ("synthesize --out a file of the user's", ["synthesize", "--out", prompt, "--count", "2"], "refused"),
        ("synthesize --out .txt", ["synthesize", "--out", w / "s.txt"], "refused"),
        (
            "synthesize --device cuda without one",
            ["synthesize", "--out", w / "s6.jsonl", "--device", "cuda"],
            "refused",
        ),
        ("synthesize --device tpu", ["synthesize", "--out", w / "s7.jsonl", "--device", "tpu"], "refused"),
        ("synthesize --target missing", ["synthesize", "--out", w / "s8.jsonl", "--target", w / "nope"], "refused"),
        (
            "synthesize --target an 8-byte gguf",
            ["synthesize", "--out", w / "s9.jsonl", "--target", file("m.gguf", b"GGUF\x03\x00\x00\x00")],
            "refused",
        ),
        (
            "synthesize --target config.json only",
            ["synthesize", "--out", w / "s10.jsonl", "--target", config_only],
            "refused",
        ),
        (
            "synthesize --placement tp without torchrun",
            ["synthesize", "--out", w / "s13.jsonl", "--placement", "tp"],
            "refused",
        ),
        ("synthesize --replica 2/1", ["synthesize", "--out", w / "s14.jsonl", "--replica", "2/1"], "refused"),
        # regenerate
        ("regenerate an empty file", ["regenerate", file("empty.jsonl", ""), "--out", w / "r0.jsonl"], "refused"),
        (
            "regenerate a prompt that is a number",
            ["regenerate", file("pint.jsonl", '{"id": "a", "prompt": 5}\n'), "--out", w / "r1.jsonl"],
            "refused",
        ),
        (
            "regenerate duplicate ids",
            ["regenerate", file("dup.jsonl", prompt.read_text() * 2), "--out", w / "r2.jsonl"],
            "refused",
        ),
        ("regenerate --n 0", ["regenerate", prompt, "--out", w / "r3.jsonl", "--n", "0"], "refused"),
        (
            "regenerate --backend sglang",
            ["regenerate", prompt, "--out", w / "r5.jsonl", "--backend", "sglang"],
            "refused",
        ),
        (
            "regenerate openai, no server",
            [
                "regenerate",
                prompt,
                "--out",
                w / "r6.jsonl",
                "--backend",
                "openai",
                "--base-url",
                "http://127.0.0.1:9",
                "--max-retries",
                "0",
                "--timeout-s",
                "2",
            ],
            "refused",
        ),
        (
            "regenerate a split with no rows",
            ["regenerate", prompt, "--out", w / "r8.jsonl", "--split", "heldout"],
            "refused",
        ),
        (
            "regenerate an unknown role",
            ["regenerate", file("mr.jsonl", conversation(("wizard", "hi"))), "--out", w / "r10.jsonl"],
            "refused",
        ),
        (
            "regenerate a UTF-16 file",
            ["regenerate", file("u16.jsonl", prompt.read_text().encode("utf-16")), "--out", w / "r11.jsonl"],
            "refused",
        ),
        (
            "regenerate a UTF-8 BOM",
            [
                "regenerate",
                file("bom.jsonl", b"\xef\xbb\xbf" + prompt.read_bytes()),
                "--out",
                w / "r12.jsonl",
                "--max-new-tokens",
                "2",
            ],
            "accepted",
        ),
        (
            "regenerate a .gz",
            ["regenerate", file("x.jsonl.gz", b"\x1f\x8b\x08\x00garbage"), "--out", w / "r14.jsonl"],
            "refused",
        ),
        ("regenerate --out = the input", ["regenerate", prompt, "--out", prompt], "refused"),
        (
            "regenerate --out a file of other rows",
            ["regenerate", prompt, "--out", file("other.jsonl", "not json\n")],
            "refused",
        ),
        (
            "regenerate a prompt past the context",
            ["regenerate", huge, "--out", w / "r17.jsonl", "--max-new-tokens", "2"],
            "refused",
        ),
        (
            "regenerate --max-new-tokens past the context",
            ["regenerate", prompt, "--out", w / "r18.jsonl", "--max-new-tokens", "9000"],
            "refused",
        ),
        # prepare
        (
            "prepare content parts (OpenAI list)",
            [
                "prepare",
                file("cl.jsonl", conversation(("user", [{"type": "text", "text": "hi"}]), ("assistant", "yo"))),
                "--out",
                w / "p0",
            ],
            "accepted",
        ),
        (
            "prepare content null",
            ["prepare", file("cn.jsonl", conversation(("user", None), ("assistant", "yo"))), "--out", w / "p1"],
            "refused",
        ),
        (
            "prepare empty assistant",
            ["prepare", file("ea.jsonl", conversation(("user", "hi"), ("assistant", ""))), "--out", w / "p2"],
            "refused",
        ),
        (  # the embedded target's template has no tool calls: the calling turn would train an empty answer
            "prepare an agent trace with a template that drops tool calls",
            ["prepare", file("tools.jsonl", agent_trace), "--out", w / "p5"],
            "refused",
        ),
        (
            "regenerate an agent trace",
            ["regenerate", file("tools2.jsonl", agent_trace), "--out", w / "r9.jsonl"],
            "refused",
        ),
        ("prepare ShareGPT rows", ["prepare", sharegpt, "--out", w / "p3"], "accepted"),
        (
            "prepare a parquet that is not",
            ["prepare", file("g.parquet", b"PAR1garbagePAR1"), "--out", w / "p4"],
            "refused",
        ),
        (
            "prepare --draft-vocab past the vocabulary",
            ["prepare", sharegpt, "--out", w / "p6", "--draft-vocab", "1000000"],
            "refused",
        ),
        (
            "prepare a broken --chat-template",
            [
                "prepare",
                sharegpt,
                "--out",
                w / "p9",
                "--chat-template",
                file("b.jinja", "{% for m in messages %}{{ m.content }"),
            ],
            "refused",
        ),
        ("prepare a directory as input", ["prepare", config_only, "--out", w / "p11"], "refused"),
        (  # what `eaglet regenerate heldout-only prompts` writes: the prompts eval scores by default
            "prepare answers all held out",
            [
                "prepare",
                file(
                    "held.jsonl",
                    json.dumps(
                        {
                            "id": "h1",
                            "split": "heldout",
                            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                        }
                    )
                    + "\n",
                ),
                "--out",
                w / "p12",
            ],
            "refused",
        ),
        (
            "prepare a split that is a number",
            [
                "prepare",
                file(
                    "split_number.jsonl",
                    json.dumps(
                        {
                            "id": "n1",
                            "split": 1,
                            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                        }
                    )
                    + "\n",
                ),
                "--out",
                w / "p13",
            ],
            "refused",
        ),
        (
            "prepare two assistant turns in a row",
            [
                "prepare",
                file("aa.jsonl", conversation(("user", "hi"), ("assistant", "yo"), ("assistant", "again"))),
                "--out",
                w / "p7",
            ],
            "refused",
        ),
        (
            "prepare a .json of JSON lines",
            ["prepare", file("jl.json", conversation(("user", "a"), ("assistant", "b")) * 2), "--out", w / "p12"],
            "refused",
        ),
        ("prepare --out ''", ["prepare", sharegpt, "--out", ""], "refused"),
        # run configs
        ("run: YAML that is a list", ["run", file("l.yaml", "- a\n- b\n")], "refused"),
        ("run: an unknown section", ["run", file("u.yaml", "target: embedded\nfoo: {}\n")], "refused"),
        ("run: a key set twice", ["run", file("d.yaml", yaml_base + "  max_prompts: 3\n"), "--plan"], "refused"),
        ("run: a tab", ["run", file("t.yaml", "target:\tembedded\n"), "--plan"], "refused"),
        (
            "run: an eval prompt past the context",
            ["run", file("ev.yaml", yaml_base + f"eval:\n  prompts: [{huge}]\n  split: all\n"), "--out", w / "run_ev"],
            "refused",
        ),
        ("run --out a file", ["run", file("ok.yaml", yaml_base), "--out", prompt, "--plan"], "refused"),
        ("demo --out '' --plan", ["demo", "--out", "", "--plan"], "refused"),
        # extract
        ("extract --out ''", ["extract", "--prepared", prepared, "--out", ""], "refused"),
        (
            "extract --replica 0/2 without tp",
            ["extract", "--prepared", prepared, "--out", w / "x0", "--replica", "0/2"],
            "refused",
        ),
        (
            "extract --layers out of range",
            ["extract", "--prepared", prepared, "--out", w / "x1", "--layers", "0,1,99"],
            "refused",
        ),
        (
            "extract resume with other --shard-mb",
            ["extract", "--prepared", prepared, "--out", store, "--shard-mb", "1"],
            "refused",
        ),
        # train
        ("train --set without =", ["train", "--store", store, "--out", w / "t0", "--set", "lr"], "refused"),
        ("train --betas 0.9,1.5", ["train", "--store", store, "--out", w / "t3", "--betas", "0.9,1.5"], "refused"),
        (
            "train --eval-store missing",
            ["train", "--store", store, "--out", w / "t4", "--eval-store", w / "nope"],
            "refused",
        ),
        (
            "train --eval-store = --store",
            ["train", "--store", store, "--out", w / "t5", "--eval-store", store, "--max-steps", "1"],
            "refused",
        ),
        (
            "train --layers unlike the store's",
            ["train", "--store", store, "--out", w / "t7", "--layers", "1,2,3"],
            "refused",
        ),
        ("train --out = the store", ["train", "--store", store, "--out", store], "refused"),
        ("train --out ''", ["train", "--store", store, "--out", ""], "refused"),
        ("train resume with another budget", train_draft(store, draft, 4 * SET_UP_TOKEN_BUDGET), "refused"),
        # eval
        (
            "eval a prompt past the context",
            ["eval", "--draft", draft, "--out", w / "e0", "--prompts", huge, "--split", "all", "--max-new-tokens", "8"],
            "refused",
        ),
        (
            "eval --max-new-tokens past the context",
            [
                "eval",
                "--draft",
                draft,
                "--out",
                w / "e1",
                "--prompts",
                prompt,
                "--split",
                "all",
                "--max-new-tokens",
                "9000",
            ],
            "refused",
        ),
        ("eval --depth 0", ["eval", "--draft", draft, "--out", w / "e2", "--depth", "0"], "refused"),
        ("eval --out = the draft", ["eval", "--draft", draft, "--out", draft], "refused"),
        ("eval a store as the draft", ["eval", "--draft", store, "--out", w / "e3"], "refused"),
        ("eval --prompts ''", ["eval", "--draft", draft, "--out", w / "e4", "--prompts", ""], "refused"),
        # export
        (
            "export --report of other JSON",
            [
                "export",
                "--draft",
                draft,
                "--format",
                "vllm",
                "--out",
                w / "x2",
                "--report",
                file("r2.json", '{"a": 1}'),
            ],
            "refused",
        ),
        (
            "export --report not JSON",
            ["export", "--draft", draft, "--format", "vllm", "--out", w / "x3", "--report", file("r.json", "{bad")],
            "refused",
        ),
        (
            "export --out inside the draft",
            ["export", "--draft", draft, "--format", "vllm", "--out", Path(draft) / "export"],
            "refused",
        ),
        (
            "export a checkpoints folder",
            ["export", "--draft", Path(draft) / "checkpoints", "--format", "vllm", "--out", w / "x4"],
            "refused",
        ),
        ("export --check a missing folder", ["export", "--check", w / "nope"], "refused"),
        ("store verify a prepared set", ["store", "verify", prepared], "refused"),
        (
            "extract a prepared set whose vocab.safetensors was cut",
            ["extract", "--prepared", cut_vocab(prepared, w / "prepared_cut"), "--out", w / "s10"],
            "refused",
        ),
        (
            "train --store a prepared set",
            ["train", "--store", prepared, "--out", w / "t9", "--max-steps", "1"],
            "refused",
        ),
        ("extract --prepared a store", ["extract", "--prepared", store, "--out", w / "s9"], "refused"),
        ("demo --scale gpu on this machine", ["demo", "--scale", "gpu", "--out", w / "dg", "--plan"], gpu_demo),
        ("prepare a file given twice", ["prepare", prompt, f"{w}/./{Path(prompt).name}", "--out", w / "p9"], "refused"),
        (
            "train --eval-fraction holding out every sample",
            ["train", "--store", store, "--out", w / "t10", "--eval-fraction", "0.9999", "--max-steps", "1"],
            "refused",
        ),
        (  # the set-up's samples are ~80 tokens, their answers after the first 16
            "train --token-budget ending before every answer",
            ["train", "--store", store, "--out", w / "t11", "--token-budget", "16", "--max-steps", "1"],
            "refused",
        ),
        (
            "eval a draft whose config.json layer ids were edited",
            ["eval", "--draft", layers_edited(Path(draft), w / "draft_edited"), "--out", w / "e5"],
            "refused",
        ),
        (
            "regenerate into answers written for other prompts",
            [
                "regenerate",
                answered_for_other_prompts(made["answers"], w / "edited_prompts.jsonl"),
                "--out",
                copy_file(made["answers"], w / "answers_copy.jsonl"),
                "--max-new-tokens",
                "24",
            ],
            "refused",
        ),
        (
            "extract with a target whose second shard is missing",
            [
                "extract",
                "--prepared",
                prepared,
                "--out",
                w / "s11",
                "--target",
                shard_missing(embedded_dir(), w / "sh"),
            ],
            "refused",
        ),
        (
            "regenerate --max-prompts lowered into the same --out",
            [
                "regenerate",
                "demo",
                "--max-prompts",
                "2",
                "--out",
                copy_file(made["answers"], w / "answers_copy2.jsonl"),
                "--max-new-tokens",
                "24",
            ],
            "refused",
        ),
        (  # cut at the target's context of 8,192, with a warning
            "prepare --max-len past the target's context",
            ["prepare", made["answers"], "--out", w / "p13", "--max-len", "16384"],
            "accepted",
        ),
        (
            "extract a set prepared past the target's context",
            ["extract", "--prepared", prepared_past_context(w), "--out", w / "s12", "--target", "embedded"],
            "refused",
        ),
        (
            "run --out a project directory with its own eval/",
            ["run", file("ok2.yaml", yaml_base), "--out", project_with_eval_folder(w), "--plan"],
            "refused",
        ),
        (
            "prepare an empty --chat-template",
            ["prepare", sharegpt, "--out", w / "p20", "--chat-template", file("empty.jinja", "")],
            "refused",
        ),
        (
            "prepare a --chat-template not in UTF-8",
            ["prepare", sharegpt, "--out", w / "p21", "--chat-template", file("latin1.jinja", b"\xff\xfe{{ x }}")],
            "refused",
        ),
        (
            "synthesize --max-new-tokens 1",
            ["synthesize", "--out", w / "s20.jsonl", "--count", "3", "--max-new-tokens", "1"],
            "refused",
        ),
        ("regenerate --n 3 at temperature 0", ["regenerate", prompt, "--out", w / "r20.jsonl", "--n", "3"], "refused"),
        ("export without --format", ["export", "--draft", draft, "--out", w / "x20"], "refused"),
        ("export --check a draft not exported", ["export", "--check", draft], "refused"),
        # issue 59's surfaces: drafts made elsewhere, warm starts, the serving bench
        (
            "eval a draft made elsewhere for another vocabulary",
            [
                "eval",
                "--draft",
                made_elsewhere_other_vocab(Path(draft), w / "elsewhere"),
                "--target",
                "embedded",
                "--out",
                w / "e30",
            ],
            "refused",
        ),
        (
            "train --init-from a folder that holds no draft",
            ["train", "--store", store, "--out", w / "t30", "--init-from", w],
            "refused",
        ),
        ("bench --concurrency 0", ["bench", "--draft", draft, "--out", w / "b30", "--concurrency", "0"], "refused"),
        # issue 60's surfaces: resume state, sizes, a prepared sample of no tokens
        (
            "train resumes a checkpoint holding a NaN Adam moment",
            ["train", "--store", store, "--out", checkpoint_with_nan_moment(Path(draft), w / "nan_draft")]
            + ["--max-steps", "3", "--token-budget", str(SET_UP_TOKEN_BUDGET), "--eval-fraction", "0"],
            "refused",
        ),
        (
            "extract with a target config of a billion layers",
            ["extract", "--prepared", prepared, "--out", w / "s40", "--target", target_of_a_billion_layers(w / "t1e9")],
            "refused",
        ),
        (
            "synthesize --batch-size 1e8",
            ["synthesize", "--out", w / "s41.jsonl", "--count", "3", "--batch-size", "100000000"],
            "refused",
        ),
        (
            "extract a prepared sample of no tokens",
            ["extract", "--prepared", prepared_with_an_empty_sample(Path(prepared), w / "p40"), "--out", w / "s42"],
            "refused",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON of every case's outcome")
    parser.add_argument("--only", nargs="*", default=[], help="cases whose name holds one of these")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="eaglet-audit-"))
    try:
        started = time.perf_counter()
        made = set_up(root / "made")
        rows = []
        (root / "w").mkdir()
        for name, argv, expected in cases(root / "w", made):
            if args.only and not any(part in name for part in args.only):
                continue
            scratch = root / "cwd"
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir()
            outcome, code, output = run([str(a) for a in argv], scratch)
            left = sorted(p.name for p in scratch.iterdir())
            one_line = [line for line in output.splitlines() if line.startswith("error:")]
            clean = outcome != "refused" or (len(one_line) == 1 and not left)
            rows.append(
                {
                    "case": name,
                    "expected": expected,
                    "outcome": outcome,
                    "exit": code,
                    "as_expected": outcome == expected and clean,
                    "error": one_line[-1][:300]
                    if one_line
                    else output.strip().splitlines()[-1][:300]
                    if output
                    else "",
                    "left_in_cwd": left,
                }
            )
            mark = "ok " if rows[-1]["as_expected"] else "BAD"
            print(f"{mark} {outcome:9} {name:45} {rows[-1]['error'][:120]}", flush=True)
        summary = {
            outcome: sum(row["outcome"] == outcome for row in rows)
            for outcome in ("refused", "accepted", "traceback", "timeout")
        }
        result = {
            "cases": len(rows),
            "as_expected": sum(row["as_expected"] for row in rows),
            "outcomes": summary,
            "seconds": round(time.perf_counter() - started, 1),
            "rows": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
