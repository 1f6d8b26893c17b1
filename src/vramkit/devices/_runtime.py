"""Questions about PyTorch's CUDA state that must not change it.

One place for checks several modules need: none of them creates a CUDA context, and
:func:`cuda_initialized` does not even import torch.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)

__all__ = ["cuda_initialized", "current_cuda_ordinal", "is_cuda_available"]


def cuda_initialized() -> bool:
    """Whether PyTorch has initialized CUDA in this process (``False`` if torch isn't imported)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def is_cuda_available() -> bool:
    """Whether PyTorch can use at least one CUDA device in this process.

    Returns:
        ``torch.cuda.is_available()``; ``False`` when torch is missing or the check raises (a
        broken driver can raise instead of returning ``False``). This asks the driver for a
        device count; it creates no CUDA context.
    """
    try:
        import torch
    except ImportError:
        return False
    try:
        return bool(torch.cuda.is_available())
    except RuntimeError as err:
        logger.debug("torch.cuda.is_available() raised: %s", err)
        return False


def current_cuda_ordinal() -> int:
    """PyTorch's current CUDA device once CUDA is initialized, else 0 (without initializing)."""
    if cuda_initialized():
        import torch

        return int(torch.cuda.current_device())
    return 0
