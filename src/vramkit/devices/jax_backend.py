"""JAX side of device management: environment set-up before the backend starts, and
:class:`JAXDeviceManager` for device lists, data distribution and sharding.

JAX is optional. Nothing here imports JAX at module import time; :class:`JAXDeviceManager`
imports it when it is created and raises :class:`~vramkit.errors.JaxUnavailableError` when it is
not installed. The helpers that decide environment variables read JAX's version through
``importlib.metadata`` so that configuring JAX never starts it.

Which environment variables JAX reads (checked against ``jaxlib/xla_client.py``):

* ``XLA_CLIENT_MEM_FRACTION`` is the GPU memory fraction name read by jaxlib since 0.4.32
  (openxla/xla PR #16457, August 2024, shipped in jaxlib 0.4.32, September 2024). Older jaxlib
  only reads ``XLA_PYTHON_CLIENT_MEM_FRACTION``. Newer jaxlib still reads the legacy name but
  refuses a process where *both* are set, so vramkit writes exactly one of them.
* ``XLA_PYTHON_CLIENT_PREALLOCATE`` controls preallocation (not renamed as of jax 0.10).
* ``JAX_ENABLE_X64`` / ``JAX_DISABLE_JIT`` are read once, when ``jax`` is imported; after that,
  ``jax.config.update`` is the way to change them.

All of these are read when the first backend client is created; after that they are fixed for
the life of the process, which is why a conflicting request afterwards raises
:class:`~vramkit.errors.TooLateError` instead of being ignored. The memory fraction and
preallocation only act on GPU backends: when every backend JAX started is a CPU one
(:func:`jax_backend_platforms`), a different request cannot matter and is accepted.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import math
import os
import re
import sys
from collections.abc import MutableMapping, Sequence
from typing import Any

from vramkit.errors import ConfigError, JaxUnavailableError, TooLateError

__all__ = [
    "JAX_DEFAULT_MEMORY_FRACTION",
    "JAX_DISABLE_JIT_ENV",
    "JAX_ENABLE_X64_ENV",
    "JAX_MEM_FRACTION_ENV",
    "JAX_PREALLOCATE_ENV",
    "LEGACY_JAX_MEM_FRACTION_ENV",
    "JAXDeviceManager",
    "apply_jax_flags",
    "apply_jax_memory_settings",
    "installed_jax_version",
    "jax_backend_initialized",
    "jax_backend_platforms",
    "jax_imported",
    "jax_installed",
    "jax_memory_conflicts",
    "memory_fraction_env_name",
]

logger = logging.getLogger(__name__)

JAX_MEM_FRACTION_ENV = "XLA_CLIENT_MEM_FRACTION"
LEGACY_JAX_MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"
JAX_ENABLE_X64_ENV = "JAX_ENABLE_X64"
JAX_DISABLE_JIT_ENV = "JAX_DISABLE_JIT"

#: What XLA uses on GPU when no fraction is set (JAX docs, "GPU memory allocation").
JAX_DEFAULT_MEMORY_FRACTION = 0.75
#: XLA preallocates on GPU unless told otherwise.
JAX_DEFAULT_PREALLOCATE = True

# First jaxlib release whose xla_client reads XLA_CLIENT_MEM_FRACTION (see module docstring).
_FIRST_VERSION_WITH_NEW_FRACTION_NAME = (0, 4, 32)
# Backends whose memory the fraction and preallocation settings do not govern.
_HOST_PLATFORMS = frozenset({"cpu"})
_FALSE_STRINGS = ("false", "False", "0")  # exactly the spellings jaxlib treats as "off"
_TRUE_ENV_STRINGS = ("1", "true", "yes", "on", "t", "y")


# --------------------------------------------------------------------------------------------
# Installation and version
# --------------------------------------------------------------------------------------------

def jax_installed() -> bool:
    """Whether the ``jax`` package can be imported, without importing it.

    Returns:
        True when ``jax`` is importable.
    """
    if "jax" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("jax") is not None
    except (ImportError, ValueError):
        return False


def installed_jax_version(package: str = "jax") -> str | None:
    """The installed version of ``jax`` (or ``jaxlib``), read from package metadata.

    Args:
        package: distribution name to look up (default ``"jax"``).

    Returns:
        The version string, or None when the distribution is not installed.
    """
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _version_tuple(version: str) -> tuple[int, int, int]:
    match = re.match(r"^\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    if match is None:
        raise ConfigError(f"cannot parse the JAX version {version!r}",
                          "Reinstall jax with pip so that its package metadata is valid.")
    return tuple(int(part or 0) for part in match.groups())  # type: ignore[return-value]


def memory_fraction_env_name(jax_version: str | None = None, jaxlib_version: str | None = None,
                             environ: MutableMapping[str, str] | None = None) -> str:
    """The one environment variable through which to set JAX's GPU memory fraction.

    A name the user already set wins (writing the other one as well would make jaxlib refuse
    to start). Otherwise the name follows the installed version: ``XLA_CLIENT_MEM_FRACTION``
    for jax/jaxlib >= 0.4.32, ``XLA_PYTHON_CLIENT_MEM_FRACTION`` before. The older of the jax
    and jaxlib versions decides, because jaxlib is the one that reads the variable.

    Args:
        jax_version: jax version (default: read from package metadata).
        jaxlib_version: jaxlib version (default: read from package metadata).
        environ: environment to inspect (default ``os.environ``).

    Returns:
        The variable name.

    Raises:
        ConfigError: both names are already set (jaxlib would refuse to start).
    """
    env = os.environ if environ is None else environ
    has_new = JAX_MEM_FRACTION_ENV in env
    has_legacy = LEGACY_JAX_MEM_FRACTION_ENV in env
    if has_new and has_legacy:
        raise ConfigError(
            f"both {JAX_MEM_FRACTION_ENV} and {LEGACY_JAX_MEM_FRACTION_ENV} are set; jaxlib "
            "refuses to start with both",
            f"Unset {LEGACY_JAX_MEM_FRACTION_ENV} (deprecated) and keep {JAX_MEM_FRACTION_ENV}.")
    if has_new:
        return JAX_MEM_FRACTION_ENV
    if has_legacy:
        return LEGACY_JAX_MEM_FRACTION_ENV
    versions = [v for v in (jax_version or installed_jax_version("jax"),
                            jaxlib_version or installed_jax_version("jaxlib")) if v]
    if not versions:
        return JAX_MEM_FRACTION_ENV
    oldest = min(_version_tuple(v) for v in versions)
    if oldest >= _FIRST_VERSION_WITH_NEW_FRACTION_NAME:
        return JAX_MEM_FRACTION_ENV
    return LEGACY_JAX_MEM_FRACTION_ENV


# --------------------------------------------------------------------------------------------
# Backend state
# --------------------------------------------------------------------------------------------

def jax_imported() -> bool:
    """Whether ``jax`` has been imported in this process.

    Returns:
        True when ``jax`` is in ``sys.modules``.
    """
    return "jax" in sys.modules


def jax_backend_initialized() -> bool:
    """Whether JAX has created its backend clients (after which XLA_* settings are fixed).

    Uses ``jax._src.xla_bridge.backends_are_initialized()`` (jax 0.4.30 .. 0.10) and falls back
    to the module's ``_backends`` cache. Never imports JAX: if it is not imported, its backends
    cannot have started.

    Returns:
        True when the backends exist, or when JAX is imported but its internals are not
        recognised (assuming "started" makes a conflicting request fail loudly rather than be
        ignored).
    """
    if not jax_imported():
        return False
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is None:
        # jax imports xla_bridge while it is imported itself; without it nothing can have run.
        return False
    check = getattr(bridge, "backends_are_initialized", None)
    if callable(check):
        return bool(check())
    cache = getattr(bridge, "_backends", None)
    if isinstance(cache, dict):
        return bool(cache)
    logger.warning("cannot tell whether JAX backends started (unknown jax internals); "
                   "assuming they did")
    return True


def jax_backend_platforms() -> frozenset[str] | None:
    """The platforms of the JAX backends that have started (``"cpu"``, ``"cuda"``, ``"rocm"``,
    ``"tpu"``, ...), without importing or starting JAX.

    Read from ``jax._src.xla_bridge._backends`` (platform name -> client; jax 0.4.30 .. 0.10),
    which JAX fills when its backends start: all of them at once, those ``JAX_PLATFORMS`` names
    or, by default, every one whose plugin initializes.

    Returns:
        The platform names; an empty set before any backend started (or when JAX is not
        imported); ``None`` when backends started but their platforms cannot be read (unknown
        jax internals), which callers treat as "a GPU may be among them".
    """
    if not jax_backend_initialized():
        return frozenset()
    bridge = sys.modules.get("jax._src.xla_bridge")
    cache = getattr(bridge, "_backends", None) if bridge is not None else None
    if not isinstance(cache, dict) or not cache:
        return None
    return frozenset(str(name).lower() for name in cache)


def _effective_fraction(env: MutableMapping[str, str]) -> float | None:
    raw = env.get(JAX_MEM_FRACTION_ENV) or env.get(LEGACY_JAX_MEM_FRACTION_ENV)
    if raw is None or raw == "":
        return JAX_DEFAULT_MEMORY_FRACTION
    try:
        return float(raw)
    except ValueError:
        return None  # unparsable: differs from anything we could ask for


def _effective_preallocate(env: MutableMapping[str, str]) -> bool:
    raw = env.get(JAX_PREALLOCATE_ENV, "")
    if raw == "":
        return JAX_DEFAULT_PREALLOCATE
    return raw not in _FALSE_STRINGS


# --------------------------------------------------------------------------------------------
# Applying settings
# --------------------------------------------------------------------------------------------

def _set_env(env: MutableMapping[str, str], name: str, value: str) -> None:
    old = env.get(name)
    if old is not None and old != value:
        # The configuration is the source of truth; say so rather than override quietly.
        logger.warning("vramkit sets %s=%s (was %s) from the DeviceConfiguration", name, value, old)
    env[name] = value


def jax_memory_conflicts(memory_fraction: float, preallocate: bool,
                         environ: MutableMapping[str, str] | None = None) -> list[TooLateError]:
    """The JAX memory settings that can no longer take effect, one error each.

    Empty before the JAX backend starts, when it runs on CPU backends only (the settings cannot
    act there), and when a GPU backend runs with exactly these values. Otherwise one
    :class:`TooLateError` for the fraction and/or one for preallocation, each naming what is in
    effect and what was asked for. Nothing is written.

    Args:
        memory_fraction: fraction of each GPU's total memory JAX may use, in (0, 1].
        preallocate: whether JAX reserves that memory up front.
        environ: environment to read (default ``os.environ``).

    Returns:
        The conflicts, fraction first.
    """
    env = os.environ if environ is None else environ
    if not jax_backend_initialized():
        return []
    platforms = jax_backend_platforms()
    if platforms and platforms <= _HOST_PLATFORMS:
        logger.debug("JAX runs on %s only: memory fraction %s and preallocate=%s cannot act "
                     "there; the environment is left as it is", sorted(platforms),
                     memory_fraction, preallocate)
        return []
    started = ("the JAX backend" if platforms is None
               else f"the JAX backend ({', '.join(sorted(platforms))})")
    conflicts: list[TooLateError] = []
    in_effect = _effective_fraction(env)
    if in_effect is None or not math.isclose(in_effect, memory_fraction, abs_tol=1e-9):
        name = (LEGACY_JAX_MEM_FRACTION_ENV if LEGACY_JAX_MEM_FRACTION_ENV in env
                and JAX_MEM_FRACTION_ENV not in env else JAX_MEM_FRACTION_ENV)
        conflicts.append(TooLateError(
            name,
            f"{started} already started with memory fraction {in_effect}, "
            f"{memory_fraction} was requested",
            "Create the DeviceManager before the first JAX operation, or ask for the "
            "fraction in effect."))
    if _effective_preallocate(env) != preallocate:
        conflicts.append(TooLateError(
            JAX_PREALLOCATE_ENV,
            f"{started} already started with preallocate={not preallocate}, "
            f"preallocate={preallocate} was requested",
            "Create the DeviceManager before the first JAX operation, or set "
            "DeviceConfiguration(preallocate=...) to the value in effect."))
    return conflicts


def apply_jax_memory_settings(memory_fraction: float, preallocate: bool,
                              environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set JAX's GPU memory fraction and preallocation through the environment.

    Before the JAX backend starts this writes the fraction variable chosen by
    :func:`memory_fraction_env_name` and ``XLA_PYTHON_CLIENT_PREALLOCATE``. After it started,
    nothing can change them any more. Both only act on GPU memory, so when JAX runs on CPU
    backends only (:func:`jax_backend_platforms`) any request is accepted and nothing is
    written; with a GPU backend (or platforms that cannot be read) a request equal to what is in
    effect is accepted and a different one raises :class:`TooLateError`
    (:func:`jax_memory_conflicts` lists them without raising).

    Args:
        memory_fraction: fraction of each GPU's total memory JAX may use, in (0, 1].
        preallocate: whether JAX reserves that memory up front.
        environ: environment to write (default ``os.environ``).

    Returns:
        The variables written (empty when the backend already runs with these values).

    Raises:
        TooLateError: a GPU backend started with a different fraction or preallocation (the
            fraction's error first).
        ConfigError: both fraction variable names are already set.
    """
    env = os.environ if environ is None else environ
    if jax_backend_initialized():
        conflicts = jax_memory_conflicts(memory_fraction, preallocate, env)
        if conflicts:
            raise conflicts[0]
        return {}
    written = {
        memory_fraction_env_name(environ=env): repr(float(memory_fraction)),
        JAX_PREALLOCATE_ENV: "true" if preallocate else "false",
    }
    for name, value in written.items():
        _set_env(env, name, value)
    logger.debug("JAX memory settings written: %s", written)
    return written


