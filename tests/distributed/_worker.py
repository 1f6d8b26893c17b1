"""One rank of the distributed tests, launched by torchrun (``tests/distributed/_launch.py``).

Each scenario runs on every rank and writes ``<out>/<scenario>-rank<R>.json`` with what the
pytest side checks; a scenario that raises writes its error there instead. The device is the one
``vramkit.distributed.init_from_env`` chooses: the CPU with gloo (the CPU tests hide the GPUs),
or ``cuda:<LOCAL_RANK>`` with NCCL when every rank has a GPU (the multigpu tests).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vramkit.distributed import (
    init_from_env,
    process_pss_bytes,
    shared_swapper,
    shutdown,
    wrap_ddp,
)
from vramkit.errors import ConfigError, OffloadError
from vramkit.offload.swap import BlockSwapper, SwapConfig

GLOBAL_BATCH = 8
IN, WIDTH, HIDDEN, BLOCKS, OUT = 12, 32, 64, 4, 5


class Adapter(nn.Module):
    """A frozen linear plus a trainable low-rank update (LoRA-like), kept resident."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.down = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.up = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.down.t()) @ self.up.t()


class Net(nn.Module):
    """Trainable input/output layers around frozen residual MLP blocks."""

    def __init__(self, lora: bool, frozen: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(IN, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))
            for _ in range(BLOCKS))
        self.out = nn.Linear(WIDTH, OUT)
        if frozen:
            for p in self.blocks.parameters():
                p.requires_grad_(False)
        if lora:
            for block in self.blocks:
                block[0] = Adapter(block[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


DEVICE = torch.device("cpu")  # this rank's device (set in main): cuda:<LOCAL_RANK> with NCCL


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)
    return x.to(DEVICE), y.to(DEVICE)


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = GLOBAL_BATCH // world
    return t[rank * per:(rank + 1) * per]


CONFIG = SwapConfig(min_param_bytes=0)


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float().cpu() - b[k].float().cpu()).abs().max()) for k in a)


