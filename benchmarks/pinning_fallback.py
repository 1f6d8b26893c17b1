"""What the pinned pool's fallback to pageable memory costs: host<->device bandwidth, paired.

Two pinned pools of the same machinery (``MemoryPool.pinned``, the anonymous-mmap backend): one
whose segment is page-locked with ``cudaHostRegister``, and one whose registration is refused by
a stand-in for ``torch.cuda.cudart()`` (the code ``cudaErrorMemoryAllocation``, without calling
the runtime), so its segment is the same kind of mapping kept as pageable memory
(``PoolConfig.pin_fallback``, the path a full RLIMIT/cgroup/WSL cap takes). Each round copies a
``--size`` buffer host->device and device->host ``--repeats`` times from each, through
``vramkit.memory.transfer`` (the shared copy streams, non-blocking), alternating which pool goes
first; the median over rounds is reported, with:

* ``gb_per_s``: bytes moved / wall time from the first copy call to the copy stream's event;
* ``thread_ms``: how long the copy calls held the Python thread (a pinned copy is queued and
  returns at once; a pageable one is staged by the driver and returns when staged or landed);
* ``ratio``: pinned / pageable bandwidth (how many times slower the fallback is).

Every round checks the bytes that came back. ``--device cpu`` (e.g. with ``--quick``) is a smoke
run: no pinned memory without CUDA, so the comparison is skipped with a message and only a
host-memory copy between two pool blocks is timed.

Run (GPU):         PYTHONPATH=src python3 benchmarks/pinning_fallback.py --out out
Quick (GPU):       PYTHONPATH=src python3 benchmarks/pinning_fallback.py --quick --out out
CPU (smoke):       PYTHONPATH=src python3 benchmarks/pinning_fallback.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, fill_defaults, write_result
from _timing import log
from vramkit.memory import _segments
from vramkit.memory.pool import MemoryPool, PoolConfig
from vramkit.memory.transfer import transfer_streams
from vramkit.units import format_size, parse_size

_REFUSED = 2  # cudaErrorMemoryAllocation, what a capped or exhausted host returns


class _RefusingCudart:
    """``torch.cuda.cudart()`` with ``cudaHostRegister`` refused (the runtime is not called, so
    no CUDA error is left behind); everything else goes to the real bindings."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        return _REFUSED

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def _refused_pinning() -> Iterator[None]:
    real = torch.cuda.cudart()
    original = torch.cuda.cudart
    torch.cuda.cudart = lambda: _RefusingCudart(real)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.cudart = original  # type: ignore[assignment]


def _pool(nbytes: int) -> MemoryPool:
    return MemoryPool.pinned(PoolConfig(initial_size=nbytes, max_size=nbytes, growth_factor=1.0,
                                        max_cached_buffers=0))


def _timed_copies(dst: torch.Tensor, src: torch.Tensor, stream: Any,
                  repeats: int) -> tuple[float, float]:
    """``(seconds until the copies landed, seconds the copy calls held this thread)``."""
    streams = transfer_streams(dst.device if dst.is_cuda else src.device)
    done = streams.event()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        streams.copy(dst, src, stream, "bench")
    queued = time.perf_counter()
    streams.record(done, stream)
    streams.synchronize(done)
    return time.perf_counter() - start, queued - start


