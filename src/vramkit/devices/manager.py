"""Device configuration: :class:`DeviceManager`, :class:`DeviceConfiguration` and memory strategies.

A :class:`DeviceManager` detects the devices of this process (through a detector, by default
:class:`vramkit.devices.info.SystemDetector`) and *applies* a :class:`DeviceConfiguration` when it
is created (pass ``apply=False`` to only look):

1. ``environment_variables`` are written to ``os.environ`` before detection, so that e.g.
   ``CUDA_VISIBLE_DEVICES`` shapes what is detected. A variable that a backend already read
   (``CUDA_*``/``PYTORCH_*`` once CUDA is initialized in PyTorch, ``XLA_*`` once the JAX backend
   started, ``JAX_*`` once JAX is imported) raises :class:`~vramkit.errors.TooLateError`
   unless it already has the requested value.
2. The memory strategy caps PyTorch through ``torch.cuda.set_per_process_memory_fraction`` on
   every managed GPU (only when there is a GPU; this initializes CUDA).
3. If JAX is installed, the same fraction and ``preallocate`` go to JAX through
   ``XLA_CLIENT_MEM_FRACTION`` (or the legacy name on old jaxlib) and
   ``XLA_PYTHON_CLIENT_PREALLOCATE``, before its backend starts; a different value after a GPU
   backend started raises :class:`~vramkit.errors.TooLateError`. When JAX runs on the CPU
   only, these settings cannot act, so any value is accepted. A re-initialization,
   :func:`get_device_manager(config, force_reinit=True)
   <vramkit.devices.shared_manager.get_device_manager>`, never fails for a setting that came too
   late: it applies the others (PyTorch's fraction), warns with a
   :class:`~vramkit.errors.VramkitWarning` and lists what it left out in
   :attr:`DeviceManager.settings`.
4. ``enable_x64`` / ``enable_jit`` go to JAX through ``jax.config.update`` when JAX is already
   imported or when :attr:`DeviceManager.jax_manager` is used, and through ``JAX_ENABLE_X64`` /
   ``JAX_DISABLE_JIT`` for a later import otherwise. JAX is never imported just for this.

``preallocate`` defaults to False: PyTorch is vramkit's engine, and JAX reserving 75% of every GPU
at start-up would starve it.
"""

from __future__ import annotations

import enum
import logging
import math
import numbers
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

from vramkit._validate import (
    check_bool,
    check_choice,
    check_int,
    check_known_fields,
    check_number,
)
from vramkit.devices._runtime import cuda_initialized
from vramkit.devices.info import DeviceCapabilities, DeviceInfo, DeviceType
from vramkit.devices.jax_backend import (
    JAX_DISABLE_JIT_ENV,
    JAX_ENABLE_X64_ENV,
    JAX_MEM_FRACTION_ENV,
    JAX_PREALLOCATE_ENV,
    LEGACY_JAX_MEM_FRACTION_ENV,
    JAXDeviceManager,
    apply_jax_flags,
    apply_jax_memory_settings,
    installed_jax_version,
    jax_backend_initialized,
    jax_imported,
    jax_installed,
    jax_memory_conflicts,
)
from vramkit.errors import (
    ConfigError,
    DeviceError,
    JaxUnavailableError,
    TooLateError,
    VramkitWarning,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "KNOWN_PLATFORMS",
    "DeviceConfiguration",
    "DeviceManager",
    "MemoryStrategy",
    "configure_for_generative_models",
]

logger = logging.getLogger(__name__)

#: Platforms ``platform_priority`` may name. "gpu" is any GPU, "cuda"/"rocm" one vendor's.
KNOWN_PLATFORMS = ("cuda", "gpu", "cpu", "tpu", "rocm")

#: Parameter-count thresholds of :meth:`DeviceManager.optimize_for_model_size` (Artifex).
SMALL_MODEL_PARAMS = 1_000_000
MEDIUM_MODEL_PARAMS = 100_000_000

