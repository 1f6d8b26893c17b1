"""CPU tests of DeviceManager / DeviceConfiguration with fake detectors (no GPU, no JAX start)."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from vramkit.devices import jax_backend, manager, shared_manager
from vramkit.devices.info import DeviceCapabilities, DeviceInfo, DeviceType
from vramkit.devices.jax_backend import (
    JAX_MEM_FRACTION_ENV,
    JAX_PREALLOCATE_ENV,
    LEGACY_JAX_MEM_FRACTION_ENV,
    apply_jax_flags,
    apply_jax_memory_settings,
    memory_fraction_env_name,
)
from vramkit.devices.manager import (
    DeviceConfiguration,
    DeviceManager,
    MemoryStrategy,
    configure_for_generative_models,
)
from vramkit.devices.shared_manager import get_device_manager, print_device_info
from vramkit.errors import (
    ConfigError,
    DeviceError,
    JaxUnavailableError,
    TooLateError,
    VramkitWarning,
)

SRC = Path(__file__).resolve().parents[2] / "src"
_REAL_SET_FRACTION = torch.cuda.set_per_process_memory_fraction

_JAX_ENV = (JAX_MEM_FRACTION_ENV, LEGACY_JAX_MEM_FRACTION_ENV, JAX_PREALLOCATE_ENV,
            "JAX_ENABLE_X64", "JAX_DISABLE_JIT", "XLA_FLAGS", "JAX_PLATFORMS")
_TEST_ENV = ("VRAMKIT_TEST_FLAG", "PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES",
             "CUDA_DEVICE_ORDER")


# ---------------------------------------------------------------------------------------------
# Fakes and fixtures
# ---------------------------------------------------------------------------------------------

def _gpu_record(device_id: int) -> DeviceInfo:
    return DeviceInfo(device_id=device_id, name=f"Fake GPU {device_id}",
                      compute_capability=(9, 0), total_memory=80 * 2**30,
                      multiprocessor_count=132, max_threads_per_block=1024,
                      max_shared_memory_per_block=48 * 1024, supports_fp16=True,
                      supports_bf16=True, uuid=f"GPU-fake-{device_id}")


class FakeDetector:
    """Reports ``n_gpus`` GPUs (or one CPU when 0) and records what the environment held."""

    def __init__(self, n_gpus: int, device_ids: list[int] | None = None,
                 watch_env: str | None = None) -> None:
        self.n_gpus = n_gpus
        self.device_ids = device_ids if device_ids is not None else list(range(n_gpus))
        self.watch_env = watch_env
        self.seen_env: str | None = None

    def detect_capabilities(self) -> DeviceCapabilities:
        if self.watch_env:
            self.seen_env = os.environ.get(self.watch_env)
        if self.n_gpus == 0:
            return DeviceCapabilities(device_type=DeviceType.CPU, device_count=1)
        return DeviceCapabilities(device_type=DeviceType.GPU, device_count=self.n_gpus,
                                  total_memory_mb=80 * 1024 * self.n_gpus,
                                  compute_capability="9.0", cuda_version="12.8",
                                  driver_version="570.00", supports_mixed_precision=True,
                                  supports_distributed=self.n_gpus > 1)

    def list_devices(self) -> list[DeviceInfo]:
        return [_gpu_record(i) for i in self.device_ids]


class CapabilitiesOnlyDetector:
    """A custom detector with only detect_capabilities() (Artifex's minimal protocol)."""

    def __init__(self, n_gpus: int) -> None:
        self.n_gpus = n_gpus

    def detect_capabilities(self) -> DeviceCapabilities:
        return DeviceCapabilities(device_type=DeviceType.GPU, device_count=self.n_gpus)


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, int]]:
    """Restore every variable the manager may write, pretend JAX is neither imported nor
    started, and record set_per_process_memory_fraction calls instead of touching CUDA."""
    for name in _JAX_ENV + _TEST_ENV:
        monkeypatch.setenv(name, "placeholder")  # records the original for restoration
        monkeypatch.delenv(name)
    for module in (manager, jax_backend):
        monkeypatch.setattr(module, "jax_backend_initialized", lambda: False)
        monkeypatch.setattr(module, "jax_imported", lambda: False)
    monkeypatch.setattr(shared_manager, "_shared_manager", None)
    calls: list[tuple[float, int]] = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device=None: calls.append((fraction, device)))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # room for every fake GPU
    return calls


# ---------------------------------------------------------------------------------------------
# DeviceConfiguration
# ---------------------------------------------------------------------------------------------

def test_configuration_defaults() -> None:
    config = DeviceConfiguration()
    assert config.memory_strategy is MemoryStrategy.BALANCED
    assert config.memory_fraction == 0.75
    assert (config.enable_x64, config.enable_jit, config.preallocate) == (False, True, False)
    assert config.platform_priority == ("cuda", "cpu")
    assert dict(config.environment_variables) == {}


