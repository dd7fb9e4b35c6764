"""One declaration per setting: every stage option is made from its config field, and every list of export formats
is the registry's."""

from __future__ import annotations

from typing import get_args

import pytest
import typer
from conftest import run_cli

from eaglet.cli import app
from eaglet.cli.stage_options import cli_type, option_value
from eaglet.config import (
    EvalConfig,
    ExportConfig,
    ExtractConfig,
    PrepareConfig,
    RegenerateConfig,
    SynthesizeConfig,
    TrainConfig,
)
from eaglet.errors import EagletError
from eaglet.export import ENGINES, FORMAT_NAMES, FORMATS
from eaglet.run import RunConfig

STAGES = {
    "synthesize": SynthesizeConfig,
    "prepare": PrepareConfig,
    "regenerate": RegenerateConfig,
    "extract": ExtractConfig,
    "train": TrainConfig,
    "export": ExportConfig,
    "eval": EvalConfig,
}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_config_field_is_an_option_of_its_command(stage):
    command = typer.main.get_command(app).commands[stage]
    options = {param.name: param for param in command.params}
    missing = set(STAGES[stage].model_fields) - set(options)
    assert not missing, f"{stage}: fields without an option: {sorted(missing)}"
    for name, field in STAGES[stage].model_fields.items():
        help_text = options[name].help or ""
        if field.description:  # the field's description is the help (rich escapes aside)
            assert field.description.split("[")[0][:30] in help_text, (name, help_text)


def test_help_lists_choices_defaults_and_negative_flags():
    options = {param.name: param for param in typer.main.get_command(app).commands["train"].params}
    assert options["schedule"].help.endswith("(cosine | linear | constant) (default: cosine)")
    assert options["ttt_steps"].help == "training-time-test unroll K (default: 7)"
    assert "--no-compile-pointwise" in options["compile_pointwise"].secondary_opts  # True by default: can be turned off
    assert options["out"].opts == ["--out", "-o"] and "(required)" in options["out"].help


@pytest.mark.parametrize(
    "config, field, text, expected",
    [
        (TrainConfig, "betas", "0.8,0.9", [0.8, 0.9]),
        (TrainConfig, "layers", "2,15,27", [2, 15, 27]),
        (EvalConfig, "tune_trees", "[[7,8,56],[8,8,64]]", [[7, 8, 56], [8, 8, 64]]),
        (ExtractConfig, "max_memory", "cuda:0=60GiB, cpu=200GiB", {"cuda:0": "60GiB", "cpu": "200GiB"}),
    ],
)
def test_text_options_become_the_field_value(config, field, text, expected):
    info = config.model_fields[field]
    _, parse = cli_type(info.annotation)
    assert option_value(f"--{field}", text, info, parse) == expected


@pytest.mark.parametrize(
    "config, field, text, message",
    [
        (TrainConfig, "betas", "0.8,1.5", "--betas '0.8,1.5': Input should be less than 1 (item 2)"),
        (TrainConfig, "betas", "0.8,inf", "--betas '0.8,inf': Input should be a finite number (item 2)"),
        (TrainConfig, "layers", "2,x", "--layers '2,x': Input should be a valid integer"),
        (ExtractConfig, "max_memory", "cuda0", "--max_memory 'cuda0': expected DEVICE=SIZE pairs"),
    ],
)
def test_bad_text_options_are_named_as_typed(config, field, text, message):
    info = config.model_fields[field]
    _, parse = cli_type(info.annotation)
    with pytest.raises(EagletError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        option_value(f"--{field}", text, info, parse)


def test_a_bad_option_is_one_line_before_anything_runs(tmp_path, capsys):
    code, _, err = run_cli(["train", "--prepared", tmp_path, "--out", tmp_path / "run", "--betas", "0.9"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--betas '0.9': item 2 is missing" in err and "Traceback" not in err


def test_a_missing_required_option_names_the_flag_and_its_choices(tmp_path, capsys):
    """A new user's first export leaves out --format: the line names the flag and what it takes, on the command line
    and from a config file."""
    code, _, err = run_cli(["export", "--draft", tmp_path, "--out", tmp_path / "x"], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "command line: --format is required: the consumer the directory is written for" in err
    assert "(vllm | sglang | speculators)" in err
    config = tmp_path / "export.yaml"
    config.write_text(f"draft: {tmp_path}\nout: {tmp_path / 'x'}\n")
    code, _, err = run_cli(["export", "--config", config], capsys)
    assert code == 2 and f"config {config}: required key 'format' is missing" in err
    assert err.rstrip().endswith("set it there or pass --format")


def test_a_value_out_of_range_names_the_flag(tmp_path, capsys):
    code, _, err = run_cli(["train", "--prepared", tmp_path, "--out", tmp_path / "run", "--lr", "-1"], capsys)
    assert code == 2 and "command line: --lr: Input should be greater than 0 (got -1.0)" in err


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--store", "s", "--out", "run"],
        ["synthesize", "--out", "s.jsonl"],
        ["regenerate", "demo", "--out", "r.jsonl"],
        ["eval", "--draft", "d", "--out", "report"],
        ["bench", "--draft", "d", "--out", "report"],
    ],
    ids=lambda args: args[0],
)
def test_a_seed_torch_and_numpy_cannot_take_is_named_before_anything(tmp_path, capsys, monkeypatch, args):
    """A seed past 2**32 - 1 overflowed torch.manual_seed (a traceback after the stage had started); a negative one
    numpy's."""
    monkeypatch.chdir(tmp_path)
    for seed, message in (("100000000000000000000000", "less than or equal to 4294967295"), ("-1", "greater than")):
        code, _, err = run_cli([*args, "--seed", seed], capsys)
        assert code == 2 and f"--seed: Input should be {message}" in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_every_list_of_export_formats_is_the_registry():
    assert get_args(ExportConfig.model_fields["format"].annotation) == FORMAT_NAMES
    assert RunConfig().export.formats == list(FORMAT_NAMES)
    assert set(ENGINES) == {engine for fmt in FORMATS.values() for engine in fmt.engines}
    from eaglet.consumers.export_check import READERS

    assert {reader for fmt in FORMATS.values() for reader in fmt.readers} <= set(READERS)


def test_an_unknown_engine_names_the_registrys(tmp_path, capsys, tiny_draft):
    code, _, err = run_cli(
        ["export", "--draft", tiny_draft, "--format", "vllm", "--out", tmp_path / "x", "--engine", "trt==1.0"], capsys
    )
    assert code == 2 and f"ENGINE one of {', '.join(ENGINES)}" in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--replica", "2/1"], "--replica 2/1: expected r/R with 0 <= r < R"),
        (["--replica", "0/0"], "--replica 0/0: expected r/R with 0 <= r < R"),
        (["--replica", "0/2"], "--replica 0/2 is for tensor-parallel groups (--placement tp)"),
        (["--replica", "1/2", "--placement", "split"], "--replica 1/2 is for tensor-parallel groups"),
    ],
)
def test_a_replica_outside_its_groups_is_refused_before_anything_runs(tmp_path, capsys, extra, message):
    code, _, err = run_cli(["extract", "--prepared", tmp_path, "--out", tmp_path / "store", *extra], capsys)
    assert code == 2 and message in err and err.count("\n") == 1 and not (tmp_path / "store").exists(), err


