"""The ``vramkit`` entry point's error handling (vramkit.cli.main)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vramkit.cli import info, main
from vramkit.errors import ConfigError


def _failing(error: BaseException) -> Any:
    def run(args: Any) -> int:
        raise error

    return run


def test_cuda_out_of_memory_gets_an_explanation(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(info, "run", _failing(torch.OutOfMemoryError("CUDA out of memory.")))
    assert main.main(["info"]) == 1
    err = capsys.readouterr().err
    assert "out_of_memory" in err and "  - " in err  # the kind and at least one suggestion


def test_unrecognised_runtime_errors_are_reported_as_internal_errors(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Issue 17: no traceback without -v; one line saying it is a vramkit bug (the traceback
    # comes with -v, tests/cli/test_errors.py).
    monkeypatch.setattr(info, "run", _failing(RuntimeError("something else entirely")))
    assert main.main(["info"]) == 1
    err = capsys.readouterr().err
    assert "something else entirely" in err and "Traceback" not in err


def test_vramkit_errors_print_message_and_hint(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(info, "run", _failing(ConfigError("bad value", hint="try another")))
    assert main.main(["info"]) == 1
    assert "bad value" in capsys.readouterr().err
