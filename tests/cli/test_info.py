"""`vramkit info` on fake hardware: 0 GPUs (NVML missing), 4 GPUs, hidden GPUs, unified memory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.devices.fakes import (
    GiB,
    forbid_cuda,
    install_fake_nvml,
    install_fake_torch_cuda,
    install_missing_nvml,
    make_gpu,
)
from vramkit.cli.main import main


def _run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["info", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_info_without_nvml_says_why(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    install_missing_nvml(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    data = _run_json(capsys)
    assert data["nvml_available"] is False
    assert data["gpus"] == []
    assert any(p.startswith("NVML:") for p in data["problems"])
    assert data["versions"]["torch"]

    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "No NVIDIA GPU visible" in text
    assert "NVML" in text


def test_info_joins_four_gpus_with_cuda_ordinals(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    gpus = [make_gpu(i, memory_used=(i + 1) * GiB, utilization=(10 * i, 0)) for i in range(4)]
    install_fake_nvml(monkeypatch, gpus)
    # The process sees physical GPUs 2 and 0, in that order.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{gpus[2].uuid},{gpus[0].uuid}")
    install_fake_torch_cuda(monkeypatch, [gpus[2], gpus[0]])
    data = _run_json(capsys)
    ordinals = {row["nvml"]["index"]: row["cuda_ordinal"] for row in data["gpus"]}
    assert ordinals == {0: 1, 1: None, 2: 0, 3: None}
    assert data["gpu_count_visible"] == 2
    joined = [row for row in data["gpus"] if row["torch"]]
    assert {row["torch"]["multiprocessor_count"] for row in joined} == {132}
    assert data["environment"]["CUDA_VISIBLE_DEVICES"] == f"{gpus[2].uuid},{gpus[0].uuid}"

    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "NVIDIA H200" in text
    assert "CUDA_VISIBLE_DEVICES" in text


def test_info_no_torch_never_initializes_cuda(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    install_fake_nvml(monkeypatch, [make_gpu(0)])
    forbid_cuda(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    data = _run_json(capsys, "--no-torch")
    assert data["gpus"][0]["cuda_ordinal"] == 0
    assert data["gpus"][0]["torch"] is None


def test_info_reports_hidden_gpus_and_unified_memory(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    install_fake_nvml(monkeypatch, [make_gpu(0, unified_memory=True)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    forbid_cuda(monkeypatch)
    data = _run_json(capsys, "--no-torch")
    assert data["gpus"][0]["nvml"]["unified_memory"] is True
    assert any("hides every GPU" in p for p in data["problems"])
    assert main(["info", "--no-torch"]) == 0
    assert "unified" in capsys.readouterr().out


def test_info_reports_malformed_visible_devices(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    install_fake_nvml(monkeypatch, [make_gpu(0)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,,1")
    forbid_cuda(monkeypatch)
    data = _run_json(capsys, "--no-torch")
    assert any("CUDA_VISIBLE_DEVICES" in p for p in data["problems"])


def test_python_dash_m_runs_the_cli() -> None:
    proc = subprocess.run([sys.executable, "-m", "vramkit", "info", "--json", "--no-torch"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert "versions" in data and "allocator" in data


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "info" in capsys.readouterr().out
