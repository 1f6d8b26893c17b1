"""explain_cuda_error on synthetic errors: OOM by type or CUDA error code (never by text), other
kinds from the code or, without one, from CUDA messages."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vramkit.devices.cuda_errors import (
    CUDA_ERROR_MEMORY_ALLOCATION,
    CudaErrorExplanation,
    CudaErrorKind,
    cuda_error_code,
    explain_cuda_error,
    is_cuda_out_of_memory,
)
from vramkit.errors import KernelError


class CUDAError(Exception):
    """Stands in for cuda-core's ``cuda.core._utils.cuda_utils.CUDAError``."""


def test_out_of_memory_is_recognised_by_type() -> None:
    explanation = explain_cuda_error(torch.OutOfMemoryError("anything at all"))
    assert explanation.kind is CudaErrorKind.OUT_OF_MEMORY
    assert explanation.recoverable
    assert any("batch size" in s for s in explanation.suggestions)


def test_out_of_memory_subclass_and_cause_chain() -> None:
    class MyOOM(torch.OutOfMemoryError):
        pass

    assert explain_cuda_error(MyOOM("x")).kind is CudaErrorKind.OUT_OF_MEMORY
    try:
        try:
            raise torch.OutOfMemoryError("inner")
        except torch.OutOfMemoryError as inner:
            raise KernelError("wrapped") from inner
    except KernelError as outer:
        assert explain_cuda_error(outer).kind is CudaErrorKind.OUT_OF_MEMORY


def test_out_of_memory_text_alone_is_not_out_of_memory() -> None:
    error = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert explain_cuda_error(error).kind is CudaErrorKind.UNKNOWN


@pytest.mark.parametrize("error, kind", [
    (RuntimeError("CUDA error: invalid configuration argument"),
     CudaErrorKind.INVALID_CONFIGURATION),
    (torch.AcceleratorError("CUDA error: too many resources requested for launch"),
     CudaErrorKind.INVALID_CONFIGURATION),
    (CUDAError("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: too many resources"),
     CudaErrorKind.INVALID_CONFIGURATION),
    (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
     CudaErrorKind.ILLEGAL_ADDRESS),
    (CUDAError("CUDA_ERROR_ILLEGAL_ADDRESS: While executing a kernel ..."),
     CudaErrorKind.ILLEGAL_ADDRESS),
    (RuntimeError("CUDA error: misaligned address"), CudaErrorKind.ILLEGAL_ADDRESS),
    (RuntimeError("CUDA error: unspecified launch failure"), CudaErrorKind.LAUNCH_FAILURE),
    (RuntimeError("CUDA error: device-side assert triggered"), CudaErrorKind.LAUNCH_FAILURE),
    (RuntimeError("CUDA error: the launch timed out and was terminated"),
     CudaErrorKind.LAUNCH_FAILURE),
    (RuntimeError("CUDA error: invalid device context"), CudaErrorKind.CONTEXT),
    (CUDAError("CUDA_ERROR_CONTEXT_IS_DESTROYED"), CudaErrorKind.CONTEXT),
    (RuntimeError("Found no NVIDIA driver... no CUDA-capable device is detected"),
     CudaErrorKind.CONTEXT),
    (RuntimeError("Cannot re-initialize CUDA in forked subprocess."), CudaErrorKind.CONTEXT),
    (KernelError("launch failed: CUDA_ERROR_ILLEGAL_INSTRUCTION"),
     CudaErrorKind.LAUNCH_FAILURE),
    (RuntimeError("shape mismatch"), CudaErrorKind.UNKNOWN),
])
def test_non_oom_errors_are_classified_from_cuda_messages(error: BaseException,
                                                         kind: CudaErrorKind) -> None:
    explanation = explain_cuda_error(error)
    assert explanation.kind is kind
    assert explanation.summary and explanation.suggestions


def test_only_cuda_message_carriers_are_read() -> None:
    # A ValueError that quotes a CUDA message is not a CUDA failure.
    assert explain_cuda_error(ValueError("illegal memory access")).kind is CudaErrorKind.UNKNOWN


