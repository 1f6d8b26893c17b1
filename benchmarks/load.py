"""Checkpoint loading to the GPU: vramkit (mmap and pread) vs safetensors.torch.load_file.

Writes an LLM-like bf16 safetensors file (>= 8 GB; 2 GB with --quick) unless --file names an
existing one, then measures, in the same run:

* host read bandwidth: the file read with positional reads by the same number of threads the
  loader uses, into reused host buffers (page cache, and cold);
* pinned host->device bandwidth: a 1 GiB pinned buffer copied to the GPU;
* GB/s to the GPU of ``MemoryEfficientLoader("cuda", use_mmap=True/False).load_safetensors``
  and of ``safetensors.torch.load_file(path, device="cuda")``, from the page cache and cold
  (page cache dropped through /proc/sys/vm/drop_caches when writable, else
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the file; the method is reported);
* peak host RSS above the baseline during each load (psutil, sampled every 2 ms in a thread).

Targets (vramkit): GB/s >= 90% of min(read bandwidth, pinned h2d bandwidth) for the same cache
state, and <= 1 GB of extra RSS. Prints JSON and markdown rows.

Run (GPU):  PYTHONPATH=src python benchmarks/load.py --out out            (about 2-4 minutes)
            PYTHONPATH=src python benchmarks/load.py --quick --out out    (2 GB file)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from vramkit.io.loader import MemoryEfficientLoader

TARGET_RATIO, TARGET_RSS_BYTES = 0.9, 10**9
HIDDEN, KV, FFN, VOCAB = 4096, 1024, 14336, 128256
PATTERN_BYTES = 256 << 20


def llm_tensors(target_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Llama-like model (bf16) until the total reaches ``target_bytes``."""
    tensors: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN)),
                                                  ("lm_head.weight", (VOCAB, HIDDEN)),
                                                  ("model.norm.weight", (HIDDEN,))]
    total = sum(2 * math.prod(shape) for _, shape in tensors)
    layer = 0
    while total < target_bytes:
        prefix = f"model.layers.{layer}."
        for name, shape in (("self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
                            ("self_attn.k_proj.weight", (KV, HIDDEN)),
                            ("self_attn.v_proj.weight", (KV, HIDDEN)),
                            ("self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
                            ("mlp.gate_proj.weight", (FFN, HIDDEN)),
                            ("mlp.up_proj.weight", (FFN, HIDDEN)),
                            ("mlp.down_proj.weight", (HIDDEN, FFN)),
                            ("input_layernorm.weight", (HIDDEN,)),
                            ("post_attention_layernorm.weight", (HIDDEN,))):
            tensors.append((prefix + name, shape))
            total += 2 * math.prod(shape)
        layer += 1
    return tensors


def write_checkpoint(path: Path, target_bytes: int) -> int:
    """Stream a safetensors file to disk (never the whole model in RAM); returns its size."""
    tensors = llm_tensors(target_bytes)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        nbytes = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    pattern = torch.randint(0, 256, (PATTERN_BYTES,), dtype=torch.uint8).numpy()
    with open(path, "wb") as handle:
        handle.write(len(body).to_bytes(8, "little") + body)
        left, position = offset, 0
        while left:
            take = min(left, PATTERN_BYTES - position)
            handle.write(memoryview(pattern[position:position + take]))
            left -= take
            position = (position + take) % PATTERN_BYTES
    os.sync()
    return path.stat().st_size


def drop_cache(path: Path) -> str:
    """Evict the file from the page cache; returns the method used."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("1\n")
        return "drop_caches"
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return "posix_fadvise(DONTNEED)"


def host_read_gbps(path: Path, threads: int, piece: int = 64 << 20) -> float:
    """Read the whole file with ``threads`` positional readers into reused buffers."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    ranges = [(start, min(piece, size - start)) for start in range(0, size, piece)]
    cursor = iter(ranges)
    lock = threading.Lock()

    def worker() -> None:
        buffer = memoryview(bytearray(piece))
        while True:
            with lock:
                item = next(cursor, None)
            if item is None:
                return
            start, length = item
            done = 0
            while done < length:
                done += os.preadv(fd, [buffer[done:length]], start + done)

    began = time.perf_counter()
    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    seconds = time.perf_counter() - began
    os.close(fd)
    return size / seconds / 1e9


def pinned_h2d_gbps(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        device.copy_(host, non_blocking=True)
    stop.record()
    stop.synchronize()
    return nbytes * repeats / (start.elapsed_time(stop) / 1e3) / 1e9


class RssSampler:
    """Peak resident set size above the value at start, sampled in a thread."""

    def __init__(self, period: float = 0.002) -> None:
        self.process = psutil.Process()
        self.period = period
        self.baseline = self.process.memory_info().rss
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.period)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def extra(self) -> int:
        return self.peak - self.baseline


def timed_load(load: Callable[[], dict[str, torch.Tensor]], file_bytes: int) -> dict[str, Any]:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    with RssSampler() as rss:
        began = time.perf_counter()
        tensors = load()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - began
    count = len(tensors)
    on_gpu = all(t.is_cuda for t in tensors.values())
    del tensors
    gc.collect()
    torch.cuda.empty_cache()
    return {"seconds": seconds, "gb_per_s": file_bytes / seconds / 1e9, "extra_rss_bytes": rss.extra,
            "tensors": count, "on_gpu": on_gpu}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--file", type=Path, default=None,
                        help="an existing .safetensors file to load (default: write one)")
    parser.add_argument("--size", type=float, default=8.5,
                        help="GB of the file to write (default 8.5)")
    parser.add_argument("--quick", action="store_true", help="write a 2 GB file")
    parser.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1),
                        help="reader threads, for vramkit and the read-bandwidth probe")
    parser.add_argument("--chunk", default="64MiB", help="vramkit staging buffer size")
    parser.add_argument("--keep", action="store_true", help="keep the written file")
    add_common_args(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/load.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from safetensors.torch import load_file

    args.out.mkdir(parents=True, exist_ok=True)
    written = args.file is None
    path = args.file or args.out / "load_bench.safetensors"
    if written:
        began = time.perf_counter()
        write_checkpoint(path, int((2.0 if args.quick else args.size) * 1e9))
        print(f"wrote {path} in {time.perf_counter() - began:.1f} s", file=sys.stderr)
    file_bytes = path.stat().st_size
    try:
        torch.zeros(1, device="cuda")  # CUDA context outside the timed regions
        h2d = pinned_h2d_gbps()
        loaders = {mode: MemoryEfficientLoader("cuda", use_mmap=mode == "mmap", progress=False,
                                               chunk_bytes=args.chunk, read_threads=args.threads)
                   for mode in ("mmap", "pread")}
        cases: dict[str, Callable[[], dict[str, torch.Tensor]]] = {
            "vramkit mmap": lambda: loaders["mmap"].load_safetensors(path),
            "vramkit pread": lambda: loaders["pread"].load_safetensors(path),
            "safetensors load_file": lambda: load_file(path, device="cuda"),
        }
        host_read_gbps(path, args.threads)  # warm the page cache
        for mode in ("mmap", "pread"):  # pin the staging buffers outside the timed regions
            timed_load(cases[f"vramkit {mode}"], file_bytes)
        runs: list[dict[str, Any]] = []
        read_bw = {"page cache": host_read_gbps(path, args.threads)}
        for name, load in cases.items():
            runs.append({"case": name, "cache": "page cache", **timed_load(load, file_bytes)})
        method = drop_cache(path)
        read_bw["cold"] = host_read_gbps(path, args.threads)
        for name, load in cases.items():
            drop_cache(path)
            runs.append({"case": name, "cache": "cold", **timed_load(load, file_bytes)})
    finally:
        if written and not args.keep:
            path.unlink(missing_ok=True)
    rows = []
    for run in runs:
        bound = min(read_bw[run["cache"]], h2d)
        run["bound_gb_per_s"] = bound
        run["ratio"] = run["gb_per_s"] / bound
        vramkit = run["case"].startswith("vramkit")
        run["meets_target"] = (run["ratio"] >= TARGET_RATIO
                               and run["extra_rss_bytes"] <= TARGET_RSS_BYTES) if vramkit else None
        rows.append({"case": run["case"], "cache": run["cache"], "GB/s": run["gb_per_s"],
                     "bound GB/s": bound, "ratio": run["ratio"],
                     "extra RSS GB": run["extra_rss_bytes"] / 1e9,
                     "target (>=0.9, <=1 GB)": {True: "met", False: "MISSED", None: "-"}[
                         run["meets_target"]]})
    result = {"file_bytes": file_bytes, "file": str(path), "written": written,
              "threads": args.threads, "chunk": args.chunk, "cold_method": method,
              "read_gb_per_s": read_bw, "pinned_h2d_gb_per_s": h2d, "runs": runs,
              "targets": {"ratio": TARGET_RATIO, "extra_rss_bytes": TARGET_RSS_BYTES}}
    write_result("load", result, rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