@pytest.mark.parametrize(("strategy", "fraction"), [
    (MemoryStrategy.CONSERVATIVE, 0.60), (MemoryStrategy.BALANCED, 0.75),
    (MemoryStrategy.AGGRESSIVE, 0.90), ("balanced", 0.75), ("AGGRESSIVE", 0.90),
    (" conservative ", 0.60),
])
def test_strategy_fractions(strategy: Any, fraction: float) -> None:
    config = DeviceConfiguration(memory_strategy=strategy)
    assert isinstance(config.memory_strategy, MemoryStrategy)
    assert config.memory_fraction == fraction
    assert config.effective_fraction == fraction


def test_named_strategy_accepts_its_own_fraction() -> None:
    config = DeviceConfiguration(memory_strategy=MemoryStrategy.AGGRESSIVE, memory_fraction=0.9)
    assert config == DeviceConfiguration(memory_strategy="aggressive")


@pytest.mark.parametrize("fraction", [0.05, 0.8, 1.0, 1])
def test_custom_fraction(fraction: float) -> None:
    config = DeviceConfiguration(memory_strategy=MemoryStrategy.CUSTOM, memory_fraction=fraction)
    assert config.memory_strategy is MemoryStrategy.CUSTOM
    assert config.memory_fraction == float(fraction)
    assert isinstance(config.memory_fraction, float)


@pytest.mark.parametrize("kwargs", [
    {"memory_strategy": "custom"},
    {"memory_strategy": "custom", "memory_fraction": 0.0},
    {"memory_strategy": "custom", "memory_fraction": -0.1},
    {"memory_strategy": "custom", "memory_fraction": 1.0001},
    {"memory_strategy": "custom", "memory_fraction": math.nan},
    {"memory_strategy": "custom", "memory_fraction": math.inf},
    {"memory_strategy": "custom", "memory_fraction": True},
    {"memory_strategy": "custom", "memory_fraction": "0.5"},
    {"memory_strategy": "turbo"},
    {"memory_strategy": 3},
    {"memory_strategy": MemoryStrategy.BALANCED, "memory_fraction": 0.5},
    {"memory_strategy": MemoryStrategy.BALANCED, "memory_fraction": 2.0},
    {"enable_x64": "false"},
    {"enable_jit": 1},
    {"preallocate": None},
    {"platform_priority": ("cuda", "metal")},
    {"platform_priority": ()},
    {"platform_priority": ("cpu", "CPU")},
    {"platform_priority": 7},
    {"environment_variables": {"X": 1}},
    {"environment_variables": {"": "1"}},
    {"environment_variables": {"A=B": "1"}},
    {"environment_variables": [("X", "1")]},
    {"environment_variables": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}},
    {"environment_variables": {"XLA_CLIENT_MEM_FRACTION": "0.5"}},
    {"environment_variables": {"JAX_ENABLE_X64": "1"}},
])
def test_invalid_configuration_raises_config_error_with_hint(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        DeviceConfiguration(**kwargs)
    # A hint written for this mistake, not the class's generic fallback.
    assert info.value.hint and info.value.hint != ConfigError.default_hint


def test_platform_priority_normalised() -> None:
    assert DeviceConfiguration(platform_priority=["CUDA", " cpu"]).platform_priority == (
        "cuda", "cpu")
    assert DeviceConfiguration(platform_priority="cpu").platform_priority == ("cpu",)


def test_configuration_is_frozen_and_environment_immutable() -> None:
    source = {"VRAMKIT_TEST_FLAG": "1"}
    config = DeviceConfiguration(environment_variables=source)
    source["VRAMKIT_TEST_FLAG"] = "2"
    assert config.environment_variables["VRAMKIT_TEST_FLAG"] == "1"
    with pytest.raises(TypeError):
        config.environment_variables["OTHER"] = "x"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.memory_fraction = 0.5  # type: ignore[misc]


@pytest.mark.parametrize("config", [
    DeviceConfiguration(),
    DeviceConfiguration(memory_strategy="custom", memory_fraction=0.33, enable_x64=True,
                        enable_jit=False, platform_priority=("rocm", "gpu", "cpu"),
                        environment_variables={"VRAMKIT_TEST_FLAG": "on"}, preallocate=True),
    DeviceConfiguration(memory_strategy="conservative"),
])
def test_to_dict_from_dict_round_trip(config: DeviceConfiguration) -> None:
    data = json.loads(json.dumps(config.to_dict()))
    restored = DeviceConfiguration.from_dict(data)
    assert restored == config
    assert hash(restored) == hash(config)


def test_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ConfigError, match="memory_stratgy"):
        DeviceConfiguration.from_dict({"memory_stratgy": "balanced"})