def test_sticky_errors_are_not_recoverable() -> None:
    assert not explain_cuda_error(RuntimeError("illegal memory access")).recoverable
    assert not explain_cuda_error(RuntimeError("unspecified launch failure")).recoverable
    assert explain_cuda_error(RuntimeError("invalid configuration argument")).recoverable


def test_classification_follows_the_cause_chain() -> None:
    try:
        try:
            raise RuntimeError("CUDA error: invalid configuration argument")
        except RuntimeError as inner:
            raise ValueError("wrapper") from inner
    except ValueError as outer:
        assert explain_cuda_error(outer).kind is CudaErrorKind.INVALID_CONFIGURATION


def test_cyclic_chains_terminate() -> None:
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__cause__, b.__cause__ = b, a
    assert explain_cuda_error(a).kind is CudaErrorKind.UNKNOWN


def test_explanation_is_frozen_and_printable() -> None:
    explanation = explain_cuda_error(RuntimeError("invalid configuration argument"))
    assert isinstance(explanation, CudaErrorExplanation)
    with pytest.raises(dataclasses.FrozenInstanceError):
        explanation.summary = "x"  # type: ignore[misc]
    text = str(explanation)
    assert text.startswith("invalid_configuration:")
    assert all(s in text for s in explanation.suggestions)


# -- CUDA error codes (torch.AcceleratorError, torch >= 2.8) ---------------------------------


def accelerator_error(code: int, message: str) -> torch.AcceleratorError:
    """A ``torch.AcceleratorError`` built the way torch builds one: the message as the only
    argument, then ``error_code`` set as an attribute (``_new_accelerator_error_object`` in
    ``torch/csrc/Exceptions.cpp``)."""
    error = torch.AcceleratorError(message)
    error.error_code = code  # type: ignore[attr-defined]
    return error


class CodedRuntimeError(RuntimeError):
    """Another RuntimeError subclass that carries a CUDA error code the same way."""

    def __init__(self, message: str, error_code: int) -> None:
        super().__init__(message)
        self.error_code = error_code


def test_cuda_error_code_reads_the_attribute_torch_sets() -> None:
    assert cuda_error_code(accelerator_error(2, "CUDA error: out of memory")) == 2
    assert cuda_error_code(CodedRuntimeError("boom", 700)) == 700
    # No code: torch < 2.8 raised plain RuntimeErrors; an AcceleratorError built by hand.
    assert cuda_error_code(RuntimeError("CUDA error: out of memory")) is None
    assert cuda_error_code(torch.AcceleratorError("CUDA error: out of memory")) is None
    # Not a RuntimeError, or not an int: not a CUDA error code.
    not_runtime = ValueError("x")
    not_runtime.error_code = 2  # type: ignore[attr-defined]
    assert cuda_error_code(not_runtime) is None
    assert cuda_error_code(CodedRuntimeError("x", True)) is None  # type: ignore[arg-type]
    text_code = RuntimeError("x")
    text_code.error_code = "2"  # type: ignore[attr-defined]
    assert cuda_error_code(text_code) is None


@pytest.mark.parametrize("error", [
    accelerator_error(CUDA_ERROR_MEMORY_ALLOCATION, "CUDA error: out of memory"),
    accelerator_error(2, "no words about memory at all"),
    CodedRuntimeError("whatever the message", 2),
])
def test_out_of_memory_is_recognised_by_cuda_error_code(error: BaseException) -> None:
    assert is_cuda_out_of_memory(error)
    explanation = explain_cuda_error(error)
    assert explanation.kind is CudaErrorKind.OUT_OF_MEMORY and explanation.recoverable


def test_out_of_memory_code_in_the_cause_chain() -> None:
    try:
        try:
            raise accelerator_error(2, "CUDA error: out of memory")
        except RuntimeError as inner:
            raise KernelError("wrapped") from inner
    except KernelError as outer:
        assert explain_cuda_error(outer).kind is CudaErrorKind.OUT_OF_MEMORY
        assert not is_cuda_out_of_memory(outer)  # the helper judges the error itself


