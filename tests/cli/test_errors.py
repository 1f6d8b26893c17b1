"""How every `vramkit` sub-command ends on a user error (vramkit.cli.main): no traceback, exit
code 2 for usage errors and 1 for runtime failures, the prefix `vramkit <sub>: error:`, one JSON
object with --json, global options before and after the sub-command, internal bugs in one line.
"""

from __future__ import annotations

import errno
import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli._helpers import check_error, json_error, run_vramkit
from tests.devices.fakes import install_missing_nvml
from vramkit.cli import main as cli_main
from vramkit.cli.main import build_parser, main

SUBCOMMANDS = ("info", "select", "profile", "inspect", "demo")
# the module attribute each sub-command's parser calls
FUNCS = {"info": ("info", "run"), "select": ("select", "run"),
         "profile": ("profile", "run_profile"), "inspect": ("inspect", "run"),
         "demo": ("demo", "run")}
# the arguments that make each sub-command's command line complete
MINIMAL = {"info": [], "select": [], "profile": ["--", "python", "train.py"],
           "inspect": ["model.safetensors"], "demo": []}
# one argparse error per sub-command: a bad value of a typed flag, or a missing one
ARGPARSE_ERRORS = {
    "info": (["--bogus"], "unrecognized arguments: --bogus"),
    "select": (["-n", "x"], "invalid int value: 'x'"),
    "profile": (["--interval", "x", "--", "python", "t.py"], "invalid float value: 'x'"),
    "inspect": (["model.safetensors", "--top", "x"], "invalid int value: 'x'"),
    "demo": (["--steps"], "expected one argument"),
}


def _failing(error: BaseException) -> Any:
    def run(args: Any) -> int:
        raise error

    return run


def _patch_func(monkeypatch: pytest.MonkeyPatch, sub: str, error: BaseException) -> None:
    module, attr = FUNCS[sub]
    monkeypatch.setattr(importlib.import_module(f"vramkit.cli.{module}"), attr,
                        _failing(error))