def _env_bool(raw: str | None) -> bool | None:
    if raw is None or raw == "":
        return None
    return raw.strip().lower() in _TRUE_ENV_STRINGS


def apply_jax_flags(enable_x64: bool, enable_jit: bool, *, import_jax: bool = False,
                    environ: MutableMapping[str, str] | None = None) -> None:
    """Apply ``enable_x64`` and ``enable_jit`` to JAX without importing it needlessly.

    If JAX is imported (or ``import_jax`` is set) this calls ``jax.config.update`` for
    ``jax_enable_x64`` and ``jax_disable_jit``, which take effect at once. If JAX is installed
    but not imported, it writes ``JAX_ENABLE_X64`` / ``JAX_DISABLE_JIT`` for JAX to read when
    it is imported, but only where a value differs from JAX's default or from a value already
    in the environment, so that default settings leave the environment alone.

    Args:
        enable_x64: 64-bit types in JAX (JAX default False).
        enable_jit: compile with ``jax.jit`` (JAX default True).
        import_jax: import JAX to apply the flags right away (default False).
        environ: environment to write (default ``os.environ``).

    Raises:
        JaxUnavailableError: a non-default value was asked for but JAX is not installed.
    """
    env = os.environ if environ is None else environ
    if not jax_installed():
        if enable_x64 or not enable_jit:
            raise JaxUnavailableError(
                f"enable_x64={enable_x64} / enable_jit={enable_jit} configure JAX, which is not "
                "installed")
        return
    if jax_imported() or import_jax:
        import jax  # optional dependency, imported on demand

        jax.config.update("jax_enable_x64", bool(enable_x64))
        jax.config.update("jax_disable_jit", not enable_jit)
        return
    for name, wanted, default in ((JAX_ENABLE_X64_ENV, enable_x64, False),
                                  (JAX_DISABLE_JIT_ENV, not enable_jit, False)):
        current = _env_bool(env.get(name))
        if wanted != default or (current is not None and current != wanted):
            _set_env(env, name, "1" if wanted else "0")