def train_reference(model: nn.Module, steps: int, make_opt: Any) -> dict[str, torch.Tensor]:
    """One process, the whole batch: the result every rank of the job must reproduce."""
    model.to(DEVICE)
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    for step in range(steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return trainable_state(model)


def lora_grad_diff(ddp: nn.Module, model: nn.Module, info: Any) -> float:
    """One backward of this rank's share through ``ddp`` against one process on the whole
    batch: the largest difference of the trainable gradients."""
    x, y = batch(0)
    nn.functional.mse_loss(ddp(shard(x, info.rank, info.world_size)),
                           shard(y, info.rank, info.world_size)).backward()
    reference = Net(lora=True).to(DEVICE)
    nn.functional.mse_loss(reference(x), y).backward()
    return max_diff(
        {n: p.grad for n, p in model.named_parameters() if p.requires_grad},
        {n: p.grad for n, p in reference.named_parameters() if p.requires_grad})


def train_steps(info: Any, ddp: nn.Module, swapper: Any, opt: torch.optim.Optimizer,
                trainable: str = "resident", steps: int = 3,
                after_step: Any = None) -> None:
    """``steps`` steps of this rank's share of each batch through ``ddp`` (host-stepped
    ``trainable="cpu"`` weights waited for first); ``after_step(step, x)`` after each."""
    for step in range(steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss(ddp(shard(x, info.rank, info.world_size)),
                                      shard(y, info.rank, info.world_size))
        loss.backward()
        if trainable == "cpu":
            swapper.sync_gradients()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(step, x)


def scenario_lora(info: Any, out: dict[str, Any]) -> None:
    """LoRA adapters and resident layers reduce through DDP; the frozen swapped base is shared."""
    model = Net(lora=True)
    reference = copy.deepcopy(model).to(DEVICE)
    x, y = batch(0)
    loss = nn.functional.mse_loss(reference(x), y)
    loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters() if p.requires_grad}
    swapper = shared_swapper(model, "blocks.*", CONFIG, device=info.device)
    ddp = wrap_ddp(model, swapper)
    out["ddp_type"] = type(ddp).__name__
    local = nn.functional.mse_loss(ddp(shard(x, info.rank, info.world_size)),
                                   shard(y, info.rank, info.world_size))
    local.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    out["grad_diff"] = max_diff(grads, ref_grads)
    stats = swapper.stats()
    out["shared_bytes"] = stats.shared_bytes
    out["swapped_bytes"] = stats.swapped_bytes
    out["swapped_blocks"] = stats.swapped_blocks
    out["ignored"] = sorted(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    # Three optimizer steps: the replicas stay equal to the one-process run.
    opt = torch.optim.AdamW(swapper.optimizer_parameters(), lr=1e-2)
    opt.zero_grad(set_to_none=True)
    reference = Net(lora=True)
    ref_state = train_reference(reference, 3, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    train_steps(info, ddp, swapper, opt)
    out["param_diff"] = max_diff(trainable_state(model), ref_state)
    swapper.detach()
    out["ignored_after_detach"] = hasattr(model, "_ddp_params_and_buffers_to_ignore")


def scenario_sharded(info: Any, out: dict[str, Any]) -> None:
    """Sharded uploads: each rank copies its share of a block and the node's ranks all-gather
    the rest. Training equals one process (frozen shared base + LoRA; trainable='cpu' and
    'swap' with per-rank masters); rank 0 alone calls the model between steps (with gradients
    inside ``local_calls()``, then under no_grad) and nobody hangs; swappers that differ
    between ranks are refused everywhere."""
    from vramkit.distributed import uploads

    uploads.MIN_SHARDED_BYTES = 0  # the test's blocks are a few KiB

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2)

    def preview(step: int, x: torch.Tensor) -> None:
        """Calls only rank 0 makes between steps."""
        if info.rank != 0:
            return
        if step == 0:  # with gradients: in local_calls()
            with swapper.local_calls():
                model(x[:2]).sum()
                model(x[:1]).sum()
        elif step == 1:  # under no_grad, with no local_calls()
            with torch.no_grad():
                model(x[:2])

    for kind in ("lora", "cpu", "swap"):
        lora = kind == "lora"
        ref_state = train_reference(Net(lora=lora, frozen=lora), 3, adamw)
        model = Net(lora=lora, frozen=lora)
        config = CONFIG if lora else SwapConfig(min_param_bytes=0, trainable=kind)
        swapper = shared_swapper(model, "blocks.*", config, device=info.device,
                                 uploads="sharded", optimizer=adamw if kind == "swap" else None)
        ddp = wrap_ddp(model, swapper)
        opt = adamw(swapper.optimizer_parameters())
        train_steps(info, ddp, swapper, opt, kind, after_step=preview)
        stats = swapper.stats()
        loader = swapper.block_loader
        out[f"{kind}_block_bytes"] = sorted({b.nbytes for b in swapper.blocks})
        swapper.detach()  # swapped trainable weights are back in the model
        out[f"{kind}_param_diff"] = max_diff(trainable_state(model), ref_state)
        out[f"{kind}_loader"] = type(loader).__name__
        out[f"{kind}_loader_loads"] = getattr(loader, "loads", 0)
        out[f"{kind}_gathered_bytes"] = stats.gathered_bytes
        out[f"{kind}_h2d_bytes"] = stats.h2d_bytes
        out[f"{kind}_loads"] = stats.loads
        out[f"{kind}_slot_bytes"] = stats.slot_bytes
        out[f"{kind}_shared_bytes"] = stats.shared_bytes
    # Ranks that swap different blocks: refused on every rank, nobody waits.
    from vramkit.distributed import ShardedUploads

    names = ["blocks.0.0", "blocks.0.2"] if info.rank == 0 else ["blocks.0.0"]
    try:
        BlockSwapper(Net(lora=True), "blocks.*",
                     SwapConfig(min_param_bytes=0, swapped_blocks=names), device=info.device,
                     block_loader=ShardedUploads(None))
        out["mismatch_refused"] = None
    except ConfigError as exc:
        out["mismatch_refused"] = str(exc)


def scenario_sharded_compressed(info: Any, out: dict[str, Any]) -> None:
    """Sharded uploads of compressed masters (``SwapConfig(compress="on")`` with a collective
    loader, per-rank masters): each rank copies its piece of a block's compressed payload, the
    ranks all-gather the rest and each decodes it; LoRA training equals one process."""
    from vramkit.distributed import uploads

    uploads.MIN_SHARDED_BYTES = 0  # the test's blocks are a few KiB

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2)

    ref_state = train_reference(Net(lora=True), 3, adamw)
    model = Net(lora=True)
    # the node's own group (as shared_swapper makes it): DDP's all-reduces in backward run on
    # the default group, and collectives of two callers on one group could interleave
    loader = uploads.node_uploads(info.device, "sharded")
    swapper = BlockSwapper(model, "blocks.*", SwapConfig(min_param_bytes=0, compress="on"),
                           device=info.device, block_loader=loader)
    ddp = wrap_ddp(model, swapper)
    opt = adamw(swapper.optimizer_parameters())
    train_steps(info, ddp, swapper, opt, "lora")
    stats = swapper.stats()
    out["loader_loads"] = swapper.block_loader.loads  # type: ignore[union-attr]
    swapper.detach()
    out["param_diff"] = max_diff(trainable_state(model), ref_state)
    out.update(compressed_blocks=stats.compressed_blocks, blocks=stats.swapped_blocks,
               loads=stats.loads, h2d_bytes=stats.h2d_bytes,
               gathered_bytes=stats.gathered_bytes, compressed_bytes=stats.compressed_bytes)


def scenario_plain_ddp(info: Any, out: dict[str, Any]) -> None:
    """A plain DistributedDataParallel(model) around a swapped model works (frozen blocks)."""
    from torch.nn.parallel import DistributedDataParallel

    model = Net(lora=True)
    swapper = BlockSwapper(model, "blocks.*", CONFIG, device=info.device)
    ddp = DistributedDataParallel(model)
    out["grad_diff"] = lora_grad_diff(ddp, model, info)
    try:
        BlockSwapper(ddp, "module.blocks.*", CONFIG, device=info.device)
        out["wrapped_refused"] = None
    except ConfigError as exc:
        out["wrapped_refused"] = str(exc)
        out["wrapped_hint"] = exc.hint
    swapper.detach()


def scenario_full(info: Any, out: dict[str, Any], trainable: str) -> None:
    """Swapped trainable weights (full fine-tuning) reduce through the swapper's hook."""
    def factory(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2)

    reference = Net(lora=False, frozen=False)
    ref_state = train_reference(reference, 3, factory)
    model = Net(lora=False, frozen=False)
    config = SwapConfig(min_param_bytes=0, trainable=trainable)
    # Swapped trainable weights: per-rank masters, not shared.
    swapper = shared_swapper(model, "blocks.*", config, device=info.device,
                             optimizer=factory if trainable == "swap" else None)
    ddp = wrap_ddp(model, swapper)
    opt = factory(swapper.optimizer_parameters())
    train_steps(info, ddp, swapper, opt, trainable)
    out["shared_bytes"] = swapper.stats().shared_bytes
    swapper.detach()
    out["param_diff"] = max_diff(trainable_state(model), ref_state)
    # Without the hook, a job of several processes refuses to train swapped weights.
    model = Net(lora=False, frozen=False)
    swapper = BlockSwapper(model, "blocks.*", config, device=info.device,
                           optimizer=factory if trainable == "swap" else None)
    try:
        x, y = batch(0)
        nn.functional.mse_loss(model(x), y).backward()
        out["unreduced_refused"] = None
    except OffloadError as exc:
        out["unreduced_refused"] = str(exc)
    swapper.detach()


def scenario_accumulate(info: Any, out: dict[str, Any], trainable: str) -> None:
    """Two micro-batches per optimizer step under DDP's no_sync(): the swapped gradients (the
    hook: every micro-batch with "cpu", the window's last with "swap" and accumulation_steps=2)
    and DDP's own give what one process accumulating the whole micro-batches gives."""
    def factory(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2)

    reference = Net(lora=False, frozen=False).to(DEVICE)
    ref_opt = factory([p for p in reference.parameters() if p.requires_grad])
    for step in range(2):
        for micro in range(2):
            x, y = batch(10 * step + micro)
            nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    model = Net(lora=False, frozen=False)
    config = SwapConfig(min_param_bytes=0, trainable=trainable,
                        accumulation_steps=2 if trainable == "swap" else 1)
    swapper = shared_swapper(model, "blocks.*", config, device=info.device,
                             optimizer=factory if trainable == "swap" else None)
    ddp = wrap_ddp(model, swapper)
    opt = factory(swapper.optimizer_parameters())
    for step in range(2):
        for micro in range(2):
            x, y = batch(10 * step + micro)
            context = ddp.no_sync() if micro == 0 else contextlib.nullcontext()
            with context:
                nn.functional.mse_loss(ddp(shard(x, info.rank, info.world_size)),
                                       shard(y, info.rank, info.world_size)).backward()
        if trainable == "cpu":
            swapper.sync_gradients()
        opt.step()
        opt.zero_grad(set_to_none=True)
    swapper.detach()
    out["param_diff"] = max_diff(trainable_state(model), trainable_state(reference))


def scenario_pss(info: Any, out: dict[str, Any], directory: Path) -> None:
    """Host memory of the swapped weights over the local ranks: ~1x shared, ~Nx per rank."""
    from safetensors.torch import save_file

    width = 1024
    path = directory / "big.safetensors"
    if info.rank == 0:
        torch.manual_seed(0)
        tensors = {f"blocks.{i}.weight": torch.randn(width, width) for i in range(16)}
        save_file(tensors, str(path))
    dist.barrier()

    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(16))
            for p in self.parameters():
                p.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    for mode in ("shared", "per_rank"):
        with torch.device("meta"):
            model = Big()
        dist.barrier()
        before = process_pss_bytes()
        if mode == "shared":
            swapper = shared_swapper(model, "blocks.*", CONFIG, device=info.device,
                                     checkpoint=str(path))
        else:
            swapper = BlockSwapper(model, "blocks.*", CONFIG, device=info.device,
                                   checkpoint=str(path), load_in_background=False)
        y = model(torch.ones(2, width, device=DEVICE))  # every rank has read every master
        dist.barrier()
        after = process_pss_bytes()
        out[f"{mode}_out"] = float(y.double().sum())
        out[f"{mode}_pss_delta"] = (after - before) if before is not None else None
        out[f"{mode}_swapped_bytes"] = swapper.stats().swapped_bytes
        # On the CPU the swapper's "device" slots are host memory too: in the delta, not masters.
        out[f"{mode}_slot_bytes"] = swapper.stats().slot_bytes
        dist.barrier()
        swapper.detach()
        del swapper, model