@pytest.mark.parametrize(
    "stage, args",
    [
        ("synthesize", ["--out", "p.jsonl"]),
        ("regenerate", ["demo", "--out", "a.jsonl"]),
        ("train", ["--store", "s", "--out", "run"]),
        ("eval", ["--draft", "d", "--out", "report"]),
    ],
)
def test_only_extract_takes_a_replica(tmp_path, capsys, stage, args):
    """Only extract splits its work over tensor-parallel groups; the other stages took --replica and ignored it.
    The option is refused while the command line is read: nothing is written."""
    code, _, err = run_cli([stage, *args, "--replica", "0/2"], capsys)
    assert code == 2 and "No such option: --replica" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["nosuch"], "eaglet: No such command 'nosuch'; see `eaglet --help`"),
        (["target", "info", "/x"], "eaglet target info: Got unexpected extra argument(s) (/x)"),
        (["train", "--max-steps", "x"], "eaglet train: Invalid value for '--max-steps'"),
        (["export", "--draft"], "eaglet: Option '--draft' requires an argument"),
    ],
)
def test_what_the_command_line_parser_refuses_is_one_line_too(capsys, args, message):
    code, _, err = run_cli(args, capsys)
    assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "args",
    [
        ["prepare", "c.jsonl", "--out", ""],
        ["synthesize", "--out", ""],
        ["regenerate", "demo", "--out", " "],
        ["extract", "--prepared", "p", "--out", ""],
        ["train", "--store", "s", "--out", ""],
        ["export", "--draft", "d", "--format", "vllm", "--out", ""],
        ["eval", "--draft", "d", "--out", ""],
        ["eval", "--draft", "d", "--out", "report", "--prompts", ""],
        ["extract", "--prepared", "", "--out", "store"],
        ["run", "run.yaml", "--out", ""],
        ["demo", "--out", "", "--plan"],
    ],
)
def test_an_empty_path_is_refused_not_taken_as_the_current_directory(tmp_path, capsys, monkeypatch, args):
    """`--out $STORE` with STORE unset passes "": Path("") is the current directory, where extract wrote a whole
    store and train a draft. Every text value is refused empty, in one line, before anything is written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("target: embedded\nregenerate:\n  prompts: [demo]\n")
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "empty" in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["prepare", "c.jsonl", "./c.jsonl", "--out", "p"], "'inputs': ./c.jsonl is given twice (also as c.jsonl)"),
        (["regenerate", "c.jsonl", "c.jsonl", "--out", "a.jsonl"], "'prompts': c.jsonl is given twice"),
        (["eval", "--draft", "d", "--out", "e", "--prompts", "mt-bench", "--prompts", "mt-bench"], "given twice"),
    ],
)
def test_a_file_given_twice_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch, args, message):
    """Its rows would be read twice, then refused as duplicate ids "first at" their own line."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    code, _, err = run_cli(args, capsys)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


@pytest.mark.parametrize(
    "per_second, unit, shown",
    [
        (12_345.6, "tok", "12,346 tok/s"),
        (45.67, "prompts", "45.7 prompts/s"),
        (2.456, "steps", "2.46 steps/s"),
        (0.25, "steps", "4.0 s/step"),  # was "0 steps/s"
        (0.5, "answers", "2.0 s/answer"),
        (0.0, "tok", "0 tok/s"),
    ],
)
def test_progress_rates_keep_three_significant_digits_or_say_seconds_per_item(per_second, unit, shown):
    from eaglet.progress import format_rate

    assert format_rate(per_second, unit) == shown


def test_a_bar_finished_in_one_update_shows_its_rate():
    """A stage whose work lands in one update (a small extraction: one shard) showed "-- tok/s" at its end: rich
    keeps no speed from a single sample. The rate is then the work over the time it took."""
    import io
    import time

    from rich.console import Console

    from eaglet.progress import RateColumn, progress_bar

    with progress_bar("tok", Console(file=io.StringIO())) as progress:
        task = progress.add_task("extract", total=2526)
        time.sleep(0.05)
        progress.advance(task, 2526)
    shown = RateColumn("tok").render(progress.tasks[task]).plain
    assert shown.endswith(" tok/s") and not shown.startswith("--"), shown