@pytest.mark.parametrize("error", [
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("CUDA error: out of memory"),
    torch.AcceleratorError("CUDA error: out of memory"),  # no error_code attribute
    CodedRuntimeError("CUDA error: out of memory", 999),  # a code, and not 2
])
def test_out_of_memory_text_without_the_code_is_not_out_of_memory(error: BaseException) -> None:
    assert not is_cuda_out_of_memory(error)
    assert explain_cuda_error(error).kind is not CudaErrorKind.OUT_OF_MEMORY


@pytest.mark.parametrize(("code", "kind"), [
    (9, CudaErrorKind.INVALID_CONFIGURATION),
    (701, CudaErrorKind.INVALID_CONFIGURATION),
    (700, CudaErrorKind.ILLEGAL_ADDRESS),
    (716, CudaErrorKind.ILLEGAL_ADDRESS),
    (719, CudaErrorKind.LAUNCH_FAILURE),
    (710, CudaErrorKind.LAUNCH_FAILURE),
    (100, CudaErrorKind.CONTEXT),
    (709, CudaErrorKind.CONTEXT),
])
def test_other_kinds_are_read_from_the_code_before_the_message(code: int,
                                                               kind: CudaErrorKind) -> None:
    # The message names another kind (and out-of-memory): the code decides.
    error = accelerator_error(code, "CUDA error: out of memory / invalid configuration argument")
    assert explain_cuda_error(error).kind is kind


def test_sticky_codes_are_not_recoverable() -> None:
    assert not explain_cuda_error(accelerator_error(700, "CUDA error")).recoverable
    assert explain_cuda_error(accelerator_error(9, "CUDA error")).recoverable


# -- torch < 2.8: the code read from the text C10_CUDA_CHECK formats ---------------------------

#: What ``c10_cuda_check_implementation`` (c10/cuda/CUDAException.cpp) raised for
#: ``cudaErrorMemoryAllocation`` before torch 2.8: "CUDA error: " + cudaGetErrorString(2), then
#: the suffix of ``get_cuda_check_suffix`` (c10/cuda/CUDAMiscFunctions.cpp) and the
#: device-side-assertion line, as a plain RuntimeError without ``error_code``.
C10_CUDA_CHECK_OOM_TEXT = (
    "CUDA error: out of memory\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")


@pytest.mark.parametrize("version", ["2.5.1+cu124", "2.7.1", "2.7.0a0+git1234"])
def test_old_torch_out_of_memory_is_read_from_the_c10_cuda_check_text(
        monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(torch, "__version__", version)
    for text in (C10_CUDA_CHECK_OOM_TEXT,
                 "CUDA error: out of memory\nCompile with `TORCH_USE_CUDA_DSA` to enable "
                 "device-side assertions.\n",  # CUDA_LAUNCH_BLOCKING=1: no suffix
                 "CUDA error: out of memory"):
        error = RuntimeError(text)
        assert cuda_error_code(error) == CUDA_ERROR_MEMORY_ALLOCATION
        assert is_cuda_out_of_memory(error)
        assert explain_cuda_error(error).kind is CudaErrorKind.OUT_OF_MEMORY
    # Only that exact first line of a plain RuntimeError: no substring search.
    for error in (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                  RuntimeError("my op: CUDA error: out of memory"),
                  RuntimeError("CUDA error: out of memory (while doing x)"),
                  RuntimeError(" CUDA error: out of memory"),
                  RuntimeError("CUDA error: an illegal memory access was encountered\n"
                               "CUDA error: out of memory"),
                  CodedRuntimeError("CUDA error: out of memory", 999),
                  ValueError("CUDA error: out of memory")):
        assert not is_cuda_out_of_memory(error), error


def test_new_torch_out_of_memory_text_without_the_code_stays_unread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # torch >= 2.8 sets error_code itself; a RuntimeError with only the text is not its error.
    for version in ("2.8.0", "2.13.0+cpu", "3.0.0"):
        monkeypatch.setattr(torch, "__version__", version)
        assert cuda_error_code(RuntimeError(C10_CUDA_CHECK_OOM_TEXT)) is None
        assert not is_cuda_out_of_memory(RuntimeError(C10_CUDA_CHECK_OOM_TEXT))