def test_with_strategy_keeps_other_fields() -> None:
    base = DeviceConfiguration(memory_strategy="custom", memory_fraction=0.2, enable_x64=True,
                               platform_priority=("cpu",), preallocate=True)
    changed = base.with_strategy("aggressive")
    assert (changed.memory_strategy, changed.memory_fraction) == (MemoryStrategy.AGGRESSIVE, 0.9)
    assert (changed.enable_x64, changed.platform_priority, changed.preallocate) == (
        True, ("cpu",), True)
    with pytest.raises(ConfigError):
        dataclasses.replace(base, memory_strategy=MemoryStrategy.AGGRESSIVE)  # keeps 0.2


# ---------------------------------------------------------------------------------------------
# DeviceManager with fake detectors
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_gpus", [0, 1, 4])
def test_manager_counts_and_torch_fraction(n_gpus: int, isolated: list) -> None:
    dm = DeviceManager(detector=FakeDetector(n_gpus))
    assert dm.has_gpu is (n_gpus > 0)
    assert dm.gpu_count == n_gpus
    assert dm.device_count == max(n_gpus, 1)
    assert [d.device_id for d in dm.devices] == list(range(n_gpus))
    assert dm.gpu_ids == tuple(range(n_gpus))
    assert isolated == [(0.75, i) for i in range(n_gpus)]
    assert dm.capabilities.device_type is (DeviceType.GPU if n_gpus else DeviceType.CPU)


@pytest.mark.parametrize(("config", "fraction"), [
    (DeviceConfiguration(memory_strategy="custom", memory_fraction=0.3), 0.3),
    (DeviceConfiguration(memory_strategy="aggressive"), 0.9),
    (DeviceConfiguration(memory_strategy="conservative"), 0.6),
])
def test_strategy_reaches_pytorch(config: DeviceConfiguration, fraction: float,
                                  isolated: list) -> None:
    DeviceManager(config, detector=FakeDetector(2, device_ids=[1, 3]))
    assert isolated == [(fraction, 1), (fraction, 3)]


def test_apply_false_changes_nothing(isolated: list) -> None:
    config = DeviceConfiguration(environment_variables={"VRAMKIT_TEST_FLAG": "1"})
    dm = DeviceManager(config, detector=FakeDetector(2), apply=False)
    assert isolated == []
    assert "VRAMKIT_TEST_FLAG" not in os.environ
    assert JAX_PREALLOCATE_ENV not in os.environ
    dm.apply_configuration()
    assert isolated == [(0.75, 0), (0.75, 1)]
    assert os.environ["VRAMKIT_TEST_FLAG"] == "1"


def test_capabilities_only_detector() -> None:
    dm = DeviceManager(detector=CapabilitiesOnlyDetector(3), apply=False)
    assert dm.devices == ()
    assert dm.gpu_ids == (0, 1, 2)
    assert dm.get_default_device() == torch.device("cuda", 0)


def test_bad_detectors() -> None:
    with pytest.raises(ConfigError):
        DeviceManager(detector=object(), apply=False)
    bad = types.SimpleNamespace(detect_capabilities=lambda: {"device_type": "gpu"})
    with pytest.raises(DeviceError):
        DeviceManager(detector=bad, apply=False)
    with pytest.raises(ConfigError):
        DeviceManager({"memory_strategy": "balanced"}, detector=FakeDetector(0))  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only PyTorch build")
def test_gpu_reported_but_pytorch_cannot_cap_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # The real function of a CPU-only build refuses; the manager must say so clearly.
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", _REAL_SET_FRACTION)
    with pytest.raises(DeviceError):
        DeviceManager(detector=FakeDetector(1))


def test_detector_reporting_more_gpus_than_pytorch_sees(
        monkeypatch: pytest.MonkeyPatch, isolated: list) -> None:
    def set_fraction(fraction: float, device: int) -> None:
        if device >= 1:  # what PyTorch says for an ordinal it does not have
            raise RuntimeError(f"Allocator not initialized for device {chr(device)}")
        isolated.append((fraction, device))

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(DeviceError) as info:
        DeviceManager(detector=FakeDetector(3))
    message = str(info.value)
    assert "the detector reports 3 GPUs" in message and "PyTorch sees 1" in message
    assert "Allocator" not in message
    assert isolated == []  # checked before any GPU was capped
    # The ordinals matter, not only the count: GPU 2 alone is not one of PyTorch's 2.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DeviceError, match="GPU 2"):
        DeviceManager(detector=FakeDetector(1, device_ids=[2]))
    DeviceManager(detector=FakeDetector(2), apply=False)  # only looking: no check needed


