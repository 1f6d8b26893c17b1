"""Every size and integer flag of every sub-command: a bad value is a usage error (exit code 2)
that names the flag in one line, whatever the value (negative, absurd, not a number)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli._helpers import check_error
from vramkit.cli.main import main

# (sub-command, the words before the flag that make the command line complete, flag)
SIZE_FLAGS = [
    ("demo", [], "--budget"),
    ("plan", ["flux-dev"], "--budget"),
    ("plan", ["flux-dev", "--budget", "12GiB"], "--host-budget"),
    ("select", [], "--min-free"),
]


@pytest.mark.parametrize(("sub", "before", "flag"), SIZE_FLAGS)
@pytest.mark.parametrize("value", ["1e99GiB", "123456789012345678901", "9000PiB"])
def test_sizes_beyond_any_memory_are_refused_when_the_flags_are_read(
        sub: str, before: list[str], flag: str, value: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main([sub, *before, flag, value])
    out, err = capsys.readouterr()
    check_error(code, out, err, sub=sub, exit_code=2,
                says=(flag, "larger than any memory", "8192.0 PiB"))
    assert len(err.splitlines()) == 2  # the error and its hint: no usage, no 90-digit figure


# (sub-command, words that complete the command line, flag, a bad value, a text the error says)
BAD_VALUES = [
    *[(sub, before, flag, "-3GiB", "cannot be negative") for sub, before, flag in SIZE_FLAGS],
    *[(sub, before, flag, "lots", "'lots'") for sub, before, flag in SIZE_FLAGS],
    ("demo", [], "--steps", "0", ">= 1"),
    ("demo", [], "--steps", "-2", ">= 1"),
    ("demo", [], "--batch-size", "-1", ">= 1"),
    ("demo", [], "--model-size", "-5MiB", "negative"),
    ("plan", ["flux-dev", "--budget", "12GiB"], "--lora-rank", "-1", ">= 0"),
    ("plan", ["flux-dev", "--budget", "12GiB"], "--batch", "0", ">= 1"),
    ("plan", ["flux-dev", "--budget", "12GiB"], "--seq-len", "-4", ">= 1"),
    ("plan", ["flux-dev", "--budget", "12GiB"], "--frames", "x", "whole number"),
    ("plan", ["flux-dev", "--budget", "12GiB"], "--headroom", "-1GiB", "--headroom"),
    ("plan", ["flux-dev", "--budget", "12GiB"], "--disk-speed", "-2", "> 0"),
    ("select", [], "--count", "0", ">= 1"),
    ("select", [], "--count", "-2", ">= 1"),
    ("select", [], "-n", "x", "invalid int value"),
    ("select", [], "--max-util", "-5", "[0"),
    ("inspect", ["model.safetensors"], "--top", "-1", ">= 0"),
    ("inspect", ["model.safetensors"], "--top", "x", "invalid int value"),
    # checked before the path is: the flag's error, not the missing file's
    ("info", ["--disk", "/nonexistent"], "--disk-threads", "0", "[1, 256]"),
    ("info", ["--disk", "/nonexistent"], "--disk-threads", "-3", "[1, 256]"),
    ("info", ["--disk", "/nonexistent"], "--disk-threads", "x", "invalid int value"),
    ("profile", [], "--interval", "-0.5", "> 0"),
]


@pytest.mark.parametrize(("sub", "before", "flag", "value", "says"), BAD_VALUES)
def test_a_bad_flag_value_is_one_line_naming_the_flag(
        sub: str, before: list[str], flag: str, value: str, says: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    # The value follows the flag as its own word, as people type it ("--budget -3GiB").
    after = ["--", "python", "train.py"] if sub == "profile" else []
    code = main([sub, *before, flag, value, *after])
    out, err = capsys.readouterr()
    name = "--count" if flag == "-n" else flag
    check_error(code, out, err, sub=sub, exit_code=2, says=(name, says),
                not_says=("usage:", "expected one argument", "measure_read_bandwidth"))
    assert len(err.splitlines()) == 2, err  # the error and its hint


def test_headroom_that_leaves_nothing_names_both_flags_in_sizes(
        capsys: pytest.CaptureFixture[str]) -> None:
    for headroom in ("12GiB", "13GiB"):
        code = main(["plan", "flux-dev", "--budget", "12GiB", "--headroom", headroom])
        out, err = capsys.readouterr()
        text = check_error(code, out, err, sub="plan", exit_code=2,
                           says=("--headroom", "--budget", "12.0 GiB"),
                           not_says=("12884901888", "bytes leaves"))
        assert headroom in text


def test_negative_looking_values_stay_in_the_profiled_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Words after the profiled program are its own: "--device -1" there is not profile's flag.
    from vramkit.cli import main as cli_main

    parser = cli_main.build_parser()
    words = ["profile", "--out", "o", "python", "train.py", "--device", "-1", "--budget", "-3GiB"]
    assert cli_main._attach_negative_values(parser, words) == words
    assert cli_main._attach_negative_values(parser, ["profile", "--interval", "-1", "--", "x"]) \
        == ["profile", "--interval=-1", "--", "x"]
    assert cli_main._attach_negative_values(parser, ["select", "-n", "-2"]) == [
        "select", "-n-2"]
    assert cli_main._attach_negative_values(parser, ["demo", "--budget", "-v"]) == [
        "demo", "--budget", "-v"]  # an option, not a value


# -- output flags: a path in a directory that does not exist is refused, nothing is made ------

@pytest.mark.parametrize(("sub", "flag", "argv"), [
    ("demo", "--report", ["--report", "{missing}/r.html"]),
    ("profile", "--out", ["--out", "{missing}/out", "--", "python", "{tmp}/t.py"]),
])
def test_output_flags_refuse_a_missing_directory(sub: str, flag: str, argv: list[str],
                                                 tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "t.py").write_text("print('ran')\n")
    missing = tmp_path / "no" / "such"
    code = main([sub, *[w.format(missing=missing, tmp=tmp_path) for w in argv]])
    out, err = capsys.readouterr()
    check_error(code, out, err, sub=sub, exit_code=2, says=(flag, str(missing), "does not exist"))
    assert "ran" not in out
    assert not (tmp_path / "no").exists()
