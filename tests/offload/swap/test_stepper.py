"""Full fine-tuning with ``SwapConfig(trainable="swap")``: block optimizers stepped on the device
inside backward, weights and optimizer state travelling together (``vramkit.offload.swap.stepper``).

Every training test runs the same job twice -- the plain model with one optimizer over all its
parameters, and the swapped model with a resident optimizer plus the swapper's block optimizers --
and compares parameters after several steps (CPU: the same kernels run, so they match to 1e-6 or
exactly).
"""

from __future__ import annotations

import copy
import gc
import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from vramkit.errors import ConfigError, OffloadError
from vramkit.memory.transfer import HostStreams, StreamOp
from vramkit.offload.checkpointing import enable_gradient_checkpointing
from vramkit.offload.swap import BlockSwapper, SwapConfig
from vramkit.offload.swap import swapper as swapper_module
from vramkit.optim import AdamW8bit

D = 32
MIN = 1024  # Linear weights (>= 8 KiB) swap; biases and norms stay resident

Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@pytest.fixture(autouse=True)
def _collect_swappers():
    """Swappers left attached here are freed now (they release PyTorch's global registration
    hooks when collected), not in the middle of another module's hook-counting test."""
    yield
    gc.collect()


class Block(nn.Module):
    def __init__(self, lora: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        if lora:
            self.lora_a = nn.Parameter(torch.randn(2, D) * 0.1)
            self.lora_b = nn.Parameter(torch.randn(2 * D, 2) * 0.1)
        else:
            self.lora_a = self.lora_b = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.norm(x))
        if self.lora_a is not None and self.lora_b is not None:
            h = h + (self.norm(x) @ self.lora_a.t()) @ self.lora_b.t()
        return x + self.fc2(torch.relu(h))


class Net(nn.Module):
    def __init__(self, blocks: int = 4, lora: bool = False, reuse: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList([Block(lora) for _ in range(blocks)])
        self.out = nn.Linear(D, 1)
        self.reuse = reuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        if self.reuse:  # the first block runs twice: one step over both calls' gradients
            x = self.blocks[0](x)
        return self.out(x)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def adamw8bit(params: Any) -> torch.optim.Optimizer:
    return AdamW8bit(params, lr=1e-2, weight_decay=0.1, min_8bit_size=256, block_size=64)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def adafactor(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(params, lr=1e-2)


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, D, generator=g) for _ in range(n)]


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def make(factory: Factory = adamw, *, seed: int = 0, keep: int = 1, ckpt: bool = False,
         lora: bool = False, reuse: bool = False, full: tuple[int, ...] | None = None,
         **config: Any) -> tuple[Net, Net, BlockSwapper]:
    """(reference model, swapped model, swapper). ``full``: indices of blocks fully trained
    (the others frozen, with LoRA adapters when ``lora``)."""
    torch.manual_seed(seed)
    ref = Net(lora=lora, reuse=reuse)
    if full is not None:
        for i, block in enumerate(ref.blocks):
            if i not in full:
                for name, p in block.named_parameters():
                    p.requires_grad_(name.startswith("lora"))
    model = copy.deepcopy(ref)
    if ckpt:
        enable_gradient_checkpointing(ref, "blocks")
        enable_gradient_checkpointing(model, "blocks")
    swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=keep, min_param_bytes=MIN,
                                                    trainable="swap", **config),
                           device="cpu", optimizer=factory)
    return ref, model, swapper


def assert_same(ref: nn.Module, model: nn.Module, atol: float = 1e-6) -> None:
    got = model.state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(got[name], value, atol=atol, rtol=0, msg=name)


def train_reference(ref: Net, factory: Factory, xs: list[torch.Tensor], *, accumulate: int = 1,
                    clip: float | None = None) -> list[float]:
    opt = factory([p for p in ref.parameters() if p.requires_grad])
    losses = []
    for i, x in enumerate(xs):
        loss = loss_of(ref, x)
        loss.backward()
        losses.append(float(loss.detach()))
        if (i + 1) % accumulate == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(
                    [p for p in ref.parameters() if p.requires_grad], clip)
            opt.step()
            opt.zero_grad()
    return losses


