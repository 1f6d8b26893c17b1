"""Explain CUDA errors: what kind of failure it is and what to try (BitNet's error handling).

:func:`explain_cuda_error` maps an exception to a :class:`CudaErrorExplanation`.

* **Out of memory** is recognised by exception *type* and by CUDA *error code*, never by a
  search of message text: ``torch.OutOfMemoryError`` (or a subclass), or an exception carrying the code
  ``cudaErrorMemoryAllocation`` (2) as read by :func:`cuda_error_code` -- the one place vramkit
  reads a CUDA error code. torch >= 2.8 raises ``torch.AcceleratorError`` (a ``RuntimeError``)
  for CUDA runtime failures and sets its ``error_code`` attribute to the ``cudaError_t`` value;
  that is how an out-of-memory outside the caching allocator shows (``cudaHostAlloc`` for
  pinned memory, a PyTorch extension's own ``cudaMalloc`` checked with ``C10_CUDA_CHECK``).
  Before torch 2.8 such failures are plain ``RuntimeError``s with only a message; for those
  torch versions only, the code is read from the exact text ``C10_CUDA_CHECK`` formats
  (:data:`C10_CUDA_CHECK_OOM_LINE`, compared with the whole first line: never a substring).
* The other kinds (invalid launch configuration, illegal memory access, launch failures,
  context/driver failures) are read from the error code when there is one, and otherwise from
  the CUDA error name or description in the message of a ``RuntimeError``, a cuda-core
  ``CUDAError`` or a vramkit ``KernelError`` (cuda-core and older torch give no code).
"""

from __future__ import annotations

import enum
import logging
import re
import sys
from dataclasses import dataclass

__all__ = [
    "C10_CUDA_CHECK_OOM_LINE",
    "CUDA_ERROR_MEMORY_ALLOCATION",
    "CudaErrorExplanation",
    "CudaErrorKind",
    "cuda_error_code",
    "explain_cuda_error",
    "is_cuda_out_of_memory",
]

logger = logging.getLogger(__name__)

#: ``cudaErrorMemoryAllocation`` (CUDA runtime ``driver_types.h``; HIP's ``hipErrorOutOfMemory``
#: has the same value): the one CUDA error code that means out of memory.
CUDA_ERROR_MEMORY_ALLOCATION = 2

#: The first line of the message ``C10_CUDA_CHECK`` raises for ``cudaErrorMemoryAllocation``:
#: ``c10_cuda_check_implementation`` (c10/cuda/CUDAException.cpp) writes ``"CUDA error: "``,
#: then ``cudaGetErrorString(cudaErrorMemoryAllocation)`` ("out of memory"), then the suffix of
#: ``get_cuda_check_suffix`` (c10/cuda/CUDAMiscFunctions.cpp), which begins with a newline
#: ("CUDA kernel errors might be asynchronously reported ...", empty with
#: ``CUDA_LAUNCH_BLOCKING=1``), then a newline and the device-side assertion note.
C10_CUDA_CHECK_OOM_LINE = "CUDA error: out of memory"