@pytest.mark.parametrize(("n_gpus", "ids", "priority", "expected"), [
    (4, None, ("cuda", "cpu"), "cuda:0"),
    (2, [2, 3], ("cuda", "cpu"), "cuda:2"),
    (4, None, ("cpu", "cuda"), "cpu"),
    (0, None, ("cuda", "cpu"), "cpu"),
    (2, None, ("gpu",), "cuda:0"),
    (2, None, ("tpu",), "cpu"),
    (0, None, ("cuda",), "cpu"),
    (2, None, ("rocm", "cpu"), "cpu"),  # this PyTorch is not a ROCm build
])
def test_get_default_device_honours_priority(n_gpus: int, ids: list[int] | None,
                                             priority: tuple[str, ...], expected: str) -> None:
    config = DeviceConfiguration(platform_priority=priority)
    dm = DeviceManager(config, detector=FakeDetector(n_gpus, device_ids=ids), apply=False)
    assert dm.get_default_device() == torch.device(expected)


def test_get_device_info() -> None:
    config = DeviceConfiguration(memory_strategy="conservative")
    info = DeviceManager(config, detector=FakeDetector(2)).get_device_info()
    assert info["backend"] == "cuda"
    assert info["default_device"] == "cuda:0"
    assert info["device_type"] == "gpu"
    assert (info["device_count"], info["gpu_count"]) == (2, 2)
    assert (info["memory_strategy"], info["memory_fraction"]) == ("conservative", 0.6)
    assert [d["uuid"] for d in info["devices"]] == ["GPU-fake-0", "GPU-fake-1"]
    versions = info["versions"]
    assert versions["torch"] == torch.__version__
    assert (versions["cuda"], versions["driver"]) == ("12.8", "570.00")
    assert versions["jax"] == jax_backend.installed_jax_version()
    json.dumps(info)

    cpu_info = DeviceManager(detector=FakeDetector(0)).get_device_info()
    assert (cpu_info["backend"], cpu_info["default_device"], cpu_info["gpu_count"]) == (
        "cpu", "cpu", 0)


@pytest.mark.parametrize(("n_params", "strategy"), [
    (0, MemoryStrategy.CONSERVATIVE), (999_999, MemoryStrategy.CONSERVATIVE),
    (1_000_000, MemoryStrategy.BALANCED), (99_999_999, MemoryStrategy.BALANCED),
    (100_000_000, MemoryStrategy.AGGRESSIVE), (12_000_000_000, MemoryStrategy.AGGRESSIVE),
])
def test_optimize_for_model_size(n_params: int, strategy: MemoryStrategy) -> None:
    base = DeviceConfiguration(memory_strategy="custom", memory_fraction=0.42, enable_x64=True,
                               platform_priority=("cpu",),
                               environment_variables={"VRAMKIT_TEST_FLAG": "1"},
                               preallocate=True)
    dm = DeviceManager(base, detector=FakeDetector(0), apply=False)
    result = dm.optimize_for_model_size(n_params)
    assert result.memory_strategy is strategy
    assert result.memory_fraction == strategy.default_fraction
    assert result == dataclasses.replace(base, memory_strategy=strategy,
                                         memory_fraction=strategy.default_fraction)
    assert dm.config is base


@pytest.mark.parametrize("bad", [-1, 1.5, True, "100"])
def test_optimize_for_model_size_rejects_bad_counts(bad: Any) -> None:
    dm = DeviceManager(detector=FakeDetector(0), apply=False)
    with pytest.raises(ConfigError):
        dm.optimize_for_model_size(bad)


def test_jax_manager_is_lazy_and_reports_missing_jax(monkeypatch: pytest.MonkeyPatch) -> None:
    dm = DeviceManager(detector=FakeDetector(0), apply=False)
    assert dm._jax_manager is None
    monkeypatch.setattr(manager, "jax_installed", lambda: False)
    with pytest.raises(JaxUnavailableError) as info:
        _ = dm.jax_manager
    assert isinstance(info.value, ImportError)
    assert "pip install" in info.value.hint


# ---------------------------------------------------------------------------------------------
# Environment variables and TooLateError
# ---------------------------------------------------------------------------------------------

