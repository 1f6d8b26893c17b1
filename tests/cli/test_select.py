"""`vramkit select` prints a CUDA_VISIBLE_DEVICES value from NVML, never touching CUDA."""

from __future__ import annotations

import json

import pytest

from tests.devices.fakes import GiB, forbid_cuda, install_fake_nvml, make_gpu
from vramkit.cli.main import main


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> list:
    gpus = [make_gpu(0, memory_used=70 * GiB), make_gpu(1, memory_used=5 * GiB),
            make_gpu(2, memory_used=40 * GiB), make_gpu(3, memory_used=1 * GiB,
                                                        utilization=(95, 50))]
    install_fake_nvml(monkeypatch, gpus)
    forbid_cuda(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    return gpus


def test_select_prints_uuids_of_most_free(four_gpus: list,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["select", "-n", "2"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == f"{four_gpus[3].uuid},{four_gpus[1].uuid}"


def test_select_filters_and_json(four_gpus: list, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["select", "-n", "2", "--min-free", "30GiB", "--max-util", "50", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["nvml_index"] for d in data["devices"]] == [1, 2]
    assert data["cuda_visible_devices"] == f"{four_gpus[1].uuid},{four_gpus[2].uuid}"


def test_select_indices(four_gpus: list, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["select", "-n", "1", "--indices"]) == 0
    assert capsys.readouterr().out.strip() == "3"


def test_select_not_enough_devices_is_an_error(four_gpus: list,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["select", "-n", "3", "--min-free", "50GiB"]) == 1
    err = capsys.readouterr().err
    assert "only 2 of 4 qualify" in err
    assert "hint:" in err


def test_select_bad_size_is_an_error(four_gpus: list, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["select", "--min-free", "lots"]) == 2  # a flag's value: a usage error
    assert "invalid size" in capsys.readouterr().err


# -- flag errors (exit 2, before NVML is read) and hints in flags ------------------------------


@pytest.mark.parametrize(("argv", "flag"), [
    (["-n", "0"], "--count"),
    (["--min-free", "lots"], "--min-free"),
    (["--max-util", "200"], "--max-util"),
    (["--max-util", "nan"], "--max-util"),
])
@pytest.mark.parametrize("as_json", [False, True])
def test_flag_errors_exit_2_and_name_the_flag(argv: list[str], flag: str, as_json: bool,
                                              four_gpus: list,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from tests.cli._helpers import check_error

    code = main(["select", *(["--json"] if as_json else []), *argv])
    out, err = capsys.readouterr()
    check_error(code, out, err, sub="select", exit_code=2, as_json=as_json, says=(flag,),
                not_says=("min_free_memory", "max_utilization"))


def test_flag_errors_read_no_nvml(monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    from vramkit.devices import selection

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("NVML read before the flags were checked")

    monkeypatch.setattr(selection, "_candidates", refuse)
    assert main(["select", "--max-util", "-1"]) == 2
    assert "--max-util" in capsys.readouterr().err


@pytest.mark.parametrize("as_json", [False, True])
def test_too_few_gpus_hint_names_the_flags(four_gpus: list, as_json: bool,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from tests.cli._helpers import check_error

    code = main(["select", "-n", "3", "--min-free", "50GiB",
                 *(["--json"] if as_json else [])])
    out, err = capsys.readouterr()
    check_error(code, out, err, sub="select", exit_code=1, as_json=as_json,
                says=("only 2 of 4 qualify", "--min-free", "--max-util"),
                not_says=("min_free_memory", "max_utilization"))
