"""``vramkit select``: choose GPUs and print the ``CUDA_VISIBLE_DEVICES`` value.

Typical use: ``CUDA_VISIBLE_DEVICES=$(vramkit select -n 2 --min-free 20GiB) torchrun ...``.
Selection reads NVML only; it never initializes CUDA.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from vramkit.cli._output import print_json
from vramkit.units import format_size


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
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vramkit.devices.selection import select_devices

    selection = select_devices(args.count, min_free_memory=args.min_free,
                               max_utilization=args.max_util, policy=args.policy)
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