# The first torch release whose CUDA runtime errors carry error_code (torch.AcceleratorError).
_FIRST_TORCH_WITH_ERROR_CODE = (2, 8)


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
        ("Reduce the batch size or resolution (vramkit.observe.recovery can search for one).",
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

# CUDA runtime error codes (cudaError_t, driver_types.h of CUDA 12; HIP keeps these numbers) per
# kind. Out-of-memory (2) is handled before this table, with the exception types.
_CODES: dict[int, CudaErrorKind] = {
    9: CudaErrorKind.INVALID_CONFIGURATION,    # cudaErrorInvalidConfiguration
    701: CudaErrorKind.INVALID_CONFIGURATION,  # cudaErrorLaunchOutOfResources
    700: CudaErrorKind.ILLEGAL_ADDRESS,        # cudaErrorIllegalAddress
    716: CudaErrorKind.ILLEGAL_ADDRESS,        # cudaErrorMisalignedAddress
    717: CudaErrorKind.ILLEGAL_ADDRESS,        # cudaErrorInvalidAddressSpace
    702: CudaErrorKind.LAUNCH_FAILURE,         # cudaErrorLaunchTimeout
    710: CudaErrorKind.LAUNCH_FAILURE,         # cudaErrorAssert (device-side assert)
    714: CudaErrorKind.LAUNCH_FAILURE,         # cudaErrorHardwareStackError
    715: CudaErrorKind.LAUNCH_FAILURE,         # cudaErrorIllegalInstruction
    718: CudaErrorKind.LAUNCH_FAILURE,         # cudaErrorInvalidPc
    719: CudaErrorKind.LAUNCH_FAILURE,         # cudaErrorLaunchFailure
    3: CudaErrorKind.CONTEXT,                  # cudaErrorInitializationError
    35: CudaErrorKind.CONTEXT,                 # cudaErrorInsufficientDriver
    46: CudaErrorKind.CONTEXT,                 # cudaErrorDevicesUnavailable
    100: CudaErrorKind.CONTEXT,                # cudaErrorNoDevice
    201: CudaErrorKind.CONTEXT,                # cudaErrorDeviceUninitialized (invalid context)
    709: CudaErrorKind.CONTEXT,                # cudaErrorContextIsDestroyed
    803: CudaErrorKind.CONTEXT,                # cudaErrorSystemDriverMismatch
    804: CudaErrorKind.CONTEXT,                # cudaErrorCompatNotSupportedOnDevice
}

# CUDA driver/runtime error names and descriptions (cudaGetErrorString / cuGetErrorName) per
# kind, for errors that carry no code. Out-of-memory is deliberately absent: its text is never
# searched (only torch < 2.8's exact C10_CUDA_CHECK line stands for its code, see above).
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


def cuda_error_code(error: BaseException) -> int | None:
    """The CUDA runtime error code ``error`` carries, or ``None`` when it carries none.

    The code is the ``error_code`` attribute of a ``RuntimeError`` (or a subclass):
    ``torch.AcceleratorError``, which torch >= 2.8 raises for CUDA runtime failures with
    ``error_code`` set to the ``cudaError_t`` value, and any other ``RuntimeError`` subclass that
    carries one the same way. Nothing else is read: a message that *mentions* a CUDA error is
    not a code, and an error of another family (a ``ValueError`` with an ``error_code`` field,
    say) is not a CUDA error. This is the one place vramkit reads CUDA error codes from
    exceptions.

    Args:
        error: any exception.

    With torch < 2.8, which raised CUDA runtime failures as plain ``RuntimeError``s without
    ``error_code``, a plain ``RuntimeError`` whose first line is exactly
    :data:`C10_CUDA_CHECK_OOM_LINE` carries :data:`CUDA_ERROR_MEMORY_ALLOCATION`: the message
    ``C10_CUDA_CHECK`` formats from that code is the only trace of it. No other text is read.

    Args:
        error: any exception.

    Returns:
        The code as an ``int``; ``None`` for an error without one (other CUDA errors of
        torch < 2.8, cuda-core's ``CUDAError``).
    """
    if not isinstance(error, RuntimeError):
        return None
    try:
        code = getattr(error, "error_code", None)
    except Exception:  # a property that raises is no code
        return None
    if code is None and type(error) is RuntimeError and _torch_without_error_codes():
        first_line = str(error).split("\n", 1)[0]
        return CUDA_ERROR_MEMORY_ALLOCATION if first_line == C10_CUDA_CHECK_OOM_LINE else None
    if isinstance(code, bool) or not isinstance(code, int):
        return None
    return int(code)


def _torch_without_error_codes() -> bool:
    """Whether the imported torch predates ``error_code`` on its CUDA errors (torch < 2.8)."""
    torch = sys.modules.get("torch")
    version = getattr(torch, "__version__", None) if torch is not None else None
    match = re.match(r"(\d+)\.(\d+)", str(version)) if version is not None else None
    if match is None:  # no torch imported (then no torch error) or an unreadable version
        return False
    return (int(match.group(1)), int(match.group(2))) < _FIRST_TORCH_WITH_ERROR_CODE


def is_cuda_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` itself is a CUDA out-of-memory error, by type or by error code.

    ``True`` for ``torch.OutOfMemoryError`` (the caching allocator's, on CUDA and ROCm builds)
    and its subclasses, and for an error whose :func:`cuda_error_code` is
    :data:`CUDA_ERROR_MEMORY_ALLOCATION` (with torch < 2.8: read from the exact first line
    ``C10_CUDA_CHECK`` formats, nothing looser). The cause chain is not followed
    (:func:`explain_cuda_error` follows it).

    Args:
        error: any exception.

    Returns:
        Whether it is a CUDA out-of-memory error.
    """
    torch = sys.modules.get("torch")
    out_of_memory = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if isinstance(out_of_memory, type) and isinstance(error, out_of_memory):
        return True
    return cuda_error_code(error) == CUDA_ERROR_MEMORY_ALLOCATION


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
        Out-of-memory is recognised by type (``torch.OutOfMemoryError``) or by the code
        ``cudaErrorMemoryAllocation`` (:func:`is_cuda_out_of_memory`), anywhere in the chain:
        a ``RuntimeError`` whose text only mentions memory is not classified as out-of-memory.
        Other kinds come from the error code when a link carries one, else from its message.
    """
    chain = _chain(error)
    if any(is_cuda_out_of_memory(e) for e in chain):
        return _EXPLANATIONS[CudaErrorKind.OUT_OF_MEMORY]
    for link in chain:
        code = cuda_error_code(link)
        if code in _CODES:
            logger.debug("classified %s (CUDA error %d) as %s", type(link).__name__, code,
                         _CODES[code].value)
            return _EXPLANATIONS[_CODES[code]]
        if not _is_cuda_message_carrier(link):
            continue
        text = str(link).lower()
        for kind, markers in _MARKERS:
            if any(marker in text for marker in markers):
                logger.debug("classified %s as %s", type(link).__name__, kind.value)
                return _EXPLANATIONS[kind]
    return _EXPLANATIONS[CudaErrorKind.UNKNOWN]
