"""CPU tests of vramkit.devices.env: allocator variable choice, merging, refusals, TF32, read-outs.

Tests never let the real run-time allocator setter touch this process's torch: the ``setter``
fixture replaces it with a recorder.
"""

from __future__ import annotations

import json
import logging
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._child import run_child
from vramkit.devices import env
from vramkit.devices.env import (
    ALLOC_CONF_VAR,
    LEGACY_ALLOC_CONF_VAR,
    CudaMemorySettings,
    GpuMemoryInfo,
    allocator_env_var,
    allocator_settings,
    clear_cuda_cache,
    get_gpu_memory_info,
    log_memory_usage,
    prefer_expandable_segments,
    setup_cuda_memory_management,
)
from vramkit.errors import ConfigError, DeviceError, TooLateError

_REAL_RUNTIME_SETTER = env._runtime_setter  # saved before the autouse fixture replaces it
GiB = 1 << 30


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start without allocator variables; monkeypatch restores the real ones afterwards."""
    monkeypatch.delenv(ALLOC_CONF_VAR, raising=False)
    monkeypatch.delenv(LEGACY_ALLOC_CONF_VAR, raising=False)


@pytest.fixture(autouse=True)
def restore_tf32() -> Any:
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(autouse=True)
def setter(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace torch's run-time allocator parser with a recorder of the strings it receives."""
    calls: list[str] = []
    monkeypatch.setattr(env, "_runtime_setter", lambda: calls.append)
    return calls


def setup_allocator(**kwargs: Any) -> dict[str, Any]:
    """setup_cuda_memory_management without touching TF32 unless asked."""
    kwargs.setdefault("allow_tf32", None)
    return setup_cuda_memory_management(**kwargs)


# -- which variable --------------------------------------------------------------------------------

@pytest.mark.parametrize(("version", "variable"), [
    ("2.13.0+cpu", ALLOC_CONF_VAR),
    ("2.11.0+cu130", ALLOC_CONF_VAR),
    ("2.10.0", ALLOC_CONF_VAR),
    ("2.12.0a0+git1234", ALLOC_CONF_VAR),
    ("2.9.1+cu128", LEGACY_ALLOC_CONF_VAR),
    ("2.8.0", LEGACY_ALLOC_CONF_VAR),
    ("2.4.1", LEGACY_ALLOC_CONF_VAR),
    ("3.0.0", ALLOC_CONF_VAR),
])
def test_variable_per_torch_version(version: str, variable: str) -> None:
    assert allocator_env_var(version) == variable


def test_setup_writes_the_variable_of_the_installed_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    assert allocator_env_var() == LEGACY_ALLOC_CONF_VAR
    setup_allocator()
    assert os.environ[LEGACY_ALLOC_CONF_VAR] == "expandable_segments:True"
    assert ALLOC_CONF_VAR not in os.environ
    monkeypatch.delenv(LEGACY_ALLOC_CONF_VAR)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    setup_allocator()
    assert os.environ[ALLOC_CONF_VAR] == "expandable_segments:True"
    assert LEGACY_ALLOC_CONF_VAR not in os.environ


def test_unparseable_version() -> None:
    with pytest.raises(ConfigError):
        allocator_env_var("nightly")


# -- merging ----------------------------------------------------------------------------------------

def test_merges_with_existing_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOC_CONF_VAR,
                       "roundup_power2_divisions:[256:1,512:2,>:4], garbage_collection_threshold:0.7")
    result = setup_allocator(expandable_segments=True)
    assert os.environ[ALLOC_CONF_VAR] == ("roundup_power2_divisions:[256:1,512:2,>:4],"
                                          "garbage_collection_threshold:0.7,"
                                          "expandable_segments:True")
    assert result["options"] == {"roundup_power2_divisions": "[256:1,512:2,>:4]",
                                 "garbage_collection_threshold": "0.7",
                                 "expandable_segments": "True"}