# --------------------------------------------------------------------------------------------
# JAXDeviceManager
# --------------------------------------------------------------------------------------------

def _import_jax() -> Any:
    try:
        import jax  # optional dependency, imported on demand
    except ImportError as err:
        raise JaxUnavailableError(f"JAX is not installed ({err})") from err
    return jax


class JAXDeviceManager:
    """JAX's view of the devices, with data distribution and sharding (Artifex API).

    Creating one imports JAX and starts its backend, so create it after the
    :class:`~vramkit.devices.manager.DeviceManager` (``DeviceManager.jax_manager`` does).

    Args:
        platform_priority: platforms tried by :meth:`get_default_device`, in order
            (default ``("cuda", "cpu")``).

    Raises:
        JaxUnavailableError: JAX is not installed.
    """

    def __init__(self, platform_priority: Sequence[str] = ("cuda", "cpu")) -> None:
        self._jax = _import_jax()
        self._platform_priority = tuple(platform_priority)

    def _devices_of(self, platform: str) -> list[Any]:
        try:
            return list(self._jax.devices(platform))
        except RuntimeError:
            # jax raises RuntimeError for a platform it has no backend for.
            return []

    @property
    def gpu_devices(self) -> list[Any]:
        """JAX GPU devices (CUDA or ROCm), empty when there is none."""
        return self._devices_of("gpu")

    @property
    def cpu_devices(self) -> list[Any]:
        """JAX CPU devices (several with ``--xla_force_host_platform_device_count``).

        Asked for by name (``jax.devices("cpu")``), so they are listed beside the GPUs when a GPU
        backend is JAX's default; empty only when JAX did not start its CPU backend
        (``JAX_PLATFORMS`` without ``cpu``).
        """
        return self._devices_of("cpu")

    @property
    def tpu_devices(self) -> list[Any]:
        """JAX TPU devices, empty when there is none."""
        return self._devices_of("tpu")

    @property
    def devices(self) -> list[Any]:
        """All local JAX devices of every backend: GPUs first, then TPUs, then CPUs."""
        return self.gpu_devices + self.tpu_devices + self.cpu_devices

    def get_default_device(self) -> Any:
        """The first device of the first platform in ``platform_priority`` that has one.

        ``"gpu"`` means any GPU, ``"cuda"`` and ``"rocm"`` the vendor's backend only.

        Returns:
            A ``jax.Device``; JAX's own default device when no listed platform has one.
        """
        for platform in self._platform_priority:
            found = self._devices_of(platform)
            if found:
                return found[0]
        logger.info("no JAX device for platforms %s; using JAX's default device",
                    self._platform_priority)
        return self._jax.devices()[0]

    def _default_targets(self) -> list[Any]:
        gpus = self.gpu_devices
        return gpus if gpus else list(self._jax.devices())

    def distribute_data(self, data: Any, target_devices: Sequence[Any] | None = None) -> list[Any]:
        """Split ``data`` along its first axis and put one shard on each device.

        Split rule (as ``numpy.array_split``): with ``n`` rows and ``k`` devices every shard
        gets ``n // k`` rows and the first ``n % k`` shards get one more, so shard sizes differ
        by at most one and their concatenation in order is ``data``.

        Args:
            data: an array (NumPy, JAX, or anything with ``shape`` and slicing) with at least
                one dimension.
            target_devices: devices to use (default: all GPUs, else the default backend's
                devices).

        Returns:
            A list of ``jax.Array``, shard ``i`` committed to ``target_devices[i]``.

        Raises:
            ConfigError: no devices, a 0-d array, or fewer rows than devices.
        """
        devices = list(target_devices) if target_devices is not None else self._default_targets()
        rows = self._leading_dim(data, len(devices))
        if rows < len(devices):
            raise ConfigError(
                f"cannot distribute {rows} rows over {len(devices)} devices (each device "
                "needs at least one row)",
                "Pass fewer target_devices or a larger batch.")
        base, extra = divmod(rows, len(devices))
        shards = []
        start = 0
        for index, device in enumerate(devices):
            size = base + (1 if index < extra else 0)
            shards.append(self._jax.device_put(data[start:start + size], device))
            start += size
        return shards

    def shard(self, data: Any, axis_name: str = "data",
              devices: Sequence[Any] | None = None) -> Any:
        """Put ``data`` on the devices as one ``jax.Array`` split along its first axis.

        Uses ``NamedSharding`` over a 1-D ``Mesh`` whose single axis is ``axis_name``, so the
        result can feed ``jax.jit`` / ``shard_map`` code that names that axis. Rows are not
        padded: they must divide evenly by the device count.

        Args:
            data: array with at least one dimension.
            axis_name: name of the mesh axis (default ``"data"``).
            devices: devices of the mesh (default: all GPUs, else the default backend's
                devices).

        Returns:
            A ``jax.Array`` with ``sharding == NamedSharding(mesh, PartitionSpec(axis_name))``.

        Raises:
            ConfigError: no devices, a 0-d array, or rows not divisible by the device count.
        """
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        mesh_devices = list(devices) if devices is not None else self._default_targets()
        rows = self._leading_dim(data, len(mesh_devices))
        if not axis_name or not isinstance(axis_name, str):
            raise ConfigError(f"axis_name must be a non-empty string, got {axis_name!r}",
                              hint="Pass the mesh axis name as a string, e.g. axis_name='data' "
                                   "(the default).")
        if rows % len(mesh_devices) != 0:
            raise ConfigError(
                f"{rows} rows do not divide evenly over {len(mesh_devices)} devices",
                "Pad or trim the batch to a multiple of the device count, or use "
                "distribute_data() for uneven shards.")
        mesh = Mesh(np.asarray(mesh_devices, dtype=object), (axis_name,))
        return self._jax.device_put(data, NamedSharding(mesh, PartitionSpec(axis_name)))

    @staticmethod
    def _leading_dim(data: Any, device_count: int) -> int:
        if device_count == 0:
            raise ConfigError("no target devices", "Pass at least one JAX device.")
        shape = getattr(data, "shape", None)
        if shape is None or len(shape) == 0:
            raise ConfigError(
                f"data must be an array with at least one dimension, got {type(data).__name__}"
                + (" of shape ()" if shape is not None else ""),
                "Pass a NumPy or JAX array whose first axis is the batch.")
        return int(shape[0])

    def __repr__(self) -> str:
        return f"JAXDeviceManager(platform_priority={self._platform_priority!r})"