def measure_cuda(nbytes: int, rounds: int, repeats: int) -> dict[str, Any]:
    pinned_pool = _pool(nbytes)
    with warnings.catch_warnings(record=True) as caught, _refused_pinning():
        warnings.simplefilter("always")
        pageable_pool = _pool(nbytes)
    messages = [str(w.message) for w in caught]
    blocks = {"pinned": pinned_pool.allocate(nbytes), "pageable": pageable_pool.allocate(nbytes)}
    stats = {name: pool.stats() for name, pool in
             (("pinned", pinned_pool), ("pageable", pageable_pool))}
    assert stats["pinned"].pageable_bytes == 0, "the pinned pool could not pin: nothing to compare"
    assert stats["pageable"].pageable_bytes == nbytes
    is_pinned = {name: bool(block.tensor.is_pinned()) for name, block in blocks.items()}
    assert is_pinned == {"pinned": True, "pageable": False}, is_pinned

    streams = transfer_streams(torch.device("cuda", torch.cuda.current_device()))
    pattern = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    device = torch.empty(nbytes, dtype=torch.uint8, device=streams.device)
    samples: dict[str, dict[str, list[float]]] = {
        name: {"h2d_s": [], "h2d_thread_s": [], "d2h_s": [], "d2h_thread_s": []}
        for name in blocks}
    for round_index in range(rounds + 1):  # round 0 warms every path up and is not counted
        order = list(blocks) if round_index % 2 == 0 else list(reversed(blocks))
        for name in order:
            host = blocks[name].tensor
            host.copy_(pattern)
            h2d, h2d_thread = _timed_copies(device, host, streams.h2d, repeats)
            assert torch.equal(device[:4096].cpu(), pattern[:4096])
            device.add_(1)  # so the way back carries new bytes
            host.zero_()
            d2h, d2h_thread = _timed_copies(host, device, streams.d2h, repeats)
            assert torch.equal(host, pattern + 1), f"{name}: wrong bytes came back"
            if round_index:
                for key, value in (("h2d_s", h2d), ("h2d_thread_s", h2d_thread),
                                   ("d2h_s", d2h), ("d2h_thread_s", d2h_thread)):
                    samples[name][key].append(value)
        log(f"round {round_index}/{rounds} done")

    moved = nbytes * repeats
    result: dict[str, Any] = {"nbytes": nbytes, "rounds": rounds, "repeats": repeats,
                              "is_pinned": is_pinned, "fallback_warning": messages}
    for direction in ("h2d", "d2h"):
        gbps = {name: moved / statistics.median(s[f"{direction}_s"]) / 1e9
                for name, s in samples.items()}
        thread_ms = {name: statistics.median(s[f"{direction}_thread_s"]) * 1e3 / repeats
                     for name, s in samples.items()}
        result[direction] = {"gb_per_s": gbps, "thread_ms_per_copy": thread_ms,
                             "ratio": gbps["pinned"] / gbps["pageable"],
                             "per_round_gb_per_s": {
                                 name: [moved / t / 1e9 for t in s[f"{direction}_s"]]
                                 for name, s in samples.items()}}
    for block in blocks.values():
        block.free()
    return result


def measure_cpu(nbytes: int, repeats: int) -> dict[str, Any]:
    """The smoke path: a host pool's blocks copied into each other (no pinned memory here)."""
    pool = MemoryPool("cpu", PoolConfig(max_cached_buffers=0))
    a, b = pool.allocate(nbytes), pool.allocate(nbytes)
    streams = transfer_streams("cpu")
    a.tensor.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    start = time.perf_counter()
    for _ in range(repeats):
        streams.copy(b.tensor, a.tensor, streams.h2d, "bench")
    seconds = time.perf_counter() - start
    assert torch.equal(a.tensor, b.tensor)
    pageable = pool.stats().pageable_bytes
    a.free()
    b.free()
    return {"nbytes": nbytes, "repeats": repeats, "host_copy_gb_per_s": nbytes * repeats /
            seconds / 1e9, "pageable_bytes": pageable}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--size", default=None, help="bytes per copy (default 1GiB; quick 64MiB)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="paired rounds after a warm-up round (default 5; quick 2)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="copies per direction, pool and round (default 3; quick 2)")
    parser.add_argument("--quick", action="store_true", help="64 MiB, 2 rounds of 2 copies")
    add_common_args(parser)
    args = parser.parse_args()
    fill_defaults(args, {"size": "64MiB", "rounds": 2, "repeats": 2} if args.quick else
                  {"size": "1GiB", "rounds": 5, "repeats": 3})
    nbytes = parse_size(args.size)
    _segments._reset_pin_fallback_warning()  # the warning text goes into the result

    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        message = ("CUDA is not available: the pinned vs pageable host<->device comparison "
                   "needs a GPU and was skipped; timed a host-memory copy between two pool "
                   "blocks instead (smoke run)")
        print(message, file=sys.stderr)
        smoke = measure_cpu(nbytes, args.repeats)
        write_result("pinning_fallback", {"skipped": message, "cpu_smoke": smoke}, [{
            "test": f"host copy {format_size(nbytes)} between pool blocks (CPU smoke)",
            "pinned": "n/a (no CUDA)",
            "pageable (fallback)": f"{smoke['host_copy_gb_per_s']:.1f} GB/s (memcpy)",
            "ratio": "n/a",
            "thread held per copy": "n/a",
        }], args.out)
        return

    result = measure_cuda(nbytes, args.rounds, args.repeats)
    rows = []
    for direction, label in (("h2d", "host->device"), ("d2h", "device->host")):
        figures = result[direction]
        gbps, thread = figures["gb_per_s"], figures["thread_ms_per_copy"]
        rows.append({
            "test": f"{label} {format_size(nbytes)}, pinned pool vs its pageable fallback",
            "pinned": f"{gbps['pinned']:.1f} GB/s",
            "pageable (fallback)": f"{gbps['pageable']:.1f} GB/s",
            "ratio": f"{figures['ratio']:.1f}x slower",
            "thread held per copy": f"{thread['pinned']:.2f} ms vs {thread['pageable']:.1f} ms",
        })
    write_result("pinning_fallback", result, rows, args.out)


if __name__ == "__main__":
    main()
