"""The GPU hardware table: every profile validates, names resolve forgivingly, the numbers keep
the order the hardware has, and every number has a source."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from vramkit.errors import ConfigError
from vramkit.planning.hardware import PROFILES, HardwareProfile, hardware_profile

REQUIRED = ("rtx3090", "rtx4090", "rtx5090", "rtx4060ti-16gb", "a100-80gb", "h100-pcie",
            "h100-sxm", "h200", "l4")
#: Ampere (and older): no FP8 tensor cores.
WITHOUT_FP8 = {"rtx3090", "rtx3060-12gb", "a6000", "a100-80gb"}
MIB = 1024**2


def _fields(profile: HardwareProfile) -> dict[str, object]:
    return {f.name: getattr(profile, f.name) for f in dataclasses.fields(profile)}


def test_the_required_gpus_are_profiled() -> None:
    assert set(REQUIRED) <= set(PROFILES)


@pytest.mark.parametrize("key", list(PROFILES))
def test_every_profile_validates(key: str) -> None:
    profile = PROFILES[key]
    assert profile.name == key
    assert HardwareProfile(**_fields(profile)) == profile  # rebuilt through __post_init__
    assert isinstance(profile.memory_bytes, int) and profile.memory_bytes > 2**30
    for value in (profile.h2d_bytes_per_s, profile.d2h_bytes_per_s, profile.bf16_flops,
                  profile.memory_bandwidth_bytes_per_s):
        assert isinstance(value, float) and value > 0
    assert profile.fp8_flops is None or profile.fp8_flops > profile.bf16_flops
    assert max(profile.h2d_bytes_per_s, profile.d2h_bytes_per_s) < profile.link_bytes_per_s
    assert isinstance(profile.sources, tuple)


@pytest.mark.parametrize("key", list(PROFILES))
def test_every_number_group_has_a_source(key: str) -> None:
    profile = PROFILES[key]
    for group in HardwareProfile.SOURCE_GROUPS:
        found = profile.sources_for(group)
        assert found, f"{key} has no {group} source"
        assert all(len(s) > len(group) + 20 for s in found)


def test_profiles_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        PROFILES["rtx4090"].bf16_flops = 1.0  # type: ignore[misc]


def test_memory_is_the_driver_reported_total() -> None:
    assert PROFILES["rtx4090"].memory_bytes == 24564 * MIB
    assert PROFILES["rtx3090"].memory_bytes == 24576 * MIB
    assert PROFILES["h100-sxm"].memory_bytes == 81559 * MIB
    assert PROFILES["a100-80gb"].memory_bytes == 80 * 1024 * MIB
    for profile in PROFILES.values():  # what is sold, less at most a few percent
        assert profile.memory_bytes % MIB == 0


@pytest.mark.parametrize(("spelling", "key"), [
    ("rtx4090", "rtx4090"), ("RTX 4090", "rtx4090"), ("rtx-4090", "rtx4090"),
    ("4090", "rtx4090"), ("rtx_4090", "rtx4090"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("GeForce RTX 3090", "rtx3090"), ("3090", "rtx3090"), ("RTX 5090", "rtx5090"),
    ("RTX 4060 Ti 16GB", "rtx4060ti-16gb"), ("4060ti-16gb", "rtx4060ti-16gb"),
    ("rtx 4070 ti super", "rtx4070ti-super"), ("NVIDIA GeForce RTX 4070 Ti SUPER",
                                                "rtx4070ti-super"),
    ("RTX 3060 12GB", "rtx3060-12gb"), ("RTX 4080", "rtx4080"),
    ("NVIDIA RTX A6000", "a6000"), ("A6000", "a6000"),
    ("A100-80GB", "a100-80gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("H100 SXM", "h100-sxm"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("h100_pcie", "h100-pcie"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("H200", "h200"), ("NVIDIA H200", "h200"), ("L4", "l4"), ("NVIDIA L40S", "l40s"),
])
def test_names_resolve_forgivingly(spelling: str, key: str) -> None:
    assert hardware_profile(spelling) is PROFILES[key]


@pytest.mark.parametrize("name", ["rtx9090", "Radeon RX 7900 XTX", "", "L40", "A100 40GB"])
def test_an_unknown_name_lists_the_known_ones(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        hardware_profile(name)
    assert isinstance(info.value, ValueError)
    for key in PROFILES:
        assert key in info.value.hint


@pytest.mark.parametrize(("name", "choices"), [
    ("H100", ("h100-sxm", "h100-pcie")), ("NVIDIA GeForce RTX 4060 Ti", ("rtx4060ti-16gb",)),
    ("RTX 3060", ("rtx3060-12gb",)), ("A100", ("a100-80gb",)),
])
def test_an_ambiguous_name_names_the_candidates(name: str, choices: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError, match="ambiguous") as info:
        hardware_profile(name)
    for choice in choices:
        assert repr(choice) in info.value.hint


def test_a_name_must_be_a_string() -> None:
    with pytest.raises(ConfigError):
        hardware_profile(4090)  # type: ignore[arg-type]


def test_bf16_peaks_keep_the_hardware_order() -> None:
    bf16 = {k: p.bf16_flops for k, p in PROFILES.items()}
    assert (bf16["h100-sxm"] > bf16["h100-pcie"] > bf16["a100-80gb"] > bf16["rtx4090"]
            > bf16["rtx3090"])
    assert bf16["h200"] == bf16["h100-sxm"]  # same GH100 silicon and clocks
    assert bf16["rtx5090"] > bf16["rtx4090"] > bf16["rtx4080"] > bf16["rtx4070ti-super"]
    assert bf16["rtx4060ti-16gb"] > bf16["rtx3060-12gb"]


def test_fp8_is_twice_bf16_where_present() -> None:
    # 2% slack: the L40S datasheet gives BF16 362.05 but FP8 733 (= 2 x 366.5) TFLOP/s.
    for profile in PROFILES.values():
        if profile.fp8_flops is not None:
            assert profile.fp8_flops == pytest.approx(2 * profile.bf16_flops, rel=0.02)


def test_fp8_is_none_exactly_without_fp8_tensor_cores() -> None:
    assert {k for k, p in PROFILES.items() if p.fp8_flops is None} == WITHOUT_FP8


def test_memory_bandwidth_keeps_the_hardware_order() -> None:
    bw = {k: p.memory_bandwidth_bytes_per_s for k, p in PROFILES.items()}
    assert bw["h200"] > bw["h100-sxm"] > bw["a100-80gb"] > bw["h100-pcie"] > bw["rtx5090"]
    assert bw["rtx5090"] > bw["rtx4090"] > bw["rtx3090"] > bw["rtx4060ti-16gb"]


def test_host_copies_follow_the_link() -> None:
    by_link: dict[str, list[HardwareProfile]] = {}
    for profile in PROFILES.values():
        by_link.setdefault(profile.pcie, []).append(profile)
    gen5, gen4 = by_link["5.0 x16"], by_link["4.0 x16"]
    assert {p.name for p in by_link["4.0 x8"]} == {"rtx4060ti-16gb"}
    slowest_gen4 = min(p.h2d_bytes_per_s for p in gen4)
    assert min(p.h2d_bytes_per_s for p in gen5) > max(p.h2d_bytes_per_s for p in gen4)
    assert min(p.d2h_bytes_per_s for p in gen5) > max(p.d2h_bytes_per_s for p in gen4)
    assert PROFILES["rtx4060ti-16gb"].h2d_bytes_per_s < slowest_gen4
    assert PROFILES["rtx4060ti-16gb"].d2h_bytes_per_s < min(p.d2h_bytes_per_s for p in gen4)
    assert {p.name for p in gen5} == {"rtx5090", "h100-pcie", "h100-sxm", "h200"}


def _valid() -> dict[str, object]:
    return _fields(PROFILES["rtx4090"])


@pytest.mark.parametrize(("field", "value"), [
    ("name", "RTX 4090"), ("name", ""), ("label", " "), ("memory_bytes", True),
    ("memory_bytes", 0), ("memory_bytes", 24.0 * 2**30), ("h2d_bytes_per_s", 0),
    ("h2d_bytes_per_s", 40e9),  # above the raw 31.5 GB/s of PCIe 4.0 x16
    ("d2h_bytes_per_s", float("nan")), ("bf16_flops", -1.0), ("bf16_flops", None),
    ("fp8_flops", 0), ("memory_bandwidth_bytes_per_s", "1TB/s"), ("pcie", "4.0"),
    ("pcie", "gen4 x16"), ("sources", "a string"), ("sources", ()),
    ("sources", ("compute: whitepaper",)),  # the other groups have no source
    ("sources", ("memory: x" * 3, "host-link: y" * 3, "compute: z" * 3, "bandwidth: w")),
])
def test_validation_rejects_bad_fields(field: str, value: object) -> None:
    with pytest.raises(ConfigError):
        HardwareProfile(**{**_valid(), field: value})  # type: ignore[arg-type]


def test_sources_may_come_as_a_list() -> None:
    values = _valid()
    profile = HardwareProfile(**{**values, "sources": list(values["sources"])})  # type: ignore[arg-type,call-overload]
    assert profile.sources == values["sources"]
    with pytest.raises(ConfigError):
        profile.sources_for("speed")


def test_the_module_imports_no_torch() -> None:
    probe = ("import sys, vramkit.planning.hardware as h; h.hardware_profile('4090'); "
             "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
