"""CUDA allocator and math-mode set-up, memory read-outs, cache clearing (EriDiffusion memory_utils).

Which variable torch reads
    PyTorch's caching allocator is configured by a string like ``expandable_segments:True`` in an
    environment variable. torch < 2.8 reads only ``PYTORCH_CUDA_ALLOC_CONF``. torch 2.8 added the
    device-generic ``PYTORCH_ALLOC_CONF`` (and warns that the CUDA name is deprecated), but the
    CUDA-specific options, ``expandable_segments`` among them, were still read only from
    ``PYTORCH_CUDA_ALLOC_CONF`` (reported for 2.9.1 in pytorch/pytorch#183387; vramkit treats 2.8
    alike). The allocator-config refactor (pytorch/pytorch#165135) made ``PYTORCH_ALLOC_CONF``
    honoured for every option from torch 2.10 (confirmed on 2.11 in that report), with
    ``PYTORCH_CUDA_ALLOC_CONF`` kept as an alias. So vramkit writes
    ``PYTORCH_ALLOC_CONF`` on torch >= 2.10 and ``PYTORCH_CUDA_ALLOC_CONF`` before, merging with
    what is already there; when the other name is also set, it receives the same merged value,
    because torch versions differ in which name wins for which option.

When settings can still change
    * ``backend`` (``native`` / ``cudaMallocAsync``) is chosen when torch is *imported* (a static
      initializer in libc10_cuda); asking for another backend after ``import torch`` raises
      :class:`~vramkit.errors.TooLateError`.
    * ``expandable_segments``, ``max_split_size_mb`` and ``garbage_collection_threshold`` are read
      by the caching allocator on every allocation, and torch (since 1.13) can re-parse the settings
      at run time (``torch._C._accelerator_setAllocatorSettings`` on torch >= 2.9,
      ``torch.cuda.memory._set_allocator_settings`` before). vramkit applies them at run time once
      torch is imported, so they work even after CUDA initialized; they govern *future*
      allocations only (existing segments keep their kind, cached blocks their splits). Only a
      torch without a run-time setter, with CUDA already initialized, gets a TooLateError.
    * TF32 switches are plain run-time flags.

Nothing here imports torch at module import; reading settings never initializes CUDA.
"""

from __future__ import annotations

import gc
import importlib.metadata
import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from vramkit._validate import check_bool, check_choice, check_int, check_number
from vramkit.devices._runtime import cuda_initialized
from vramkit.devices.memory_info import MemoryInfo, read_memory_info
from vramkit.devices.resolve import resolve_device
from vramkit.errors import ConfigError, TooLateError
from vramkit.units import format_size

if TYPE_CHECKING:
    from vramkit.devices.torch_backend import DeviceLike

__all__ = [
    "ALLOC_CONF_VAR",
    "LEGACY_ALLOC_CONF_VAR",
    "CudaMemorySettings",
    "GpuMemoryInfo",
    "allocator_env_var",
    "allocator_settings",
    "clear_cuda_cache",
    "get_gpu_memory_info",
    "log_memory_usage",
    "prefer_expandable_segments",
    "setup_cuda_memory_management",
]

logger = logging.getLogger(__name__)

ALLOC_CONF_VAR = "PYTORCH_ALLOC_CONF"
LEGACY_ALLOC_CONF_VAR = "PYTORCH_CUDA_ALLOC_CONF"

# torch's smallest accepted max_split_size_mb (kLargeBuffer, 20 MiB, in c10's allocator config).
MIN_MAX_SPLIT_SIZE_MB = 20
_BACKENDS = ("native", "cudaMallocAsync")
_NATIVE_ONLY_OPTIONS = ("expandable_segments", "max_split_size_mb", "garbage_collection_threshold")
_RUNTIME_OPTIONS = frozenset(_NATIVE_ONLY_OPTIONS)


# -- torch version and variable names ------------------------------------------------------------

def _torch_version() -> tuple[int, int]:
    torch = sys.modules.get("torch")
    if torch is not None:
        text = str(torch.__version__)
    else:
        # Reading the installed version from metadata keeps torch unimported, so the variable can be
        # written before torch loads (the only way the load-time ``backend`` option can apply).
        try:
            text = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError as err:
            raise ConfigError("PyTorch is not installed", "pip install torch") from err
    return _parse_version(text)


def _parse_version(text: str) -> tuple[int, int]:
    match = re.match(r"\s*(\d+)\.(\d+)", text)
    if match is None:
        raise ConfigError(f"cannot parse the torch version {text!r}",
                          hint="torch.__version__ should start with MAJOR.MINOR (e.g. "
                               "'2.5.1+cu124'); reinstall PyTorch from pytorch.org if it does not.")
    return int(match.group(1)), int(match.group(2))