def train_swapped(model: Net, swapper: BlockSwapper, factory: Factory, xs: list[torch.Tensor],
                  *, accumulate: int = 1, clip: bool = False,
                  resident: torch.optim.Optimizer | None = None) -> list[float]:
    opt = resident if resident is not None else factory(swapper.optimizer_parameters())
    losses = []
    for i, x in enumerate(xs):
        loss = loss_of(model, x)
        loss.backward()
        losses.append(float(loss.detach()))
        if (i + 1) % accumulate == 0:
            if clip:
                swapper.clip_grad_norm_()
            opt.step()
            swapper.optimizer.step()
            opt.zero_grad()
    return losses


# --------------------------------------------------------------------------------------------
# Same parameters as the resident model
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("factory", [adamw, adamw8bit, sgd, adafactor],
                         ids=["adamw", "adamw8bit", "sgd", "adafactor"])
@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_matches_resident_training(factory: Factory, ckpt: bool) -> None:
    ref, model, swapper = make(factory, ckpt=ckpt)
    xs = batches(4)
    expected = train_reference(ref, factory, xs)
    got = train_swapped(model, swapper, factory, xs)
    assert got == pytest.approx(expected, abs=1e-6)
    assert_same(ref, model)
    stats = swapper.stats()
    assert stats.swapped_blocks == 3
    assert stats.optimizer_steps == 3 * 4
    swapper.detach()
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=0, msg=name)


def test_every_block_swapped_and_gradients_never_reach_the_host() -> None:
    ref, model, swapper = make(adamw, keep=0)
    xs = batches(3)
    train_reference(ref, adamw, xs)
    train_swapped(model, swapper, adamw, xs)
    assert_same(ref, model)
    assert swapper._host.grad_pool is None  # no pinned gradient buffer without accumulation/clipping
    stats = swapper.stats()
    swapped = stats.swapped_bytes
    # Per step: the updated weights and the state come back; nothing else (no gradients).
    assert stats.d2h_bytes == 3 * (stats.swapped_bytes + stats.state_bytes)
    assert stats.state_bytes == pytest.approx(2 * swapped, rel=0.05)  # AdamW: m and v
    assert stats.pinned_bytes <= 1.05 * (swapped + stats.state_bytes)
    assert stats.state_slot_bytes >= 2 * max(b.nbytes for b in swapper.blocks) * 2


def test_block_called_twice_steps_once_over_both_gradients() -> None:
    ref, model, swapper = make(adamw, reuse=True)
    xs = batches(3)
    train_reference(ref, adamw, xs)
    train_swapped(model, swapper, adamw, xs)
    assert_same(ref, model)
    assert swapper.stats().optimizer_steps == 3 * 3


def test_lora_and_full_blocks_mixed() -> None:
    """Blocks 0 and 2 fully trained (their weights swap with their state); 1 and 3 frozen
    with LoRA adapters (their adapters are resident, stepped by the user's optimizer)."""
    ref, model, swapper = make(adamw, keep=0, lora=True, full=(0, 2))
    xs = batches(4)
    train_reference(ref, adamw, xs)
    train_swapped(model, swapper, adamw, xs)
    assert_same(ref, model)
    stepped = set(swapper.optimizer.optimizers)
    assert stepped == {"blocks.0", "blocks.2"}
    resident = {id(p) for p in swapper.optimizer_parameters()}
    assert id(model.blocks[1].lora_a) in resident
    assert id(model.blocks[0].fc1.weight) not in resident


