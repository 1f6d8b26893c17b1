"""Loading a swapped model from its checkpoint, and a disk tier under the host budget:
``BlockSwapper(model_on_meta, checkpoint=folder)`` against today's ways, on FLUX.1-dev.

The checkpoint: a diffusers component folder (``config.json`` from FLUX.1-dev's published
transformer config, ``diffusion_pytorch_model-0000N-of-0000M.safetensors`` shards of about 5 GB
and their ``diffusion_pytorch_model.safetensors.index.json``) with random bf16 weights (matrices
N(0, 0.02), norm scales 1, biases 0), 23.8 GB. It is written once into ``--workdir`` (kept and
reused while its marker file matches) by a streaming safetensors writer: the headers come from
the meta model's shapes, then each top-level module or block is drawn on the device, copied out
and written, and freed, so the writer never holds more than one block.

The job (the planner benchmark's FLUX LoRA job, ``benchmarks/plan.py``): peft LoRA r16 (alpha 16, fp32) on ``to_q, to_k, to_v,
to_out.0``, 1024x1024 = 4096 image + 512 text tokens, batch 1, bf16 autocast, every block
checkpointed, AdamW on the adapters, MSE against a fixed random target, under an 11.5 GiB GPU
cap (``set_per_process_memory_fraction``), with ``SwapConfig(max_gpu_bytes=MAX_GPU_BYTES)``: as
many blocks swapped as that leaves (6 GiB at 11.5 GiB leaves room for the activations). cuDNN's SDPA
backend is disabled (illegal memory access on Flux shapes with torch 2.11 + H100).

Where the LoRA goes: every variant injects the adapters once the base model holds its weights
(``BlockSwapper(checkpoint=)`` also accepts peft injected on meta -- the renamed
``to_q.base_layer.weight`` loads from the file's ``to_q.weight`` and the adapters are initialized
peft's way, ``vramkit.io.adapters`` -- but diffusers' variants cannot, and the rows compare the
same adapters): in the vramkit variants after the swapper attached (peft creates them on the
device of the base weight, which is the GPU: a swapped weight's placeholder lives there), in
``attach`` likewise, in ``diffusers`` before ``enable_group_offload`` (its hooks snapshot the
parameters they move, an adapter added later has no snapshot). The adapters' values are the same in every variant: drawn
on the CPU from the seed (A ~ N(0, 1/in), B ~ 0.01 N(0, 1): B is not zero, so A gets a gradient
too), then copied to where peft put them, in fp32.

Parts (``--part``; default ``all`` = load then disk; each runs alone and writes the checkpoint
when it is missing):

* ``write``: only the checkpoint.
* ``load``: ``measure_read_bandwidth`` (``O_DIRECT`` where possible, 1, 8 and 16 reads in
  flight, up to 4 GiB of the largest shard; the best is the disk's bandwidth); then, for each of
  ``--rounds`` rounds, per variant: the checkpoint's cold read (page cache dropped, 8 threads of
  ``pread`` of 64 MiB over every shard, each range's pages dropped behind it) right before one
  child process (fresh RSS; page cache dropped before it) and another right after it, so each
  child's ratio has its own cold read and a drift of the disk during the child shows (the
  virtual disks' speed drifts between minutes). The child times from the start
  of the load to the end of the first training step (fwd + bwd + AdamW), then a second step:

  - ``vramkit``: ``FluxTransformer2DModel`` built on meta from the config, checkpointing marked,
    ``BlockSwapper(model, SwapConfig(max_gpu_bytes=...), checkpoint=folder)``, then LoRA; the
    swapped blocks are read in the background while LoRA is added and the first step runs;
  - ``vramkit-fg``: the same with ``load_in_background=False`` (everything read before the
    swapper returns);
  - ``attach`` (today's way): ``FluxTransformer2DModel.from_pretrained(folder,
    torch_dtype=bf16)`` on the CPU, checkpointing marked, ``BlockSwapper(model, config)``, then
    LoRA;
  - ``diffusers``: ``from_pretrained`` as above, LoRA, diffusers' own
    ``enable_gradient_checkpointing()`` and ``enable_group_offload(onload_device=cuda,
    offload_device=cpu, offload_type="block_level", num_blocks_per_group=1, use_stream=True)``.
    Group offloading puts the adapters back on their pinned CPU snapshots after each block, so
    their gradients (made on the GPU) are moved to them and AdamW steps them there (in place:
    the next onload copies the new values). A block's offload runs in its post-forward hook,
    which a recomputation stopped early by torch's non-reentrant checkpoint never reaches: on the
    CPU smoke model backward onloaded all 10 blocks and offloaded none, so on the GPU the
    blocks may pile up under the cap. Whatever happens is recorded (status, error, the phases
    done before it).

  Printed per child: time to first step / its cold read (target <= 1.1; the median per
  variant over the rounds is logged), peak RSS (``VmHWM``) /
  (pinned bytes + 1 GiB) (target <= 1.05), pinned / swapped bytes (target <= 1.05), and the
  phases (build/load, LoRA, forward, backward, optimizer).
* ``disk``: the same job, ``SwapConfig(max_gpu_bytes=..., host_budget=HOST_BUDGET)`` (swapped
  frozen blocks beyond the pinned budget stay in the checkpoint and are read ahead into pinned
  staging) against the same without ``host_budget`` (all in RAM, run twice: ``ram2`` is the
  control, how far two identical RAM runs' losses differ), one child each, same seed and
  inputs, page cache dropped after attaching, deterministic algorithms on (``--deterministic
  off`` for the default kernels). Per variant: the losses of every step (they must be
  identical: max abs diff printed), the median step time over ``--steps`` after
  ``--warmup``, disk bytes read per step; the disk's bandwidth (the best
  ``measure_read_bandwidth``, cold, of 1/8/16 reads in flight), the bound ``disk bytes per step
  / bandwidth`` and step / bound (target <= 1.15).

Wall clock: each part runs alone, in one command (the GPU machines allow 10 minutes); progress
lines go to stderr as they happen, each child's result to ``<workdir>/child-<variant>.json`` and
``<out>/swap_load-children.jsonl`` as soon as it ends.

Run (GPU):       PYTHONPATH=src python3 benchmarks/swap_load.py --part load --out out/load
                 PYTHONPATH=src python3 benchmarks/swap_load.py --part disk --out out/load
Run (CPU smoke): PYTHONPATH=src python3 benchmarks/swap_load.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import struct
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, environment, fill_defaults, write_result
from _timing import log
from vramkit.io.disk import drop_page_cache, measure_read_bandwidth

GIB = 1 << 30
CAP_GIB = 11.5  # the simulated card (a "12 GB" card less its context)
MAX_GPU_BYTES = "6GiB"  # resident blocks + slots at 11.5 GiB
HOST_BUDGET = "8GiB"  # --part disk: pinned bytes the swapper may hold
LORA_RANK = 16
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
IMAGE_TOKENS, TEXT_TOKENS = 4096, 512  # 1024x1024
SHARD_BYTES = 5 * 10**9  # diffusers' max_shard_size="5GB"
READ_THREADS = 8
LR = 1e-4
LOAD_VARIANTS = ("vramkit", "vramkit-fg", "attach", "diffusers")
DISK_VARIANTS = ("disk", "ram", "ram2")
BANDWIDTH_THREADS = (1, 8, 16)  # the disk's bandwidth: reads in flight
TARGETS = {"ttfs / cold read": 1.1, "peak RSS / (pinned + 1 GiB)": 1.05,
           "pinned / swapped": 1.05, "disk step / disk bound": 1.15}
MARKER = "vramkit_swap_load.json"
INDEX = "diffusion_pytorch_model.safetensors.index.json"

# --quick: a Flux of the same classes, seconds on the CPU.
TINY_FLUX = {
    "patch_size": 1, "in_channels": 16, "num_layers": 2, "num_single_layers": 8,
    "attention_head_dim": 64, "num_attention_heads": 4, "joint_attention_dim": 64,
    "pooled_projection_dim": 32, "guidance_embeds": True, "axes_dims_rope": [16, 24, 24],
}
TINY_TOKENS = (64, 16)

_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


# -- host readings ----------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss() -> int | None:
    return _status_kib("VmRSS")


def peak_rss() -> int | None:
    """``VmHWM``: the process's peak resident set."""
    return _status_kib("VmHWM")


