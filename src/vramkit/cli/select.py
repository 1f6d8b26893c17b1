"""``vramkit select``: choose GPUs and print the ``CUDA_VISIBLE_DEVICES`` value.

Typical use: ``CUDA_VISIBLE_DEVICES=$(vramkit select -n 2 --min-free 20GiB) torchrun ...``.
Selection reads NVML only; it never initializes CUDA. Flag values are checked before NVML is
read (exit code 2); too few GPUs qualifying is a runtime failure (exit code 1), whose hint names
the flags to relax.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from vramkit.cli._output import flag_values, print_json
from vramkit.units import format_size

__all__ = ["FLAG_NAMES", "register", "run"]

#: The arguments of :func:`vramkit.devices.selection.select_devices` the flags set.
FLAG_NAMES = {"count": "--count", "min_free_memory": "--min-free",
              "max_utilization": "--max-util", "policy": "--policy"}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "select", help="choose GPUs and print a CUDA_VISIBLE_DEVICES value",
        description="Choose N GPUs (by free memory, total memory or speed) that meet the "
                    "filters, and print the CUDA_VISIBLE_DEVICES value (GPU UUIDs, which do "
                    "not depend on device order).")
    parser.add_argument("-n", "--count", type=int, default=1, help="how many GPUs (default 1)")
    parser.add_argument("--min-free", default=None, metavar="SIZE",
                        help="minimum free memory, e.g. 10GiB")
    parser.add_argument("--max-util", type=float, default=None, metavar="PERCENT",
                        help="maximum GPU utilization in percent")
    parser.add_argument("--policy", default="most_free_memory",
                        choices=("most_free_memory", "largest_memory", "fastest"),
                        help="how to rank GPUs (default most_free_memory)")
    parser.add_argument("--indices", action="store_true",
                        help="print NVML indices instead of UUIDs (valid only with "
                             "CUDA_DEVICE_ORDER=PCI_BUS_ID in the child)")
    parser.add_argument("--json", action="store_true", help="print JSON with the reasons")
    parser.set_defaults(func=run, flag_names=FLAG_NAMES)


def run(args: argparse.Namespace) -> int:
    from vramkit._validate import check_int, check_number, check_size
    from vramkit.devices.selection import select_devices

    with flag_values():
        count = check_int("--count", args.count, minimum=1,
                          hint="Ask for at least one GPU, e.g. -n 1.")
        min_free = None if args.min_free is None else check_size(
            "--min-free", args.min_free, hint="Give a size such as 20GiB, 1500MB or 2G.")
        max_util = None if args.max_util is None else check_number(
            "--max-util", args.max_util, minimum=0, maximum=100,
            hint="Give a percentage in [0, 100], e.g. --max-util 10.")
    selection = select_devices(count, min_free_memory=min_free, max_utilization=max_util,
                               policy=args.policy)
    value = (",".join(str(d.index) for d in selection.devices) if args.indices
             else selection.cuda_visible_devices)
    if args.json:
        print_json({
            "cuda_visible_devices": value,
            "devices": [
                {"nvml_index": d.index, "uuid": d.uuid, "name": d.name,
                 "memory_free": d.memory_free, "memory_total": d.memory_total,
                 "utilization_gpu": d.utilization_gpu}
                for d in selection.devices
            ],
            "policy": args.policy,
        })
    else:
        print(value)
        for d in selection.devices:
            free = "?" if d.memory_free is None else format_size(d.memory_free)
            print(f"  {d.uuid}  NVML {d.index}  {d.name}  {free} free", file=sys.stderr)
    return 0