def test_quantized_frozen_blocks_elsewhere() -> None:
    from vramkit.quant.model import QuantizationConfig, quantize_model

    torch.manual_seed(0)
    ref = Net()
    for block in ref.blocks[2:]:
        block.requires_grad_(False)
    quantize_model(ref.blocks[2], QuantizationConfig(weights_dtype="int8"))
    quantize_model(ref.blocks[3], QuantizationConfig(weights_dtype="int8"))
    model = copy.deepcopy(ref)
    swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=0, min_param_bytes=MIN,
                                                    trainable="swap"),
                           device="cpu", optimizer=adamw)
    assert set(swapper.optimizer.optimizers) == {"blocks.0", "blocks.1"}
    assert len(swapper.blocks) == 4  # the packed int8 blocks swap too (frozen, host->device)
    xs = batches(3)
    train_reference(ref, adamw, xs)
    train_swapped(model, swapper, adamw, xs)
    assert_same(ref, model)


# --------------------------------------------------------------------------------------------
# Accumulation, clipping, schedulers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_gradient_accumulation(ckpt: bool) -> None:
    ref, model, swapper = make(adamw, accumulation_steps=3, ckpt=ckpt)
    xs = batches(6)
    train_reference(ref, adamw, xs, accumulate=3)
    train_swapped(model, swapper, adamw, xs, accumulate=3)
    assert_same(ref, model)
    stats = swapper.stats()
    assert stats.optimizer_steps == 3 * 2
    assert swapper._host.grad_pool is not None


def test_accumulation_moves_gradients_only_for_the_first_micro_batches() -> None:
    _, model, swapper = make(adamw, keep=0, accumulation_steps=2)
    train_swapped(model, swapper, adamw, batches(2), accumulate=2)
    s = swapper.stats()
    grads = sum(e.nbytes for b in swapper.blocks for e in b.trainable_entries)
    # micro-batch 1 parks the gradients, micro-batch 2 takes them back and steps.
    assert s.d2h_bytes == grads + s.swapped_bytes + s.state_bytes


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("factory", [adamw, adamw8bit], ids=["adamw", "adamw8bit"])
def test_clipping_by_global_norm(accumulate: int, factory: Factory) -> None:
    ref, model, swapper = make(factory, max_grad_norm=0.05, accumulation_steps=accumulate)
    xs = batches(4)
    train_reference(ref, factory, xs, accumulate=accumulate, clip=0.05)
    train_swapped(model, swapper, factory, xs, accumulate=accumulate, clip=True)
    assert_same(ref, model)


def test_clip_norm_is_the_global_norm() -> None:
    ref, model, swapper = make(adamw, max_grad_norm=1e9)
    x = batches(1)[0]
    loss_of(ref, x).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    loss_of(model, x).backward()
    total = swapper.clip_grad_norm_()
    torch.testing.assert_close(total, expected, atol=1e-6, rtol=1e-6)


def test_clipping_is_applied_at_step_not_in_backward() -> None:
    _, model, swapper = make(adamw, max_grad_norm=0.05)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss_of(model, batches(1)[0]).backward()
    assert swapper.stats().optimizer_steps == 0  # deferred
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(OffloadError, match="clipped"):
        swapper.optimizer.step()  # clip first
    with pytest.raises(OffloadError, match="deferred optimizer step"):
        loss_of(model, batches(1)[0])  # a forward with the step still waiting
    swapper.clip_grad_norm_()
    swapper.optimizer.step()
    assert swapper.stats().optimizer_steps == 3
    loss_of(model, batches(1)[0]).backward()  # a new step starts cleanly


def test_lr_schedulers_reach_every_block() -> None:
    ref, model, swapper = make(adamw)
    xs = batches(5)
    opt_ref = adamw(ref.parameters())
    sched_ref = torch.optim.lr_scheduler.LambdaLR(opt_ref, lambda s: 1.0 / (s + 1))
    opt = adamw(swapper.optimizer_parameters())
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1))
              for o in (opt, swapper.optimizer)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        for x in xs:
            loss_of(ref, x).backward()
            opt_ref.step()
            opt_ref.zero_grad()
            sched_ref.step()
            loss_of(model, x).backward()
            opt.step()
            swapper.optimizer.step()
            opt.zero_grad()
            for s in scheds:
                s.step()
    assert_same(ref, model)
    lrs = [g["lr"] for g in swapper.optimizer.param_groups]
    assert lrs == pytest.approx([1e-2 / 6] * 3)
    assert len(swapper.optimizer.param_groups) == 3


