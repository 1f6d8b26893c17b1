"""JAX tests, each in a fresh subprocess with four host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``, ``JAX_PLATFORMS=cpu``).

A subprocess gives every test a JAX whose backend has not started yet, which is what the
environment-variable checks need, and keeps JAX out of the pytest process.
"""

from __future__ import annotations

import importlib.util
import textwrap
from typing import Any

import pytest

from tests._child import run_child

if importlib.util.find_spec("jax") is None:  # checked without importing JAX here
    pytest.skip("JAX is not installed", allow_module_level=True)


_CLEARED = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
            "XLA_PYTHON_CLIENT_PREALLOCATE", "JAX_ENABLE_X64", "JAX_DISABLE_JIT",
            "XLA_PYTHON_CLIENT_ALLOCATOR")

_PRELUDE = """
import json, os, sys
import numpy as np
from vramkit.devices.info import DeviceCapabilities, DeviceType
from vramkit.devices.manager import DeviceConfiguration, DeviceManager, MemoryStrategy
from vramkit.errors import ConfigError, TooLateError

class CpuDetector:
    def detect_capabilities(self):
        return DeviceCapabilities(device_type=DeviceType.CPU, device_count=1)

def manager(**kwargs):
    return DeviceManager(DeviceConfiguration(**kwargs), detector=CpuDetector())

def raises(exc_type, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as err:
        return err
    raise AssertionError(f"{fn} did not raise {exc_type.__name__}")

result = {}
"""


def run_jax_script(body: str, timeout: float = 120) -> dict[str, Any]:
    """Run ``body`` after the prelude in a fresh interpreter; return its ``result`` dict."""
    script = _PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(result))\n"
    return run_child(script, drop=_CLEARED, timeout=timeout,  # type: ignore[no-any-return]
                     env={"JAX_PLATFORMS": "cpu",
                          "XLA_FLAGS": "--xla_force_host_platform_device_count=4"})


