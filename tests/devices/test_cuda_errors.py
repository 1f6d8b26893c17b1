"""explain_cuda_error on synthetic errors: OOM by type only, other kinds from CUDA messages."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vramkit.devices.cuda_errors import CudaErrorExplanation, CudaErrorKind, explain_cuda_error
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