def test_one_cycle_scheduler_reads_betas() -> None:
    _, _, swapper = make(adamw)
    sched = torch.optim.lr_scheduler.OneCycleLR(swapper.optimizer, max_lr=0.1, total_steps=10)
    swapper.optimizer.step()
    sched.step()
    assert all("initial_lr" in g for g in swapper.optimizer.param_groups)


# --------------------------------------------------------------------------------------------
# Checkpoints: save and resume
# --------------------------------------------------------------------------------------------


def _saved(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("factory", [adamw, adamw8bit], ids=["adamw", "adamw8bit"])
def test_save_and_resume_mid_run(factory: Factory) -> None:
    ref, model, swapper = make(factory)
    xs = batches(4)
    train_reference(ref, factory, xs)

    opt = factory(swapper.optimizer_parameters())
    train_swapped(model, swapper, factory, xs[:2], resident=opt)
    checkpoint = _saved({"model": model.state_dict(), "opt": opt.state_dict(),
                         "swapped": swapper.optimizer.state_dict()})
    swapper.detach()

    torch.manual_seed(123)  # different initial weights: everything must come from the file
    fresh = Net()
    fresh.load_state_dict(checkpoint["model"])
    resumed = BlockSwapper(fresh, config=SwapConfig(max_gpu_blocks=1, min_param_bytes=MIN,
                                                    trainable="swap"),
                           device="cpu", optimizer=factory)
    opt2 = factory(resumed.optimizer_parameters())
    opt2.load_state_dict(checkpoint["opt"])
    resumed.optimizer.load_state_dict(checkpoint["swapped"])
    train_swapped(fresh, resumed, factory, xs[2:], resident=opt2)
    assert_same(ref, fresh)


def test_resume_into_an_attached_swapper_through_state_dicts() -> None:
    """load_state_dict on the model and the optimizer while attached, after steps were taken
    (state already adopted): the masters are overwritten in place."""
    ref, model, swapper = make(adamw)
    xs = batches(4)
    train_reference(ref, adamw, xs[:2])
    saved_ref = _saved(ref.state_dict())
    opt_ref = adamw(ref.parameters())  # rebuild the reference's optimizer state from scratch
    opt = adamw(swapper.optimizer_parameters())
    train_swapped(model, swapper, adamw, xs[:2], resident=opt)
    checkpoint = _saved({"model": model.state_dict(), "opt": opt.state_dict(),
                         "swapped": swapper.optimizer.state_dict()})
    train_swapped(model, swapper, adamw, xs[2:], resident=opt)  # diverge, then rewind
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    swapper.optimizer.load_state_dict(checkpoint["swapped"])
    train_swapped(model, swapper, adamw, xs[2:], resident=opt)
    del opt_ref, saved_ref
    ref2, _, _ = make(adamw)
    train_reference(ref2, adamw, xs)
    assert_same(ref2, model)


def test_optimizer_state_dict_holds_values_not_placeholders() -> None:
    _, model, swapper = make(adamw)
    train_swapped(model, swapper, adamw, batches(2))
    sd = swapper.optimizer.state_dict()
    state = sd["blocks"]["blocks.0"]["state"]
    exp_avg = state[0]["exp_avg"]
    assert exp_avg.device.type == "cpu" and exp_avg.abs().sum() > 0
    assert exp_avg.stride() != (0, 0)
    # Between steps the live state holds placeholders, never the values of another block.
    live = next(iter(swapper.optimizer.optimizers["blocks.0"].state.values()))
    assert live["exp_avg"].stride() == (0, 0)


def test_load_state_dict_refuses_other_blocks() -> None:
    _, model, swapper = make(adamw)
    train_swapped(model, swapper, adamw, batches(1))
    sd = swapper.optimizer.state_dict()
    del sd["blocks"]["blocks.0"]
    with pytest.raises(ConfigError, match="do not match"):
        swapper.optimizer.load_state_dict(sd)
    with pytest.raises(ConfigError, match="blocks"):
        swapper.optimizer.load_state_dict({"state": {}})


def test_detach_keeps_the_block_optimizers_usable() -> None:
    ref, model, swapper = make(adamw)
    xs = batches(3)
    train_reference(ref, adamw, xs)
    opt = adamw(swapper.optimizer_parameters())
    train_swapped(model, swapper, adamw, xs[:2], resident=opt)
    block_opts = list(swapper.optimizer.optimizers.values())
    swapper.detach()
    # Continue without swapping: the block optimizers hold real state on the model's device.
    loss_of(model, xs[2]).backward()
    opt.step()
    for o in block_opts:
        o.step()
    assert_same(ref, model)


# --------------------------------------------------------------------------------------------
# Streams: what waits for what
# --------------------------------------------------------------------------------------------


def test_write_back_and_reload_ordering(monkeypatch: pytest.MonkeyPatch) -> None:
    ops: list[StreamOp] = []
    streams = HostStreams(log=ops)
    monkeypatch.setattr(swapper_module, "transfer_streams", lambda device: streams)
    _, model, swapper = make(adamw, keep=0, num_slots=2)
    train_swapped(model, swapper, adamw, batches(2))
    copies = [op for op in ops if op.kind == "copy"]
    # State travels: host->device before a step (from the second step on) and back after.
    assert any(op.stream == "h2d" and op.what.endswith(" state") for op in copies)
    assert any(op.stream == "d2h" and op.what.endswith(" state") for op in copies)
    assert not any(op.stream == "compute" for op in copies)
    # A block's write-back into its master is waited for (on the copy stream) before that
    # master is read again.
    checked = 0
    for i, op in enumerate(ops):
        if op.kind != "record" or op.stream != "d2h" or i == 0:
            continue
        prior = ops[i - 1]
        if prior.kind != "copy" or prior.stream != "d2h":
            continue
        name = prior.what.removesuffix(" state")
        reads = [j for j, o in enumerate(ops) if j > i and o.kind == "copy" and o.stream == "h2d"
                 and o.what.removesuffix(" state") == name]
        if reads:
            waits = [o for o in ops[i:reads[0]] if o.kind == "wait" and o.stream == "h2d"
                     and o.event == op.event]
            assert waits, f"{name} was read back before its write-back {op.event} landed"
            checked += 1
    assert checked


@pytest.mark.parametrize("accumulate", [1, 2])
def test_states_follow_their_weights_when_prefetched_in_backward(
        monkeypatch: pytest.MonkeyPatch, accumulate: int) -> None:
    """With more than two slots a block's state is loaded right behind its prefetched weights
    (not when its backward begins, queued behind later blocks' weights); only for a backward
    that steps; the parameters still equal the resident model's."""
    ops: list[StreamOp] = []
    streams = HostStreams(log=ops)
    monkeypatch.setattr(swapper_module, "transfer_streams", lambda device: streams)
    ref, model, swapper = make(adamw, keep=0, num_slots=3, accumulation_steps=accumulate)
    xs = batches(3 * accumulate)
    train_reference(ref, adamw, xs, accumulate=accumulate)
    train_swapped(model, swapper, adamw, xs, accumulate=accumulate)
    stats = swapper.stats()
    assert stats.state_prefetched > 0
    assert stats.state_slot_bytes >= 3 * max(b.nbytes for b in swapper._stepper.by_block.values())
    h2d = [op.what for op in ops if op.kind == "copy" and op.stream == "h2d"]
    behind = [i for i, what in enumerate(h2d) if what.endswith(" state") and i
              and h2d[i - 1] == what.removesuffix(" state")]
    assert behind  # (a block whose weights were still in a slot has no weight copy to follow)
    swapper.detach()
    assert_same(ref, model)


def test_masters_version_unchanged_by_write_back() -> None:
    """Write-backs make master and slot equal: slots of other blocks stay valid (hits)."""
    _, model, swapper = make(adamw, keep=0, num_slots=4)  # 4 blocks, 4 slots: all stay loaded
    train_swapped(model, swapper, adamw, batches(1))
    swapper.reset_stats()
    train_swapped(model, swapper, adamw, batches(1))
    assert swapper.stats().loads == 0


# --------------------------------------------------------------------------------------------
# Clear errors
# --------------------------------------------------------------------------------------------


def test_config_errors() -> None:
    model = Net()
    with pytest.raises(ConfigError, match="optimizer=factory"):
        BlockSwapper(model, config=SwapConfig(trainable="swap"), device="cpu")
    with pytest.raises(ConfigError, match="callable"):
        BlockSwapper(model, config=SwapConfig(trainable="swap"), device="cpu",
                     optimizer=torch.optim.AdamW([nn.Parameter(torch.zeros(1))]))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="trainable='swap'"):
        BlockSwapper(model, config=SwapConfig(trainable="cpu"), device="cpu", optimizer=adamw)
    with pytest.raises(ConfigError, match="accumulation_steps"):
        SwapConfig(accumulation_steps=2)
    with pytest.raises(ConfigError, match="max_grad_norm"):
        SwapConfig(trainable="cpu", max_grad_norm=1.0)
    with pytest.raises(ConfigError, match="max_grad_norm"):
        SwapConfig(trainable="swap", max_grad_norm=0)
    with pytest.raises(ConfigError, match="accumulation_steps"):
        SwapConfig(trainable="swap", accumulation_steps=0)