def process_age() -> float | None:
    """Seconds since this process started (``/proc``; 10 ms resolution)."""
    try:
        stat = Path("/proc/self/stat").read_text(encoding="ascii")
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
        uptime = float(Path("/proc/uptime").read_text(encoding="ascii").split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def hardware(workdir: Path) -> dict[str, Any]:
    """RAM and the filesystem holding the checkpoint (GPU and CPU are in ``environment``)."""
    out: dict[str, Any] = {}
    try:
        for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
            key, value = line.split(":", 1)
            if key in ("MemTotal", "MemAvailable"):
                out[key.lower() + "_gib"] = round(int(value.split()[0]) * 1024 / GIB, 1)
    except OSError:
        pass
    try:
        target = str(workdir.resolve())
        best = ("", "", "")
        for line in Path("/proc/mounts").read_text(encoding="utf-8").splitlines():
            device, point, fstype = line.split()[:3]
            if (target == point or target.startswith(point.rstrip("/") + "/")) and len(
                    point) >= len(best[1]):
                best = (device, point, fstype)
        out["workdir_mount"] = {"device": best[0], "mount": best[1], "fstype": best[2]}
    except OSError:
        pass
    try:
        usage = os.statvfs(workdir)
        out["workdir_free_gib"] = round(usage.f_bavail * usage.f_frsize / GIB, 1)
    except OSError:
        pass
    return out


def torch_pinned_bytes() -> int | None:
    """Bytes PyTorch's pinned host allocator holds (``pin_memory()``, ``pin_memory=True``)."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    try:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    except (RuntimeError, AttributeError):
        return None


# -- the model --------------------------------------------------------------------------------


def model_config(tiny: bool) -> dict[str, Any]:
    from vramkit.recipes.targets import MODEL_PRESETS

    config = dict(TINY_FLUX if tiny else MODEL_PRESETS["flux-dev"].config)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}


def meta_model(config: dict[str, Any]) -> nn.Module:
    """``FluxTransformer2DModel`` on meta in bf16, frozen (as ``from_pretrained(torch_dtype=
    bf16)`` would type it)."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            t.data = t.data.to(torch.bfloat16)
    model.requires_grad_(False)
    return model


def units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The writer's units: every block of a ``ModuleList``, every other top-level child."""
    out: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            out += [(f"{name}.{i}", sub) for i, sub in enumerate(child)]
        else:
            out.append((name, child))
    return out


def flux_inputs(config: dict[str, Any], tokens: tuple[int, int], device: torch.device,
                seed: int) -> tuple[dict[str, Any], torch.Tensor]:
    """One step's inputs (noise latents and text states, positions of a square grid, t=0.5,
    guidance 3.5) and the MSE target, from a CPU generator."""
    image, text = tokens
    g = torch.Generator().manual_seed(seed)
    side = math.isqrt(image)
    ids = torch.zeros(image, 3)
    ids[:, 1] = torch.arange(image) // side
    ids[:, 2] = torch.arange(image) % side
    bf16 = torch.bfloat16
    inputs: dict[str, Any] = {
        "hidden_states": torch.randn(1, image, config["in_channels"], generator=g).to(device, bf16),
        "encoder_hidden_states": torch.randn(1, text, config["joint_attention_dim"],
                                             generator=g).to(device, bf16),
        "pooled_projections": torch.randn(1, config["pooled_projection_dim"],
                                          generator=g).to(device, bf16),
        "timestep": torch.full((1,), 0.5, dtype=bf16, device=device),
        "img_ids": ids.to(device, bf16),
        "txt_ids": torch.zeros(text, 3, dtype=bf16, device=device),
    }
    if config.get("guidance_embeds"):
        inputs["guidance"] = torch.full((1,), 3.5, dtype=bf16, device=device)
    target = torch.randn(1, image, config["in_channels"], generator=g).to(device)
    return inputs, target


def add_lora(model: nn.Module, seed: int) -> list[nn.Parameter]:
    """peft LoRA r16 on the targets; values drawn on the CPU from ``seed`` (the same in every
    variant), fp32, on the device peft chose (the base weight's)."""
    import peft

    config = peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, target_modules=list(LORA_TARGETS))
    peft.inject_adapter_in_model(config, model)
    g = torch.Generator().manual_seed(seed)
    params = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" not in name:
                continue
            if "lora_A" in name:
                value = torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5
            else:
                value = torch.randn(p.shape, generator=g) * 1e-2
            p.data = value.to(p.device)
            p.requires_grad_(True)
            params.append(p)
    return params