# -- argparse errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("sub", SUBCOMMANDS)
@pytest.mark.parametrize("as_json", [False, True])
def test_argparse_errors_name_the_subcommand(sub: str, as_json: bool,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    argv, says = ARGPARSE_ERRORS[sub]
    json_flag = ["--json"] if as_json else []
    code = main([sub, *json_flag, *argv])
    out, err = capsys.readouterr()
    check_error(code, out, err, sub=sub, exit_code=2, as_json=as_json,
                says=(says, f"vramkit {sub} --help"))
    if as_json:
        assert err == ""


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_unknown_flag_after_the_subcommand_is_the_subcommands_error(
        sub: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [sub, "--no-such-flag", *MINIMAL[sub]]
    code = main(argv)
    out, err = capsys.readouterr()
    check_error(code, out, err, sub=sub, exit_code=2,
                says=("unrecognized arguments: --no-such-flag",))


def test_unknown_subcommand_is_the_top_commands_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "vramkit: error: argument COMMAND: invalid choice: 'nope'" in err
    assert "Traceback" not in err


def test_help_and_version_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--help"]) == 0
    assert "--budget" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("vramkit ")


# -- the prefix of errors raised by the sub-commands ------------------------------------------


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_errors_of_every_subcommand_read_vramkit_sub_error(
        sub: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from vramkit.errors import DeviceError

    _patch_func(monkeypatch, sub, DeviceError("no such thing", hint="try another"))
    code = main([sub, *MINIMAL[sub]])
    out, err = capsys.readouterr()
    check_error(code, out, err, sub=sub, exit_code=1, says=("no such thing", "try another"))


def test_profile_prefix_is_not_the_profiled_command(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # `profile` has a positional called `command`: it must not become the error prefix
    code = main(["profile", "--out", str(tmp_path / "o"), "--", "python",
                 str(tmp_path / "missing.py")])
    out, err = capsys.readouterr()
    check_error(code, out, err, sub="profile", exit_code=2,
                says=("script not found",), not_says=("['--'",))


# -- OSError and other failures ---------------------------------------------------------------


@pytest.mark.parametrize("sub", SUBCOMMANDS)
@pytest.mark.parametrize(("error", "says"), [
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/x"),
     ("No such file or directory: /data/x", "exists")),
    (PermissionError(errno.EACCES, "Permission denied", "/root/y"),
     ("Permission denied: /root/y", "permissions")),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "/tmp"),
     ("Is a directory: /tmp", "not of a directory")),
    (OSError(errno.ENOSPC, "No space left on device"),
     ("No space left on device", "disk is full")),
])
def test_os_errors_are_user_errors(sub: str, error: OSError, says: tuple[str, ...],
                                   monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    _patch_func(monkeypatch, sub, error)
    code = main([sub, *MINIMAL[sub]])
    out, err = capsys.readouterr()
    check_error(code, out, err, sub=sub, exit_code=1, says=says)
    code = main([sub, "--json", *MINIMAL[sub]])
    out, err = capsys.readouterr()
    check_error(code, out, err, sub=sub, exit_code=1, as_json=True, says=says)


def test_missing_optional_package_is_a_user_error(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _patch_func(monkeypatch, "info", ModuleNotFoundError("No module named 'jax'", name="jax"))
    code = main(["info"])
    out, err = capsys.readouterr()
    check_error(code, out, err, sub="info", exit_code=1, says=("'jax'", "pip install jax"))


def test_interrupt_exits_130(monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    _patch_func(monkeypatch, "select", KeyboardInterrupt())
    assert main(["select"]) == 130
    assert "Traceback" not in capsys.readouterr().err


# -- internal errors: one line, the traceback only with -v ------------------------------------


@pytest.mark.parametrize("error", [ZeroDivisionError("division by zero"),
                                   RuntimeError("something else entirely"),
                                   KeyError("missing")])
def test_internal_errors_are_one_line_without_verbose(error: Exception,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    _patch_func(monkeypatch, "info", error)
    code = main(["info"])
    out, err = capsys.readouterr()
    text = check_error(code, out, err, sub="info", exit_code=1,
                       says=("internal error", type(error).__name__, "bug in vramkit",
                             "report it", "-v"))
    assert text.count("\n") <= 2  # the error line and the hint line


@pytest.mark.parametrize("argv", [["-v", "info"], ["info", "-v"], ["info", "--verbose"]])
def test_internal_errors_show_the_traceback_with_verbose(argv: list[str],
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    _patch_func(monkeypatch, "info", ZeroDivisionError("division by zero"))
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError" in err
    assert "vramkit info: error: internal error: ZeroDivisionError" in err


def test_internal_error_with_json_is_one_object(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _patch_func(monkeypatch, "info", ZeroDivisionError("division by zero"))
    assert main(["info", "--json"]) == 1
    out, err = capsys.readouterr()
    assert "internal error" in json_error(out)["error"] and err == ""
    assert main(["info", "--json", "-v"]) == 1  # the traceback goes to stderr, not stdout
    out, err = capsys.readouterr()
    assert "internal error" in json_error(out)["error"] and "Traceback" in err


# -- global options before and after the sub-command ------------------------------------------


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_verbose_before_and_after_the_subcommand(sub: str) -> None:
    parser = build_parser()
    for argv in ([sub, "-v", *MINIMAL[sub]], ["-v", sub, *MINIMAL[sub]],
                 [sub, "--verbose", *MINIMAL[sub]]):
        args = parser.parse_args(argv)
        assert args.verbose is True, argv
    assert parser.parse_args([sub, *MINIMAL[sub]]).verbose is False


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_every_subcommand_has_json(sub: str) -> None:
    parser = build_parser()
    assert parser.parse_args([sub, "--json", *MINIMAL[sub]]).json is True
    assert parser.parse_args([sub, *MINIMAL[sub]]).json is False


def test_verbose_and_json_work_on_both_sides(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    install_missing_nvml(monkeypatch)
    for argv in (["info", "-v", "--json", "--no-torch"], ["-v", "info", "--json", "--no-torch"],
                 ["--json", "info", "--no-torch"], ["-v", "--json", "info", "--no-torch", "-v"]):
        assert main(argv) == 0, argv
        data = json.loads(capsys.readouterr().out)
        assert "versions" in data, argv


def test_verbose_after_the_subcommand_turns_on_debug_logging(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    monkeypatch.setattr(cli_main.logging, "basicConfig",
                        lambda **kwargs: seen.append(kwargs["level"]))
    monkeypatch.setattr(importlib.import_module("vramkit.cli.select"), "run", lambda args: 0)
    assert main(["select", "-v"]) == 0
    assert seen == [cli_main.logging.DEBUG]


# -- real subprocesses: one user error per sub-command ----------------------------------------


def test_subprocess_info(tmp_path: Path) -> None:
    proc = run_vramkit("info", "--bogus", cwd=tmp_path)
    check_error(proc.returncode, proc.stdout, proc.stderr, sub="info", exit_code=2,
                says=("unrecognized arguments: --bogus",))
    proc = run_vramkit("info", "--json", "--bogus", cwd=tmp_path)
    check_error(proc.returncode, proc.stdout, proc.stderr, sub="info", exit_code=2,
                as_json=True, says=("--bogus",))
    proc = run_vramkit("info", "-v", "--json", "--no-torch", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "versions" in json.loads(proc.stdout)


def test_subprocess_select(tmp_path: Path) -> None:
    proc = run_vramkit("select", "--max-util", "200", cwd=tmp_path)
    check_error(proc.returncode, proc.stdout, proc.stderr, sub="select", exit_code=2,
                says=("--max-util",), not_says=("max_utilization",))
    proc = run_vramkit("select", "--min-free", "lots", "--json", cwd=tmp_path)
    check_error(proc.returncode, proc.stdout, proc.stderr, sub="select", exit_code=2,
                as_json=True, says=("--min-free", "invalid size"))


def test_subprocess_profile(tmp_path: Path) -> None:
    proc = run_vramkit("profile", "--out", str(tmp_path / "o"), "--", "python",
                       str(tmp_path / "missing.py"), cwd=tmp_path)
    check_error(proc.returncode, proc.stdout, proc.stderr, sub="profile", exit_code=2,
                says=("script not found",))
    proc = run_vramkit("profile", "--json", "--", "python", "missing.py", cwd=tmp_path)
    check_error(proc.returncode, proc.stdout, proc.stderr, sub="profile", exit_code=2,
                as_json=True, says=("script not found",))


def test_subprocess_inspect(tmp_path: Path) -> None:
    proc = run_vramkit("inspect", str(tmp_path / "missing.safetensors"), cwd=tmp_path)
    assert proc.returncode in (1, 2)
    check_error(proc.returncode, proc.stdout, proc.stderr, sub="inspect",
                exit_code=proc.returncode, says=("missing.safetensors",))
    proc = run_vramkit("inspect", "m.safetensors", "--top", "x", "--json", cwd=tmp_path)
    check_error(proc.returncode, proc.stdout, proc.stderr, sub="inspect", exit_code=2,
                as_json=True, says=("--top",))


def test_subprocess_demo(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    report = str(tmp_path / "a-file" / "report.html")
    proc = run_vramkit("demo", "--report", report, "--device", "cpu", cwd=tmp_path)
    check_error(proc.returncode, proc.stdout, proc.stderr, sub="demo", exit_code=2,
                says=("--report", "is not a directory"))
    proc = run_vramkit("demo", "--json", "--steps", "0", "--device", "cpu", cwd=tmp_path)
    check_error(proc.returncode, proc.stdout, proc.stderr, sub="demo", exit_code=2,
                as_json=True, says=("--steps",))


def test_verbose_shows_the_traceback_of_user_errors_too(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    # -v is for debugging: an OSError deep in an import (a file shadowing a library) is found so
    _patch_func(monkeypatch, "info", FileNotFoundError(errno.ENOENT, "No such file", "/x"))
    assert main(["info", "-v"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "vramkit info: error: No such file: /x" in err