def test_factory_errors() -> None:
    model = Net()
    with pytest.raises(ConfigError, match=r"not a torch\.optim\.Optimizer"):
        BlockSwapper(model, config=SwapConfig(trainable="swap", min_param_bytes=MIN),
                     device="cpu", optimizer=lambda ps: object())  # type: ignore[arg-type,return-value]
    # The failed attach left the model as it was.
    assert all(p.stride() != () or p.dim() == 0 for p in model.parameters())
    assert model.blocks[0].fc1.weight.untyped_storage().nbytes() > 0
    with pytest.raises(ConfigError, match="exactly"):
        BlockSwapper(model, config=SwapConfig(trainable="swap", min_param_bytes=MIN),
                     device="cpu", optimizer=lambda ps: torch.optim.AdamW(model.parameters()))
    model(torch.randn(2, D)).sum().backward()  # still a plain, working model


def test_api_outside_swap_mode() -> None:
    frozen = Net().requires_grad_(False)
    swapper = BlockSwapper(frozen, config=SwapConfig(min_param_bytes=MIN), device="cpu")
    with pytest.raises(ConfigError, match="trainable='swap'"):
        swapper.optimizer  # noqa: B018
    with pytest.raises(ConfigError, match="clip_grad_norm_"):
        swapper.clip_grad_norm_(1.0)
    _, _, swapped = make(adamw)
    with pytest.raises(ConfigError, match="max_grad_norm"):
        swapped.clip_grad_norm_(1.0)  # in-backward steps: no global norm to clip by
    with pytest.raises(ConfigError, match="no new parameter groups"):
        swapped.optimizer.add_param_group({"params": []})
    with pytest.raises(ConfigError, match="closure"):
        swapped.optimizer.step(lambda: 0.0)


