"""How fast N GPUs of one host get the same swapped block from host memory.

Every rank must end with the whole block in its GPU memory. Two ways, measured side by side in
alternating rounds under one ``torchrun`` job:

* ``full``: every rank copies the whole block host->device (what a swapper does on each GPU).
* ``sharded``: every rank copies its 1/N of the block host->device, then the ranks all-gather
  the pieces in place over the GPUs' links (NCCL ``all_gather_into_tensor``).

Prints, per way, the time to deliver one block to every rank and the effective bandwidth per
rank (block bytes / time), plus the ratio. With several GPUs reading the same host memory, the
``full`` way shows whether host DRAM / the PCIe root shares its bandwidth between them.

Usage (GPU machine)::

    for n in 1 2 4; do torchrun --nproc_per_node $n benchmarks/host_copy_scaling.py; done
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-mib", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8, help="blocks copied per timed round")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    nbytes = args.block_mib * MIB // world * world
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(rank + 1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    piece = nbytes // world
    stream = torch.cuda.Stream()

    def full() -> None:
        with torch.cuda.stream(stream):
            for _ in range(args.blocks):
                dev.copy_(host, non_blocking=True)

    def sharded() -> None:
        with torch.cuda.stream(stream):
            for _ in range(args.blocks):
                mine = dev[rank * piece:(rank + 1) * piece]
                mine.copy_(host[rank * piece:(rank + 1) * piece], non_blocking=True)
                if world > 1:
                    dist.all_gather_into_tensor(dev, mine)

    times: dict[str, list[float]] = {"full": [], "sharded": []}
    for r in range(args.rounds + 1):
        for name, fn in (("full", full), ("sharded", sharded)) if r % 2 == 0 else (
                ("sharded", sharded), ("full", full)):
            dist.barrier()
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            seconds = torch.tensor(start.elapsed_time(end) / 1e3, device="cuda")
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            if r:  # round 0 warms up
                times[name].append(seconds.item() / args.blocks)
    if rank == 0:
        gb = nbytes / 1e9
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in med.items():
            print(f"[host_copy] gpus={world} way={k} block={gb:.3f} GB "
                  f"per block {v * 1e3:.2f} ms = {gb / v:.1f} GB/s per rank "
                  f"({world * gb / v:.1f} GB/s delivered in all)", flush=True)
        print(f"[host_copy] gpus={world} full/sharded time ratio "
              f"{med['full'] / med['sharded']:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
