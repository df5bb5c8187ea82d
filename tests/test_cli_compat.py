"""llama.cpp's habitual flags on `run` and `serve`: each parses to its own setting (never
split like `-ngl` -> `-n gl`), maps where we have the setting, and prints its note."""
from __future__ import annotations

import io

import pytest
import torch

from alphallama.cli import build_parser
from alphallama.cli_compat import apply_compat, warmup_wanted
from alphallama.config import DEFAULTS


def parse(*argv: str):
    argv = list(argv)
    return build_parser(argv).parse_args(argv)


def notes(args, command: str) -> list[str]:
    out = io.StringIO()
    apply_compat(args, command, out)
    return out.getvalue().splitlines()


@pytest.mark.parametrize("command", ["run", "serve"])
def test_ngl_is_its_own_flag_not_n(command):
    extra = ["-p", "x"] if command == "run" else []
    default_n = DEFAULTS.sampling.max_tokens if command == "run" else DEFAULTS.server.n_predict
    for flag in ("-ngl", "--n-gpu-layers"):
        a = parse(command, *extra, flag, "99")
        assert a.n_gpu_layers == 99 and a.n_predict == default_n   # not `-n gl`
        lines = notes(a, command)
        assert len(lines) == 1 and "-ngl 99" in lines[0] and "plan" in lines[0]
        assert a.device == DEFAULTS.engine.device


def test_ngl_zero_means_the_cpu_unless_a_device_is_given():
    a = parse("run", "-p", "x", "-ngl", "0")
    assert "CPU" in notes(a, "run")[0] and a.device == "cpu"
    a = parse("run", "-p", "x", "-ngl", "0", "--device", "cuda")
    notes(a, "run")
    assert a.device == "cuda"          # an explicit --device wins
    assert parse("serve", "-ngl", "all").n_gpu_layers == "all"


def test_ngl_rejects_nonsense():
    with pytest.raises(SystemExit):
        parse("run", "-p", "x", "-ngl", "lots")
    with pytest.raises(SystemExit):
        parse("serve", "-ngl", "-3")


def test_flash_attn_takes_an_optional_value():
    assert parse("serve", "-fa").flash_attn == "on"
    assert parse("serve", "-fa", "off").flash_attn == "off"
    assert parse("serve", "--flash-attn", "auto").flash_attn == "auto"
    a = parse("run", "-fa", "-p", "x")                      # -fa then another flag: still "on"
    assert a.flash_attn == "on" and a.prompt == "x"
    assert "-fa on" in notes(a, "run")[0]
    with pytest.raises(SystemExit):
        parse("serve", "-fa", "sometimes")


def test_threads_sets_torchs_cpu_threads():
    before = torch.get_num_threads()
    try:
        a = parse("run", "-p", "x", "-t", "1")
        assert a.threads == 1
        line, = notes(a, "run")
        assert torch.get_num_threads() == 1 and "-t 1" in line
        assert parse("serve", "--threads", "3").threads == 3
    finally:
        torch.set_num_threads(before)
    with pytest.raises(SystemExit):
        parse("serve", "-t", "0")


@pytest.mark.parametrize("argv, dest, value, says", [
    (["-np", "4"], "parallel", 4, "-np 4"),
    (["--parallel", "2"], "parallel", 2, "-np 2"),
    (["-b", "2048"], "batch_size", 2048, f"chunks of {DEFAULTS.engine.prefill_chunk}"),
    (["--batch-size", "64"], "batch_size", 64, "chunks of"),
    (["--jinja"], "jinja", True, "Jinja"),
    (["--mlock"], "mlock", True, "VRAM"),
    (["--no-warmup"], "no_warmup", True, "warm-up"),
])
@pytest.mark.parametrize("command", ["run", "serve"])
def test_each_flag_parses_and_prints_its_note(command, argv, dest, value, says):
    extra = ["-p", "x"] if command == "run" else []
    a = parse(command, *extra, *argv)
    assert getattr(a, dest) == value
    line, = notes(a, command)
    assert line.startswith("alphallama: ") and says in line


def test_embeddings_flag_on_serve_names_the_pooling():
    line, = notes(parse("serve", "--embeddings", "--pooling", "last"), "serve")
    assert "always on" in line and "last-pooled" in line
    assert parse("serve", "--embedding").embeddings
    with pytest.raises(SystemExit):
        parse("serve", "--pooling", "max")


def test_no_warmup_switches_the_warmup_off():
    assert warmup_wanted(parse("serve")) and not warmup_wanted(parse("serve", "--no-warmup"))


def test_conversation_flag_on_run_and_serve():
    a = parse("run", "-cnv")
    assert a.conversation and a.prompt is None
    line, = notes(a, "run")
    assert "interactive conversation" in line and "system message" in line
    a = parse("serve", "--conversation")
    assert "ignored" in notes(a, "serve")[0]


def test_run_needs_a_prompt_unless_a_conversation(capsys):
    from alphallama.cli import main
    assert main(["run"]) == 2
    assert "-p/--prompt is required" in capsys.readouterr().err
    assert main(["run", "-cnv", "--json"]) == 2


def test_no_flags_no_notes_and_no_abbreviations():
    assert notes(parse("serve"), "serve") == []
    with pytest.raises(SystemExit):       # --spec is not --spec-type (allow_abbrev=False)
        parse("serve", "--spec", "ngram")
    a = parse("run", "-p", "x", "-n", "5")
    assert a.n_predict == 5 and a.n_gpu_layers is None