def test_clip_max_norm_is_validated() -> None:
    _, model, swapper = make(adamw, max_grad_norm=1.0)
    loss_of(model, batches(1)[0]).backward()
    for bad in (0, -1.0, float("nan"), "1"):
        with pytest.raises(ConfigError, match="max_norm"):
            swapper.clip_grad_norm_(bad)  # type: ignore[arg-type]
    swapper.clip_grad_norm_(2.0)
    swapper.optimizer.step()


def test_clip_mid_accumulation_window_is_refused() -> None:
    _, model, swapper = make(adamw, max_grad_norm=1.0, accumulation_steps=2)
    loss_of(model, batches(1)[0]).backward()
    with pytest.raises(OffloadError, match="accumulation window"):
        swapper.clip_grad_norm_()


def test_zero_grad_forgets_host_accumulation() -> None:
    ref, model, swapper = make(adamw, accumulation_steps=2)
    xs = batches(3)
    loss_of(model, xs[0]).backward()  # half a window, then thrown away
    swapper.optimizer.zero_grad()
    for p in swapper.optimizer_parameters():
        p.grad = None
    train_reference(ref, adamw, xs[1:], accumulate=2)
    train_swapped(model, swapper, adamw, xs[1:], accumulate=2)
    assert_same(ref, model)