def test_environment_variables_applied_before_detection() -> None:
    config = DeviceConfiguration(environment_variables={"CUDA_VISIBLE_DEVICES": "1,0",
                                                        "VRAMKIT_TEST_FLAG": "yes"})
    detector = FakeDetector(0, watch_env="CUDA_VISIBLE_DEVICES")
    DeviceManager(config, detector=detector)
    assert detector.seen_env == "1,0"
    assert os.environ["VRAMKIT_TEST_FLAG"] == "yes"


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES"])
def test_cuda_variable_after_cuda_init_is_too_late(name: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    config = DeviceConfiguration(environment_variables={name: "expandable_segments:True",
                                                        "VRAMKIT_TEST_FLAG": "1"})
    with pytest.raises(TooLateError) as info:
        DeviceManager(config, detector=FakeDetector(0))
    assert info.value.setting == name
    assert name not in os.environ
    assert "VRAMKIT_TEST_FLAG" not in os.environ  # nothing half-applied


def test_unchanged_or_unrelated_variable_after_cuda_init_is_accepted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    config = DeviceConfiguration(environment_variables={
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "VRAMKIT_TEST_FLAG": "1"})
    DeviceManager(config, detector=FakeDetector(0))
    assert os.environ["VRAMKIT_TEST_FLAG"] == "1"


@pytest.mark.parametrize(("name", "state"), [
    ("XLA_FLAGS", "backend"), ("CUDA_VISIBLE_DEVICES", "backend"), ("JAX_PLATFORMS", "import"),
])
def test_jax_variables_after_jax_start_are_too_late(name: str, state: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if state == "backend":
        monkeypatch.setattr(manager, "jax_backend_initialized", lambda: True)
    else:
        monkeypatch.setattr(manager, "jax_imported", lambda: True)
    with pytest.raises(TooLateError) as info:
        DeviceManager(DeviceConfiguration(environment_variables={name: "x"}),
                      detector=FakeDetector(0), apply=True)
    assert info.value.setting == name


# ---------------------------------------------------------------------------------------------
# JAX memory settings and flags (environment only; JAX itself runs in test_jax_backend.py)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("jax_version", "jaxlib_version", "expected"), [
    ("0.4.30", "0.4.30", LEGACY_JAX_MEM_FRACTION_ENV),
    ("0.4.31", "0.4.31", LEGACY_JAX_MEM_FRACTION_ENV),
    ("0.4.32", "0.4.32", JAX_MEM_FRACTION_ENV),
    ("0.4.35", "0.4.31", LEGACY_JAX_MEM_FRACTION_ENV),  # the older one decides
    ("0.10.2", "0.10.2", JAX_MEM_FRACTION_ENV),
    ("0.11.0rc1", "0.11.0", JAX_MEM_FRACTION_ENV),
    ("0.4.32.dev20240901", "0.4.32.dev20240901", JAX_MEM_FRACTION_ENV),
])
def test_memory_fraction_env_name_by_version(jax_version: str, jaxlib_version: str,
                                             expected: str) -> None:
    assert memory_fraction_env_name(jax_version, jaxlib_version, environ={}) == expected


def test_memory_fraction_env_name_follows_user_setting() -> None:
    assert memory_fraction_env_name("0.10.2", "0.10.2",
                                    environ={LEGACY_JAX_MEM_FRACTION_ENV: ".5"}) == (
        LEGACY_JAX_MEM_FRACTION_ENV)
    assert memory_fraction_env_name("0.4.30", "0.4.30",
                                    environ={JAX_MEM_FRACTION_ENV: ".5"}) == JAX_MEM_FRACTION_ENV
    with pytest.raises(ConfigError):
        memory_fraction_env_name(environ={JAX_MEM_FRACTION_ENV: ".5",
                                          LEGACY_JAX_MEM_FRACTION_ENV: ".5"})


@pytest.mark.skipif(not jax_backend.jax_installed(), reason="JAX not installed")
def test_manager_writes_exactly_one_fraction_variable() -> None:
    config = DeviceConfiguration(memory_strategy="custom", memory_fraction=0.3, preallocate=True)
    DeviceManager(config, detector=FakeDetector(0))
    name = memory_fraction_env_name()
    other = ({JAX_MEM_FRACTION_ENV, LEGACY_JAX_MEM_FRACTION_ENV} - {name}).pop()
    assert os.environ[name] == "0.3"
    assert other not in os.environ
    assert os.environ[JAX_PREALLOCATE_ENV] == "true"


@pytest.mark.skipif(not jax_backend.jax_installed(), reason="JAX not installed")
def test_manager_updates_the_legacy_name_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LEGACY_JAX_MEM_FRACTION_ENV, "0.9")
    DeviceManager(DeviceConfiguration(memory_strategy="conservative"), detector=FakeDetector(0))
    assert os.environ[LEGACY_JAX_MEM_FRACTION_ENV] == "0.6"
    assert JAX_MEM_FRACTION_ENV not in os.environ
    assert os.environ[JAX_PREALLOCATE_ENV] == "false"


def test_jax_memory_settings_after_backend_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax_backend, "jax_backend_initialized", lambda: True)
    env: dict[str, str] = {}
    # Nothing set: JAX runs with its defaults (0.75, preallocate) and those are accepted.
    assert apply_jax_memory_settings(0.75, True, environ=env) == {}
    with pytest.raises(TooLateError) as info:
        apply_jax_memory_settings(0.6, True, environ=env)
    assert info.value.setting == JAX_MEM_FRACTION_ENV
    with pytest.raises(TooLateError) as info:
        apply_jax_memory_settings(0.75, False, environ=env)
    assert info.value.setting == JAX_PREALLOCATE_ENV
    env = {LEGACY_JAX_MEM_FRACTION_ENV: "0.6", JAX_PREALLOCATE_ENV: "false"}
    assert apply_jax_memory_settings(0.6, False, environ=env) == {}
    with pytest.raises(TooLateError) as info:
        apply_jax_memory_settings(0.9, False, environ=env)
    assert info.value.setting == LEGACY_JAX_MEM_FRACTION_ENV
    assert env == {LEGACY_JAX_MEM_FRACTION_ENV: "0.6", JAX_PREALLOCATE_ENV: "false"}


