"""vramkit.plan (vramkit.planning.api): one call copies the model to the meta device once and
finds its blocks once, whatever it analyzes and calibrates."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

import vramkit
from tests.planning import test_split_plans as split
from tests.planning._models import inputs, stack
from vramkit.planning import api as api_module
from vramkit.planning.api import plan

MiB = 1 << 20


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count ``meta_copy`` and ``find_blocks`` wherever a planning module reaches them."""
    calls: Counter[str] = Counter()

    def counted(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapper

    for module_name in ("api", "analysis", "calibration"):
        module = importlib.import_module(f"vramkit.planning.{module_name}")
        for name in ("meta_copy", "find_blocks"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    return calls


def test_a_split_inference_plan_copies_and_finds_blocks_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_calls(monkeypatch)
    p = plan(split._net(), (split._x(),), 5 * MiB, **split.OPTIONS)
    assert p.split  # the whole blocks were analyzed, then their units
    assert calls == {"meta_copy": 1, "find_blocks": 1}


def test_a_calibrated_training_plan_copies_and_finds_blocks_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # hardware=None measures the machine; a CPU "machine" stands in for the GPU here
    from vramkit.planning import api
    from vramkit.planning.machine import Machine

    monkeypatch.setattr(api, "machine_for", lambda hardware, target: Machine(
        "cpu", None, 1e9, 1e9, 1e12, None, 1e11))
    monkeypatch.setattr(api, "check_device", lambda *args, **kwargs: "cpu")
    monkeypatch.setattr(api, "calibrate_blocks", functools.partial(api.calibrate_blocks,
                                                                   repeats=1))
    calls = _count_calls(monkeypatch)
    p = plan(stack(), inputs(), 6 * MiB, headroom=0, autocast=None)
    assert p.notes and "measured on cpu" in p.notes[0]
    assert calls == {"meta_copy": 1, "find_blocks": 1}


@pytest.mark.parametrize("model", [None, lambda t: t, "flux-dev"])
def test_a_model_that_is_no_module_is_a_config_error(model: Any) -> None:
    import vramkit
    from vramkit.errors import ConfigError

    for call in (lambda: plan(model, inputs(), 1 << 30, hardware="rtx4090"),
                 lambda: vramkit.fit(model, inputs(), 1 << 30, hardware="rtx4090",
                                     device="cpu"),
                 lambda: vramkit.planning.analyze(model, inputs())):
        with pytest.raises(ConfigError, match=r"model must be a torch\.nn\.Module, got "
                                              f"{type(model).__name__}"):
            call()


@pytest.mark.parametrize("example_inputs", [None, 3, inputs()[0]])
def test_bad_example_inputs_are_named_by_type_not_by_the_model_repr(example_inputs: Any) -> None:
    from vramkit.errors import ConfigError

    model = stack()
    with pytest.raises(ConfigError) as err:
        plan(model, example_inputs, 1 << 30, hardware="rtx4090")
    said = f"{err.value.message} {err.value.hint}"
    assert type(example_inputs).__name__ in said
    assert repr(model) not in said and "Linear(" not in said and len(said) < 400


def test_an_error_inside_the_step_is_kept_short() -> None:
    from vramkit.errors import ConfigError

    model = stack()

    def step(m: Any, x: Any) -> Any:  # a failure whose text carries the model's repr
        raise TypeError(f"{m!r} cannot take {x!r}")

    with pytest.raises(ConfigError) as err:
        plan(model, inputs(), 1 << 30, hardware="rtx4090", step=step)
    assert "Linear(" not in err.value.message and len(err.value.message) < 600


def test_a_budget_above_the_hardware_memory_is_refused() -> None:
    # A 48 GiB budget "on rtx4090" predicted a peak no 24 GiB card holds.
    from vramkit.errors import ConfigError
    from vramkit.planning.hardware import hardware_profile
    from vramkit.planning.machine import Machine

    profile = hardware_profile("rtx4090")
    for hardware in ("rtx4090", profile, Machine.from_profile(profile)):
        with pytest.raises(ConfigError, match=r"48\.0 GiB.*24\.0 GiB"):
            plan(stack(device="meta"), inputs(device="meta"), "48GiB", hardware=hardware)
    plan(stack(device="meta"), inputs(device="meta"), profile.memory_bytes, hardware="rtx4090")
    plan(stack(device="meta"), inputs(device="meta"), "24GiB", hardware="rtx4090")  # as sold
    with pytest.raises(ConfigError, match="rtx4090"):
        plan(stack(device="meta"), inputs(device="meta"), (24 << 30) + 1, hardware="rtx4090")


def test_without_a_gpu_plan_and_fit_plan_for_the_cli_s_gpu_and_say_so(monkeypatch) -> None:
    """The Python API on a laptop agrees with `vramkit plan`: no hardware= and no GPU plans for
    the same stated GPU, said in the plan; fit on the CPU needs no extra arguments."""
    import torch

    import vramkit
    from tests.planning._models import inputs, stack
    from vramkit.cli import plan as plan_cli
    from vramkit.planning.api import DEFAULT_OFFLINE_HARDWARE

    assert plan_cli.DEFAULT_OFFLINE_HARDWARE == DEFAULT_OFFLINE_HARDWARE
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    made = vramkit.plan(stack(), inputs(), "1GiB")
    assert made.machine == DEFAULT_OFFLINE_HARDWARE
    assert any("PyTorch sees no GPU" in note and DEFAULT_OFFLINE_HARDWARE in note
               for note in made.notes)


def test_pageable_masters_are_priced_at_the_staged_rate_and_explained(monkeypatch) -> None:
    from tests.planning._models import plan_stack, stack_cost
    from vramkit.devices import host as host_module
    from vramkit.planning import hardware

    cost = stack_cost()
    pinned = plan_stack(cost, 6 << 20, host_memory="pinned")
    # a staged copy as slow as a tenth of the pinned one: the copies must cost more
    monkeypatch.setattr(api_module, "PAGEABLE_MEMCPY_BYTES_PER_S",
                        hardware.hardware_profile("rtx4090").h2d_bytes_per_s / 10)
    pageable = plan_stack(cost, 6 << 20, host_memory="pageable", staging_pool="512MiB")
    assert pinned.host_memory == "pinned" and pageable.host_memory == "pageable"
    assert pageable.copy_bytes_per_s == pytest.approx(2.5e9)
    assert pageable.forward.copy_seconds > pinned.forward.copy_seconds
    text = pageable.explain()
    # the pool the swapper will pin: the blocks its ring has in flight, within the 512 MiB
    slot = pageable.peak_breakdown["swap_slots"] // pageable.num_slots
    assert pageable.staging_pool_bytes == slot * (pageable.num_slots + 1)
    assert (f"of pageable host memory, copied through a "
            f"{vramkit.format_size(pageable.staging_pool_bytes)} pinned staging pool") in text
    assert "Masters pageable, because host_memory='pageable' was asked for" in text
    assert "assumed, not measured" in text  # the offline memcpy figure says where it is from
    assert vramkit.Plan.from_dict(pageable.to_dict()) == pageable
    # "auto" offline: this host's cap is not the planned machine's, but WSL is WSL
    capped = host_module.HostMemory(total=64 << 30, available=60 << 30, pin_limit=1 << 20,
                                    pin_limit_source="cgroup memory.max")
    monkeypatch.setattr(host_module, "read_host_memory", lambda **kw: capped)
    offline = plan_stack(cost, 6 << 20)
    assert offline.host_memory == "pinned" and "offline" in offline.host_memory_reason
    wsl = dataclasses.replace(capped, wsl=True)
    monkeypatch.setattr(host_module, "read_host_memory", lambda **kw: wsl)
    auto = plan_stack(cost, 6 << 20)
    assert auto.host_memory == "pageable" and "WSL" in auto.host_memory_reason
    assert auto.forward.copy_seconds == pytest.approx(pageable.forward.copy_seconds)


def test_auto_on_a_measured_machine_weighs_the_masters_against_the_cap(monkeypatch) -> None:
    from tests.planning._models import stack_cost
    from vramkit.devices import host as host_module
    from vramkit.planning.machine import machine_for

    measured = dataclasses.replace(machine_for("rtx4090", None), measured=True)
    monkeypatch.setattr(api_module, "measure_memcpy_bytes_per_s", lambda: 5e9)
    monkeypatch.setattr(api_module, "measure_staged_bytes_per_s", lambda device: 5e9)
    monkeypatch.setattr(host_module, "read_host_memory", lambda **kw: host_module.HostMemory(
        total=64 << 30, available=60 << 30, pin_limit=1 << 20,
        pin_limit_source="cgroup memory.max"))
    result = plan(stack(device="meta"), inputs(device="meta"), 6 << 20, cost=stack_cost(),
                  hardware=measured, headroom=0)
    assert result.host_memory == "pageable" and "cgroup" in result.host_memory_reason
    assert result.copy_bytes_per_s == 5e9 and any("measured here" in n for n in result.notes)


def test_a_measured_gpu_prices_pageable_masters_at_a_timed_staged_copy(monkeypatch) -> None:
    """On the GPU it plans for, the pageable rate is a staged copy timed there (memcpy and DMA
    together), not the memcpy timed alone: the two share the host's memory bandwidth."""
    import torch

    from vramkit.planning.machine import machine_for

    measured = dataclasses.replace(machine_for("rtx4090", None), measured=True)
    asked: list[object] = []
    monkeypatch.setattr(api_module, "measure_memcpy_bytes_per_s", lambda: 40e9)
    monkeypatch.setattr(api_module, "measure_staged_bytes_per_s",
                        lambda device: asked.append(device) or 9e9)
    rate = api_module._PageableRate.of(measured, torch.device("cuda", 0))
    assert asked == [torch.device("cuda", 0)] and rate.rate == 9e9 and rate.staged
    assert "timed here" in rate.note(measured)
    offline = api_module._PageableRate.of(machine_for("rtx4090", None), None)
    assert not offline.staged and not offline.measured