# -- the checkpoint -----------------------------------------------------------------------------


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["diffusion_pytorch_model.safetensors"]
    return [f"diffusion_pytorch_model-{i + 1:05d}-of-{count:05d}.safetensors"
            for i in range(count)]


def checkpoint_ready(folder: Path, expected: dict[str, Any]) -> bool:
    """Whether ``folder`` holds the checkpoint ``expected`` describes (marker and file sizes)."""
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if any(marker.get(k) != v for k, v in expected.items()):
        return False
    return all((folder / name).is_file() and (folder / name).stat().st_size == size
               for name, size in marker.get("files", {}).items())


@torch.no_grad()
def write_checkpoint(folder: Path, config: dict[str, Any], device: torch.device, seed: int,
                     shard_bytes: int) -> dict[str, Any]:
    """Write the diffusers component folder: config.json, sharded safetensors and their index.

    Streaming: each shard's header is computed from the meta model's shapes; then, unit by unit
    (top-level modules, blocks) in the state dict's order, the unit is drawn on ``device``
    (``presets.fill_random`` seeded by ``seed`` and the unit's index), its tensors are copied to
    the CPU and appended to the open shard, and the unit goes back to meta.
    """
    import diffusers

    from presets import fill_random

    expected = {"config": config, "seed": seed, "shard_bytes": shard_bytes}
    if checkpoint_ready(folder, expected):
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
        log(f"checkpoint: reusing {folder} ({marker['total_bytes'] / 1e9:.2f} GB)")
        return marker | {"reused": True}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).unlink(missing_ok=True)
    for old in folder.glob("diffusion_pytorch_model*"):
        old.unlink()
    t0 = time.perf_counter()
    model = meta_model(config)
    parts = units(model)
    entries: list[tuple[str, int, torch.dtype, tuple[int, ...], int]] = []
    for index, (prefix, module) in enumerate(parts):
        for key, t in module.state_dict(prefix=prefix + ".").items():
            entries.append((key, index, t.dtype, tuple(t.shape), t.numel() * t.element_size()))
    if [e[0] for e in entries] != list(model.state_dict()):
        raise RuntimeError("the writer's units do not cover the model's state dict in order")
    shards: list[list[int]] = [[]]
    size = 0
    for i, e in enumerate(entries):
        if shards[-1] and size + e[4] > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += e[4]
    names = shard_names(len(shards))
    where = {}
    headers = []
    for name, members in zip(names, shards, strict=True):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for i in members:
            key, _, dtype, shape, nbytes = entries[i]
            header[key] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                           "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            where[key] = name
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)
        headers.append(text)
    config_json = {"_class_name": "FluxTransformer2DModel",
                   "_diffusers_version": diffusers.__version__, **config}
    (folder / "config.json").write_text(json.dumps(config_json, indent=2), encoding="utf-8")
    shard_of = {i: s for s, members in enumerate(shards) for i in members}
    current: tuple[int, dict[str, torch.Tensor]] | None = None
    handle = None
    open_shard = -1
    written = 0
    for i, (key, index, _dtype, _shape, nbytes) in enumerate(entries):
        if shard_of[i] != open_shard:
            if handle is not None:
                handle.flush()
                os.fsync(handle.fileno())
                handle.close()
                log(f"checkpoint: {names[open_shard]} written ({written / 1e9:.1f} GB so far)")
            open_shard = shard_of[i]
            handle = open(folder / names[open_shard], "wb")
            handle.write(struct.pack("<Q", len(headers[open_shard])))
            handle.write(headers[open_shard])
        if current is None or current[0] != index:
            if current is not None:
                parts[current[0]][1].to_empty(device="meta")
            prefix, module = parts[index]
            module.to_empty(device=device)
            torch.manual_seed(seed * 100_003 + index)
            fill_random(module)
            current = (index, module.state_dict(prefix=prefix + "."))
        data = current[1][key].detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        if data.numel() != nbytes:
            raise RuntimeError(f"{key}: {data.numel()} bytes, header says {nbytes}")
        assert handle is not None
        handle.write(memoryview(data.numpy()))
        written += nbytes
    if current is not None:
        parts[current[0]][1].to_empty(device="meta")
    if handle is not None:
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
    if len(names) > 1:
        index_json = {"metadata": {"total_size": written}, "weight_map": where}
        (folder / INDEX).write_text(json.dumps(index_json, indent=2), encoding="utf-8")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    seconds = time.perf_counter() - t0
    files = {name: (folder / name).stat().st_size for name in names}
    marker = {**expected, "files": files, "total_bytes": written, "tensors": len(entries),
              "write_seconds": seconds}
    (folder / MARKER).write_text(json.dumps(marker, indent=2), encoding="utf-8")
    drop_page_cache(folder)
    log(f"checkpoint: {len(names)} shard(s), {written / 1e9:.2f} GB in {seconds:.1f} s "
        f"({written / seconds / 1e9:.2f} GB/s with drawing)")
    return marker | {"reused": False}


def shard_paths(folder: Path) -> list[Path]:
    return sorted(folder.glob("diffusion_pytorch_model*.safetensors"))