def scenario_shm_fallback(info: Any, out: dict[str, Any]) -> None:
    """No room to share (a tmpfs directory that does not exist): every rank pins its own
    masters, rank 0 says why once, training is unchanged."""
    import warnings

    from vramkit.distributed import NodeSharedMasters
    from vramkit.errors import VramkitWarning

    model = Net(lora=True)
    memory = NodeSharedMasters(directory="/nonexistent/vramkit-shm")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        swapper = BlockSwapper(model, "blocks.*", CONFIG, device=info.device,
                               master_memory=memory)
    said = [str(w.message) for w in caught if issubclass(w.category, VramkitWarning)]
    out["warnings"] = said
    out["reason"] = memory.reason
    out["shared"] = swapper.master_memory is not None
    out["shared_bytes"] = swapper.stats().shared_bytes
    out["pinned_bytes"] = swapper.stats().pinned_bytes
    out["swapped_bytes"] = swapper.stats().swapped_bytes
    ddp = wrap_ddp(model, swapper)
    out["grad_diff"] = lora_grad_diff(ddp, model, info)
    swapper.detach()


class Wide(nn.Module):
    """Frozen blocks large enough to swap (256 KiB each) around a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(IN, 256)
        self.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))
        self.blocks.requires_grad_(False)
        self.out = nn.Linear(256, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.out(x)


def scenario_fit_rank(info: Any, out: dict[str, Any]) -> None:
    """fit_rank plans each rank (DDP buckets counted), agrees on one plan, applies it with shared
    masters; the job then trains as one process on the whole batch would."""
    import dataclasses

    import vramkit
    from vramkit.distributed import agree_on_plan, ddp_bucket_bytes, fit_rank, plan_for_rank
    from vramkit.errors import PlanError

    model = Wide()
    x, y = batch(0)
    inputs = (shard(x, info.rank, info.world_size),)
    options: dict[str, Any] = {"hardware": "rtx4090", "headroom": 0.05, "blocks": "blocks.*"}
    minimums = []
    for planner in (vramkit.plan, plan_for_rank):  # one GPU, then one rank of a DDP job
        try:
            planner(model, inputs, 1, **options)
            minimums.append(0)
        except PlanError as exc:
            minimums.append(int(exc.minimum_budget or 0))
    out["minimum_one_gpu"], out["minimum_rank"] = minimums
    out["bucket_bytes"] = ddp_bucket_bytes(model)
    budget = minimums[1]  # the smallest budget a rank can train in
    fitted = fit_rank(model, inputs, budget, device=info.device, **options)
    plan = fitted.plan
    out["swapped"] = list(plan.swapped)
    out["reserved_at_least_buckets"] = plan.headroom_bytes >= ddp_bucket_bytes(model)
    swapper = fitted.swapper
    out["shared_bytes"] = swapper.stats().shared_bytes if swapper is not None else 0
    ddp = wrap_ddp(model, swapper) if swapper is not None else None
    if ddp is not None:
        nn.functional.mse_loss(ddp(inputs[0]), shard(y, info.rank, info.world_size)).backward()
        reference = Wide().to(DEVICE)
        nn.functional.mse_loss(reference(x), y).backward()
        out["grad_diff"] = max_diff(
            {n: p.grad for n, p in model.named_parameters() if p.requires_grad},
            {n: p.grad for n, p in reference.named_parameters() if p.requires_grad})
    fitted.detach()
    # agree_on_plan: the plan predicting the slowest step wins on every rank.
    mine = dataclasses.replace(plan, overhead_seconds=plan.overhead_seconds + 1.0 + info.rank)
    out["agreed_step"] = agree_on_plan(mine).predicted_step_seconds


def scenario_two_nodes(info: Any, out: dict[str, Any]) -> None:
    """Four ranks as two nodes of two (``--fake-hosts``): each node shares one copy; node 1
    built other weights, and wrap_ddp's broadcast between the nodes' writers makes every rank
    compute rank 0's model."""
    node = info.rank // 2
    torch.manual_seed(0)
    model = Net(lora=True)
    if node:  # different frozen weights on the second node
        with torch.no_grad():
            for p in model.blocks.parameters():
                p.add_(1.0)
    swapper = shared_swapper(model, "blocks.*", CONFIG, device=info.device)
    out["shared_bytes"] = swapper.stats().shared_bytes
    out["local_ranks"] = swapper.master_memory.local_ranks if swapper.master_memory else []
    probe = torch.randn(3, IN, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    with torch.no_grad():
        before = model(probe).flatten()
    ddp = wrap_ddp(model, swapper)
    with torch.no_grad():
        after = ddp.module(probe).flatten()
    gathered = [torch.zeros_like(after) for _ in range(info.world_size)]
    dist.all_gather(gathered, after)
    out["equal_after"] = all(torch.equal(g, gathered[0]) for g in gathered)
    rank0_before = before.clone()
    dist.broadcast(rank0_before, 0)
    out["differed_before"] = not torch.equal(before, rank0_before)
    out["same_as_rank0_model"] = torch.equal(after, rank0_before)
    swapper.detach()


def scenario_one_node_without_room(info: Any, out: dict[str, Any]) -> None:
    """Two nodes (``--fake-hosts``); the second has no tmpfs to share in. Node 0 shares, node 1
    pins per rank, and nobody waits forever in a collective the other node skipped."""
    from vramkit.distributed import NodeSharedMasters

    node = info.rank // 2
    model = Net(lora=True)
    memory = NodeSharedMasters(directory="/dev/shm" if node == 0 else "/nonexistent/vramkit")
    swapper = BlockSwapper(model, "blocks.*", CONFIG, device=info.device, master_memory=memory)
    out["shared_bytes"] = swapper.stats().shared_bytes
    out["reason"] = memory.reason
    out["grad_diff"] = lora_grad_diff(wrap_ddp(model, swapper), model, info)
    swapper.detach()


def scenario_fsdp(info: Any, out: dict[str, Any]) -> None:
    """FSDP2 and the swapper on one module: refused in both orders."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as exc:  # torch < 2.6
        out["skipped"] = f"no fully_shard: {exc}"
        return
    model = Net(lora=True)
    fully_shard(model)
    try:
        BlockSwapper(model, "blocks.*", CONFIG, device=info.device)
        out["before"] = None
    except ConfigError as exc:
        out["before"] = str(exc)
    model = Net(lora=True)
    swapper = BlockSwapper(model, "blocks.*", CONFIG, device=info.device)
    try:
        fully_shard(model)
        x, _ = batch(0)
        model(shard(x, info.rank, info.world_size))
        out["after"] = None
    except ConfigError as exc:
        out["after"] = str(exc)
    except Exception as exc:  # FSDP itself refused first: say what it said
        out["after"] = f"fsdp: {type(exc).__name__}: {exc}"
    swapper.detach()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", required=True)
    parser.add_argument("--fake-hosts", type=int, default=0,
                        help="pretend the ranks run on hosts of this many ranks each")
    args = parser.parse_args()
    if args.fake_hosts:
        import socket

        per_host = args.fake_hosts
        rank = int(os.environ["RANK"])
        socket.gethostname = lambda: f"fake-node-{rank // per_host}"  # type: ignore[assignment]
    info = init_from_env()
    global DEVICE
    DEVICE = info.device
    if DEVICE.type == "cuda":  # compare in full fp32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    directory = Path(args.out)
    for name in args.scenarios.split(","):
        result: dict[str, Any] = {"rank": info.rank, "world_size": info.world_size,
                                  "local_rank": info.local_rank, "backend": info.backend}
        try:
            if name == "lora":
                scenario_lora(info, result)
            elif name == "sharded":
                scenario_sharded(info, result)
            elif name == "sharded_compressed":
                scenario_sharded_compressed(info, result)
            elif name == "plain_ddp":
                scenario_plain_ddp(info, result)
            elif name in ("full_cpu", "full_swap"):
                scenario_full(info, result, name.split("_")[1])
            elif name in ("accumulate_cpu", "accumulate_swap"):
                scenario_accumulate(info, result, name.split("_")[1])
            elif name == "pss":
                scenario_pss(info, result, directory)
            elif name == "fsdp":
                scenario_fsdp(info, result)
            elif name == "shm_fallback":
                scenario_shm_fallback(info, result)
            elif name == "fit_rank":
                scenario_fit_rank(info, result)
            elif name == "two_nodes":
                scenario_two_nodes(info, result)
            elif name == "one_node_without_room":
                scenario_one_node_without_room(info, result)
            else:
                raise SystemExit(f"unknown scenario {name}")
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["traceback"] = traceback.format_exc()
        (directory / f"{name}-rank{info.rank}.json").write_text(json.dumps(result))
        dist.barrier()
    shutdown()  # DDP reducers in reference cycles go before the group does
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