def test_overrides_only_the_keys_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOC_CONF_VAR, "expandable_segments:False,pinned_use_cuda_host_register:True")
    setup_allocator(expandable_segments=True, garbage_collection_threshold=0.6)
    assert os.environ[ALLOC_CONF_VAR] == ("expandable_segments:True,"
                                          "pinned_use_cuda_host_register:True,"
                                          "garbage_collection_threshold:0.6")


def test_none_leaves_settings_alone(monkeypatch: pytest.MonkeyPatch, setter: list[str]) -> None:
    setup_allocator(expandable_segments=None)
    assert ALLOC_CONF_VAR not in os.environ and setter == []
    monkeypatch.setenv(ALLOC_CONF_VAR, "expandable_segments:False")
    setup_allocator(expandable_segments=None)
    assert os.environ[ALLOC_CONF_VAR] == "expandable_segments:False"


def test_legacy_variable_is_merged_and_kept_in_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LEGACY_ALLOC_CONF_VAR, "release_lock_on_cudamalloc:True")
    setup_allocator()
    expected = "release_lock_on_cudamalloc:True,expandable_segments:True"
    assert os.environ[ALLOC_CONF_VAR] == expected
    assert os.environ[LEGACY_ALLOC_CONF_VAR] == expected


def test_old_torch_ignores_the_new_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.4.0")
    monkeypatch.setenv(ALLOC_CONF_VAR, "garbage_collection_threshold:0.5")
    setup_allocator()
    assert os.environ[LEGACY_ALLOC_CONF_VAR] == "expandable_segments:True"
    assert os.environ[ALLOC_CONF_VAR] == "garbage_collection_threshold:0.5"  # untouched


def test_malformed_existing_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOC_CONF_VAR, "expandable_segments")
    with pytest.raises(ConfigError, match=ALLOC_CONF_VAR):
        setup_allocator()


# -- run-time application and refusals ----------------------------------------------------------

def test_applies_at_runtime_once_torch_is_loaded(setter: list[str]) -> None:
    result = setup_allocator(expandable_segments=False, max_split_size_mb=512)
    assert setter == ["expandable_segments:False,max_split_size_mb:512"]
    assert result["applied_at_runtime"] is True
    setup_allocator(expandable_segments=False, max_split_size_mb=512)  # nothing changes
    assert len(setter) == 1