# Variables that fields of DeviceConfiguration own; two ways to set one thing would conflict.
_FIELD_OWNED_ENV = {
    JAX_MEM_FRACTION_ENV: "memory_strategy / memory_fraction",
    LEGACY_JAX_MEM_FRACTION_ENV: "memory_strategy / memory_fraction",
    JAX_PREALLOCATE_ENV: "preallocate",
    JAX_ENABLE_X64_ENV: "enable_x64",
    JAX_DISABLE_JIT_ENV: "enable_jit",
}


class MemoryStrategy(str, enum.Enum):
    """How much of each GPU's total memory a process may use (Artifex strategies).

    ``CONSERVATIVE`` 0.60 (shared GPUs), ``BALANCED`` 0.75 (default), ``AGGRESSIVE`` 0.90
    (dedicated GPUs), ``CUSTOM`` (the fraction given in ``DeviceConfiguration.memory_fraction``).
    """

    CONSERVATIVE = "conservative"
    BALANCED = "balanced"
    AGGRESSIVE = "aggressive"
    CUSTOM = "custom"

    @property
    def default_fraction(self) -> float | None:
        """The strategy's fraction of total GPU memory; None for ``CUSTOM``."""
        return _STRATEGY_FRACTIONS.get(self)

    @classmethod
    def parse(cls, value: MemoryStrategy | str) -> MemoryStrategy:
        """Accept a strategy or its name (``"balanced"``, ``"BALANCED"``).

        Args:
            value: a :class:`MemoryStrategy` or its name, case-insensitive.

        Returns:
            The strategy.

        Raises:
            ConfigError: an unknown name or a value of another type.
        """
        if isinstance(value, MemoryStrategy):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        names = ", ".join(s.value for s in cls)
        raise ConfigError(f"unknown memory strategy {value!r}", f"Use one of: {names}.")


_STRATEGY_FRACTIONS = {
    MemoryStrategy.CONSERVATIVE: 0.60,
    MemoryStrategy.BALANCED: 0.75,
    MemoryStrategy.AGGRESSIVE: 0.90,
}


def _validate_fraction(value: object) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
        value = float(value)  # numpy floats, Fraction: numbers, as the docs promise
    return check_number("memory_fraction", value, minimum=0.0, maximum=1.0, low_open=True,
                        hint="Pass a float in (0, 1], e.g. 0.8 for 80% of each GPU.")


def _validate_bool(name: str, value: object) -> bool:
    # A string like "false" is truthy; accepting it would silently invert the setting.
    return check_bool(name, value, hint=f"Pass a Python bool ({name}=True); strings such as "
                                        "'false' are truthy and are refused rather than misread.")


def _validate_platforms(value: object) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, Iterable):
        raise ConfigError(f"platform_priority must be a sequence of names, got {value!r}",
                          f"Use names from {KNOWN_PLATFORMS}, e.g. ('cuda', 'cpu').")
    platforms: list[str] = []
    for item in items:
        name = item.strip().lower() if isinstance(item, str) else item
        if name not in KNOWN_PLATFORMS:
            raise ConfigError(f"unknown platform {item!r} in platform_priority",
                              f"Use names from {KNOWN_PLATFORMS}.")
        if name in platforms:
            raise ConfigError(f"platform {name!r} appears twice in platform_priority",
                              "List each platform once (names are case-insensitive).")
        platforms.append(name)
    if not platforms:
        raise ConfigError("platform_priority is empty", "Use e.g. ('cuda', 'cpu').")
    return tuple(platforms)