def cold_read(folder: Path, threads: int = READ_THREADS, chunk: int = 64 << 20
              ) -> dict[str, Any]:
    """Read every shard once, cold: page cache dropped first, ``threads`` threads of ``pread``
    over ``chunk``-byte ranges in file order, each range's pages dropped behind it."""
    dropped = drop_page_cache(folder)
    files = shard_paths(folder)
    fds = {p: os.open(p, os.O_RDONLY) for p in files}
    jobs = []
    for p in files:
        size = p.stat().st_size
        jobs += [(fds[p], off, min(chunk, size - off)) for off in range(0, size, chunk)]
    local = threading.local()
    dontneed = getattr(os, "POSIX_FADV_DONTNEED", None)

    def read(job: tuple[int, int, int]) -> int:
        fd, offset, nbytes = job
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(bytearray(chunk))
        done = 0
        while done < nbytes:
            got = os.preadv(fd, [buf[:nbytes - done]], offset + done)
            if got <= 0:
                break
            done += got
        if dontneed is not None:
            os.posix_fadvise(fd, offset, nbytes, dontneed)
        return done

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(read, jobs))
        seconds = time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"bytes": total, "seconds": seconds, "gb_per_s": total / seconds / 1e9,
            "threads": threads, "chunk_bytes": chunk, "files": len(files),
            "page_cache_dropped": dropped}


def disk_bandwidth(folder: Path) -> dict[str, Any]:
    """``measure_read_bandwidth`` (cold) over the largest shard (up to 4 GiB) with 1, 8 and 16
    reads in flight; ``gb_per_s`` is the best (the disk's bandwidth, the bound's divisor)."""
    largest = max(shard_paths(folder), key=lambda p: p.stat().st_size)
    runs = []
    for threads in BANDWIDTH_THREADS:
        drop_page_cache(largest)
        result = measure_read_bandwidth(largest, max_bytes=min(largest.stat().st_size, 4 * GIB),
                                        cold=True, threads=threads)
        runs.append(result.to_dict())
        log(f"disk bandwidth: {result}")
    drop_page_cache(largest)
    best = max(runs, key=lambda r: r["gb_per_s"])
    return {**best, "single_thread_gb_per_s": runs[0]["gb_per_s"], "runs": runs}


# -- the child: one variant in a fresh process ----------------------------------------------------