def _conf_variables(version: tuple[int, int]) -> tuple[str, ...]:
    """The allocator variables this torch reads, the one vramkit writes first."""
    if version >= (2, 10):
        return (ALLOC_CONF_VAR, LEGACY_ALLOC_CONF_VAR)
    if version >= (2, 8):
        return (LEGACY_ALLOC_CONF_VAR, ALLOC_CONF_VAR)
    return (LEGACY_ALLOC_CONF_VAR,)


def allocator_env_var(torch_version: str | None = None) -> str:
    """The environment variable vramkit writes allocator settings to for a torch version.

    Args:
        torch_version: a version string such as ``"2.11.0+cu130"``; default: the installed torch.

    Returns:
        ``"PYTORCH_ALLOC_CONF"`` for torch >= 2.10, ``"PYTORCH_CUDA_ALLOC_CONF"`` before.
    """
    version = _parse_version(torch_version) if torch_version is not None else _torch_version()
    return _conf_variables(version)[0]


# -- the allocator string ----------------------------------------------------------------------

def _parse_conf(value: str, variable: str) -> dict[str, str]:
    """Parse ``key:value,key:[a:b,c:d]`` into an ordered dict of raw strings, as torch lexes it."""
    options: dict[str, str] = {}
    items: list[str] = []
    depth, start = 0, 0
    for position, char in enumerate(value):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(value[start:position])
            start = position + 1
    items.append(value[start:])
    for item in items:
        item = item.replace(" ", "")  # torch ignores spaces
        if not item:
            continue
        key, sep, raw = item.partition(":")
        if not sep or not key or not raw:
            raise ConfigError(
                f"cannot parse {variable}={value!r}: {item!r} is not 'key:value'",
                f"Fix or unset {variable}; torch itself would fail on it.")
        options[key] = raw
    return options


def _format_conf(options: dict[str, str]) -> str:
    return ",".join(f"{key}:{value}" for key, value in options.items())


def _check_combination(options: dict[str, str], origin: str) -> None:
    if options.get("expandable_segments", "").lower() == "true" and "max_split_size_mb" in options:
        raise ConfigError(
            f"expandable_segments:True together with max_split_size_mb ({origin}): they are "
            "alternative remedies for fragmentation that PyTorch does not document as combinable, "
            "so vramkit refuses the mix",
            "Choose one: expandable_segments=True (recommended) or expandable_segments=False with "
            "max_split_size_mb.")
    if options.get("backend") == "cudaMallocAsync":
        native = [key for key in _NATIVE_ONLY_OPTIONS
                  if key in options and options[key].lower() != "false"]
        if native:
            raise ConfigError(
                f"backend:cudaMallocAsync ignores {', '.join(native)} ({origin})",
                "Drop those options, or use the native backend.")


@dataclass(frozen=True)
class CudaMemorySettings:
    """What :func:`setup_cuda_memory_management` applies; ``None`` leaves a setting as it is.

    Args:
        expandable_segments: let the caching allocator grow segments in place instead of keeping
            many fixed-size ones, which cuts fragmentation (default True).
        max_split_size_mb: do not split cached blocks larger than this many MiB (>= 20, torch's
            minimum); only with ``expandable_segments=False`` (default None).
        garbage_collection_threshold: reclaim unused cached blocks once reserved memory exceeds
            this fraction of the allowed memory, in (0, 1) (default None).
        allow_tf32: True lets float32 matmuls and cuDNN convolutions/RNNs use TF32 tensor cores,
            False forces IEEE float32 (default True).
        backend: ``"native"`` or ``"cudaMallocAsync"``; only before torch is imported (default
            None).
    """

    expandable_segments: bool | None = True
    max_split_size_mb: int | None = None
    garbage_collection_threshold: float | None = None
    allow_tf32: bool | None = True
    backend: str | None = None

    def __post_init__(self) -> None:
        for name in ("expandable_segments", "allow_tf32"):
            check_bool(name, getattr(self, name), allow_none=True)
        check_int("max_split_size_mb", self.max_split_size_mb, minimum=MIN_MAX_SPLIT_SIZE_MB,
                  allow_none=True,
                  hint=f"Give MiB as an int >= {MIN_MAX_SPLIT_SIZE_MB} (torch's minimum); blocks "
                       "under 20 MiB are never split anyway.")
        object.__setattr__(self, "garbage_collection_threshold", check_number(
            "garbage_collection_threshold", self.garbage_collection_threshold, minimum=0.0,
            maximum=1.0, low_open=True, high_open=True, allow_none=True,
            hint="Typical values are 0.6 to 0.8."))
        if self.backend is not None:
            check_choice("backend", self.backend, _BACKENDS)
        _check_combination(self.allocator_options(), "in the arguments")

    def allocator_options(self) -> dict[str, str]:
        """The allocator options this object sets, as torch spells them."""
        options: dict[str, str] = {}
        if self.backend is not None:
            options["backend"] = self.backend
        if self.expandable_segments is not None:
            options["expandable_segments"] = str(self.expandable_segments)
        if self.max_split_size_mb is not None:
            options["max_split_size_mb"] = str(self.max_split_size_mb)
        if self.garbage_collection_threshold is not None:
            options["garbage_collection_threshold"] = repr(float(self.garbage_collection_threshold))
        return options

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict of the fields."""
        return asdict(self)


# -- torch hooks (kept small so tests can replace them) -------------------------------------------

def _runtime_setter() -> Callable[[str], None] | None:
    """torch's run-time allocator-settings parser, or None when this torch has none."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        return setter  # type: ignore[no-any-return]
    if hasattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings"):
        return torch.cuda.memory._set_allocator_settings  # type: ignore[no-any-return]
    return None


