"""``vramkit info``: devices, versions, host memory, allocator settings, environment, and why no
GPU shows; ``--disk PATH`` adds the read bandwidth of a checkpoint's disk.

Equivalent in spirit to ``nvidia-smi`` + ``python -c 'import torch; print(torch.cuda...)'``, but
joined: each physical GPU (NVML) is shown with the CUDA ordinal this process would use for it.
Host memory is this process's view (:func:`vramkit.devices.host.read_host_memory`): RAM, its
cgroup's limit, ``RLIMIT_MEMLOCK`` and the cap on pinned memory in effect, and where a block
swapper keeps its masters here (``host memory mode here: pinned/pageable, because ...``:
:func:`vramkit.devices.host.choose_host_memory`). ``--disk`` times a
cold sequential read (:func:`vramkit.io.disk.measure_read_bandwidth`) before anything is
printed, so a bad path ends as one error (exit code 1) and no partial report.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import platform
import sys
from typing import Any

from rich.table import Table

from vramkit import __version__
from vramkit.cli._output import console, print_json
from vramkit.errors import ConfigError, VramkitError
from vramkit.units import format_size

# Variables that change which devices a process sees or how memory is managed. The deprecated
# names are listed so that a stale setting in a user's shell shows up.
RELEVANT_ENV_VARS: tuple[tuple[str, str], ...] = (
    ("CUDA_VISIBLE_DEVICES", "which GPUs CUDA exposes, in which order"),
    ("CUDA_DEVICE_ORDER", "FASTEST_FIRST (default) or PCI_BUS_ID"),
    ("NVIDIA_VISIBLE_DEVICES", "GPUs the container runtime mounted"),
    ("PYTORCH_ALLOC_CONF", "PyTorch allocator settings"),
    ("PYTORCH_CUDA_ALLOC_CONF", "PyTorch allocator settings (deprecated name in torch >= 2.9)"),
    ("PYTORCH_NO_CUDA_MEMORY_CACHING", "disables PyTorch's caching allocator"),
    ("CUDA_LAUNCH_BLOCKING", "synchronous kernel launches (debugging only: slow)"),
    ("XLA_CLIENT_MEM_FRACTION", "JAX GPU memory fraction"),
    ("XLA_PYTHON_CLIENT_MEM_FRACTION", "JAX GPU memory fraction (legacy name)"),
    ("XLA_PYTHON_CLIENT_PREALLOCATE", "JAX preallocation (default true: 75% of the GPU)"),
    ("XLA_PYTHON_CLIENT_ALLOCATOR", "JAX allocator (platform = no caching)"),
    ("JAX_PLATFORMS", "JAX backends to start"),
    ("JAX_PLATFORM_NAME", "JAX backend (deprecated: use JAX_PLATFORMS)"),
    ("XLA_FLAGS", "XLA compiler/runtime flags"),
    ("VRAMKIT_MEMORY_DEBUG", "vramkit pools record allocation stacks"),
)


#: The arguments the flags feed, each with its flag (errors name the flag).
FLAG_NAMES = {"threads": "--disk-threads"}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "info", help="show GPUs, versions, allocator settings and environment",
        description="Show the GPUs this process can see (NVML joined with PyTorch by UUID), "
                    "versions, allocator settings in effect and relevant environment variables.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--jax", action="store_true",
                        help="also start JAX (without preallocation) and join its devices")
    parser.add_argument("--no-torch", action="store_true",
                        help="do not initialize CUDA in PyTorch (NVML view only)")
    parser.add_argument("--disk", metavar="PATH",
                        help="also time a cold sequential read (up to 1 GiB) of PATH, a "
                             "checkpoint file or directory (its largest file is read)")
    parser.add_argument("--disk-threads", type=int, default=1, metavar="N",
                        help="with --disk: N reads in flight at once (default 1; NVMe and "
                             "network disks often need several to reach their bandwidth)")
    parser.set_defaults(func=run, flag_names=FLAG_NAMES)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_info(*, include_torch: bool = True, include_jax: bool = False) -> dict[str, Any]:
    """Everything ``vramkit info`` shows, as plain data (the ``--json`` output; ``--disk``
    adds its ``disk`` key in :func:`run`)."""
    import torch

    from vramkit.devices import nvml
    from vramkit.devices.env import allocator_settings
    from vramkit.devices.host import choose_host_memory, read_host_memory
    from vramkit.devices.info import detect_devices, resolve_visible_devices

    snapshot = nvml.query_nvml()
    host = read_host_memory()
    problems: list[str] = []
    ordinal_of: dict[str, int] = {}
    try:
        for visible in resolve_visible_devices(snapshot):
            ordinal_of[visible.uuid] = visible.cuda_ordinal
    except VramkitError as err:
        problems.append(str(err))
    else:
        if snapshot.available and snapshot.devices and not ordinal_of:
            problems.append("CUDA_VISIBLE_DEVICES hides every GPU from this process")

    torch_devices: list[Any] = []
    if include_torch and torch.cuda.is_available():
        try:
            torch_devices = detect_devices(snapshot=snapshot, include_jax=include_jax)
        except VramkitError as err:
            problems.append(str(err))
    torch_by_uuid = {d.uuid: d for d in torch_devices if d.uuid}

    gpus = []
    for dev in snapshot.all_devices():
        joined = torch_by_uuid.get(dev.uuid)
        gpus.append({
            "nvml": dev,
            "cuda_ordinal": joined.device_id if joined else ordinal_of.get(dev.uuid),
            "torch": joined,
        })

    # Whether NVLink joins every pair of the visible GPUs: vramkit.distributed then shares each
    # swapped block's host->device copy between them (uploads="auto").
    visible = [row["nvml"].uuid for row in gpus
               if row["cuda_ordinal"] is not None and row["nvml"].mig_index is None]
    nvlink = nvml.nvlink_connected(visible) if len(visible) >= 2 else None

    if not snapshot.available:
        problems.append(f"NVML: {snapshot.reason}")
    if torch.version.cuda is None:
        problems.append(f"this PyTorch build ({torch.__version__}) has no CUDA support")
    problems.extend(snapshot.warnings)

    return {
        "vramkit": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {
            "driver": snapshot.driver_version,
            "cuda_driver": snapshot.cuda_driver_version,
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "jax": _version("jax"),
            "jaxlib": _version("jaxlib"),
            "nvidia-ml-py": _version("nvidia-ml-py"),
            "safetensors": _version("safetensors"),
        },
        "nvml_available": snapshot.available,
        "gpus": gpus,
        "gpu_count_visible": len(ordinal_of) if snapshot.available else len(torch_devices),
        "nvlink_all_pairs": nvlink,
        "host": host.to_dict(),
        # where a BlockSwapper's masters go here with SwapConfig(host_memory="auto")
        "host_memory": dataclasses.asdict(choose_host_memory("auto", host=host)),
        "allocator": allocator_settings(),
        "environment": {name: os.environ.get(name) for name, _ in RELEVANT_ENV_VARS},
        "problems": problems,
    }


def _pcie(dev: Any) -> str:
    if dev.pcie_generation is None:
        return "-"
    text = f"Gen{dev.pcie_generation} x{dev.pcie_width}"
    if dev.pcie_max_generation and (dev.pcie_max_generation, dev.pcie_max_width) != (
            dev.pcie_generation, dev.pcie_width):
        text += f" (max Gen{dev.pcie_max_generation} x{dev.pcie_max_width})"
    return text


def _memory(dev: Any) -> str:
    if dev.unified_memory:
        return "unified (shared with host)"
    if dev.memory_total is None:
        return "-"
    used = format_size(dev.memory_used) if dev.memory_used is not None else "?"
    return f"{used} / {format_size(dev.memory_total)}"


def _size(value: int | None, missing: str = "unknown") -> str:
    return missing if value is None else format_size(value)


def _render_host(out: Any, host: dict[str, Any]) -> None:
    table = Table(title="Host memory", title_justify="left")
    table.add_column("what")
    table.add_column("value")
    table.add_row("total", _size(host["total"]) + ("  (WSL)" if host["wsl"] else ""))
    table.add_row("available", _size(host["available"]))
    table.add_row("this process (RSS)", _size(host["process_rss"]))
    if host["cgroup_limit"] is not None:
        cgroup = f"limit {_size(host['cgroup_limit'])}, using {_size(host['cgroup_usage'])}"
    elif host["cgroup_usage"] is not None:
        cgroup = f"no limit, using {_size(host['cgroup_usage'])}"
    else:
        cgroup = "no memory cgroup read"
    table.add_row("cgroup", cgroup)
    table.add_row("headroom", _size(host["headroom"]))
    table.add_row("RLIMIT_MEMLOCK", _size(host["memlock_limit"], "unlimited or unknown")
                  + "  (not charged for CUDA pinned memory)")
    pin = host["pin_limit"]
    table.add_row("pinning limit", "none known (RAM)" if pin is None
                  else f"{format_size(pin)}  ({host['pin_limit_source']})")
    shm = host.get("shm_total")
    table.add_row("/dev/shm", "absent" if shm is None else
                  f"{_size(host['shm_free'])} free of {format_size(shm)}  (one copy of the "
                  "swapped weights per node under torchrun)")
    out.print(table)


def _render_disk(out: Any, disk: dict[str, Any]) -> None:
    threads = disk.get("threads", 1)
    out.print(f"disk read: {disk['gb_per_s']:.2f} GB/s  ({format_size(disk['bytes'])} of "
              f"{disk['path']} in {disk['seconds']:.3f} s, {disk['method']}"
              + (f", {threads} threads" if threads > 1 else "") + ")")


def render(info: dict[str, Any]) -> None:
    out = console()
    versions = info["versions"]
    out.print(f"[bold]vramkit {info['vramkit']}[/bold]  Python {info['python']}  "
              f"torch {versions['torch']} (CUDA {versions['torch_cuda'] or 'none'})  "
              f"JAX {versions['jax'] or 'not installed'}")
    out.print(f"driver {versions['driver'] or '-'}  CUDA driver {versions['cuda_driver'] or '-'}")

    if info["gpus"]:
        table = Table(title="GPUs", title_justify="left")
        for column in ("cuda", "nvml", "name", "uuid", "memory used / total", "cc", "SMs",
                       "PCIe", "util", "procs"):
            table.add_column(column)
        for row in info["gpus"]:
            dev, joined = row["nvml"], row["torch"]
            cc = dev.compute_capability
            table.add_row(
                "-" if row["cuda_ordinal"] is None else str(row["cuda_ordinal"]),
                str(dev.index) if dev.mig_index is None else f"{dev.index}/{dev.mig_index}",
                dev.name, dev.uuid, _memory(dev),
                f"{cc[0]}.{cc[1]}" if cc else "-",
                str(joined.multiprocessor_count) if joined else "-",
                _pcie(dev),
                "-" if dev.utilization_gpu is None else f"{dev.utilization_gpu}%",
                str(len(dev.processes)),
            )
        out.print(table)
        linked = info.get("nvlink_all_pairs")
        if linked is not None:
            out.print("GPU links: " + (
                "NVLink between every pair of the visible GPUs (data-parallel jobs share each "
                "swapped block's copy between them)" if linked else
                "not every pair of the visible GPUs is linked by NVLink (data-parallel jobs "
                "copy whole blocks on each GPU)"))
    else:
        out.print("[bold yellow]No NVIDIA GPU visible.[/bold yellow]")

    if "host" in info:
        _render_host(out, info["host"])
    mode = info.get("host_memory")
    if mode is not None:
        out.print(f"host memory mode here: {mode['mode']}, because {mode['reason']}  "
                  "(SwapConfig.host_memory='auto')")
    if info.get("disk") is not None:
        _render_disk(out, info["disk"])

    alloc = info["allocator"]
    out.print(f"allocator: {alloc['variable']}={alloc['value'] or '(unset)'}"
              + (f"  backend={alloc['backend']}" if alloc.get("backend") else "")
              + (f"  in effect={alloc['in_effect']}" if alloc.get("in_effect") else ""))

    env_table = Table(title="Environment", title_justify="left")
    env_table.add_column("variable")
    env_table.add_column("value")
    env_table.add_column("meaning")
    for name, meaning in RELEVANT_ENV_VARS:
        value = info["environment"].get(name)
        if value is not None:
            env_table.add_row(name, value, meaning)
    if env_table.row_count:
        out.print(env_table)
    else:
        out.print("environment: none of the relevant variables is set")
    for problem in info["problems"]:
        out.print(f"[yellow]note:[/yellow] {problem}")


def run(args: argparse.Namespace) -> int:
    if args.jax and "jax" not in sys.modules:
        # Starting JAX's GPU client would otherwise take 75% of every GPU for this process.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from vramkit._validate import check_int
    from vramkit.cli._output import flag_values
    from vramkit.io.disk import MAX_READ_THREADS

    with flag_values():  # a bad flag value is a usage error (exit code 2), before any work
        check_int("--disk-threads", args.disk_threads, minimum=1, maximum=MAX_READ_THREADS,
                  hint="Give --disk-threads the reads to keep in flight, e.g. --disk-threads 4.")
        if args.disk is None and args.disk_threads != 1:
            raise ConfigError("--disk-threads applies to --disk", hint="Add --disk PATH.")
    disk = None
    if args.disk is not None:
        from vramkit.io.disk import measure_read_bandwidth

        # Measured first: a bad path ends as one error, before anything is printed.
        disk = measure_read_bandwidth(args.disk, threads=args.disk_threads).to_dict()
    info = collect_info(include_torch=not args.no_torch, include_jax=args.jax)
    if disk is not None:
        info["disk"] = disk
    if args.json:
        print_json(info)
    else:
        render(info)
    return 0
