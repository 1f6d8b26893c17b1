"""Every size and integer flag of every sub-command: a bad value is a usage error (exit code 2)
that names the flag in one line, whatever the value (negative, absurd, not a number)."""

from __future__ import annotations

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
