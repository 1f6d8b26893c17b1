"""vramkit.planning.record: a plan shows itself (explain, to_dict), and is saved, loaded and applied
again as it was made."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import vramkit
from tests.planning._models import inputs, plan_stack, stack, stack_cost
from vramkit.errors import ConfigError
from vramkit.planning.api import plan
from vramkit.planning.record import Plan, _by_stack

MiB = 1 << 20


@pytest.fixture(scope="module")
def cost():  # type: ignore[no-untyped-def]
    return stack_cost()


_plan = plan_stack


def test_the_plan_serializes_and_explains_itself(cost) -> None:  # type: ignore[no-untyped-def]
    p = _plan(cost, 7 * MiB)
    data = json.loads(p.to_json())
    assert data["swapped"] == list(p.swapped)
    assert data["predicted_step_seconds"] == pytest.approx(p.predicted_step_seconds)
    assert data["forward"]["transfer_bound"] == p.forward.transfer_bound
    text = p.explain()
    assert f"Swap {len(p.swapped)} of 6 blocks" in text and "Predicted step" in text
    assert "rtx4090" in text


def test_explain_says_how_much_of_each_stack_is_swapped() -> None:
    names = ["blocks.0", "blocks.1", "single.0", "single.1", "single.2", "head"]
    assert _by_stack(names, {"blocks.1", "single.0", "single.2"}) == {
        "blocks": (1, 2), "single": (2, 3), "head": (0, 1)}
    model = torch.nn.Module()
    model.a = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(3))
    model.b = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(3))
    model.forward = lambda x: model.b[2](model.b[1](model.b[0](  # type: ignore[method-assign]
        model.a[2](model.a[1](model.a[0](x))))))
    model.requires_grad_(False).to("meta")
    x = torch.empty(8, 512, device="meta")
    whole = plan(model, (x,), 20 << 30, hardware="rtx4090", headroom=0, mode="infer")
    tight = plan(model, (x,), whole.predicted_peak_bytes - 2 * 512 * 513 * 4,
                 hardware="rtx4090", headroom=0, mode="infer")
    assert tight.swapped
    line = next(li for li in tight.explain().splitlines() if li.startswith("Swapped per stack"))
    counts = _by_stack(tight.block_order, set(tight.swapped))
    assert line == "Swapped per stack: " + ", ".join(
        f"{stack} {k} of {n}" for stack, (k, n) in counts.items()) + "."
    assert "Swapped per stack" not in whole.explain()  # nothing swapped: no such line


def test_a_plan_round_trips_through_its_dict_and_json(cost, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    plans = (_plan(cost, 7 * MiB), _plan(cost, 5 * MiB, allow_formats=("fp8",)),
              _plan(cost, 6 * MiB, host_budget=6 * MiB),  # a disk tier
             _plan(cost, 64 * MiB, checkpointing="none"))
    assert plans[2].disk_blocks and plans[1].swapped_format == "fp8"
    for p in plans:
        assert Plan.from_dict(p.to_dict()) == p
        assert Plan.from_dict(json.loads(p.to_json())) == p
        path = p.save(tmp_path / "plan.json")
        assert path == tmp_path / "plan.json"
        assert Plan.load(path) == p
        assert list(tmp_path.iterdir()) == [path]  # no temporary file left beside it


def test_a_dict_from_elsewhere_is_refused(cost, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data = _plan(cost, 7 * MiB).to_dict()
    with pytest.raises(ConfigError, match="no field"):
        Plan.from_dict({**data, "slots": 3})
    with pytest.raises(ConfigError, match="lacks"):
        Plan.from_dict({k: v for k, v in data.items() if k != "swapped"})
    with pytest.raises(ConfigError, match="mapping"):
        Plan.from_dict([])  # type: ignore[arg-type]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not a saved plan"):
        Plan.load(bad)


@pytest.mark.parametrize("as_path", [False, True])
def test_fit_applies_a_loaded_plan_without_searching_again(
        as_path: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options = {"hardware": "rtx4090", "headroom": 0, "autocast": None, "device": "cpu"}
    fresh = vramkit.fit(stack(), inputs(), 6 * MiB, **options)
    made = fresh.plan
    fresh.detach()
    assert made.swapped and made.checkpointed
    path = made.save(tmp_path / "plan.json")

    def no_search(*args: object, **kwargs: object) -> None:
        raise AssertionError("fit searched again")

    monkeypatch.setattr("vramkit.planning.fitting.make_plan", no_search)
    model = stack()
    fitted = vramkit.fit(model, inputs(), 6 * MiB, device="cpu",
                         plan=path if as_path else Plan.load(path))
    assert fitted.plan == made
    assert fitted.swapper is not None and fitted.swapper.swapped_names == list(made.swapped)
    from vramkit.offload.checkpointing import is_checkpointed

    assert {n for n in made.block_order if is_checkpointed(model.get_submodule(n))} == set(
        made.checkpointed)
    fitted.detach()


def test_a_transfer_bound_phase_says_what_the_compute_waits_for(cost) -> None:  # type: ignore[no-untyped-def]
    # "Forward 1205 ms, transfer-bound: 2.3 GiB of copies (897 ms) vs 1093 ms of compute"
    # read as a contradiction: the copies take less than the compute, yet bound it (the first
    # block's copy, and copies a full ring cannot start early, do not overlap).
    import dataclasses

    from vramkit.planning.record import PhaseTime

    phase = PhaseTime(seconds=1.205, compute_seconds=1.093, copy_seconds=0.897,
                      copy_bytes=int(2.3 * (1 << 30)), slowed_seconds=0.0)
    assert phase.transfer_bound
    made = dataclasses.replace(_plan(cost, 7 * MiB), forward=phase)
    line = next(li for li in made.explain().splitlines() if li.startswith("Forward"))
    assert "waits 112 ms for them" in line and "1093 ms" in line and "897 ms" in line
    assert " vs " not in line
    hidden = PhaseTime(seconds=0.091, compute_seconds=0.091, copy_seconds=0.001,
                       copy_bytes=15 << 20)
    line = next(li for li in dataclasses.replace(made, forward=hidden).explain().splitlines()
                if li.startswith("Forward"))
    assert "compute-bound" in line and "hide behind" in line and " vs " not in line


def test_an_offline_plan_names_no_model_its_copy_slowdown_was_measured_on(cost) -> None:  # type: ignore[no-untyped-def]
    # Plans of Llama and SDXL said "the share the calibration measured for FLUX.1-dev's blocks".
    import dataclasses

    made = _plan(cost, 7 * MiB)
    assert made.swapped
    note = next(n for n in made.notes if n.startswith("Copies slow the compute"))
    assert "FLUX" not in note and "not timed for this model" in note
    from vramkit.planning.hardware import hardware_profile
    from vramkit.planning.machine import Machine

    own = dataclasses.replace(Machine.from_profile(hardware_profile("rtx4090")),
                              copy_slowdown=(0.05, 0.04))
    made = _plan(cost, 7 * MiB, hardware=own)
    note = next(n for n in made.notes if n.startswith("Copies slow the compute"))
    assert "H200" not in note and "Machine.copy_slowdown" in note


def test_the_host_memory_is_a_part_of_the_plan_with_a_verdict(cost) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    p = _plan(cost, 6 * MiB, host_budget="64MiB")
    assert p.swapped
    masters = sum(b.swapped["bf16"] for b in cost.blocks if b.name in set(p.swapped))
    assert p.host_breakdown.get("masters") == masters  # 2 x 256 x 1024 fp32 per block
    assert p.host_bytes == sum(p.host_breakdown.values())
    assert p.host_budget_bytes == 64 * MiB
    spare = 64 * MiB - p.host_bytes
    assert (f"within the host budget of 64.0 MiB ({vramkit.format_size(spare)} to spare)"
            in p.explain())
    over = replace(p, host_budget_bytes=p.host_bytes - MiB)
    assert "OVER the host budget" in over.host_verdict() and "by 1.0 MiB" in over.host_verdict()
    unbounded = _plan(cost, 6 * MiB)
    assert "no host budget was given" in unbounded.explain()
    offloaded = replace(p, host_breakdown={"masters": 3 * MiB, "offloaded_activations": MiB},
                        host_bytes=4 * MiB)
    assert "(masters 3.0 MiB, offloaded activations 1.0 MiB)" in offloaded.host_verdict()
    assert Plan.from_dict(json.loads(offloaded.to_json())) == offloaded
    assert "4.0 MiB pinned" in offloaded.host_verdict()
    pageable = replace(offloaded, host_memory="pageable", staging_pool_bytes=2 * MiB)
    said = pageable.host_verdict()
    assert "pinned (" not in said and "4.0 MiB held" in said  # the masters are not pinned
    assert ("masters in pageable memory; pinned: the 2.0 MiB staging pool and the offloaded "
            "activations") in said
    resident = _plan(cost, 64 * MiB)
    assert not resident.host_bytes and resident.host_verdict() == ""