def _validate_env(value: object) -> Mapping[str, str]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"environment_variables must be a mapping, got {type(value).__name__}",
                          "Pass a dict of names to string values, e.g. {'XLA_FLAGS': '...'}.")
    checked: dict[str, str] = {}
    for key, val in value.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise ConfigError(f"invalid environment variable name {key!r}",
                              "Names are non-empty strings without '='.")
        if not isinstance(val, str) or "\0" in val:
            raise ConfigError(f"environment variable {key} must be a string, got {val!r}",
                              "Pass values as strings, e.g. '1' or 'false'.")
        if key in _FIELD_OWNED_ENV:
            raise ConfigError(f"{key} is set through DeviceConfiguration.{_FIELD_OWNED_ENV[key]}",
                              f"Remove {key} from environment_variables and use "
                              f"{_FIELD_OWNED_ENV[key]} instead.")
        checked[key] = val
    return MappingProxyType(dict(sorted(checked.items())))


@dataclass(frozen=True)
class DeviceConfiguration:
    """How devices are configured; validated on creation, applied by :class:`DeviceManager`.

    Args:
        memory_strategy: a :class:`MemoryStrategy` or its name (default ``BALANCED``, 0.75).
        memory_fraction: for ``CUSTOM``, the fraction of each GPU's total memory in (0, 1]
            (required); for a named strategy None or exactly the strategy's fraction. After
            creation it always holds the effective fraction.
        enable_x64: 64-bit types in JAX (default False).
        enable_jit: JIT compilation in JAX (default True; False sets ``jax_disable_jit``).
        platform_priority: device platforms in order of preference, from
            :data:`KNOWN_PLATFORMS` (default ``("cuda", "cpu")``).
        environment_variables: variables written to ``os.environ`` before any backend starts
            (default none); stored read-only.
        preallocate: whether JAX reserves its memory fraction up front (default False).

    Raises:
        ConfigError: any invalid value.
    """

    memory_strategy: MemoryStrategy = MemoryStrategy.BALANCED
    memory_fraction: float | None = None
    enable_x64: bool = False
    enable_jit: bool = True
    platform_priority: tuple[str, ...] = ("cuda", "cpu")
    environment_variables: Mapping[str, str] = field(default_factory=dict)
    preallocate: bool = False

    def __post_init__(self) -> None:
        strategy = MemoryStrategy.parse(self.memory_strategy)
        if strategy is MemoryStrategy.CUSTOM:
            if self.memory_fraction is None:
                raise ConfigError("MemoryStrategy.CUSTOM needs memory_fraction",
                                  "Pass memory_fraction in (0, 1], e.g. 0.8.")
            fraction = _validate_fraction(self.memory_fraction)
        else:
            fraction = _STRATEGY_FRACTIONS[strategy]
            if self.memory_fraction is not None and not math.isclose(
                    _validate_fraction(self.memory_fraction), fraction, abs_tol=1e-12):
                raise ConfigError(
                    f"memory_fraction={self.memory_fraction!r} contradicts "
                    f"{strategy.name} ({fraction})",
                    "Use MemoryStrategy.CUSTOM for your own fraction, or config.with_strategy() "
                    "to change the strategy of an existing configuration.")
        # Frozen dataclass: normalise through object.__setattr__ so fields hold clean values.
        object.__setattr__(self, "memory_strategy", strategy)
        object.__setattr__(self, "memory_fraction", fraction)
        object.__setattr__(self, "enable_x64", _validate_bool("enable_x64", self.enable_x64))
        object.__setattr__(self, "enable_jit", _validate_bool("enable_jit", self.enable_jit))
        object.__setattr__(self, "preallocate", _validate_bool("preallocate", self.preallocate))
        object.__setattr__(self, "platform_priority", _validate_platforms(self.platform_priority))
        object.__setattr__(self, "environment_variables",
                           _validate_env(self.environment_variables))

    def __hash__(self) -> int:
        return hash((self.memory_strategy, self.memory_fraction, self.enable_x64,
                     self.enable_jit, self.platform_priority,
                     tuple(self.environment_variables.items()), self.preallocate))

    @property
    def effective_fraction(self) -> float:
        """The fraction of each GPU's total memory in force (same as ``memory_fraction``)."""
        # __post_init__ replaced None with the strategy's fraction.
        return cast(float, self.memory_fraction)

    def with_strategy(self, memory_strategy: MemoryStrategy | str,
                      memory_fraction: float | None = None) -> DeviceConfiguration:
        """A copy with another strategy (and fraction, for ``CUSTOM``), other fields kept.

        Args:
            memory_strategy: the new strategy or its name.
            memory_fraction: the fraction for ``CUSTOM`` (default None).

        Returns:
            A new configuration.
        """
        data = self.to_dict()
        data["memory_strategy"] = MemoryStrategy.parse(memory_strategy).value
        data["memory_fraction"] = memory_fraction
        return DeviceConfiguration.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_dict` restores an equal configuration.

        Returns:
            Field name -> plain value (strategy by name, tuples as lists).
        """
        return {
            "memory_strategy": self.memory_strategy.value,
            "memory_fraction": self.memory_fraction,
            "enable_x64": self.enable_x64,
            "enable_jit": self.enable_jit,
            "platform_priority": list(self.platform_priority),
            "environment_variables": dict(self.environment_variables),
            "preallocate": self.preallocate,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceConfiguration:
        """Build a configuration from :meth:`to_dict` output (missing keys take defaults).

        Args:
            data: field name -> value.

        Returns:
            The validated configuration.

        Raises:
            ConfigError: unknown keys or invalid values.
        """
        kwargs = check_known_fields(cls, data)
        if "platform_priority" in kwargs and not isinstance(kwargs["platform_priority"], str):
            kwargs["platform_priority"] = tuple(kwargs["platform_priority"])
        return cls(**kwargs)


# --------------------------------------------------------------------------------------------
# Applying environment variables
# --------------------------------------------------------------------------------------------

def _too_late_reason(name: str) -> str | None:
    if name.startswith(("CUDA_", "PYTORCH_")) and cuda_initialized():
        return "PyTorch already initialized CUDA"
    if name.startswith("CUDA_") and jax_backend_initialized():
        return "the JAX backend already started"
    if name.startswith("XLA_") and jax_backend_initialized():
        return "the JAX backend already started"
    if name.startswith(("JAX_", "TF_")) and jax_imported():
        return "JAX is already imported (it reads JAX_* variables on import)"
    return None


def _environment_conflicts(variables: Mapping[str, str]) -> list[TooLateError]:
    """One error per variable a backend already read with another value."""
    conflicts = []
    for name, value in variables.items():
        if os.environ.get(name) == value:
            continue
        reason = _too_late_reason(name)
        if reason is not None:
            conflicts.append(TooLateError(name, f"{reason}; it read {name}="
                                                f"{os.environ.get(name)!r} and {value!r} was "
                                                "requested"))
    return conflicts


def _apply_environment_variables(variables: Mapping[str, str]) -> None:
    # Check every variable first so that a refusal leaves the environment untouched.
    conflicts = _environment_conflicts(variables)
    if conflicts:
        raise conflicts[0]
    for name, value in variables.items():
        os.environ[name] = value
    if variables:
        logger.debug("environment variables applied: %s", dict(variables))


# --------------------------------------------------------------------------------------------
# DeviceManager
# --------------------------------------------------------------------------------------------

class DeviceManager:
    """Detects this process's devices and applies a :class:`DeviceConfiguration`.

    Args:
        config: the configuration (default ``DeviceConfiguration()``: BALANCED, 0.75).
        detector: any object with ``detect_capabilities() -> DeviceCapabilities`` and
            optionally ``list_devices() -> Sequence[DeviceInfo]`` (default
            :class:`vramkit.devices.info.SystemDetector`).
        apply: apply the configuration now (default True); see the module docstring for what
            that does. With False the manager only reports; :meth:`apply_configuration`
            applies later.
        on_too_late: what to do with a setting that can no longer take effect (JAX's memory
            fraction after its GPU backend started, a variable a backend already read):
            ``"raise"`` (default) raises :class:`~vramkit.errors.TooLateError` before anything
            is applied; ``"warn"`` applies every other setting, warns with a
            :class:`~vramkit.errors.VramkitWarning` for each one left out and lists them in
            :attr:`settings` (``get_device_manager(config, force_reinit=True)`` does this: a
            re-initialization keeps what it can).

    Raises:
        ConfigError: ``config`` or ``detector`` of the wrong type, an unknown ``on_too_late``.
        TooLateError: a setting can no longer take effect (with ``on_too_late="raise"``).
        DeviceError: the detector reports GPUs that PyTorch cannot configure.
    """

    def __init__(self, config: DeviceConfiguration | None = None, detector: Any = None, *,
                 apply: bool = True, on_too_late: str = "raise") -> None:
        config = DeviceConfiguration() if config is None else config
        if not isinstance(config, DeviceConfiguration):
            raise ConfigError(f"config must be a DeviceConfiguration, got {type(config).__name__}",
                              "Build one with DeviceConfiguration(...) or "
                              "DeviceConfiguration.from_dict(...).")
        self._config = config
        self._apply = bool(apply)
        self._on_too_late = check_choice("on_too_late", on_too_late, ("raise", "warn"))
        self._applied: dict[str, Any] = {}
        self._not_applied: dict[str, str] = {}
        self._jax_manager: JAXDeviceManager | None = None
        self._precision: Any = None
        if self._apply:
            # Before detection: CUDA_VISIBLE_DEVICES and friends decide what is detected.
            self._apply_environment()
        if detector is None:
            from vramkit.devices.info import SystemDetector

            detector = SystemDetector()
        if not callable(getattr(detector, "detect_capabilities", None)):
            raise ConfigError(f"detector {detector!r} has no detect_capabilities() method",
                              "Pass an object with detect_capabilities() -> DeviceCapabilities.")
        self._detector = detector
        capabilities = detector.detect_capabilities()
        if not isinstance(capabilities, DeviceCapabilities):
            raise DeviceError(f"detector returned {type(capabilities).__name__}, "
                              "not DeviceCapabilities")
        self._capabilities = capabilities
        list_devices = getattr(detector, "list_devices", None)
        self._devices: tuple[DeviceInfo, ...] = (
            tuple(list_devices()) if callable(list_devices) else ())
        if self._apply:
            self._apply_configuration(environment_applied=True)

    # -- what there is ------------------------------------------------------------------------

    @property
    def config(self) -> DeviceConfiguration:
        """The configuration this manager applies."""
        return self._config

    @property
    def capabilities(self) -> DeviceCapabilities:
        """Capabilities reported by the detector."""
        return self._capabilities

    @property
    def devices(self) -> tuple[DeviceInfo, ...]:
        """The detector's device records (empty when it has no ``list_devices()``)."""
        return self._devices

    @property
    def has_gpu(self) -> bool:
        """Whether at least one GPU is available."""
        return (self._capabilities.device_type is DeviceType.GPU
                and self._capabilities.device_count > 0)

    @property
    def device_count(self) -> int:
        """Number of compute devices of the detected type."""
        return self._capabilities.device_count

    @property
    def gpu_count(self) -> int:
        """Number of GPUs (0 without one)."""
        return self._capabilities.device_count if self.has_gpu else 0

    @property
    def gpu_ids(self) -> tuple[int, ...]:
        """CUDA ordinals of the managed GPUs (from the device records, else 0..gpu_count-1)."""
        if not self.has_gpu:
            return ()
        if self._devices:
            return tuple(d.device_id for d in self._devices)
        return tuple(range(self.gpu_count))

    @property
    def settings(self) -> dict[str, dict[str, Any]]:
        """What applying the configuration did: ``{"applied": {setting: value},
        "not_applied": {setting: reason}}``.

        ``applied`` holds the environment variables written (JAX's memory variables among them)
        and ``torch_memory_fraction`` when PyTorch's GPUs were capped; ``not_applied`` the
        settings that could no longer take effect (only with ``on_too_late="warn"``). Both are
        empty before the configuration is applied.
        """
        return {"applied": dict(self._applied), "not_applied": dict(self._not_applied)}

    @property
    def precision(self) -> Any:
        """Mixed-precision choice made by :func:`configure_for_generative_models`, else None."""
        return self._precision

    # -- applying -----------------------------------------------------------------------------

    def apply_configuration(self) -> None:
        """Apply the memory strategy and JAX flags (done on creation unless ``apply=False``).

        Raises:
            TooLateError: JAX already started with other memory settings, or an environment
                variable can no longer take effect.
            DeviceError: a reported GPU is not one PyTorch sees, or PyTorch cannot set the
                memory fraction on it.
        """
        self._applied, self._not_applied = {}, {}
        self._apply_configuration(environment_applied=False)

    def _apply_configuration(self, *, environment_applied: bool) -> None:
        # __init__ writes the environment before detection (it decides what is detected) and
        # must not write (or warn about) it a second time here.
        if not environment_applied:
            self._apply_environment()
        fraction = self._config.effective_fraction
        self._check_gpus_exist_in_pytorch()
        if jax_installed():
            conflicts = jax_memory_conflicts(fraction, self._config.preallocate)
            if conflicts:
                self._too_late(conflicts)
            else:
                self._applied.update(apply_jax_memory_settings(fraction,
                                                               self._config.preallocate))
        apply_jax_flags(self._config.enable_x64, self._config.enable_jit)
        self._apply_torch_memory_fraction(fraction)
        self._apply = True

    def _apply_environment(self) -> None:
        variables = self._config.environment_variables
        conflicts = _environment_conflicts(variables)
        if conflicts:
            self._too_late(conflicts)
        refused = {err.setting for err in conflicts}
        kept = {name: value for name, value in variables.items() if name not in refused}
        _apply_environment_variables(kept)
        self._applied.update(kept)

    def _too_late(self, conflicts: list[TooLateError]) -> None:
        """Raise the first conflict, or (``on_too_late="warn"``) warn and record each one."""
        if self._on_too_late == "raise":
            raise conflicts[0]
        for err in conflicts:
            self._not_applied[err.setting] = err.reason
            warnings.warn(f"{err.message}; the other settings were applied. {err.hint}",
                          VramkitWarning, stacklevel=4)

    def _check_gpus_exist_in_pytorch(self) -> None:
        """Every GPU the detector reports must be one of PyTorch's ordinals.

        Checked before anything is capped: a custom detector that reports more GPUs than exist
        would otherwise fail inside PyTorch with an allocator message that names no cause.
        """
        if not self.has_gpu:
            return
        import torch

        try:
            seen = int(torch.cuda.device_count())
        except (RuntimeError, AssertionError) as err:  # a broken CUDA install: none usable
            logger.debug("torch.cuda.device_count() failed: %s", err)
            seen = 0
        missing = [device_id for device_id in self.gpu_ids if not 0 <= device_id < seen]
        if missing:
            listed = ", ".join(str(device_id) for device_id in missing)
            raise DeviceError(
                f"the detector reports {self.gpu_count} GPUs (CUDA ordinals "
                f"{', '.join(str(i) for i in self.gpu_ids)}) and PyTorch sees {seen}: "
                + (f"GPU {listed} does not" if len(missing) == 1 else f"GPUs {listed} do not")
                + " exist for PyTorch",
                "Check the detector passed to DeviceManager and CUDA_VISIBLE_DEVICES (PyTorch "
                "numbers the GPUs it sees from 0), or pass apply=False to only inspect what the "
                "detector reports.")

    def _apply_torch_memory_fraction(self, fraction: float) -> None:
        if not self.has_gpu:
            return
        import torch

        for device_id in self.gpu_ids:
            try:
                torch.cuda.set_per_process_memory_fraction(fraction, device_id)
            except (RuntimeError, AssertionError, ValueError) as err:
                # A CPU-only PyTorch build raises AssertionError here; report it as a device error.
                raise DeviceError(
                    f"cannot cap PyTorch memory on GPU {device_id}: {err}",
                    "Install a CUDA build of PyTorch, check CUDA_VISIBLE_DEVICES, or pass "
                    "apply=False to only inspect devices.") from err
        self._applied["torch_memory_fraction"] = fraction
        logger.info("PyTorch memory fraction %.3f set on GPUs %s", fraction, self.gpu_ids)

    # -- choosing -----------------------------------------------------------------------------

    def get_default_device(self) -> torch.device:
        """The device to compute on: the first platform in ``platform_priority`` available.

        ``"cuda"`` needs an NVIDIA GPU with a CUDA (non-ROCm) PyTorch, ``"rocm"`` a ROCm
        build, ``"gpu"`` either; ``"tpu"`` is skipped (PyTorch has no TPU device without
        torch_xla); ``"cpu"`` always matches. Without a match this falls back to the CPU.

        Returns:
            ``torch.device("cuda", first managed GPU)`` or ``torch.device("cpu")``.
        """
        import torch

        rocm_build = getattr(torch.version, "hip", None) is not None
        for platform in self._config.platform_priority:
            if platform in ("cuda", "gpu", "rocm") and self.has_gpu:
                if platform == "gpu" or (platform == "rocm") == rocm_build:
                    return torch.device("cuda", self.gpu_ids[0])
            elif platform == "cpu":
                return torch.device("cpu")
        logger.info("no device for platform_priority %s; falling back to CPU",
                    self._config.platform_priority)
        return torch.device("cpu")

    def optimize_for_model_size(self, n_params: int) -> DeviceConfiguration:
        """A configuration whose strategy suits a model of ``n_params`` parameters.

        Below 1M parameters CONSERVATIVE, below 100M BALANCED, otherwise AGGRESSIVE (Artifex
        guidelines). Other fields are kept. The manager itself is unchanged; create a new
        :class:`DeviceManager` with the result to use it.

        Args:
            n_params: number of parameters (>= 0).

        Returns:
            A new :class:`DeviceConfiguration`.

        Raises:
            ConfigError: ``n_params`` is not a non-negative integer.
        """
        check_int("n_params", n_params, minimum=0,
                  hint="Pass the parameter count, e.g. sum(p.numel() for p in "
                       "model.parameters()).")
        if n_params < SMALL_MODEL_PARAMS:
            strategy = MemoryStrategy.CONSERVATIVE
        elif n_params < MEDIUM_MODEL_PARAMS:
            strategy = MemoryStrategy.BALANCED
        else:
            strategy = MemoryStrategy.AGGRESSIVE
        return self._config.with_strategy(strategy)

    @property
    def jax_manager(self) -> JAXDeviceManager:
        """The :class:`JAXDeviceManager`, created (and JAX imported) on first access.

        On first access ``enable_x64`` / ``enable_jit`` are applied through ``jax.config``
        (unless the manager was created with ``apply=False``).

        Raises:
            JaxUnavailableError: JAX is not installed.
        """
        if self._jax_manager is None:
            if not jax_installed():
                raise JaxUnavailableError("DeviceManager.jax_manager needs JAX, which is not "
                                          "installed")
            if self._apply:
                apply_jax_flags(self._config.enable_x64, self._config.enable_jit,
                                import_jax=True)
            self._jax_manager = JAXDeviceManager(self._config.platform_priority)
        return self._jax_manager

    # -- reporting ----------------------------------------------------------------------------

    def get_device_info(self) -> dict[str, Any]:
        """A summary of devices, configuration and versions (JSON-ready).

        Returns:
            A dict with keys ``backend``, ``default_device``, ``device_type``,
            ``device_count``, ``gpu_count``, ``gpu_ids``, ``memory_strategy``,
            ``memory_fraction``, ``preallocate``, ``platform_priority``, ``total_memory_mb``,
            ``compute_capability``, ``supports_mixed_precision``, ``supports_distributed``,
            ``devices`` (one dict per GPU), ``versions`` (torch, cuda, driver, jax) and
            ``settings`` (:attr:`settings`: what was applied and what could not be).
        """
        import torch

        default = self.get_default_device()
        caps = self._capabilities
        if default.type == "cuda":
            backend = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        else:
            backend = default.type
        return {
            "backend": backend,
            "default_device": str(default),
            "device_type": caps.device_type.value,
            "device_count": self.device_count,
            "gpu_count": self.gpu_count,
            "gpu_ids": list(self.gpu_ids),
            "memory_strategy": self._config.memory_strategy.value,
            "memory_fraction": self._config.effective_fraction,
            "preallocate": self._config.preallocate,
            "platform_priority": list(self._config.platform_priority),
            "total_memory_mb": caps.total_memory_mb,
            "compute_capability": caps.compute_capability,
            "supports_mixed_precision": caps.supports_mixed_precision,
            "supports_distributed": caps.supports_distributed,
            "devices": [
                {"device_id": d.device_id, "name": d.name, "uuid": d.uuid,
                 "total_memory": d.total_memory,
                 "compute_capability": "{}.{}".format(*d.compute_capability)}
                for d in self._devices
            ],
            "versions": {
                "torch": torch.__version__,
                "cuda": caps.cuda_version or torch.version.cuda,
                "driver": caps.driver_version,
                # Package metadata, so that reporting never imports (and starts) JAX.
                "jax": installed_jax_version("jax"),
            },
            "settings": self.settings,
        }

    def __repr__(self) -> str:
        return (f"DeviceManager(device_type={self._capabilities.device_type.value!r}, "
                f"gpu_count={self.gpu_count}, "
                f"memory_strategy={self._config.memory_strategy.value!r}, "
                f"memory_fraction={self._config.effective_fraction})")


def configure_for_generative_models(
        memory_strategy: MemoryStrategy | str = MemoryStrategy.BALANCED,
        enable_mixed_precision: bool = True, *, memory_fraction: float | None = None,
        detector: Any = None) -> DeviceManager:
    """A :class:`DeviceManager` set up for training/sampling generative models.

    Applies ``memory_strategy`` with preallocation off and JIT on, and, when a GPU exists and
    ``enable_mixed_precision`` is True, picks the mixed precision through
    :func:`vramkit.devices.selection.select_precision` (available as ``manager.precision``;
    None means full fp32).

    Args:
        memory_strategy: strategy or its name (default BALANCED).
        enable_mixed_precision: choose a reduced-precision dtype for the GPU (default True).
        memory_fraction: fraction for ``MemoryStrategy.CUSTOM`` (default None).
        detector: device detector (default ``SystemDetector``).

    Returns:
        A new, applied :class:`DeviceManager`.
    """
    config = DeviceConfiguration(memory_strategy=memory_strategy,
                                 memory_fraction=memory_fraction, enable_jit=True,
                                 preallocate=False)
    manager = DeviceManager(config, detector=detector)
    if _validate_bool("enable_mixed_precision", enable_mixed_precision) and manager.has_gpu:
        from vramkit.devices.selection import select_precision

        manager._precision = select_precision(_primary_device_record(manager))
        logger.info("mixed precision for generative models: %s", manager._precision)
    return manager


def _primary_device_record(manager: DeviceManager) -> Any:
    # The record of the default device when the detector listed it (no CUDA query needed),
    # else the torch.device itself.
    default = manager.get_default_device()
    for record in manager.devices:
        if default.type == "cuda" and record.device_id == default.index:
            return record
    return default
