"""What page-locking host memory costs the *other* threads of the process, and what faulting
the pages in first (``vramkit.memory._segments.populate``) changes.

The background fill of ``BlockSwapper(model_on_meta, checkpoint=...)`` pins each swapped block's
master on a helper thread while the main thread works (adds LoRA adapters, runs the first
forward). Three measurements, each on the GPU:

* ``register``: a helper thread calls ``cudaHostRegister`` on 8 fresh 512 MiB anonymous
  mappings -- through ``torch.cuda.cudart()`` and through ``ctypes`` (which releases the GIL),
  on untouched pages and on pages written first -- while the main thread either counts Python
  loop turns (is the GIL held?) or launches a small kernel in a loop (is the CUDA driver
  held?). Reported: the registration's GB/s and the main thread's rate, against the rates
  alone.
* ``pool``: the main thread copies small CPU tensors to the GPU in a loop (``randn(3072,
  16).to("cuda")``: what peft's adapter creation does) while a helper thread grows a pinned
  ``MemoryPool`` by 8 x 512 MiB, with ``populate`` (the pool as shipped) and with it replaced by
  a no-op (pages faulted in by the driver inside ``cudaHostRegister``).
* ``read``: a 6 GiB file read cold (page cache dropped) by 8 threads in 16 MiB ``preadv``
  pieces into a reused buffer, into a fresh unregistered mapping, and into a registered one;
  then the registration of the filled mapping.

Run (GPU): PYTHONPATH=src python3 benchmarks/investigations/pin_contention.py --file /tmp/pin_contention.bin --out out
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the helpers
from _common import add_common_args, write_result

MiB = 1 << 20


def _libcudart() -> Any:
    """The libcudart this process loaded (through torch), opened with ctypes."""
    with open("/proc/self/maps", encoding="utf-8") as f:
        for line in f:
            path = line.split()[-1]
            if "libcudart.so" in path:
                return ctypes.CDLL(path)
    return None


def _fresh(size: int) -> tuple[mmap.mmap, torch.Tensor]:
    m = mmap.mmap(-1, size)
    return m, torch.frombuffer(m, dtype=torch.uint8)


def _rate(loop: Callable[[Callable[[], bool]], int], seconds: float = 1.0) -> float:
    t0 = time.perf_counter()
    n = loop(lambda: time.perf_counter() - t0 > seconds)
    return n / (time.perf_counter() - t0)


def register_part(cudart: Any, lib: Any) -> dict[str, Any]:
    x = torch.ones(1 << 10, device="cuda")
    torch.cuda.synchronize()

    def spin(stop: Callable[[], bool]) -> int:
        n = 0
        while not stop():
            n += 1
        return n

    def launches(stop: Callable[[], bool]) -> int:
        n = 0
        while not stop():
            x.add_(1)
            n += 1
        torch.cuda.synchronize()
        return n

    def during(register: Callable[[int, int], None], prefault: bool,
               main: Callable[[Callable[[], bool]], int], count: int = 8,
               size: int = 512 * MiB) -> dict[str, float]:
        bufs = [_fresh(size) for _ in range(count)]
        if prefault:
            for _, b in bufs:
                b.fill_(1)
        done = threading.Event()
        took: list[float] = []

        def reg() -> None:
            t = time.perf_counter()
            for _, b in bufs:
                register(b.data_ptr(), size)
            took.append(time.perf_counter() - t)
            done.set()

        thread = threading.Thread(target=reg)
        t0 = time.perf_counter()
        thread.start()
        n = main(done.is_set)
        elapsed = time.perf_counter() - t0
        thread.join()
        for _, b in bufs:
            cudart.cudaHostUnregister(b.data_ptr())
        return {"register_GBps": round(count * size / took[0] / 1e9, 2),
                "main_rate": n / elapsed}

    def reg_torch(ptr: int, size: int) -> None:
        cudart.cudaHostRegister(ptr, size, 0)

    def reg_ctypes(ptr: int, size: int) -> None:
        code = lib.cudaHostRegister(ctypes.c_void_p(ptr), ctypes.c_size_t(size), ctypes.c_uint(0))
        if code != 0:
            raise RuntimeError(f"cudaHostRegister: {code}")

    out: dict[str, Any] = {"spin_alone": _rate(spin), "launches_alone": _rate(launches)}
    for name, reg in (("torch", reg_torch), ("ctypes", reg_ctypes)):
        if name == "ctypes" and lib is None:
            continue
        for prefault in (False, True):
            for main_name, main in (("spin", spin), ("launches", launches)):
                key = f"{name}_{'prefault' if prefault else 'fresh'}_{main_name}"
                out[key] = during(reg, prefault, main)
                print(key, out[key], flush=True)
    return out


def pool_part() -> dict[str, Any]:
    from vramkit.memory import _segments
    from vramkit.memory.pool import MemoryPool, PoolConfig

    torch.ones(1, device="cuda")

    def work(stop: Callable[[], bool]) -> int:
        n = 0
        while not stop():
            torch.randn(3072, 16).to("cuda")
            n += 1
        torch.cuda.synchronize()
        return n

    out: dict[str, Any] = {"alone": _rate(work)}
    real = _segments.populate
    try:
        for populate in (True, False):
            _segments.populate = real if populate else (lambda mapping: None)
            pool = MemoryPool.pinned(PoolConfig(initial_size=0, max_size=None,
                                                growth_factor=1.0, max_cached_buffers=0))
            done = threading.Event()
            took: list[float] = []
            blocks: list[Any] = []

            def grow(pool: MemoryPool, blocks: list[Any], took: list[float],
                     done: threading.Event) -> None:
                t = time.perf_counter()
                blocks.extend(pool.allocate(512 * MiB) for _ in range(8))
                took.append(time.perf_counter() - t)
                done.set()

            thread = threading.Thread(target=grow, args=(pool, blocks, took, done))
            t0 = time.perf_counter()
            thread.start()
            n = work(done.is_set)
            elapsed = time.perf_counter() - t0
            thread.join()
            key = "populate" if populate else "no_populate"
            out[key] = {"grow_GBps": round(4 * 2**30 / took[0] / 1e9, 2),
                        "main_rate": n / elapsed}
            print(key, out[key], flush=True)
            blocks.clear()
            del pool  # the pool's segments are unregistered and unmapped with it
    finally:
        _segments.populate = real
    return out


def read_part(path: Path, cudart: Any, lib: Any, size: int = 6 << 30) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not path.exists() or path.stat().st_size != size:
        chunk = os.urandom(64 * MiB)
        with path.open("wb") as f:
            for _ in range(size // len(chunk)):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())

    def drop() -> None:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    piece = 16 * MiB

    def read_into(buf_for: Callable[[int], torch.Tensor], label: str) -> None:
        drop()
        fd = os.open(path, os.O_RDONLY)
        t0 = time.perf_counter()

        def job(off: int) -> None:
            mv = memoryview(buf_for(off).numpy())
            got = 0
            while got < piece:
                got += os.preadv(fd, [mv[got:]], off + got)

        with ThreadPoolExecutor(8) as ex:
            list(ex.map(job, range(0, size, piece)))
        elapsed = time.perf_counter() - t0
        os.close(fd)
        out[f"read_{label}_GBps"] = round(size / elapsed / 1e9, 3)
        print(label, out[f"read_{label}_GBps"], flush=True)

    reuse = torch.empty(8 * piece, dtype=torch.uint8)
    read_into(lambda off: reuse[(off // piece) % 8 * piece:][:piece], "reused")
    mapping, big = _fresh(size)
    read_into(lambda off: big[off:off + piece], "fresh_unregistered")
    t = time.perf_counter()
    if lib is not None:
        lib.cudaHostRegister(ctypes.c_void_p(big.data_ptr()), ctypes.c_size_t(size),
                             ctypes.c_uint(0))
    else:
        cudart.cudaHostRegister(big.data_ptr(), size, 0)
    out["register_after_fill_GBps"] = round(size / (time.perf_counter() - t) / 1e9, 2)
    cudart.cudaHostUnregister(big.data_ptr())
    del big, mapping
    _mapping, big = _fresh(size)
    t = time.perf_counter()
    cudart.cudaHostRegister(big.data_ptr(), size, 0)
    out["register_fresh_GBps"] = round(size / (time.perf_counter() - t) / 1e9, 2)
    read_into(lambda off: big[off:off + piece], "registered")
    cudart.cudaHostUnregister(big.data_ptr())
    read_into(lambda off: reuse[(off // piece) % 8 * piece:][:piece], "reused2")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--file", type=Path, default=Path("/tmp/pin_contention.bin"),
                        help="scratch file for the read part (6 GiB, on the disk to measure)")
    parser.add_argument("--parts", default="register,pool,read")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("pin_contention: needs a CUDA GPU (page-locking is a CUDA driver call); skipped")
        return
    cudart = torch.cuda.cudart()
    lib = _libcudart()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    result: dict[str, Any] = {"libcudart": getattr(lib, "_name", None)}
    if "register" in parts:
        result["register"] = register_part(cudart, lib)
    if "pool" in parts:
        result["pool"] = pool_part()
    if "read" in parts:
        try:
            result["read"] = read_part(args.file, cudart, lib)
        finally:
            args.file.unlink(missing_ok=True)
    rows = []
    for key, value in result.get("register", {}).items():
        if isinstance(value, dict):
            alone = result["register"]["spin_alone" if key.endswith("spin") else "launches_alone"]
            rows.append({"case": f"register: {key}", "GB/s": value["register_GBps"],
                         "main thread rate / alone": f"{value['main_rate'] / alone:.3g}"})
    for key in ("populate", "no_populate"):
        value = result.get("pool", {}).get(key)
        if value:
            rows.append({"case": f"pool growth: {key}", "GB/s": value["grow_GBps"],
                         "main thread rate / alone":
                             f"{value['main_rate'] / result['pool']['alone']:.3g}"})
    for key, value in result.get("read", {}).items():
        rows.append({"case": key, "GB/s": value, "main thread rate / alone": "-"})
    write_result("pin_contention", result, rows, args.out)


if __name__ == "__main__":
    main()
