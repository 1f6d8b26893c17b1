"""The vramkit error hierarchy.

Every error carries a ``hint``: one sentence on what to try next. ``str(err)`` shows the
message followed by the hint, so a traceback alone tells the user what to do.

Out-of-memory conditions are detected by exception *type* (``torch.OutOfMemoryError`` and
friends) or by the CUDA error code torch puts on ``torch.AcceleratorError`` (see
:mod:`vramkit.observe.oom`), never by matching message strings.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CompressionError",
    "ConfigError",
    "DeviceError",
    "DeviceMismatchError",
    "InvalidBlockError",
    "InvalidDeviceError",
    "JaxUnavailableError",
    "KernelError",
    "NvmlError",
    "OffloadError",
    "PlanError",
    "PoolExhaustedError",
    "QuantizationError",
    "RecoveryError",
    "SafetensorsFormatError",
    "TooLateError",
    "VramkitError",
    "VramkitWarning",
]


class VramkitError(Exception):
    """Base class of every error raised by vramkit.

    Args:
        message: what went wrong.
        hint: what to try next (defaults to the class's ``default_hint``).
    """

    default_hint: str = "See the vramkit documentation for this feature."

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint if hint is not None else self.default_hint
        super().__init__(message)

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep errors picklable across processes (torchrun, multiprocessing).
        return (_rebuild, (type(self), self.__dict__.copy()))


def _rebuild(cls: type[VramkitError], state: dict[str, Any]) -> VramkitError:
    err = cls.__new__(cls)
    Exception.__init__(err, state.get("message", ""))
    err.__dict__.update(state)
    return err


class ConfigError(VramkitError, ValueError):
    """An invalid configuration value. Also a ``ValueError``, so generic handlers catch it."""

    default_hint = ("See the docstring of the function or config named in the message for the "
                    "accepted values.")


class DeviceError(VramkitError):
    """A device that does not exist, is not visible, or cannot do what was asked."""

    default_hint = "Run `vramkit info` to see the devices this process can see."


class DeviceMismatchError(DeviceError):
    """Tensors or modules that must share a device do not.

    Args:
        expected: the device that was required.
        got: the device that was found.
        what: optional name of the offending tensor or argument.
    """

    def __init__(self, expected: object, got: object, what: str | None = None,
                 hint: str | None = None) -> None:
        self.expected = expected
        self.got = got
        self.what = what
        subject = f"{what} is" if what else "got a tensor"
        super().__init__(
            f"device mismatch: expected {expected}, {subject} on {got}",
            hint or "Move the tensor with vramkit.devices.to_device(t, device) or tensor.to(device) first.",
        )


class InvalidDeviceError(ConfigError, DeviceError):
    """A device value that names no device vramkit can use: a bool, a negative ordinal, text
    torch does not parse, or a device type the caller does not take. Both a
    :class:`ConfigError` (the value is wrong) and a :class:`DeviceError` (it is about a device)."""

    default_hint = "Use 'cpu', 'cuda', 'cuda:N' or an integer CUDA ordinal."


class NvmlError(DeviceError):
    """NVML (the NVIDIA management library) is missing or failed."""

    default_hint = ("Install the NVIDIA driver and make libnvidia-ml.so visible to this process "
                    "(in containers: run with the NVIDIA container toolkit).")


class JaxUnavailableError(VramkitError, ImportError):
    """A JAX feature was asked for but JAX is not installed."""

    default_hint = "Install the extra: pip install 'vramkit[jax]'."


class TooLateError(VramkitError):
    """A setting that can no longer take effect, because the backend it configures already started.

    Args:
        setting: the name of the setting (an environment variable or an option).
        reason: why it is too late.
    """

    def __init__(self, setting: str, reason: str, hint: str | None = None) -> None:
        self.setting = setting
        self.reason = reason
        super().__init__(
            f"{setting} can no longer take effect: {reason}",
            hint or "Apply this setting at the start of the program, before any CUDA or JAX work "
                    "(or set it in the environment before launching Python).",
        )


class PoolExhaustedError(VramkitError, MemoryError):
    """A memory pool cannot satisfy a request without exceeding its ``max_size`` cap.

    Args:
        requested: bytes requested.
        stats: the pool's statistics at the time of failure (a ``PoolStats``), if known.
    """

    def __init__(self, message: str, requested: int, stats: object | None = None,
                 hint: str | None = None) -> None:
        self.requested = requested
        self.stats = stats
        super().__init__(
            message,
            hint or "Free blocks you no longer need, raise PoolConfig.max_size, or call "
                    "pool.defragment() if fragmentation is high.",
        )


class InvalidBlockError(VramkitError):
    """A pool block handle used after it was freed, freed twice, or given to the wrong pool."""

    default_hint = "Each block may be freed once; do not keep tensors from a freed block."


class OffloadError(VramkitError):
    """Offloading or block swapping cannot do what was asked (a missing block, a detached swapper,
    a module layout it cannot handle)."""

    default_hint = ("See the docstring of the offloading class or function named in the message "
                    "for what it supports.")


class CompressionError(VramkitError):
    """Losslessly compressed bytes cannot be decoded: a corrupted or truncated payload, a header
    of another format version, or data the coder does not take."""

    default_hint = ("The compressed copy no longer matches what was encoded; encode the original "
                    "tensor again (a swapper: detach and attach again, or set compress='off').")


class QuantizationError(VramkitError):
    """A tensor or layer cannot be quantized or dequantized as asked (an unsupported dtype, an
    already-quantized layer, a file whose quantized layout is unknown)."""

    default_hint = ("See the docstring of the quantization function named in the message; the "
                    "weight formats are int8, int4, nf4 and fp8, of floating-point tensors.")


class SafetensorsFormatError(VramkitError, ValueError):
    """A safetensors file (or a sharded checkpoint's index) is malformed.

    Args:
        path: the file at fault.
        tensor: the tensor at fault, when one is.
    """

    default_hint = ("The file is damaged or was not written as safetensors; re-download or "
                    "re-save it (safetensors.torch.save_file).")

    def __init__(self, message: str, path: object | None = None, tensor: str | None = None,
                 hint: str | None = None) -> None:
        self.path = None if path is None else str(path)
        self.tensor = tensor
        where = ""
        if self.path is not None:
            where = f"{self.path}: "
        if tensor is not None:
            where += f"tensor {tensor!r}: "
        super().__init__(where + message, hint)


class KernelError(VramkitError):
    """A runtime-compiled CUDA kernel failed to compile or launch, or kernels are unavailable here
    (no GPU, or the optional ``cuda-core`` package is missing).

    Args:
        log: the compiler log, for compile errors.
    """

    default_hint = ("See the docstring of the KernelManager method named in the message; kernels "
                    "need an NVIDIA GPU and the kernels extra (pip install 'vramkit[kernels]').")

    def __init__(self, message: str, hint: str | None = None, log: str | None = None) -> None:
        self.log = log
        super().__init__(message if not log else f"{message}\n{log}", hint)


class RecoveryError(VramkitError, MemoryError):
    """Out-of-memory recovery gave up (the micro-batch is already 1, or every attempt failed)."""

    default_hint = ("Lower the memory need another way: enable gradient checkpointing, block "
                    "swapping (BlockSwapper) or a quantized base model.")


class PlanError(VramkitError):
    """No plan fits the budget (:func:`vramkit.plan`).

    Args:
        minimum_budget: the smallest budget a plan would fit with the options given, in bytes
            (``None`` when no budget would).
    """

    default_hint = "Raise the budget, allow packed storage (allow_formats), or lower the batch."

    def __init__(self, message: str, hint: str | None = None,
                 minimum_budget: int | None = None) -> None:
        self.minimum_budget = minimum_budget
        super().__init__(message, hint)


class VramkitWarning(UserWarning):
    """Something vramkit did differs from what the user probably expected, though nothing
    failed: a swapper that swaps nothing, a setting that has no effect here. The message says
    why and what to change."""