@pytest.mark.skipif(not jax_backend.jax_installed(), reason="JAX not installed")
def test_jax_flags_through_environment_before_import() -> None:
    env: dict[str, str] = {}
    apply_jax_flags(False, True, environ=env)
    assert env == {}  # JAX's defaults: leave the environment alone
    apply_jax_flags(True, False, environ=env)
    assert env == {"JAX_ENABLE_X64": "1", "JAX_DISABLE_JIT": "1"}
    apply_jax_flags(False, True, environ=env)  # a stale value would otherwise win
    assert env == {"JAX_ENABLE_X64": "0", "JAX_DISABLE_JIT": "0"}


def test_jax_flags_without_jax(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax_backend, "jax_installed", lambda: False)
    env: dict[str, str] = {}
    apply_jax_flags(False, True, environ=env)  # defaults need no JAX
    with pytest.raises(JaxUnavailableError):
        apply_jax_flags(True, True, environ=env)
    with pytest.raises(JaxUnavailableError):
        apply_jax_flags(False, False, environ=env)


_REAL_BACKEND_PLATFORMS = jax_backend.jax_backend_platforms


def test_jax_backend_platforms_reads_the_started_backends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax_backend, "jax_backend_platforms", _REAL_BACKEND_PLATFORMS)
    assert jax_backend.jax_backend_platforms() == frozenset()  # nothing started
    monkeypatch.setattr(jax_backend, "jax_backend_initialized", lambda: True)
    bridge = types.SimpleNamespace(_backends={"cpu": object(), "cuda": object()})
    monkeypatch.setitem(sys.modules, "jax._src.xla_bridge", bridge)
    assert jax_backend.jax_backend_platforms() == frozenset({"cpu", "cuda"})
    bridge._backends = {"cpu": object()}
    assert jax_backend.jax_backend_platforms() == frozenset({"cpu"})
    del bridge._backends  # unknown internals: None, treated as "a GPU may be there"
    assert jax_backend.jax_backend_platforms() is None


def test_memory_settings_after_a_cpu_only_start_are_accepted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax_backend, "jax_backend_initialized", lambda: True)
    monkeypatch.setattr(jax_backend, "jax_backend_platforms", lambda: frozenset({"cpu"}))
    env = {JAX_MEM_FRACTION_ENV: "0.6", JAX_PREALLOCATE_ENV: "false"}
    assert apply_jax_memory_settings(0.9, True, environ=env) == {}
    assert env == {JAX_MEM_FRACTION_ENV: "0.6", JAX_PREALLOCATE_ENV: "false"}  # untouched


@pytest.mark.parametrize("platforms", [frozenset({"cpu", "cuda"}), frozenset({"rocm"}),
                                       frozenset({"tpu"}), None])
def test_memory_settings_after_a_gpu_start_are_refused(
        monkeypatch: pytest.MonkeyPatch, platforms: frozenset[str] | None) -> None:
    monkeypatch.setattr(jax_backend, "jax_backend_initialized", lambda: True)
    monkeypatch.setattr(jax_backend, "jax_backend_platforms", lambda: platforms)
    env = {JAX_MEM_FRACTION_ENV: "0.6", JAX_PREALLOCATE_ENV: "false"}
    with pytest.raises(TooLateError) as info:
        apply_jax_memory_settings(0.9, False, environ=env)
    assert info.value.setting == JAX_MEM_FRACTION_ENV
    assert "before the first JAX operation" in info.value.hint
    with pytest.raises(TooLateError) as info:
        apply_jax_memory_settings(0.6, True, environ=env)
    assert info.value.setting == JAX_PREALLOCATE_ENV
    assert apply_jax_memory_settings(0.6, False, environ=env) == {}  # what is in effect


def test_force_reinit_with_another_strategy_on_cpu_only_jax(
        monkeypatch: pytest.MonkeyPatch, isolated: list) -> None:
    monkeypatch.setattr(manager, "jax_installed", lambda: True)  # JAX itself is faked below
    first = get_device_manager(DeviceConfiguration(memory_strategy="conservative"),
                               detector=FakeDetector(0))
    # JAX starts (on the CPU only) after the first manager wrote its settings.
    for module in (manager, jax_backend):
        monkeypatch.setattr(module, "jax_backend_initialized", lambda: True)
        monkeypatch.setattr(module, "jax_imported", lambda: True)
    monkeypatch.setattr(jax_backend, "jax_backend_platforms", lambda: frozenset({"cpu"}))
    monkeypatch.setattr(jax_backend, "apply_jax_flags", lambda *a, **k: None)
    monkeypatch.setattr(manager, "apply_jax_flags", lambda *a, **k: None)
    aggressive = DeviceConfiguration(memory_strategy="aggressive", preallocate=True)
    second = get_device_manager(aggressive, force_reinit=True, detector=FakeDetector(0))
    assert second is not first and second.config is aggressive
    assert get_device_manager() is second
    assert os.environ[JAX_PREALLOCATE_ENV] == "false"  # what JAX read; nothing rewritten
    assert second.settings == {"applied": {}, "not_applied": {}}  # nothing could act here
    assert isolated == []  # no GPU was capped on the way


