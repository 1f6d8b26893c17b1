"""``vramkit info``: devices, versions, allocator settings, environment, and why no GPU shows.

Equivalent in spirit to ``nvidia-smi`` + ``python -c 'import torch; print(torch.cuda...)'``, but
joined: each physical GPU (NVML) is shown with the CUDA ordinal this process would use for it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
from typing import Any

from rich.table import Table

from vramkit import __version__
from vramkit.cli._output import console, print_json
from vramkit.errors import VramkitError
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
    parser.set_defaults(func=run)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_info(*, include_torch: bool = True, include_jax: bool = False) -> dict[str, Any]:
    """Everything ``vramkit info`` shows, as plain data (the ``--json`` output)."""
    import torch

    from vramkit.devices.env import allocator_settings
    from vramkit.devices.info import detect_devices, resolve_visible_devices
    from vramkit.devices.nvml import query_nvml

    snapshot = query_nvml()
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
    else:
        out.print("[bold yellow]No NVIDIA GPU visible.[/bold yellow]")

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
    info = collect_info(include_torch=not args.no_torch, include_jax=args.jax)
    if args.json:
        print_json(info)
    else:
        render(info)
    return 0