class Context:
    """What a child needs: device (capped), model config, inputs, limits."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tiny = args.tiny
        device = torch.device(args.device)
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            torch.backends.cuda.enable_cudnn_sdp(False)  # illegal memory access (torch 2.11)
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total),
                                                       device)
            torch.zeros(1, device=device)  # the context exists before the clock starts
        self.device = device
        self.folder = Path(args.folder)
        self.config = model_config(self.tiny)
        tokens = TINY_TOKENS if self.tiny else (IMAGE_TOKENS, TEXT_TOKENS)
        self.inputs, self.target = flux_inputs(self.config, tokens, device, args.seed + 1)
        self.max_gpu_bytes, self.host_budget = limits(self.config, args)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def limits(config: dict[str, Any], args: argparse.Namespace) -> tuple[int | str, int | str]:
    """``max_gpu_bytes`` and ``host_budget``: the constants (or the flags); with ``--quick``
    scaled to the tiny model's blocks (about one resident block, and a budget that leaves
    about half of the swapped bytes on disk)."""
    if not args.tiny:
        return args.max_gpu_bytes or MAX_GPU_BYTES, args.host_budget or HOST_BUDGET
    from vramkit.offload.blocks import find_blocks, module_bytes

    sizes = [module_bytes(m) for _, m in find_blocks(meta_model(config))]
    largest = max(sizes)
    max_gpu = args.max_gpu_bytes or 3 * largest + (1 << 20)
    budget = args.host_budget or int(3 * largest + (sum(sizes) - 3 * largest) / 2)
    return max_gpu, budget


def train_step(ctx: Context, model: nn.Module, opt: torch.optim.Optimizer,
               params: list[nn.Parameter], phases: dict[str, float],
               grads_to_params: bool = False) -> float:
    """One step: forward (bf16 autocast), MSE, backward, AdamW; each phase synchronized and
    written into ``phases`` as it ends (a failure leaves the phases done)."""
    ctx.sync()
    t0 = time.perf_counter()
    with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
        out = model(**ctx.inputs, return_dict=False)[0]
    loss = F.mse_loss(out.float(), ctx.target)
    ctx.sync()
    t1 = time.perf_counter()
    phases["forward_s"] = t1 - t0
    loss.backward()
    ctx.sync()
    t2 = time.perf_counter()
    phases["backward_s"] = t2 - t1
    if grads_to_params:  # diffusers' group offloading: adapters live on the CPU between calls
        for p in params:
            if p.grad is not None and p.grad.device != p.device:
                p.grad = p.grad.to(p.device)
    opt.step()
    opt.zero_grad(set_to_none=True)
    ctx.sync()
    t3 = time.perf_counter()
    phases["optimizer_s"] = t3 - t2
    phases["step_s"] = t3 - t0
    return float(loss.detach())


def adamw(params: list[nn.Parameter], device: torch.device) -> torch.optim.Optimizer:
    on_device = device.type == "cuda" and all(p.device.type == "cuda" for p in params)
    if on_device:
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, foreach=False)


def swap_config(ctx: Context, disk: bool) -> Any:
    from vramkit.offload.swap import SwapConfig

    return SwapConfig(max_gpu_bytes=ctx.max_gpu_bytes,
                      host_budget=ctx.host_budget if disk else None)


def swapper_stats(swapper: Any) -> dict[str, Any]:
    s = swapper.stats()
    keep = ("blocks", "swapped_blocks", "swapped_bytes", "pinned_bytes", "pageable_bytes",
            "slot_bytes", "resident_block_bytes", "disk_blocks", "disk_bytes", "staging_bytes",
            "disk_reads", "disk_read_bytes", "disk_read_seconds", "disk_hits", "disk_waits",
            "disk_wait_seconds", "checkpoint_bytes", "load_seconds", "h2d_bytes", "loads",
            "on_demand")
    return {k: getattr(s, k) for k in keep if hasattr(s, k)}


def load_child(variant: str, ctx: Context, r: dict[str, Any]) -> None:
    """Load with ``variant``, attach LoRA, run two steps; fills ``r`` as it goes (a failure
    leaves the phases done so far)."""
    from diffusers import FluxTransformer2DModel

    from vramkit.offload.checkpointing import enable_gradient_checkpointing
    from vramkit.offload.swap import BlockSwapper

    device, folder = ctx.device, ctx.folder
    r.update(rss_before_load=rss(), peak_rss_before_load=peak_rss(),
             process_age_at_load_start_s=process_age(),
             max_gpu_bytes=str(ctx.max_gpu_bytes))
    log(f"{variant}: loading {folder}")
    t0 = time.perf_counter()
    swapper = None
    if variant in ("vramkit", "vramkit-fg"):
        model = meta_model(ctx.config)
        enable_gradient_checkpointing(model)
        swapper = BlockSwapper(model, config=swap_config(ctx, disk=False), device=device,
                               checkpoint=folder, progress=False,
                               load_in_background=variant == "vramkit")
    elif variant == "attach":
        model = FluxTransformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16)
        r["from_pretrained_s"] = time.perf_counter() - t0
        r["rss_after_from_pretrained"] = rss()
        model.requires_grad_(False)
        enable_gradient_checkpointing(model)
        swapper = BlockSwapper(model, config=swap_config(ctx, disk=False), device=device)
    elif variant == "diffusers":
        model = FluxTransformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16)
        r["from_pretrained_s"] = time.perf_counter() - t0
        r["rss_after_from_pretrained"] = rss()
        model.requires_grad_(False)
    else:
        raise ValueError(variant)
    ctx.sync()
    t1 = time.perf_counter()
    r["load_s"] = t1 - t0
    r["rss_after_load"] = rss()
    params = add_lora(model, ctx.args.seed)
    if variant == "diffusers":
        model.enable_gradient_checkpointing()
        model.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1,
                                   use_stream=device.type == "cuda")
        ctx.sync()
        r["group_offload_s"] = time.perf_counter() - t1
    r["lora_params"] = sum(p.numel() for p in params)
    opt = adamw(params, device)
    t2 = time.perf_counter()
    r["lora_s"] = t2 - t1
    log(f"{variant}: loaded in {r['load_s']:.1f} s (+{r['lora_s']:.1f} s LoRA"
        + (" and group offloading" if variant == "diffusers" else "") + "), first step ...")
    if swapper is not None:
        r["stats_after_load"] = swapper_stats(swapper)
    r["losses"] = []
    r["steps"] = []
    for i in range(ctx.args.load_steps):
        phases: dict[str, float] = {}
        r["steps"].append(phases)
        loss = train_step(ctx, model, opt, params, phases, grads_to_params=variant == "diffusers")
        r["losses"].append(loss)
        if i == 0:
            r["ttfs_s"] = time.perf_counter() - t0
            r["process_age_at_first_step_s"] = process_age()
        log(f"{variant}: step {i + 1}: loss {loss:.6f}, {phases['step_s']:.2f} s "
            f"(fwd {phases['forward_s']:.2f}, bwd {phases['backward_s']:.2f}, "
            f"opt {phases['optimizer_s']:.2f})")
    if swapper is not None:
        swapper.wait_loaded()  # (the first step used every block: a no-op, for the figures)
        r["fill_s"] = swapper.stats().load_seconds  # from the start of the attach to the end
        # of the read, background part included
        fill = getattr(getattr(swapper, "_host", None), "filler", None)
        if fill is not None:  # the read threads' occupancy and each block's pin/fill times
            r["fill"] = fill.figures()
    r["peak_rss"] = peak_rss()
    r["rss_end"] = rss()
    r["torch_pinned_bytes"] = torch_pinned_bytes()
    if device.type == "cuda":
        r["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    if swapper is not None:
        s = swapper_stats(swapper)
        r["stats"] = s
        r["pinned_bytes"] = s["pinned_bytes"]
        r["swapped_bytes"] = s["swapped_bytes"]
    else:
        # Group offloading pins a copy of every tensor with pin_memory(): the torch allocator's
        # bytes (rounded up to powers of two) against the whole model's bytes.
        r["pinned_bytes"] = r["torch_pinned_bytes"]
        r["swapped_bytes"] = sum(t.numel() * t.element_size()
                                 for t in (*model.parameters(), *model.buffers()))
    if r.get("pinned_bytes") and r.get("peak_rss") and r.get("rss_before_load") is not None:
        r["rss_growth_over_pinned"] = (r["peak_rss"] - r["rss_before_load"]) / r["pinned_bytes"]


def disk_child(variant: str, ctx: Context, r: dict[str, Any]) -> None:
    """The LoRA job with (``disk``) or without (``ram``, and ``ram2``: the same again, the
    control of the loss comparison) ``host_budget``: warm-up, then timed steps; losses of every
    step, disk counters of the timed steps."""
    from vramkit.offload.checkpointing import enable_gradient_checkpointing
    from vramkit.offload.swap import BlockSwapper

    args, device = ctx.args, ctx.device
    r.update(max_gpu_bytes=str(ctx.max_gpu_bytes),
             host_budget=str(ctx.host_budget) if variant == "disk" else None)
    t0 = time.perf_counter()
    model = meta_model(ctx.config)
    enable_gradient_checkpointing(model)
    swapper = BlockSwapper(model, config=swap_config(ctx, disk=variant == "disk"), device=device,
                           checkpoint=ctx.folder, progress=False)
    params = add_lora(model, args.seed)
    opt = adamw(params, device)
    swapper.wait_loaded()  # the timed steps measure the disk tier, not the load
    ctx.sync()
    r["load_s"] = time.perf_counter() - t0
    r["stats_after_load"] = swapper_stats(swapper)
    r["page_cache_dropped_after_load"] = drop_page_cache(ctx.folder)
    s = r["stats_after_load"]
    log(f"{variant}: attached in {r['load_s']:.1f} s: {s['swapped_blocks']}/{s['blocks']} "
        f"swapped, {s['disk_blocks']} on disk ({s['disk_bytes'] / GIB:.2f} GiB), pinned "
        f"{s['pinned_bytes'] / GIB:.2f} GiB")
    r["losses"], r["step_s"] = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            swapper.reset_stats()
        phases = {}
        loss = train_step(ctx, model, opt, params, phases)
        r["losses"].append(loss)
        if i >= args.warmup:
            r["step_s"].append(phases["step_s"])
        log(f"{variant}: step {i + 1}/{args.warmup + args.steps}: loss {loss!r}, "
            f"{phases['step_s']:.2f} s" + (" (warm-up)" if i < args.warmup else ""))
    s = swapper_stats(swapper)
    r["stats"] = s
    steps = len(r["step_s"])
    r["step_s_p50"] = statistics.median(r["step_s"])
    r["disk_read_bytes_per_step"] = s["disk_read_bytes"] / steps
    r["disk_reads_per_step"] = s["disk_reads"] / steps
    r["disk_waits_per_step"] = s["disk_waits"] / steps
    r["disk_wait_s_per_step"] = s["disk_wait_seconds"] / steps
    r["h2d_bytes_per_step"] = s["h2d_bytes"] / steps
    r["pinned_bytes"], r["swapped_bytes"] = s["pinned_bytes"], s["swapped_bytes"]
    r["peak_rss"] = peak_rss()
    if device.type == "cuda":
        r["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(device)


def child_main(args: argparse.Namespace) -> None:
    part, variant = args.variant.split(":")
    r: dict[str, Any] = {"variant": variant, "part": part, "status": "ok"}
    try:
        import diffusers  # noqa: F401  (imported before the clock starts, in every variant)
        import peft  # noqa: F401

        if part == "disk" and args.deterministic == "on":
            # The two variants' losses are compared bit for bit: flash attention's backward
            # accumulates with atomics unless deterministic algorithms are asked for, and only
            # the strict mode switches it (with warn_only=True it warns and stays
            # non-deterministic: two all-in-RAM runs drifted by 2.3e-4 that way).
            torch.use_deterministic_algorithms(True)
            torch.utils.deterministic.fill_uninitialized_memory = False  # no NaN fill cost
            r["deterministic"] = True
        ctx = Context(args)
        r["device"] = str(ctx.device)
        (load_child if part == "load" else disk_child)(variant, ctx, r)
    except BaseException as exc:  # recorded: the parent reports it beside the other variants
        from vramkit.observe.oom import is_oom_error

        r["status"] = "OOM" if is_oom_error(exc) else "error"
        r["error"] = f"{type(exc).__name__}: {str(exc)[:1500]}"
        r["traceback"] = traceback.format_exc()[-6000:]
        r["peak_rss"] = r.get("peak_rss") or peak_rss()
        log(f"{variant}: {r['status']}: {r['error'][:600]}")
    Path(args.child_out).write_text(json.dumps(r, default=str, indent=1), encoding="utf-8")
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown (freeing tens of GB of pinned memory one tensor at a time):
    # everything is written.
    os._exit(0)


# -- the parent -----------------------------------------------------------------------------------


def run_child(kind: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    out = Path(args.workdir) / f"child-{kind.replace(':', '-')}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--variant", kind, "--child-out",
           str(out), "--folder", str(folder), "--device", args.device, "--workdir",
           str(args.workdir), "--cap-gib", str(args.cap_gib), "--seed", str(args.seed),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--load-steps",
           str(args.load_steps), "--deterministic", args.deterministic]
    if args.quick:
        cmd.append("--quick")
    if args.max_gpu_bytes:
        cmd += ["--max-gpu-bytes", str(args.max_gpu_bytes)]
    if args.host_budget:
        cmd += ["--host-budget", str(args.host_budget)]
    dropped = drop_page_cache(folder)
    log(f"{kind}: child process (page cache dropped: {dropped})")
    t0 = time.perf_counter()
    failure = None
    try:
        env = os.environ.copy()
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # for --deterministic on
        done = subprocess.run(cmd, env=env, timeout=args.child_timeout)
        if done.returncode != 0:
            failure = f"child exited {done.returncode}"
    except subprocess.TimeoutExpired:
        failure = f"no end within {args.child_timeout:.0f} s"
    wall = time.perf_counter() - t0
    if out.exists():
        result = json.loads(out.read_text(encoding="utf-8"))
    else:
        result = {"variant": kind.split(":")[1], "status": "crashed",
                  "error": failure or "no result file"}
    result.update(child_wall_s=wall, page_cache_dropped_before=dropped)
    with (Path(args.out) / "swap_load-children.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps(result, default=str) + "\n")
    return result


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


def _num(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def load_part(args: argparse.Namespace, folder: Path, ckpt: dict[str, Any]
              ) -> dict[str, Any]:
    bw = disk_bandwidth(folder)
    log(f"load: measure_read_bandwidth on the largest shard: best {bw['gb_per_s']:.2f} GB/s "
        f"({bw['method']}, {bw['threads']} threads)")
    results = []
    colds = []
    # Each child is paired with a cold read of the checkpoint right before it (the disk's
    # speed drifts by 10-20 % over minutes on the virtual disks of the GPU machines), and the
    # variants alternate over --rounds.
    for round_ in range(args.rounds):
        for variant in args.variants:
            log(f"load: cold read of the checkpoint (round {round_ + 1}, before {variant}) ...")
            cold = cold_read(folder)
            colds.append(cold)
            log(f"load: cold read {cold['bytes'] / 1e9:.2f} GB in {cold['seconds']:.2f} s "
                f"({cold['gb_per_s']:.2f} GB/s, {cold['threads']} threads)")
            r = run_child(f"load:{variant}", args, folder)
            # and one right after: a drift of the disk during the child shows as a gap
            after = cold_read(folder)
            log(f"load: cold read after {variant}: {after['seconds']:.2f} s "
                f"({after['gb_per_s']:.2f} GB/s)")
            r["round"] = round_ + 1
            r["cold_read_s"] = cold["seconds"]
            r["cold_read_after_s"] = after["seconds"]
            r["ttfs_over_cold_read"] = _ratio(r.get("ttfs_s"), cold["seconds"])
            r["ttfs_over_bracket"] = _ratio(r.get("ttfs_s"),
                                            (cold["seconds"] + after["seconds"]) / 2)
            pinned = r.get("pinned_bytes")
            r["rss_over_pinned_plus_1gib"] = _ratio(r.get("peak_rss"),
                                                    pinned + GIB if pinned is not None else None)
            r["pinned_over_swapped"] = _ratio(pinned, r.get("swapped_bytes"))
            results.append(r)
            print(json.dumps({k: r.get(k) for k in (
                "variant", "round", "status", "ttfs_s", "cold_read_s", "cold_read_after_s",
                "load_s", "ttfs_over_cold_read", "ttfs_over_bracket", "peak_rss",
                "pinned_bytes", "rss_over_pinned_plus_1gib",
                "swapped_bytes", "pinned_over_swapped", "error")}, default=str), flush=True)
    medians = {}
    for variant in args.variants:
        ratios = [r["ttfs_over_cold_read"] for r in results
                  if r["variant"] == variant and r.get("ttfs_over_cold_read") is not None]
        if ratios:
            medians[variant] = statistics.median(ratios)
            log(f"load: {variant}: ttfs / paired cold read, median of {len(ratios)}: "
                f"{medians[variant]:.3f} (target <= 1.1); each: "
                + ", ".join(f"{x:.3f}" for x in ratios))
    cold = colds[0]
    rows = []
    for r in results:
        first = (r.get("steps") or [{}])[0]
        rows.append({
            "variant": r["variant"],
            "round": r.get("round"),
            "time to 1st step s": _num(r.get("ttfs_s")),
            "cold read s (just before)": _num(r.get("cold_read_s")),
            "ttfs / cold (<= 1.1)": _num(r.get("ttfs_over_cold_read"), ".3f"),
            "cold read s (just after)": _num(r.get("cold_read_after_s")),
            "ttfs / mean(before, after)": _num(r.get("ttfs_over_bracket"), ".3f"),
            "attach returns s": _num(r.get("load_s")),
            "read done s": _num(r.get("fill_s")),
            "read done / cold before": _num(_ratio(r.get("fill_s"), r.get("cold_read_s")),
                                            ".3f"),
            "reads in flight (mean)": _num((r.get("fill") or {}).get("mean_in_flight")),
            "1st step s": _num(first.get("step_s")),
            "2nd step s": _num((r.get("steps") or [{}, {}])[1].get("step_s")
                               if len(r.get("steps") or []) > 1 else None),
            "peak RSS GiB": _gib(r.get("peak_rss")),
            "pinned GiB": _gib(r.get("pinned_bytes")),
            "RSS / (pinned + 1 GiB) (<= 1.05)": _num(r.get("rss_over_pinned_plus_1gib"), ".3f"),
            "swapped GiB": _gib(r.get("swapped_bytes")),
            "pinned / swapped (<= 1.05)": _num(r.get("pinned_over_swapped"), ".3f"),
            "GPU peak GiB": _gib(r.get("gpu_peak_bytes")),
            "status": r.get("status", "?") if r.get("status") == "ok"
            else f"{r.get('status')}: {str(r.get('error'))[:120]}",
        })
    return {"cold_read": cold, "cold_reads": colds, "read_bandwidth": bw, "checkpoint": ckpt,
            "results": results, "ttfs_over_cold_read_median": medians, "rows": rows}


def disk_part(args: argparse.Namespace, folder: Path, ckpt: dict[str, Any]) -> dict[str, Any]:
    bw = disk_bandwidth(folder)
    log(f"disk: measure_read_bandwidth on the largest shard: best {bw['gb_per_s']:.2f} GB/s "
        f"({bw['method']}, {bw['threads']} threads)")
    results = {v: run_child(f"disk:{v}", args, folder) for v in args.disk_variants}
    disk, ram = results.get("disk"), results.get("ram")

    def compare_losses(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any]:
        if not (a and b and a.get("losses") and b.get("losses")):
            return {}
        pairs = list(zip(a["losses"], b["losses"], strict=False))
        return {"steps_compared": len(pairs), "losses_identical": all(x == y for x, y in pairs),
                "max_abs_loss_diff": max(abs(x - y) for x, y in pairs),
                "losses": [a["losses"], b["losses"]]}

    # disk against RAM, and RAM against RAM: the kernels' own run-to-run spread
    compare = compare_losses(disk, ram)
    control = compare_losses(results.get("ram2"), ram)
    print(json.dumps({"loss_comparison": compare, "loss_control_ram_vs_ram": control}),
          flush=True)
    bandwidth = bw["gb_per_s"] * 1e9
    for r in results.values():
        per_step = r.get("disk_read_bytes_per_step")
        r["disk_bound_s"] = per_step / bandwidth if per_step else None
        r["step_over_disk_bound"] = _ratio(r.get("step_s_p50"), r.get("disk_bound_s"))
        r["disk_bound_single_thread_s"] = (per_step / (bw["single_thread_gb_per_s"] * 1e9)
                                           if per_step else None)
        floor = max(r["disk_bound_s"] or 0.0, (ram or {}).get("step_s_p50") or 0.0)
        r["step_over_floor"] = _ratio(r.get("step_s_p50"), floor or None)
        pinned = r.get("pinned_bytes")
        r["rss_over_pinned_plus_1gib"] = _ratio(r.get("peak_rss"),
                                                pinned + GIB if pinned is not None else None)
        print(json.dumps({k: r.get(k) for k in (
            "variant", "status", "step_s_p50", "disk_read_bytes_per_step", "disk_bound_s",
            "step_over_disk_bound", "step_over_floor", "peak_rss", "pinned_bytes", "error")},
            default=str), flush=True)

    def same(c: dict[str, Any]) -> str:
        return ("-" if not c else "identical" if c["losses_identical"]
                else f"max diff {c['max_abs_loss_diff']:.3g}")

    rows = []
    for r in results.values():
        stats = r.get("stats") or r.get("stats_after_load") or {}
        rows.append({
            "variant": r["variant"],
            "step s (p50)": _num(r.get("step_s_p50")),
            "disk GB / step": _num((r.get("disk_read_bytes_per_step") or 0) / 1e9),
            "disk GB/s (best; 1 thread)": f"{bw['gb_per_s']:.2f}; "
                                          f"{bw['single_thread_gb_per_s']:.2f}",
            "disk bound s": _num(r.get("disk_bound_s")),
            "step / bound (<= 1.15)": _num(r.get("step_over_disk_bound"), ".3f"),
            "step / max(bound, ram step)": _num(r.get("step_over_floor"), ".3f"),
            "disk waits / step": _num(r.get("disk_waits_per_step"), ".1f"),
            "on disk GiB": _gib(stats.get("disk_bytes")),
            "pinned GiB": _gib(r.get("pinned_bytes")),
            "peak RSS GiB": _gib(r.get("peak_rss")),
            "RSS / (pinned + 1 GiB)": _num(r.get("rss_over_pinned_plus_1gib"), ".3f"),
            "losses vs ram": (same(compare) if r["variant"] == "disk"
                              else same(control) if r["variant"] == "ram2" else "-"),
            "status": r.get("status", "?") if r.get("status") == "ok"
            else f"{r.get('status')}: {str(r.get('error'))[:120]}",
        })
    return {"read_bandwidth": bw, "checkpoint": ckpt, "results": list(results.values()),
            "loss_comparison": compare, "loss_control_ram_vs_ram": control, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--part", choices=("all", "write", "load", "disk"), default="all")
    parser.add_argument("--quick", action="store_true",
                        help="tiny Flux: the code paths in seconds (always tiny with --device cpu)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/vramkit-swap-load"),
                        help="where the checkpoint is written once (default %(default)s)")
    parser.add_argument("--variants", default=",".join(LOAD_VARIANTS),
                        help="load part: %(default)s")
    parser.add_argument("--disk-variants", default=",".join(DISK_VARIANTS),
                        help="disk part: %(default)s")
    parser.add_argument("--steps", type=int, default=None,
                        help="disk part: timed steps (default 4; 2 with --quick)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="disk part: warm-up steps (default 2; 1 with --quick)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="--part load: rounds of the variants, each child after its own "
                             "cold read")
    parser.add_argument("--load-steps", type=int, default=2,
                        help="load part: steps per variant, the first one timed from the load")
    parser.add_argument("--cap-gib", type=float, default=CAP_GIB)
    parser.add_argument("--deterministic", choices=("on", "off"), default="on",
                        help="disk part: deterministic algorithms, so the two variants' losses "
                             "can be compared bit for bit (default on)")
    parser.add_argument("--max-gpu-bytes", default=None, help=f"default {MAX_GPU_BYTES}")
    parser.add_argument("--host-budget", default=None, help=f"default {HOST_BUDGET}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child-timeout", type=float, default=420.0,
                        help="seconds before a variant's process is given up (default 420)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    add_common_args(parser)
    args = parser.parse_args()
    args.tiny = args.quick or torch.device(args.device).type == "cpu"
    if torch.device(args.device).type == "cpu":
        # The CPU run checks code paths: one thread keeps the tiny steps at ~0.1 s where other
        # processes share the cores (two OpenMP threads then spin: 40x slower seen here).
        torch.set_num_threads(1)
    fill_defaults(args, {"steps": 2 if args.tiny else 4, "warmup": 1 if args.tiny else 2})
    if args.steps < 1 or args.warmup < 0 or args.load_steps < 1:
        parser.error("--steps and --load-steps must be at least 1, --warmup at least 0")
    if args.variant:
        child_main(args)
        return
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.disk_variants = [v.strip() for v in args.disk_variants.split(",") if v.strip()]
    for chosen, known in ((args.variants, LOAD_VARIANTS), (args.disk_variants, DISK_VARIANTS)):
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            parser.error(f"unknown variants {unknown}; choose from {', '.join(known)}")
    device = torch.device(args.device)
    folder = Path(args.workdir) / ("transformer-tiny" if args.tiny else "transformer")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "swap_load-children.jsonl").unlink(missing_ok=True)
    config = model_config(args.tiny)
    settings = {"cap_gib": args.cap_gib,
                "max_gpu_bytes": args.max_gpu_bytes or (MAX_GPU_BYTES if not args.tiny
                                                        else "scaled (--quick)"),
                "host_budget": args.host_budget or (HOST_BUDGET if not args.tiny
                                                    else "scaled (--quick)"),
                "lora": f"peft r{LORA_RANK} alpha {LORA_RANK} fp32 on {', '.join(LORA_TARGETS)}",
                "tokens": list(TINY_TOKENS if args.tiny else (IMAGE_TOKENS, TEXT_TOKENS)),
                "steps": args.steps, "warmup": args.warmup, "load_steps": args.load_steps,
                "seed": args.seed, "targets": TARGETS, "folder": str(folder),
                "model": "tiny Flux (--quick)" if args.tiny else "FLUX.1-dev transformer"}
    print(json.dumps({"settings": settings}), flush=True)
    log(f"settings: cap {args.cap_gib} GiB, max_gpu_bytes {settings['max_gpu_bytes']}, "
        f"host_budget {settings['host_budget']}; targets {TARGETS}")
    shard = SHARD_BYTES if not args.tiny else 8 << 20  # tiny: several shards, as the real one
    ckpt = write_checkpoint(folder, config, device, args.seed, shard)
    gc.collect()
    if args.part == "write":
        return
    header = {"settings": settings, "hardware": hardware(Path(args.workdir))}
    if args.part in ("all", "load"):
        doc = load_part(args, folder, ckpt)
        rows = doc.pop("rows")
        write_result("swap_load", {**header, **doc}, rows, Path(args.out))
    if args.part in ("all", "disk"):
        doc = disk_part(args, folder, ckpt)
        rows = doc.pop("rows")
        write_result("swap_load_disk", {**header, **doc}, rows, Path(args.out))
    log(f"done; environment: {json.dumps(environment(), default=str)}")


if __name__ == "__main__":
    main()
