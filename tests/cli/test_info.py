"""`vramkit info` on fake hardware: 0 GPUs (NVML missing), 4 GPUs, hidden GPUs, unified memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli._helpers import check_error, run_vramkit
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


@pytest.mark.parametrize("linked", [True, False, None], ids=["nvlink", "pcie", "unknown"])
def test_info_says_whether_nvlink_joins_the_visible_gpus(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str],
                                                          linked: bool | None) -> None:
    from vramkit.devices import nvml

    gpus = [make_gpu(i) for i in range(4)]
    install_fake_nvml(monkeypatch, gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{gpus[2].uuid},{gpus[0].uuid}")
    install_fake_torch_cuda(monkeypatch, [gpus[2], gpus[0]])
    asked: list[list[str]] = []
    monkeypatch.setattr(nvml, "nvlink_connected", lambda uuids: asked.append(uuids) or linked)
    data = _run_json(capsys)
    assert data["nvlink_all_pairs"] is linked
    assert sorted(asked[0]) == sorted([gpus[0].uuid, gpus[2].uuid])  # the visible ones only
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    if linked is None:
        assert "GPU links" not in text
    else:
        assert ("NVLink between every pair" in text) is linked
        assert ("copy whole blocks" in text) is (not linked)


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


# -- host memory and --disk ----------------------------------------------------------------------


def test_info_shows_host_memory(monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    from vramkit.devices import host

    install_missing_nvml(monkeypatch)
    fake = host.HostMemory(total=16 * GiB, available=12 * GiB, process_rss=GiB,
                           cgroup_limit=8 * GiB, cgroup_usage=6 * GiB, memlock_limit=8 << 20,
                           wsl=False, pin_limit=8 * GiB, pin_limit_source="cgroup memory.max",
                           shm_free=GiB, shm_total=2 * GiB)
    monkeypatch.setattr(host, "read_host_memory", lambda **kwargs: fake)
    data = _run_json(capsys, "--no-torch")
    assert data["host"] == fake.to_dict()
    assert data["host"]["headroom"] == 2 * GiB
    assert "disk" not in data

    assert main(["info", "--no-torch"]) == 0
    text = capsys.readouterr().out
    assert "Host memory" in text
    assert "limit 8.0 GiB, using 6.0 GiB" in text
    assert "8.0 GiB  (cgroup memory.max)" in text
    assert "RLIMIT_MEMLOCK" in text
    assert "1.0 GiB free of 2.0 GiB" in text  # /dev/shm: room for node-shared weights
    assert ("host memory mode here: pinned, because pinning is bounded by 8.0 GiB (cgroup "
            "memory.max): masters up to 6.4 GiB are pinned, larger ones pageable") in text


def test_info_says_masters_are_pageable_on_wsl(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from vramkit.devices import host

    install_missing_nvml(monkeypatch)
    fake = host.HostMemory(total=32 * GiB, available=30 * GiB, wsl=True, pin_limit=16 * GiB,
                           pin_limit_source="WSL (half of RAM)")
    monkeypatch.setattr(host, "read_host_memory", lambda **kwargs: fake)
    data = _run_json(capsys, "--no-torch")
    assert data["host_memory"]["mode"] == "pageable" and "WSL" in data["host_memory"]["reason"]
    assert main(["info", "--no-torch"]) == 0
    assert "host memory mode here: pageable, because this is WSL 2" in capsys.readouterr().out


def test_info_host_memory_of_this_machine(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    install_missing_nvml(monkeypatch)
    host = _run_json(capsys, "--no-torch")["host"]
    assert {"total", "available", "process_rss", "cgroup_limit", "memlock_limit", "pin_limit",
            "pin_limit_source", "headroom"} <= set(host)


def test_info_disk_measures_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    install_missing_nvml(monkeypatch)
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x01" * (1 << 20))
    data = _run_json(capsys, "--no-torch", "--disk", str(path))
    assert data["disk"]["path"] == str(path)
    assert data["disk"]["bytes"] == 1 << 20
    assert data["disk"]["gb_per_s"] > 0

    assert main(["info", "--no-torch", "--disk", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "disk read:" in text and "GB/s" in text and "model.safetensors" in text


def test_info_disk_on_a_missing_path_is_a_clean_error(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    install_missing_nvml(monkeypatch)
    missing = str(tmp_path / "nope")
    code = main(["info", "--no-torch", "--disk", missing])
    captured = capsys.readouterr()
    check_error(code, captured.out, captured.err, sub="info", exit_code=1,
                says=(missing, "does not exist"))
    assert captured.out == ""  # nothing of the report was printed

    code = main(["info", "--json", "--no-torch", "--disk", missing])
    captured = capsys.readouterr()
    check_error(code, captured.out, captured.err, sub="info", exit_code=1, as_json=True,
                says=("does not exist",))


def test_info_disk_errors_in_a_real_process(tmp_path: Path) -> None:
    empty = tmp_path / "empty.bin"
    empty.touch()
    proc = run_vramkit("info", "--no-torch", "--disk", str(empty))
    check_error(proc.returncode, proc.stdout, proc.stderr, sub="info", exit_code=1,
                says=("empty",))


def test_info_disk_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    install_missing_nvml(monkeypatch)
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x01" * (1 << 20))
    data = _run_json(capsys, "--no-torch", "--disk", str(path), "--disk-threads", "4")
    assert data["disk"]["threads"] == 4 and data["disk"]["bytes"] == 1 << 20
    assert main(["info", "--no-torch", "--disk", str(path), "--disk-threads", "4"]) == 0
    assert "4 threads" in capsys.readouterr().out
    for argv, says in ((["--disk-threads", "4"], "--disk"),
                       (["--disk", str(path), "--disk-threads", "0"], "--disk-threads")):
        code = main(["info", "--no-torch", *argv])
        captured = capsys.readouterr()
        # a flag's value: a usage error, before anything is measured
        check_error(code, captured.out, captured.err, sub="info", exit_code=2, says=(says,))