def test_runtime_changeable_settings_after_cuda_init(monkeypatch: pytest.MonkeyPatch,
                                                     setter: list[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr(torch.cuda.memory, "_snapshot",
                        lambda: {"allocator_settings": {"expandable_segments": True}})
    result = setup_allocator(garbage_collection_threshold=0.8)
    assert setter == ["expandable_segments:True,garbage_collection_threshold:0.8"]
    assert result["cuda_initialized"] is True and result["backend"] == "native"
    assert result["in_effect"] == {"expandable_segments": True}


def test_too_late_without_a_runtime_setter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(env, "_runtime_setter", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(TooLateError) as info:
        setup_allocator(expandable_segments=True, garbage_collection_threshold=0.7)
    assert info.value.setting == "expandable_segments, garbage_collection_threshold"
    assert ALLOC_CONF_VAR not in os.environ  # a refusal changes nothing


def test_without_setter_before_cuda_init_the_variable_suffices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(env, "_runtime_setter", lambda: None)
    result = setup_allocator()
    assert os.environ[ALLOC_CONF_VAR] == "expandable_segments:True"
    assert result["applied_at_runtime"] is False


# -- what fit asks for ----------------------------------------------------------------------------

def test_expandable_segments_are_turned_on_where_nobody_chose(setter: list[str]) -> None:
    note = prefer_expandable_segments()
    assert setter == ["expandable_segments:True"]
    assert os.environ[ALLOC_CONF_VAR] == "expandable_segments:True"
    assert note is not None and "expandable_segments:False" in note  # says how to opt out
    assert prefer_expandable_segments() is None  # chosen now: nothing more to do


@pytest.mark.parametrize("value", ["expandable_segments:False", "max_split_size_mb:512",
                                   "backend:cudaMallocAsync",
                                   "garbage_collection_threshold:0.6,expandable_segments:True"])
def test_a_segment_policy_already_chosen_is_left_alone(monkeypatch: pytest.MonkeyPatch,
                                                       setter: list[str], value: str) -> None:
    monkeypatch.setenv(ALLOC_CONF_VAR, value)
    assert prefer_expandable_segments() is None
    assert setter == [] and os.environ[ALLOC_CONF_VAR] == value


def test_other_options_are_kept_beside_expandable_segments(monkeypatch: pytest.MonkeyPatch,
                                                           setter: list[str]) -> None:
    monkeypatch.setenv(ALLOC_CONF_VAR, "garbage_collection_threshold:0.6")
    assert prefer_expandable_segments() is not None
    assert setter == ["garbage_collection_threshold:0.6,expandable_segments:True"]


def test_a_torch_that_cannot_change_it_now_is_left_as_it_is(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(env, "_runtime_setter", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert prefer_expandable_segments() is None
    assert ALLOC_CONF_VAR not in os.environ


def test_backend_is_too_late_after_torch_import(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TooLateError, match="allocator backend"):
        setup_allocator(backend="cudaMallocAsync", expandable_segments=None)
    assert ALLOC_CONF_VAR not in os.environ
    monkeypatch.setattr(env, "_loaded_backend", lambda: "native")
    setup_allocator(backend="native")  # the backend torch already uses: nothing to change
    assert os.environ[ALLOC_CONF_VAR] == "backend:native,expandable_segments:True"
    with pytest.raises(TooLateError):
        setup_allocator(backend="cudaMallocAsync", expandable_segments=False)


def test_rejected_by_torch_restores_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(value: str) -> None:
        raise RuntimeError("nope")

    monkeypatch.setattr(env, "_runtime_setter", lambda: refuse)
    monkeypatch.setenv(ALLOC_CONF_VAR, "garbage_collection_threshold:0.5")
    with pytest.raises(ConfigError, match="torch rejected"):
        setup_allocator()
    assert os.environ[ALLOC_CONF_VAR] == "garbage_collection_threshold:0.5"


def test_real_runtime_setter_is_found() -> None:
    # The hook must resolve to torch's parser on this torch (2.9+ has it on every build).
    assert _REAL_RUNTIME_SETTER() is torch._C._accelerator_setAllocatorSettings


# -- bad combinations and values ------------------------------------------------------------------

def test_expandable_segments_with_max_split_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="max_split_size_mb"):
        setup_allocator(max_split_size_mb=512)
    monkeypatch.setenv(ALLOC_CONF_VAR, "expandable_segments:True")
    with pytest.raises(ConfigError, match="after merging"):
        setup_allocator(expandable_segments=None, max_split_size_mb=512)
    assert os.environ[ALLOC_CONF_VAR] == "expandable_segments:True"


def test_async_backend_with_native_options_is_refused() -> None:
    with pytest.raises(ConfigError, match="cudaMallocAsync ignores expandable_segments"):
        CudaMemorySettings(backend="cudaMallocAsync")
    CudaMemorySettings(backend="cudaMallocAsync", expandable_segments=False)


@pytest.mark.parametrize("kwargs", [
    {"expandable_segments": False, "max_split_size_mb": 19},
    {"expandable_segments": False, "max_split_size_mb": True},
    {"expandable_segments": False, "max_split_size_mb": "512"},
    {"garbage_collection_threshold": 0.0},
    {"garbage_collection_threshold": 1.0},
    {"garbage_collection_threshold": 1.5},
    {"garbage_collection_threshold": float("nan")},
    {"garbage_collection_threshold": True},
    {"expandable_segments": "yes"},
    {"allow_tf32": 1},
    {"backend": "cudaMalloc"},
])
def test_bad_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        setup_cuda_memory_management(**kwargs)
    assert ALLOC_CONF_VAR not in os.environ


def test_settings_record() -> None:
    settings = CudaMemorySettings(expandable_segments=False, max_split_size_mb=20,
                                  garbage_collection_threshold=0.75, allow_tf32=None)
    assert settings.allocator_options() == {"expandable_segments": "False",
                                            "max_split_size_mb": "20",
                                            "garbage_collection_threshold": "0.75"}
    assert json.loads(json.dumps(settings.to_dict()))["max_split_size_mb"] == 20


# -- read-back ----------------------------------------------------------------------------------------

def test_allocator_settings_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    empty = allocator_settings()
    assert (empty["variable"], empty["value"], empty["options"]) == (ALLOC_CONF_VAR, None, {})
    assert empty["cuda_initialized"] is False and empty["backend"] is None
    assert empty["in_effect"] is None
    monkeypatch.setenv(LEGACY_ALLOC_CONF_VAR, "max_split_size_mb:256")
    legacy_only = allocator_settings()  # torch 2.13 still reads the legacy name as a fallback
    assert legacy_only["variable"] == LEGACY_ALLOC_CONF_VAR
    assert legacy_only["options"] == {"max_split_size_mb": "256"}


def test_allocator_settings_warns_on_disagreeing_variables(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(ALLOC_CONF_VAR, "expandable_segments:True")
    monkeypatch.setenv(LEGACY_ALLOC_CONF_VAR, "expandable_segments:False")
    with caplog.at_level(logging.WARNING, logger="vramkit.devices.env"):
        result = allocator_settings()
    assert result["variable"] == ALLOC_CONF_VAR
    assert result["variables"] == {ALLOC_CONF_VAR: "expandable_segments:True",
                                   LEGACY_ALLOC_CONF_VAR: "expandable_segments:False"}
    assert "disagree" in caplog.text


# -- TF32 -----------------------------------------------------------------------------------------

def test_tf32_enabled_and_disabled() -> None:
    result = setup_cuda_memory_management(expandable_segments=None, allow_tf32=True)
    assert torch.backends.cuda.matmul.allow_tf32 is True
    assert torch.backends.cudnn.allow_tf32 is True
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.get_float32_matmul_precision() == "high"  # legacy readers keep working
    assert result["tf32"]["matmul_allow_tf32"] is True
    result = setup_cuda_memory_management(expandable_segments=None, allow_tf32=False)
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.backends.cudnn.allow_tf32 is False
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert result["tf32"]["matmul_fp32_precision"] == "ieee"


def test_tf32_none_leaves_flags() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    result = setup_cuda_memory_management(expandable_segments=None, allow_tf32=None)
    assert torch.backends.cuda.matmul.allow_tf32 is True and result["tf32"] is None


# -- memory read-outs ---------------------------------------------------------------------------

def test_memory_info_on_cpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    info = get_gpu_memory_info()
    assert info.kind == "host" and info.device == "cpu"
    assert info.total is not None and info.total > 0
    assert info.free is not None and 0 <= info.free <= info.total
    assert info.used == info.total - info.free
    assert (info.allocated, info.reserved, info.max_allocated, info.max_reserved) == (None,) * 4
    assert str(info).startswith("no CUDA GPU; host RAM")
    assert get_gpu_memory_info("cpu").kind == "host"


def test_memory_info_of_missing_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(DeviceError):
        get_gpu_memory_info("cuda:0")


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    state: dict[str, Any] = {"reserved": [6 * GiB, 2 * GiB], "emptied": 0}
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda, "current_device", lambda: 1)
    monkeypatch.setattr(cuda, "mem_get_info", lambda i=None: (3 * GiB, 8 * GiB))
    monkeypatch.setattr(cuda, "get_device_name", lambda i=None: f"Fake GPU {i}")
    monkeypatch.setattr(cuda, "memory_allocated", lambda i=None: 1 * GiB)
    monkeypatch.setattr(cuda, "memory_reserved", lambda i=None: state["reserved"][i])
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda i=None: 2 * GiB)
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda i=None: 4 * GiB)
    # The same figures as the one dict read_memory_info reads them from.
    monkeypatch.setattr(cuda, "memory_stats", lambda i=None: {
        "allocated_bytes.all.current": 1 * GiB, "reserved_bytes.all.current": state["reserved"][i],
        "allocated_bytes.all.peak": 2 * GiB, "reserved_bytes.all.peak": 4 * GiB})

    def empty_cache() -> None:
        state["emptied"] += 1
        state["reserved"] = [GiB, GiB]

    monkeypatch.setattr(cuda, "empty_cache", empty_cache)
    return state


def test_memory_info_from_torch_cuda(fake_gpu: dict[str, Any]) -> None:
    info = get_gpu_memory_info()  # CUDA initialized: the current device, cuda:1
    assert info == GpuMemoryInfo("cuda:1", 8 * GiB, 3 * GiB, 5 * GiB, 1 * GiB, 2 * GiB,
                                 2 * GiB, 4 * GiB, kind="cuda", name="Fake GPU 1")
    text = str(info)
    assert "cuda:1 (Fake GPU 1): 5.0 GiB used of 8.0 GiB (3.0 GiB free)" in text
    assert "allocated 1.0 GiB, reserved 2.0 GiB, peak allocated 2.0 GiB" in text
    assert get_gpu_memory_info(0).reserved == 6 * GiB


def test_log_memory_usage(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="vramkit.devices.env"):
        info = log_memory_usage("after forward")
    assert info.kind == "host"
    assert caplog.records[-1].levelno == logging.INFO
    assert caplog.records[-1].getMessage().startswith("[after forward] no CUDA GPU")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vramkit.devices.env"):
        log_memory_usage("quiet", level=logging.DEBUG)
        log_memory_usage("loud", level=logging.WARNING)
    assert [r.getMessage().split("]")[0] for r in caplog.records] == ["[loud"]
    with pytest.raises(ConfigError):
        log_memory_usage("x", level="INFO")  # type: ignore[arg-type]


def test_clear_cuda_cache_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    collected: list[bool] = []
    monkeypatch.setattr(env.gc, "collect", lambda: collected.append(True))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: pytest.fail("must not touch CUDA"))
    assert clear_cuda_cache() == 0
    assert collected == [True]


def test_clear_cuda_cache_counts_released_bytes(fake_gpu: dict[str, Any]) -> None:
    assert clear_cuda_cache() == 6 * GiB  # (6 + 2) - (1 + 1) over both devices
    assert fake_gpu["emptied"] == 1
    fake_gpu["reserved"] = [5 * GiB, 3 * GiB]
    assert clear_cuda_cache("cuda:1") == 2 * GiB
    assert clear_cuda_cache("cpu") == 0


# -- a fresh interpreter ----------------------------------------------------------------------------

def test_fresh_python_reads_the_settings(tmp_path: Path) -> None:
    """Before torch is imported: no torch import, backend allowed, a child torch parses it."""
    script = textwrap.dedent("""
        import json, os, subprocess, sys
        from vramkit.devices.env import setup_cuda_memory_management, allocator_env_var
        result = setup_cuda_memory_management(expandable_segments=True,
                                              garbage_collection_threshold=0.7,
                                              allow_tf32=None, backend="native")
        assert "torch" not in sys.modules, "setup without TF32 must not import torch"
        child = subprocess.run(
            [sys.executable, "-c",
             "import os, torch; print(torch._C._accelerator_getAllocatorSettings())"],
            capture_output=True, text=True, check=True)
        print(json.dumps({"variable": allocator_env_var(), "result": result["value"],
                          "child": child.stdout.strip()}))
    """)
    report = run_child(script, drop=(ALLOC_CONF_VAR, LEGACY_ALLOC_CONF_VAR), timeout=120,
                       cwd=tmp_path)
    expected = "backend:native,expandable_segments:True,garbage_collection_threshold:0.7"
    assert report["variable"] == ALLOC_CONF_VAR  # torch 2.13 here
    assert report["result"] == expected
    assert report["child"] == expected
