"""Registered pinned segments fault their pages in before ``cudaHostRegister`` (no GPU needed).

A stand-in for ``torch.cuda.cudart()`` reads the process's resident set when it is asked to
register: the segment's pages must already be there (faulted in by the kernel, or touched where
``MADV_POPULATE_WRITE`` is missing), so the driver never faults them in under its lock.
"""

from __future__ import annotations

import sys

import pytest
import torch

from vramkit.memory import _segments

MiB = 1 << 20

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads the resident set from /proc")


def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class RecordingCudart:
    """Registers successfully and records the resident set at each registration."""

    def __init__(self) -> None:
        self.rss_at_register: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.rss_at_register.append(_rss())
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        return 0


@pytest.mark.parametrize("madvise", [True, False], ids=["madvise", "touch"])
def test_pages_are_resident_before_registration(monkeypatch: pytest.MonkeyPatch,
                                                madvise: bool) -> None:
    if not madvise:
        monkeypatch.setattr(_segments, "_madvise_populate", lambda ptr, size: False)
    monkeypatch.setattr(_segments, "read_host", lambda: None)  # no pinning cap
    cudart = RecordingCudart()
    backend = _segments.RegisteredPinnedSegments(cudart, alignment=512)
    size = 64 * MiB
    before = _rss()
    storage = backend.new_storage(size)
    try:
        assert storage.numel() == size
        assert cudart.rss_at_register and cudart.rss_at_register[0] - before >= 0.9 * size
        assert int(storage[::4096].sum()) == 0 and int(storage[-1]) == 0  # still zeros
        storage[:16] = 7
        assert storage[:16].tolist() == [7] * 16
    finally:
        backend.close()


def test_populate_keeps_a_fresh_mapping_zero() -> None:
    mapping = torch.frombuffer(_segments._anonymous_mmap(3 * 4096 + 5), dtype=torch.uint8)
    _segments.populate(mapping)
    assert int(mapping.sum()) == 0
    _segments.populate(mapping[:0])  # empty: nothing to do
