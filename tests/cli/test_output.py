"""vramkit.cli._output: flag names in errors, the usage-error block, output paths checked early."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from vramkit.cli import _output
from vramkit.cli._output import (
    REPORT_FORMATS,
    FlagError,
    check_output_dir,
    check_output_file,
    flag_text,
    flag_values,
)
from vramkit.errors import ConfigError, DeviceError

FLAGS = {"budget": "--budget", "model_size": "--model-size", "steps": "--steps",
         "min_free_memory": "--min-free", "max_utilization": "--max-util"}


@pytest.mark.parametrize(("text", "expected"), [
    ("DemoConfig.budget must be at least 1 bytes", "--budget must be at least 1 bytes"),
    ("Give DemoConfig.model_size as a size.", "Give --model-size as a size."),
    ("Lower min_free_memory or max_utilization.", "Lower --min-free or --max-util."),
    ("Pass a percentage, e.g. max_utilization=10 to skip", "Pass a percentage, e.g. --max-util "
                                                           "10 to skip"),
    ("steps=3 is too few", "--steps 3 is too few"),
    # plain words stay words; other names and flags stay as they are
    ("the budget is simulated over 10 steps", "the budget is simulated over 10 steps"),
    ("--budget 4GiB is more than free", "--budget 4GiB is more than free"),
    ("SwapConfig.num_slots must be >= 1", "SwapConfig.num_slots must be >= 1"),
    ("my_budget and budget_bytes", "my_budget and budget_bytes"),
    # a function's argument, as validators name it
    ("plan_demo.steps must be >= 1, got 0", "--steps must be >= 1, got 0"),
    ("Give plan_demo.budget as a size.", "Give --budget as a size."),
    # a module's attribute is not an argument
    ("got torch.steps", "got torch.steps"),
])
def test_flag_text(text: str, expected: str) -> None:
    assert flag_text(text, FLAGS) == expected


def test_flag_values_marks_config_errors_as_usage_errors() -> None:
    with pytest.raises(FlagError) as caught, flag_values():
        raise ConfigError("bad", hint="do this")
    assert caught.value.message == "bad" and caught.value.hint == "do this"
    assert isinstance(caught.value, ConfigError)  # callers catching ConfigError still do
    with pytest.raises(DeviceError), flag_values():  # not a flag value: a runtime failure
        raise DeviceError("gone")


def test_output_file_accepts_new_files_in_existing_directories(tmp_path: Path) -> None:
    assert check_output_file("--report", tmp_path / "r.html") == tmp_path / "r.html"
    existing = tmp_path / "old.html"
    existing.write_text("x")
    assert check_output_file("--report", existing) == existing
    assert os.listdir(tmp_path) == ["old.html"]  # and leaves no probe file behind


def test_output_paths_whose_parent_is_missing_are_refused(tmp_path: Path) -> None:
    # A typo in a directory name would otherwise grow a tree of directories silently.
    deep = tmp_path / "a" / "b" / "r.json"
    with pytest.raises(ConfigError) as caught:
        check_output_file("--report", deep, formats=REPORT_FORMATS)
    text = f"{caught.value.message} {caught.value.hint}"
    assert "--report" in text and str(deep) in text and "does not exist" in text
    with pytest.raises(ConfigError, match=r"--out .*does not exist"):
        check_output_dir("--out", tmp_path / "a" / "out")
    assert os.listdir(tmp_path) == []  # the checks make nothing


@pytest.mark.parametrize("case", ["directory", "parent is a file", "suffix", "empty",
                                  "missing library", "probe fails"])
def test_output_file_refusals_name_the_flag(case: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path: Path | str = tmp_path / "r.html"
    says = ""
    if case == "directory":
        Path(path).mkdir()
        says = "is a directory"
    elif case == "parent is a file":
        (tmp_path / "f").write_text("")
        path, says = tmp_path / "f" / "g" / "r.html", "is not a directory"
    elif case == "suffix":
        path, says = tmp_path / "r.txt", ".html, .htm, .json, .png"
    elif case == "empty":
        path, says = "", "needs a file path"
    elif case == "missing library":
        monkeypatch.setitem(sys.modules, "matplotlib", None)
        path, says = tmp_path / "r.png", "pip install matplotlib"
    else:
        def refuse(directory: Path) -> None:
            raise OSError(30, "Read-only file system", str(directory))

        monkeypatch.setattr(_output, "_probe_directory", refuse)
        says = "Read-only file system"
    with pytest.raises(ConfigError) as caught:
        check_output_file("--report", path, formats=REPORT_FORMATS)
    text = f"{caught.value.message} {caught.value.hint}"
    assert "--report" in text and says in text


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root writes through directory permissions")
def test_output_file_in_a_read_only_directory(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="cannot write in"):
            check_output_file("--report", locked / "r.html")
    finally:
        locked.chmod(0o700)


def test_output_dir(tmp_path: Path) -> None:
    assert check_output_dir("--out", tmp_path / "new", ["report.json"]) == tmp_path / "new"
    assert not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"--out .* not a directory"):
        check_output_dir("--out", tmp_path / "file")
    (tmp_path / "d" / "report.json").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"report\.json is a directory"):
        check_output_dir("--out", tmp_path / "d", ["report.json"])


def test_module_available() -> None:
    assert _output.module_available("json")
    assert not _output.module_available("no_such_module_vramkit")