def _loaded_backend() -> str | None:
    """The allocator backend torch chose at import; None for builds without a CUDA allocator."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch._C, "_cuda_getAllocatorBackend"):
        return None
    # A static choice made when libc10_cuda loaded: reading it creates no CUDA context.
    return str(torch.cuda.get_allocator_backend())


def _set_tf32(enabled: bool) -> None:
    import torch

    try:
        # The legacy setters also update the fp32_precision flags, so code reading either API
        # keeps working. Setting only the new API leaves torch 2.13's legacy getters (and
        # torch.get_float32_matmul_precision) raising "mix of the legacy and new APIs".
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled
    except (AttributeError, RuntimeError):  # a torch that removed the legacy flags
        mode = "tf32" if enabled else "ieee"
        torch.backends.cuda.matmul.fp32_precision = mode
        torch.backends.cudnn.conv.fp32_precision = mode
        torch.backends.cudnn.rnn.fp32_precision = mode


def _tf32_state() -> dict[str, Any]:
    import torch

    def read(getter: Callable[[], Any]) -> Any:
        try:
            return getter()
        except (AttributeError, RuntimeError):
            return None

    return {
        "matmul_allow_tf32": read(lambda: torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": read(lambda: torch.backends.cudnn.allow_tf32),
        "matmul_fp32_precision": read(lambda: torch.backends.cuda.matmul.fp32_precision),
        "cudnn_conv_fp32_precision": read(lambda: torch.backends.cudnn.conv.fp32_precision),
    }


# -- set-up and read-back ------------------------------------------------------------------------

def _current_options(variables: tuple[str, ...]) -> dict[str, str]:
    merged: dict[str, str] = {}
    for name in reversed(variables):  # the primary variable is read last, so it wins
        value = os.environ.get(name)
        if value:
            merged.update(_parse_conf(value, name))
    return merged


def setup_cuda_memory_management(
    expandable_segments: bool | None = True,
    max_split_size_mb: int | None = None,
    garbage_collection_threshold: float | None = None,
    allow_tf32: bool | None = True,
    backend: str | None = None,
) -> dict[str, Any]:
    """Configure PyTorch's CUDA caching allocator and TF32 math; call it at program start.

    Allocator options are merged into the variable the installed torch reads (keys you do not
    pass are kept), and applied at run time when torch is already imported (see the module
    docstring for what can change when). Unlike the seed's version it does not set
    ``CUDA_LAUNCH_BLOCKING`` (unrelated to fragmentation) or ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE``
    (the torch API below is the supported switch). Imports torch only to set TF32.

    Args:
        expandable_segments: see :class:`CudaMemorySettings` (default True; None = leave as is).
        max_split_size_mb: see :class:`CudaMemorySettings` (default None).
        garbage_collection_threshold: see :class:`CudaMemorySettings` (default None).
        allow_tf32: see :class:`CudaMemorySettings` (default True; None = leave as is).
        backend: see :class:`CudaMemorySettings` (default None).

    Returns:
        :func:`allocator_settings` after the change, plus ``"applied_at_runtime"`` (whether torch
        re-parsed the settings in this process) and ``"tf32"`` (the flags read back, or None).

    Raises:
        ConfigError: invalid values, or a bad combination (also with options already in the
            environment), e.g. expandable segments with ``max_split_size_mb``.
        TooLateError: a different ``backend`` after torch was imported, or allocator options
            after CUDA initialized on a torch that cannot re-parse them at run time.
    """
    settings = CudaMemorySettings(expandable_segments, max_split_size_mb,
                                  garbage_collection_threshold, allow_tf32, backend)
    variables = _conf_variables(_torch_version())
    current = _current_options(variables)
    requested = settings.allocator_options()
    merged = {**current, **requested}
    _check_combination(merged, f"after merging with {variables[0]}={_format_conf(current)!r}")
    changed = {key for key, value in requested.items() if current.get(key) != value}

    # Decide everything before touching the environment, so a refusal changes nothing.
    torch_loaded = "torch" in sys.modules
    if torch_loaded and "backend" in requested and requested["backend"] != _loaded_backend():
        raise TooLateError(
            "allocator backend",
            f"torch is already imported and chose the {_loaded_backend() or 'no CUDA'} allocator "
            "backend when it loaded",
            f"Set {variables[0]}=backend:{requested['backend']} before importing torch, or call "
            "setup_cuda_memory_management before the first `import torch`.")
    setter = _runtime_setter() if torch_loaded and (changed & _RUNTIME_OPTIONS) else None
    if torch_loaded and (changed & _RUNTIME_OPTIONS) and setter is None and cuda_initialized():
        raise TooLateError(
            ", ".join(sorted(changed & _RUNTIME_OPTIONS)),
            "CUDA is already initialized and this torch cannot change allocator settings at run "
            "time")

    previous = {name: os.environ.get(name) for name in variables}
    value = _format_conf(merged)
    targets = [variables[0], *(name for name in variables[1:] if previous[name] is not None)]
    for name in targets:
        if value:
            os.environ[name] = value
    applied = False
    if setter is not None:
        try:
            setter(value)
        except (RuntimeError, ValueError) as err:
            for name, old in previous.items():  # leave the environment as we found it
                if old is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = old
            raise ConfigError(f"torch rejected the allocator settings {value!r}: {err}",
                              hint="Fix or drop the option torch names in this message "
                                   "(see the arguments of setup_cuda_memory_management), "
                                   "or leave it at its default.") from err
        applied = True
    logger.info("allocator settings %s=%r (applied at run time: %s)", variables[0], value, applied)

    tf32 = None
    if settings.allow_tf32 is not None:
        _set_tf32(settings.allow_tf32)
        tf32 = _tf32_state()
    return {**allocator_settings(), "applied_at_runtime": applied, "tf32": tf32}


#: Allocator options by which someone has already chosen how segments grow: left as they are.
_SEGMENT_CHOICES = frozenset({"expandable_segments", "max_split_size_mb", "backend"})


def prefer_expandable_segments() -> str | None:
    """Let PyTorch's caching allocator grow expandable segments in this process, unless its
    segment policy was already chosen (``expandable_segments``, ``max_split_size_mb`` or the
    ``backend`` in the allocator variable: set ``expandable_segments:False`` to keep the
    default).

    A plan's headroom covers workspaces, rounding and the CUDA context, not the default
    allocator's fragmentation, which grows with the largest activation: a Wan 2.1 14B forward
    at 32,760 tokens planned to 7.1 of 8 GiB held 6.5 GiB allocated and 1.3 GiB cached in
    pieces too small for its next 640 MiB tensor. Expandable segments map such a tensor into
    one growing range instead. Applied at run time (future allocations only); numerics do not
    change.

    Returns:
        A sentence saying what was changed, or ``None`` where nothing was (already chosen, or
        a torch that cannot change the setting now).
    """
    variables = _conf_variables(_torch_version())
    if _SEGMENT_CHOICES & set(_current_options(variables)):
        return None
    try:
        setup_cuda_memory_management(expandable_segments=True, allow_tf32=None)
    except (TooLateError, ConfigError) as exc:
        logger.info("expandable segments left off: %s", exc)
        return None
    return (f"PyTorch's caching allocator now grows expandable segments ({variables[0]}="
            "expandable_segments:True): the plan's headroom does not cover the default "
            "allocator's fragmentation around large activations. Set expandable_segments:False "
            "there to keep the default.")


def allocator_settings() -> dict[str, Any]:
    """The allocator settings in effect, read without initializing CUDA (or importing torch).

    Returns:
        A dict with ``"variable"`` (the variable whose value torch uses: the first one set, in
        this torch's order), ``"value"`` (its raw string or None), ``"options"`` (the parsed
        ``key -> value`` strings), ``"variables"`` (every allocator variable this torch reads and
        its value), ``"cuda_initialized"``, ``"backend"`` (``torch.cuda.get_allocator_backend()``
        once CUDA is initialized, else None) and ``"in_effect"`` (once CUDA is initialized, the
        values torch's allocator reports in a memory snapshot: ``expandable_segments``,
        ``max_split_size`` in bytes, ``garbage_collection_threshold``; else None). Taking that
        snapshot walks all segments: use this for diagnostics, not per step.
    """
    variables = _conf_variables(_torch_version())
    values = {name: os.environ.get(name) for name in variables}
    chosen = next((name for name in variables if values[name] is not None), variables[0])
    present = {v for v in values.values() if v is not None}
    if len(present) > 1:
        logger.warning("%s disagree (%s); torch versions differ in which wins for which option: "
                       "set only %s", " and ".join(variables), values, variables[0])
    raw = values[chosen]
    result: dict[str, Any] = {
        "variable": chosen,
        "value": raw,
        "options": _parse_conf(raw, chosen) if raw else {},
        "variables": values,
        "cuda_initialized": cuda_initialized(),
        "backend": None,
        "in_effect": None,
    }
    if result["cuda_initialized"]:
        import torch

        result["backend"] = torch.cuda.get_allocator_backend()
        try:
            reported = torch.cuda.memory._snapshot()["allocator_settings"]
            result["in_effect"] = {key: reported[key] for key in
                                   ("expandable_segments", "max_split_size",
                                    "garbage_collection_threshold") if key in reported}
        except (AttributeError, KeyError, RuntimeError):  # older torch: no settings in snapshots
            result["in_effect"] = None
    return result


# -- memory read-outs ---------------------------------------------------------------------------

#: The memory record of :func:`get_gpu_memory_info` (EriDiffusion ``get_gpu_memory_info``): the one
#: :class:`~vramkit.devices.memory_info.MemoryInfo` class under its historical name.
GpuMemoryInfo = MemoryInfo


def get_gpu_memory_info(device: DeviceLike | None = None) -> GpuMemoryInfo:
    """Read the memory of a CUDA device (creating its CUDA context if needed).

    Args:
        device: the GPU (Device, torch.device, ``"cuda:1"`` or an ordinal); default: the current
            CUDA device, or a host record when no GPU is usable. A CPU device gives the host record.

    Returns:
        A :class:`GpuMemoryInfo` (:func:`~vramkit.devices.memory_info.read_memory_info` with the
        allocator figures and the device name); on a machine without a usable GPU, one with
        ``kind="host"``.

    Raises:
        DeviceError: if an explicitly requested GPU is not visible.
    """
    if device is not None:
        return read_memory_info(device, owner="get_gpu_memory_info")
    try:
        return read_memory_info(None, owner="get_gpu_memory_info")
    except RuntimeError as err:  # a GPU that is listed but cannot be used (busy, broken driver)
        logger.warning("cannot read the memory of the current CUDA device (%s); reporting host "
                       "memory", err)
        return read_memory_info("cpu")


def log_memory_usage(stage: str, device: DeviceLike | None = None,
                     level: int = logging.INFO) -> GpuMemoryInfo:
    """Log the memory of ``device`` at a named point of the program and return it.

    Args:
        stage: a label such as ``"after forward"``.
        device: as for :func:`get_gpu_memory_info` (default: the current device).
        level: the logging level (default ``logging.INFO``).

    Returns:
        The :class:`GpuMemoryInfo` that was logged.
    """
    check_int("log_memory_usage level", level, hint="Pass a logging level such as logging.INFO.")
    info = get_gpu_memory_info(device)
    logger.log(level, "[%s] %s", stage, info)
    return info


def clear_cuda_cache(device: DeviceLike | None = None) -> int:
    """Run ``gc.collect()`` and return PyTorch's cached, unused GPU blocks to the driver.

    Never initializes CUDA (or imports torch): before CUDA is initialized there is no cache.
    ``torch.cuda.empty_cache()`` releases cached blocks on every device; ``device`` only selects
    which device's release is counted.

    Args:
        device: count the bytes released on this GPU; default: all visible GPUs.

    Returns:
        Bytes of reserved memory released (reserved before minus after, never negative).
    """
    gc.collect()
    if not cuda_initialized():
        return 0
    import torch

    if device is None:
        indices = list(range(torch.cuda.device_count()))
    else:
        target = resolve_device(device, owner="clear_cuda_cache")
        if target.type != "cuda":
            return 0
        indices = [int(target.index)]
    before = sum(torch.cuda.memory_reserved(i) for i in indices)
    torch.cuda.empty_cache()
    after = sum(torch.cuda.memory_reserved(i) for i in indices)
    released = max(0, before - after)
    logger.debug("clear_cuda_cache released %s", format_size(released))
    return released