def test_distribute_data_uneven_and_custom_targets() -> None:
    result = run_jax_script("""
        import jax
        jm = manager().jax_manager
        devices = jax.devices()
        data = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
        shards = jm.distribute_data(data)
        expected = np.array_split(data, 4)
        result["shapes"] = [list(s.shape) for s in shards]
        result["contents"] = all(np.array_equal(np.asarray(s), e) for s, e in zip(shards, expected))
        result["devices"] = [list(s.devices())[0].id for s in shards]
        result["committed"] = all(s.committed for s in shards)
        result["all_devices"] = [d.id for d in devices]

        two = jm.distribute_data(data, target_devices=devices[2:])
        result["two_shapes"] = [list(s.shape) for s in two]
        result["two_devices"] = [list(s.devices())[0].id for s in two]

        even = jm.distribute_data(jax.numpy.arange(8))
        result["even"] = [np.asarray(s).tolist() for s in even]

        result["too_few"] = str(raises(ConfigError, jm.distribute_data, np.zeros((3, 2))))
        raises(ConfigError, jm.distribute_data, np.float32(1.0))
        raises(ConfigError, jm.distribute_data, data, target_devices=[])
    """)
    assert result["all_devices"] == [0, 1, 2, 3]
    # numpy.array_split rule: 10 rows over 4 devices -> 3, 3, 2, 2.
    assert result["shapes"] == [[3, 3], [3, 3], [2, 3], [2, 3]]
    assert result["contents"] is True
    assert result["devices"] == [0, 1, 2, 3]
    assert result["committed"] is True
    assert result["two_shapes"] == [[5, 3], [5, 3]]
    assert result["two_devices"] == [2, 3]
    assert result["even"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert "3 rows over 4 devices" in result["too_few"]


def test_shard_named_sharding_over_1d_mesh() -> None:
    result = run_jax_script("""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec
        jm = manager().jax_manager
        data = np.arange(8 * 2, dtype=np.int32).reshape(8, 2)
        arr = jm.shard(data)
        result["type"] = isinstance(arr, jax.Array)
        result["named"] = isinstance(arr.sharding, NamedSharding)
        result["axis_names"] = list(arr.sharding.mesh.axis_names)
        result["spec"] = arr.sharding.spec == PartitionSpec("data")
        result["full"] = np.array_equal(np.asarray(arr), data)
        shards = sorted(arr.addressable_shards, key=lambda s: s.device.id)
        result["shard_devices"] = [s.device.id for s in shards]
        result["shard_rows"] = [np.asarray(s.data)[:, 0].tolist() for s in shards]

        custom = jm.shard(data, axis_name="batch", devices=jax.devices()[:2])
        result["custom_axis"] = list(custom.sharding.mesh.axis_names)
        result["custom_shards"] = sorted(list(s.data.shape) for s in custom.addressable_shards)

        result["uneven"] = str(raises(ConfigError, jm.shard, np.zeros((10, 2))))
        raises(ConfigError, jm.shard, data, axis_name="")
    """)
    assert result["type"] and result["named"] and result["spec"] and result["full"]
    assert result["axis_names"] == ["data"]
    assert result["shard_devices"] == [0, 1, 2, 3]
    assert result["shard_rows"] == [[0, 2], [4, 6], [8, 10], [12, 14]]
    assert result["custom_axis"] == ["batch"]
    assert result["custom_shards"] == [[4, 2], [4, 2]]
    assert "do not divide evenly" in result["uneven"]


def test_device_lists_and_default_device() -> None:
    result = run_jax_script("""
        jm = manager(platform_priority=("cuda", "cpu")).jax_manager
        result["devices"] = [d.id for d in jm.devices]
        result["cpu"] = [d.platform for d in jm.cpu_devices]
        result["gpu"] = len(jm.gpu_devices)
        result["default"] = [jm.get_default_device().platform, jm.get_default_device().id]
        tpu_first = manager(platform_priority=("tpu",)).jax_manager
        result["fallback"] = tpu_first.get_default_device().platform
    """)
    assert result["devices"] == [0, 1, 2, 3]
    assert result["cpu"] == ["cpu"] * 4
    assert result["gpu"] == 0
    assert result["default"] == ["cpu", 0]
    assert result["fallback"] == "cpu"


def test_distribute_data_to_the_host_devices_by_name() -> None:
    # jax.devices("cpu") names the host devices whatever the default backend is; the manager
    # lists them and distributes over a slice of them.
    result = run_jax_script("""
        jm = manager().jax_manager
        hosts = jm.cpu_devices
        data = np.arange(5 * 2, dtype=np.float32).reshape(5, 2)
        shards = jm.distribute_data(data, target_devices=hosts[:2])
        result["hosts"] = [d.id for d in hosts]
        result["devices"] = [list(s.devices())[0].id for s in shards]
        result["rows"] = [s.shape[0] for s in shards]
        result["whole"] = np.array_equal(np.concatenate([np.asarray(s) for s in shards]), data)
    """)
    assert result["hosts"] == [0, 1, 2, 3]
    assert result["devices"] == [0, 1]
    assert result["rows"] == [3, 2]
    assert result["whole"] is True


def test_memory_settings_are_in_the_environment_before_jax_starts() -> None:
    result = run_jax_script("""
        from vramkit.devices.jax_backend import memory_fraction_env_name
        manager(memory_strategy="custom", memory_fraction=0.42, preallocate=True)
        result["jax_imported_by_manager"] = "jax" in sys.modules
        name = memory_fraction_env_name()
        result["name"] = name
        result["fraction"] = os.environ.get(name)
        result["both"] = ("XLA_CLIENT_MEM_FRACTION" in os.environ
                          and "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ)
        result["preallocate"] = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
        import jax, jax.numpy as jnp
        result["devices"] = len(jax.devices())
        result["sum"] = float(jnp.arange(4.0).sum())
        # Same settings again after the start: accepted, nothing is too late.
        manager(memory_strategy="custom", memory_fraction=0.42, preallocate=True)
        result["again"] = True
    """)
    assert result["jax_imported_by_manager"] is False
    assert result["name"] == "XLA_CLIENT_MEM_FRACTION"  # jax >= 0.4.32 in CI
    assert result["fraction"] == "0.42"
    assert result["both"] is False
    assert result["preallocate"] == "true"
    assert result["devices"] == 4
    assert result["sum"] == 6.0
    assert result["again"] is True


def test_too_late_after_backend_started() -> None:
    result = run_jax_script("""
        import jax
        from vramkit.devices.jax_backend import jax_backend_initialized
        result["after_import"] = jax_backend_initialized()
        # Import alone does not start the backend: configuring still works.
        manager(memory_strategy="conservative", preallocate=True)
        jax.devices()
        result["after_devices"] = jax_backend_initialized()
        from vramkit.devices import jax_backend
        result["platforms"] = sorted(jax_backend.jax_backend_platforms())
        # The fraction and preallocation act on GPU backends only (on this CPU-only JAX any
        # request is accepted, see test_cpu_only_jax_accepts_another_memory_strategy): make
        # the started backends look like a GPU machine's.
        jax_backend.jax_backend_platforms = lambda: frozenset({"cpu", "cuda"})
        # The backend started with 0.6 / preallocate: asking for 0.9 is too late.
        err = raises(TooLateError, manager, memory_strategy="aggressive", preallocate=True)
        result["fraction_setting"] = err.setting
        err = raises(TooLateError, manager, memory_strategy="conservative", preallocate=False)
        result["prealloc_setting"] = err.setting
        err = raises(TooLateError, manager, environment_variables={"XLA_FLAGS": "--x"})
        result["flags_setting"] = err.setting
        result["env_unchanged"] = os.environ.get("XLA_CLIENT_MEM_FRACTION")
        manager(memory_strategy="conservative", preallocate=True)
        result["same_ok"] = True
    """)
    assert result["after_import"] is False
    assert result["after_devices"] is True
    assert result["platforms"] == ["cpu"]
    assert result["fraction_setting"] == "XLA_CLIENT_MEM_FRACTION"
    assert result["prealloc_setting"] == "XLA_PYTHON_CLIENT_PREALLOCATE"
    assert result["flags_setting"] == "XLA_FLAGS"
    assert result["env_unchanged"] == "0.6"
    assert result["same_ok"] is True


def test_cpu_only_jax_accepts_another_memory_strategy() -> None:
    result = run_jax_script("""
        import jax, jax.numpy as jnp
        from vramkit.devices import jax_backend
        from vramkit.devices.shared_manager import get_device_manager
        first = get_device_manager(DeviceConfiguration(memory_strategy="conservative"),
                                   detector=CpuDetector())
        result["sum"] = float(jnp.arange(4.0).sum())  # the (CPU) backend starts here
        result["started"] = jax_backend.jax_backend_initialized()
        result["platforms"] = sorted(jax_backend.jax_backend_platforms())
        # Another strategy and preallocation: the fraction cannot act on a CPU backend.
        second = get_device_manager(
            DeviceConfiguration(memory_strategy="aggressive", preallocate=True),
            force_reinit=True, detector=CpuDetector())
        result["replaced"] = second is not first and get_device_manager() is second
        result["strategy"] = second.config.memory_strategy.value
        result["env"] = [os.environ.get("XLA_CLIENT_MEM_FRACTION"),
                         os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")]
        result["written"] = jax_backend.apply_jax_memory_settings(0.3, True)
        # Variables XLA reads on every platform are still refused once it started.
        err = raises(TooLateError, manager, environment_variables={"XLA_FLAGS": "--x"})
        result["flags_setting"] = err.setting
        # With a GPU backend among the started ones the fraction cannot apply: the new
        # manager warns, says so in its info, and replaces the shared one all the same.
        import warnings
        from vramkit.errors import VramkitWarning
        jax_backend.jax_backend_platforms = lambda: frozenset({"cpu", "cuda"})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            third = get_device_manager(DeviceConfiguration(memory_strategy="balanced"),
                                       force_reinit=True, detector=CpuDetector())
        result["gpu_warnings"] = [str(w.message) for w in caught
                                  if issubclass(w.category, VramkitWarning)]
        result["not_applied"] = sorted(third.get_device_info()["settings"]["not_applied"])
        result["kept"] = get_device_manager() is third
        # Host devices are listed whatever backend is the default.
        result["cpu_devices"] = [d.platform for d in third.jax_manager.cpu_devices]
    """)
    assert result["sum"] == 6.0 and result["started"] is True
    assert result["platforms"] == ["cpu"]
    assert result["replaced"] is True and result["strategy"] == "aggressive"
    assert result["env"] == ["0.6", "false"]  # left as the backend read them
    assert result["written"] == {}
    assert result["flags_setting"] == "XLA_FLAGS"
    assert len(result["gpu_warnings"]) == 1
    assert "(cpu, cuda) already started with memory fraction 0.6" in result["gpu_warnings"][0]
    assert "before the first JAX operation" in result["gpu_warnings"][0]
    assert result["not_applied"] == ["XLA_CLIENT_MEM_FRACTION"]
    assert result["kept"] is True
    assert result["cpu_devices"] == ["cpu"] * 4


def test_x64_and_jit_flags() -> None:
    result = run_jax_script("""
        dm = manager(enable_x64=True, enable_jit=False)
        result["env"] = [os.environ.get("JAX_ENABLE_X64"), os.environ.get("JAX_DISABLE_JIT")]
        import jax, jax.numpy as jnp
        result["x64_on_import"] = bool(jax.config.jax_enable_x64)
        result["dtype"] = str(jnp.zeros(1).dtype)
        _ = dm.jax_manager
        result["disable_jit"] = bool(jax.config.jax_disable_jit)
        # JAX already imported: flags go through jax.config.update at creation.
        manager(enable_x64=False, enable_jit=True)
        result["x64_after_update"] = bool(jax.config.jax_enable_x64)
        result["jit_after_update"] = not jax.config.jax_disable_jit
        result["dtype_after"] = str(jnp.zeros(1).dtype)
    """)
    assert result["env"] == ["1", "1"]
    assert result["x64_on_import"] is True
    assert result["dtype"] == "float64"
    assert result["disable_jit"] is True
    assert result["x64_after_update"] is False
    assert result["jit_after_update"] is True
    assert result["dtype_after"] == "float32"
