"""Explain CUDA errors: what kind of failure it is and what to try (BitNet's error handling).

:func:`explain_cuda_error` maps an exception to a :class:`CudaErrorExplanation`. Out-of-memory is
recognised by exception *type* only (``torch.OutOfMemoryError``, a subclass of it, or an error
whose cause chain contains one); the other kinds (invalid launch configuration, illegal memory
access, launch failures, context/driver failures) have no exception type of their own in PyTorch
or cuda-core, so they are recognised from the CUDA error name or description in the message of
a ``RuntimeError`` (``torch.AcceleratorError``), a cuda-core ``CUDAError`` or a vramkit
``KernelError``.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

__all__ = ["CudaErrorExplanation", "CudaErrorKind", "explain_cuda_error"]

logger = logging.getLogger(__name__)


class CudaErrorKind(str, enum.Enum):
    """The kinds of CUDA failure :func:`explain_cuda_error` tells apart."""

    OUT_OF_MEMORY = "out_of_memory"
    INVALID_CONFIGURATION = "invalid_configuration"
    ILLEGAL_ADDRESS = "illegal_address"
    LAUNCH_FAILURE = "launch_failure"
    CONTEXT = "context"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class CudaErrorExplanation:
    """A short explanation of a CUDA error.

    Args:
        kind: the :class:`CudaErrorKind`.
        summary: one sentence on what happened.
        suggestions: what to try, most likely fix first.
        recoverable: whether the process can keep using CUDA. Illegal addresses and launch
            failures are "sticky": the CUDA context is unusable until the process exits.
    """

    kind: CudaErrorKind
    summary: str
    suggestions: tuple[str, ...]
    recoverable: bool = True

    def __str__(self) -> str:
        lines = [f"{self.kind.value}: {self.summary}"]
        lines += [f"  - {suggestion}" for suggestion in self.suggestions]
        return "\n".join(lines)


_DEBUG_SYNC = ("Rerun with CUDA_LAUNCH_BLOCKING=1 so the error is reported at the launch that "
               "caused it, not at a later call.")

_EXPLANATIONS: dict[CudaErrorKind, CudaErrorExplanation] = {
    CudaErrorKind.OUT_OF_MEMORY: CudaErrorExplanation(
        CudaErrorKind.OUT_OF_MEMORY,
        "the GPU ran out of memory for an allocation.",
        ("Reduce the batch size or resolution (vramkit.memory.recovery can search for one).",
         "Enable gradient checkpointing, block swapping (BlockSwapper) or CPU offload.",
         "Store the frozen base weights quantized (int8/nf4/fp8).",
         "If much memory is reserved but unallocated, set "
         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to reduce fragmentation."),
    ),
    CudaErrorKind.INVALID_CONFIGURATION: CudaErrorExplanation(
        CudaErrorKind.INVALID_CONFIGURATION,
        "a kernel was launched with a grid, block or shared-memory size the device or kernel "
        "does not allow.",
        ("Check the launch parameters: at most 1024 threads per block (fewer for kernels that "
         "use many registers), grid y/z <= 65535.",
         "Build the configuration with LaunchConfig.for_elements or "
         "calculate_optimal_launch_params, which validate it against the device.",
         "Dynamic shared memory above 48 KiB needs the kernel to opt in (KernelManager does).",
         ),
    ),
    CudaErrorKind.ILLEGAL_ADDRESS: CudaErrorExplanation(
        CudaErrorKind.ILLEGAL_ADDRESS,
        "a kernel read or wrote memory outside any allocation (or at a misaligned address).",
        ("Check the kernel's bounds test (idx < n) and that n matches the tensors passed.",
         "Pass contiguous tensors of the dtype the kernel expects, on the kernel's device.",
         _DEBUG_SYNC,
         "Restart the process: this error leaves the CUDA context unusable."),
        recoverable=False,
    ),
    CudaErrorKind.LAUNCH_FAILURE: CudaErrorExplanation(
        CudaErrorKind.LAUNCH_FAILURE,
        "a kernel failed while running (an exception, an assertion, a timeout or an illegal "
        "instruction).",
        (_DEBUG_SYNC,
         "Run under compute-sanitizer to find the faulting access.",
         "Restart the process: this error leaves the CUDA context unusable."),
        recoverable=False,
    ),
    CudaErrorKind.CONTEXT: CudaErrorExplanation(
        CudaErrorKind.CONTEXT,
        "the CUDA driver or context could not be used (no device, a driver too old, a device "
        "busy in exclusive mode, or a destroyed context).",
        ("Check the CUDA installation and driver version (nvidia-smi) against the CUDA version "
         "PyTorch was built with.",
         "Check device permissions and CUDA_VISIBLE_DEVICES; in containers run with the NVIDIA "
         "container toolkit.",
         "Do not use CUDA in a process forked after CUDA was initialized (use the 'spawn' "
         "start method)."),
    ),
    CudaErrorKind.UNKNOWN: CudaErrorExplanation(
        CudaErrorKind.UNKNOWN,
        "an error vramkit does not recognise as a specific CUDA failure.",
        (_DEBUG_SYNC, "Read the original message and traceback for details."),
    ),
}

# CUDA driver/runtime error names and descriptions (cudaGetErrorString / cuGetErrorName) per
# kind. Out-of-memory is deliberately absent: it is recognised by exception type only.
_MARKERS: tuple[tuple[CudaErrorKind, tuple[str, ...]], ...] = (
    (CudaErrorKind.INVALID_CONFIGURATION, (
        "invalid configuration argument", "cudaerrorinvalidconfiguration",
        "too many resources requested for launch", "cuda_error_launch_out_of_resources",
        "cudaerrorlaunchoutofresources")),
    (CudaErrorKind.ILLEGAL_ADDRESS, (
        "illegal memory access", "cuda_error_illegal_address", "cudaerrorillegaladdress",
        "misaligned address", "cuda_error_misaligned_address", "cudaerrormisalignedaddress")),
    (CudaErrorKind.LAUNCH_FAILURE, (
        "unspecified launch failure", "cuda_error_launch_failed", "cudaerrorlaunchfailure",
        "the launch timed out", "cuda_error_launch_timeout", "device-side assert triggered",
        "cuda_error_assert", "illegal instruction", "cuda_error_illegal_instruction",
        "hardware stack error", "cuda_error_hardware_stack_error")),
    (CudaErrorKind.CONTEXT, (
        "invalid device context", "cuda_error_invalid_context", "context is destroyed",
        "cuda_error_context_is_destroyed", "no cuda-capable device", "cuda_error_no_device",
        "driver version is insufficient", "cuda_error_insufficient_driver",
        "initialization error", "cuda_error_not_initialized", "busy or unavailable",
        "cuda_error_device_unavailable", "cuda driver initialization failed",
        "cannot re-initialize cuda in forked subprocess", "cuda_error_primary_context_active")),
)


def _is_out_of_memory(error: BaseException) -> bool:
    try:
        import torch
    except ImportError:
        return False
    return isinstance(error, torch.OutOfMemoryError)


def _chain(error: BaseException) -> list[BaseException]:
    """The error and its causes/contexts, outermost first, without cycles."""
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not e for e in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _is_cuda_message_carrier(error: BaseException) -> bool:
    # Only errors that carry a CUDA runtime/driver message are read: RuntimeError (and its
    # subclass torch.AcceleratorError), cuda-core's CUDAError, vramkit's KernelError.
    if isinstance(error, RuntimeError):
        return True
    module = type(error).__module__ or ""
    return module.startswith("cuda.") or type(error).__name__ in {"CUDAError", "KernelError"}


def explain_cuda_error(error: BaseException) -> CudaErrorExplanation:
    """Explain a CUDA-related exception with a summary and suggestions.

    Args:
        error: the exception (it and its ``__cause__``/``__context__`` chain are examined).

    Returns:
        A :class:`CudaErrorExplanation`; ``kind`` is ``UNKNOWN`` when nothing matches.
        Out-of-memory is recognised only by type (``torch.OutOfMemoryError``): a plain
        ``RuntimeError`` whose text mentions memory is not classified as out-of-memory.
    """
    chain = _chain(error)
    if any(_is_out_of_memory(e) for e in chain):
        return _EXPLANATIONS[CudaErrorKind.OUT_OF_MEMORY]
    for link in chain:
        if not _is_cuda_message_carrier(link):
            continue
        text = str(link).lower()
        for kind, markers in _MARKERS:
            if any(marker in text for marker in markers):
                logger.debug("classified %s as %s", type(link).__name__, kind.value)
                return _EXPLANATIONS[kind]
    return _EXPLANATIONS[CudaErrorKind.UNKNOWN]
