"""Small helpers shared by the benchmark scripts: environment header, statistics, output.

Every benchmark prints one JSON document (machine-readable) and one markdown table row (for
docs/benchmarks.md), and writes both under ``--out``. The environment header names the hardware
and versions so a number is never quoted without its machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vramkit.devices.nvml import query_nvml

__all__ = [
    "add_common_args",
    "environment",
    "fill_defaults",
    "format_markdown_row",
    "parse_variants",
    "percentile",
    "summarize_ns",
    "write_result",
]


def fill_defaults(args: argparse.Namespace, defaults: dict[str, Any]) -> None:
    """Set each option the user left at ``None`` to its default for this run."""
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def parse_variants(parser: argparse.ArgumentParser, text: str, known: Any) -> list[str]:
    """The comma-separated variant names of ``text``; a name not in ``known`` is a usage
    error."""
    variants = [v.strip() for v in text.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(known))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(known)}")
    return variants


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--out`` (default ``./out``) to a benchmark's argument parser."""
    parser.add_argument("--out", type=Path, default=Path("out"),
                        help="directory for the JSON and markdown outputs (default ./out)")


def deterministic_kernels(enabled: bool = True) -> None:
    """PyTorch's deterministic algorithms, for benchmarks that compare losses bit for bit: the
    attention backward accumulates with atomics by default, and a swapped and a resident run
    of one FLUX-sized stack then differed by up to 2e-4 in the loss over 1,000 steps (equal bit
    for bit with deterministic kernels; benchmarks/soak.py on an H200), which would hide, or
    fake, a difference the code under test makes. cuBLAS needs
    its workspace fixed before its first call for deterministic results: call this (with
    ``enabled=False`` where only a later check is deterministic) before CUDA starts."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)


def environment() -> dict[str, Any]:
    """Hardware and software versions of this run (GPU fields only when CUDA is usable).

    Returns:
        A JSON-serializable dict: python, platform, cpu, torch, cuda, gpu name/memory, driver.
    """
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch
    except ImportError:
        return info
    info["torch"] = torch.__version__
    info["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["driver"] = _driver_version()
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _driver_version() -> str | None:
    # query_nvml never raises for a missing or failing NVML: the header then omits the driver.
    return query_nvml(include_processes=False).driver_version


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation, like ``numpy.percentile``."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize_ns(samples_ns: Sequence[int]) -> dict[str, float]:
    """p50 / p99 / mean of per-operation timings, converted from ns to µs."""
    return {
        "p50_us": percentile(samples_ns, 50) / 1e3,
        "p99_us": percentile(samples_ns, 99) / 1e3,
        "mean_us": sum(samples_ns) / len(samples_ns) / 1e3,
        "samples": len(samples_ns),
    }


def format_markdown_row(columns: dict[str, Any], header: bool = False) -> str:
    """One markdown table row from ``columns`` (with the header lines when ``header``)."""
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)

    row = "| " + " | ".join(cell(v) for v in columns.values()) + " |"
    if not header:
        return row
    names = "| " + " | ".join(columns) + " |"
    rule = "| " + " | ".join("---" for _ in columns) + " |"
    return "\n".join([names, rule, row])


def write_result(name: str, result: dict[str, Any], rows: list[dict[str, Any]],
                 out_dir: Path) -> None:
    """Print the JSON document and markdown rows, and write ``<out>/<name>.json`` and ``.md``.

    Args:
        name: the benchmark's name (file stem).
        result: the full result; the environment header is added under ``"environment"``.
        rows: markdown rows (same keys in each), printed as one table.
        out_dir: output directory, created if missing.
    """
    document = {"benchmark": name, "command": " ".join(sys.argv), "environment": environment(),
                **result}
    text = json.dumps(document, indent=2, default=str)
    table = "\n".join(format_markdown_row(row, header=i == 0) for i, row in enumerate(rows))
    env = document["environment"]
    caption = (f"{name}: {env.get('gpu', env.get('cpu'))}, torch {env.get('torch')}, "
               f"CUDA {env.get('cuda')}, Python {env.get('python')}")
    print(text)
    print()
    print(caption)
    print(table)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(text + "\n", encoding="utf-8")
    (out_dir / f"{name}.md").write_text(caption + "\n\n" + table + "\n", encoding="utf-8")