def test_repr_and_stats() -> None:
    _, model, swapper = make(adamw8bit)
    assert "3 block optimizers, AdamW8bit" in repr(swapper.optimizer)
    train_swapped(model, swapper, adamw8bit, batches(1))
    stats = swapper.stats()
    assert stats.as_dict()["optimizer_steps"] == 3
    assert 0 < stats.state_bytes < stats.swapped_bytes  # 8-bit moments: ~1 byte/param each


def test_forward_without_backward_does_not_delay_steps() -> None:
    """A grad-enabled forward whose graph is dropped (a validation loss, say) leaves no call
    waiting: the next backward still steps every block."""
    ref, model, swapper = make(adamw)
    xs = batches(3)
    train_reference(ref, adamw, xs)
    opt = adamw(swapper.optimizer_parameters())
    for i, x in enumerate(xs):
        if i == 1:
            dropped = loss_of(model, x)
            del dropped
        train_swapped(model, swapper, adamw, [x], resident=opt)
    assert_same(ref, model)
    assert swapper.stats().optimizer_steps == 3 * 3


def test_dropped_graph_is_freed() -> None:
    """Saved tensors of a graph dropped without backward are freed (a saved output returned as
    is by the swapper's pack hook would hold its own grad_fn: a cycle through C++)."""
    from vramkit.offload.swap.records import WeightRef

    _, model, swapper = make(adamw)
    for _ in range(3):
        dropped = loss_of(model, batches(1)[0])
        del dropped
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, WeightRef)]
    swapper.detach()


def test_bf16_weights_with_fp32_master_in_the_travelling_state() -> None:
    """Mixed precision: bf16 weights, AdamW8bit(master_weights=True) keeps the fp32 master in
    the optimizer state, which lives in the block's host master and travels with it."""

    def factory(params: Any) -> torch.optim.Optimizer:
        return AdamW8bit(params, lr=1e-3, min_8bit_size=256, block_size=64, master_weights=True)

    torch.manual_seed(0)
    ref = Net().to(torch.bfloat16)
    model = copy.deepcopy(ref)
    swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=1, min_param_bytes=MIN // 2,
                                                    trainable="swap"),
                           device="cpu", optimizer=factory)
    xs = [x.to(torch.bfloat16) for x in batches(3)]
    train_reference(ref, factory, xs)
    train_swapped(model, swapper, factory, xs)
    assert_same(ref, model, atol=0)
    stats = swapper.stats()
    # fp32 master (4 bytes) + 8-bit moments (~2 bytes) per 2-byte weight.
    assert stats.state_bytes >= 2.5 * stats.swapped_bytes
    sd = swapper.optimizer.state_dict()["blocks"]["blocks.0"]["state"]
    master = next(v["master"] for v in sd.values() if "master" in v)
    assert master.dtype == torch.float32
    swapper.detach()