def test_force_reinit_after_a_jax_gpu_start_applies_what_it_can(
        monkeypatch: pytest.MonkeyPatch, isolated: list) -> None:
    monkeypatch.setattr(manager, "jax_installed", lambda: True)  # JAX itself is faked below
    first = get_device_manager(DeviceConfiguration(memory_strategy="conservative"),
                               detector=FakeDetector(1))
    fraction_env = memory_fraction_env_name()
    assert first.settings["applied"] == {fraction_env: "0.6", JAX_PREALLOCATE_ENV: "false",
                                         "torch_memory_fraction": 0.6}
    # JAX starts a GPU backend after the first manager wrote its settings.
    for module in (manager, jax_backend):
        monkeypatch.setattr(module, "jax_backend_initialized", lambda: True)
        monkeypatch.setattr(module, "jax_imported", lambda: True)
    monkeypatch.setattr(jax_backend, "jax_backend_platforms",
                        lambda: frozenset({"cpu", "cuda"}))
    monkeypatch.setattr(manager, "apply_jax_flags", lambda *a, **k: None)
    aggressive = DeviceConfiguration(memory_strategy="aggressive", preallocate=True)
    with pytest.warns(VramkitWarning) as caught:
        second = get_device_manager(aggressive, force_reinit=True, detector=FakeDetector(1))
    assert second is not first and get_device_manager() is second
    assert isolated[-1] == (0.9, 0)  # PyTorch's fraction still applies
    assert os.environ[fraction_env] == "0.6"  # what JAX read; nothing rewritten
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert fraction_env in messages[0] and "memory fraction 0.6, 0.9 was requested" in messages[0]
    assert JAX_PREALLOCATE_ENV in messages[1]
    info = second.get_device_info()
    assert info["settings"]["applied"] == {"torch_memory_fraction": 0.9}
    assert set(info["settings"]["not_applied"]) == {fraction_env, JAX_PREALLOCATE_ENV}
    assert "(cpu, cuda) already started" in info["settings"]["not_applied"][fraction_env]
    out = io.StringIO()
    print_device_info(second, file=out)
    assert f"not applied: {fraction_env}" in out.getvalue()
    # A first manager (no re-initialization asked for) still refuses before applying anything.
    monkeypatch.setattr(shared_manager, "_shared_manager", None)
    calls = len(isolated)
    with pytest.raises(TooLateError):
        get_device_manager(aggressive, detector=FakeDetector(1))
    assert len(isolated) == calls


class _GpuDefaultJax(types.ModuleType):
    """A fake ``jax`` whose default backend is a GPU, with host devices beside it."""

    def __init__(self) -> None:
        super().__init__("jax")
        self.gpus = [types.SimpleNamespace(id=i, platform="gpu") for i in range(2)]
        self.cpus = [types.SimpleNamespace(id=10 + i, platform="cpu") for i in range(3)]
        self.asked: list[str | None] = []

    def devices(self, backend: str | None = None) -> list[Any]:
        self.asked.append(backend)
        if backend in (None, "gpu", "cuda"):
            return list(self.gpus)  # jax.devices() is the default backend's: the GPUs
        if backend == "cpu":
            return list(self.cpus)
        raise RuntimeError(f"Unknown backend {backend}")

    def device_put(self, data: Any, device: Any) -> tuple[Any, Any]:
        return data, device


def test_cpu_devices_listed_when_a_gpu_backend_is_the_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _GpuDefaultJax()
    monkeypatch.setitem(sys.modules, "jax", fake)
    jm = jax_backend.JAXDeviceManager(("cpu", "cuda"))
    assert [d.id for d in jm.cpu_devices] == [10, 11, 12]
    assert "cpu" in fake.asked  # asked by name, not filtered from the default backend
    assert [d.id for d in jm.gpu_devices] == [0, 1]
    assert [d.id for d in jm.devices] == [0, 1, 10, 11, 12]
    assert jm.get_default_device().id == 10  # "cpu" first in the priority
    assert jm.tpu_devices == []
    # Data goes to the host devices when asked, although the GPUs are JAX's default.
    shards = jm.distribute_data(torch.arange(6).reshape(3, 2).numpy(),
                                target_devices=jm.cpu_devices[:2])
    assert [device.id for _, device in shards] == [10, 11]
    assert [rows.shape[0] for rows, _ in shards] == [2, 1]


# ---------------------------------------------------------------------------------------------
# Shared manager and convenience functions
# ---------------------------------------------------------------------------------------------

def test_get_device_manager_singleton(isolated: list) -> None:
    first = get_device_manager(detector=FakeDetector(2))
    assert get_device_manager() is first
    assert get_device_manager(DeviceConfiguration()) is first  # equal config: same manager
    assert isolated == [(0.75, 0), (0.75, 1)]
    aggressive = DeviceConfiguration(memory_strategy="aggressive")
    with pytest.raises(ConfigError, match="force_reinit"):
        get_device_manager(aggressive)
    assert get_device_manager() is first
    second = get_device_manager(aggressive, force_reinit=True, detector=FakeDetector(1))
    assert second is not first
    assert second.config is aggressive
    assert get_device_manager() is second
    assert isolated[-1] == (0.9, 0)
    assert shared_manager.has_gpu() is True
    assert shared_manager.get_default_device() == torch.device("cuda", 0)


def test_queries_without_shared_manager_have_no_side_effects(
        monkeypatch: pytest.MonkeyPatch, isolated: list) -> None:
    from vramkit.devices import info

    monkeypatch.setattr(info, "SystemDetector", lambda: FakeDetector(2), raising=False)
    assert shared_manager.has_gpu() is True
    assert shared_manager.get_default_device() == torch.device("cuda", 0)
    assert isolated == []
    assert JAX_PREALLOCATE_ENV not in os.environ
    assert shared_manager._shared_manager is None


def test_print_device_info_to_file_and_console() -> None:
    from rich.console import Console

    dm = DeviceManager(DeviceConfiguration(memory_strategy="aggressive"),
                       detector=FakeDetector(2))
    buffer = io.StringIO()
    print_device_info(dm, file=buffer)
    text = buffer.getvalue()
    for expected in ("aggressive", "0.9", "Fake GPU 1", "GPU-fake-0", "cuda:0", "570.00"):
        assert expected in text
    console = Console(record=True, width=120)
    print_device_info(dm, console=console)
    assert "Fake GPU 0" in console.export_text()


def _fake_selection(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []

    def select_precision(device: Any = None) -> str:
        seen.append(device)
        return "bf16-choice"

    module = types.ModuleType("vramkit.devices.selection")
    module.select_precision = select_precision  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vramkit.devices.selection", module)
    return seen


def test_configure_for_generative_models(monkeypatch: pytest.MonkeyPatch, isolated: list) -> None:
    seen = _fake_selection(monkeypatch)
    dm = configure_for_generative_models("aggressive", detector=FakeDetector(2, [1, 2]))
    assert isinstance(dm, DeviceManager)
    assert dm.config.memory_strategy is MemoryStrategy.AGGRESSIVE
    assert dm.config.preallocate is False
    assert isolated == [(0.9, 1), (0.9, 2)]
    assert dm.precision == "bf16-choice"
    assert [d.device_id for d in seen] == [1]


def test_configure_for_generative_models_without_mixed_precision_or_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _fake_selection(monkeypatch)
    dm = configure_for_generative_models(enable_mixed_precision=False, detector=FakeDetector(1))
    assert dm.precision is None
    dm = configure_for_generative_models(detector=FakeDetector(0))
    assert dm.precision is None
    assert seen == []
    dm = configure_for_generative_models(MemoryStrategy.CUSTOM, memory_fraction=0.5,
                                         detector=FakeDetector(0))
    assert dm.config.memory_fraction == 0.5


# ---------------------------------------------------------------------------------------------
# Import hygiene
# ---------------------------------------------------------------------------------------------

def test_manager_neither_imports_jax_nor_initializes_cuda() -> None:
    script = (
        "import sys\n"
        "from vramkit.devices.manager import DeviceManager, DeviceConfiguration\n"
        "from vramkit.devices.info import DeviceCapabilities, DeviceType\n"
        "assert 'torch' not in sys.modules and 'jax' not in sys.modules\n"
        "class D:\n"
        "    def detect_capabilities(self):\n"
        "        return DeviceCapabilities(DeviceType.CPU, 1)\n"
        "dm = DeviceManager(DeviceConfiguration(enable_x64=True), detector=D())\n"
        "info = dm.get_device_info()\n"
        "import torch\n"
        "assert 'jax' not in sys.modules, 'jax imported'\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok', info['versions']['jax'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in _JAX_ENV}
    env["PYTHONPATH"] = str(SRC)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")



def test_shared_manager_refuses_a_detector_it_would_ignore(isolated: list) -> None:
    first = get_device_manager(detector=FakeDetector(2))
    with pytest.raises(ConfigError, match="detector only applies to a new one"):
        get_device_manager(detector=FakeDetector(1))
    assert get_device_manager() is first and first.gpu_count == 2
