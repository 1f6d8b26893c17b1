"""CPU tests of CPUOffloadOptimizer: exact equality with torch.optim.AdamW, modes, errors.

fp32 CPU parameters are stepped in place; bf16 CPU parameters go through the same path as GPU
parameters (fp32 master in a host pool, staging buffer, copies through HostStreams, worker thread).
"""

from __future__ import annotations

import copy
import gc
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

from vramkit.errors import ConfigError, OffloadError
from vramkit.memory.pool import MemoryPool
from vramkit.memory.transfer import HostStreams
from vramkit.offload import optimizer as offload_optimizer
from vramkit.offload.optimizer import CPUOffloadOptimizer

HYPER = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.8, 0.95)}
MODES = [(True, True), (True, False), (False, True), (False, False)]  # (offload_grads, overlap)


def make_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, 4)).to(dtype)


def batch(step: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(6, 8, generator=gen).to(dtype)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


class Reference:
    """AdamW on fp32 masters of ``model``'s params; gradients summed in fp32; cast back."""

    def __init__(self, model: nn.Module, max_grad_norm: float | None = None, **kwargs: object):
        self.model = model
        self.masters = [p.detach().float().clone() for p in model.parameters()]
        kwargs.setdefault("fused", True)
        self.opt = torch.optim.AdamW(self.masters, **kwargs)  # type: ignore[arg-type]
        self.max_grad_norm = max_grad_norm
        self.grads: list[torch.Tensor | None] = [None] * len(self.masters)

    def backward(self, x: torch.Tensor) -> None:
        loss_of(self.model, x).backward()
        for i, p in enumerate(self.model.parameters()):
            g = p.grad.float()
            self.grads[i] = g.clone() if self.grads[i] is None else self.grads[i] + g
            p.grad = None

    def step(self) -> None:
        for master, grad in zip(self.masters, self.grads, strict=True):
            master.grad = grad
        if self.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.masters, self.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad()
        self.grads = [None] * len(self.masters)
        with torch.no_grad():
            for p, master in zip(self.model.parameters(), self.masters, strict=True):
                p.copy_(master)


def assert_params_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, dtype: torch.dtype,
          micro: int = 1, after_step: Callable[[], None] | None = None) -> None:
    for step in range(steps):
        for m in range(micro):
            loss_of(model, batch(step * micro + m, dtype)).backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step()


# -- equality with torch.optim.AdamW ------------------------------------------------------------


@pytest.mark.parametrize(("offload_gradients", "overlap"), MODES)
def test_fp32_host_params_equal_adamw(offload_gradients: bool, overlap: bool) -> None:
    model, ref = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    with CPUOffloadOptimizer(model.parameters(), offload_gradients=offload_gradients,
                             overlap=overlap, **HYPER) as opt:
        train(model, opt, 4, torch.float32)
        train(ref, ref_opt, 4, torch.float32)
        assert_params_equal(model, ref)
        stats = opt.stats()
        assert (stats.host_params, stats.staged_host_params, stats.pinned_bytes) == (6, 0, 0)
        assert stats.grads_transferred == 0  # in place: no copies


@pytest.mark.parametrize(("offload_gradients", "overlap"), MODES)
def test_bf16_params_step_fp32_masters_like_adamw(offload_gradients: bool, overlap: bool) -> None:
    model, ref_model = make_model(torch.bfloat16), make_model(torch.bfloat16)
    ref = Reference(ref_model, **HYPER)
    with CPUOffloadOptimizer(model.parameters(), offload_gradients=offload_gradients,
                             overlap=overlap, **HYPER) as opt:
        for step in range(4):
            loss_of(model, batch(step, torch.bfloat16)).backward()
            opt.step()
            opt.zero_grad()
            ref.backward(batch(step, torch.bfloat16))
            ref.step()
        assert_params_equal(model, ref_model)
        for slot, master in zip(opt._slots, ref.masters, strict=True):
            assert torch.equal(slot.master, master)  # the fp32 masters too, not only the casts
        stats = opt.stats()
        assert stats.staged_host_params == 6 and stats.grads_transferred == 4 * 6
        assert stats.h2d_bytes == 4 * sum(p.nbytes for p in model.parameters())


def test_overlap_and_non_overlap_agree() -> None:
    results = []
    for overlap in (True, False):
        model = make_model(torch.bfloat16)
        with CPUOffloadOptimizer(model.parameters(), overlap=overlap, **HYPER) as opt:
            train(model, opt, 3, torch.bfloat16)
        results.append(model)
    assert_params_equal(*results)


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_updates_during_backward(overlap: bool) -> None:
    model = make_model(torch.bfloat16)
    with CPUOffloadOptimizer(model.parameters(), overlap=overlap, **HYPER) as opt:
        before = [slot.master.clone() for slot in opt._slots]
        loss_of(model, batch(0, torch.bfloat16)).backward()
        opt._drain()  # let the worker finish what backward handed it (step() would too)
        changed = [not torch.equal(b, slot.master) for b, slot in zip(before, opt._slots, strict=True)]
        assert all(changed) if overlap else not any(changed)
        params_before = [p.clone() for p in model.parameters()]
        opt.step()  # publishes the update either way
        assert all(not torch.equal(b, p) for b, p in zip(params_before, model.parameters(),
                                                      strict=True))


def test_mixed_host_and_staged_params() -> None:
    model, ref_model = make_model(), make_model()
    model[4].to(torch.bfloat16)
    ref_model[4].to(torch.bfloat16)

    def run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = m[3](m[2](m[1](m[0](x))))
        return m[4](h.to(torch.bfloat16)).float().pow(2).mean()

    ref = Reference(ref_model, **HYPER)
    with CPUOffloadOptimizer(model.parameters(), **HYPER) as opt:
        for step in range(3):
            run(model, batch(step, torch.float32)).backward()
            opt.step()
            opt.zero_grad()
            run(ref_model, batch(step, torch.float32)).backward()
            for i, p in enumerate(ref_model.parameters()):
                ref.grads[i] = p.grad.float()
                p.grad = None
            ref.step()
        assert_params_equal(model, ref_model)
        stats = opt.stats()
        assert (stats.host_params, stats.staged_host_params) == (4, 2)


def test_fused_is_the_default_for_adamw_only() -> None:
    with CPUOffloadOptimizer(make_model().parameters()) as opt:
        assert opt.defaults["fused"] is True
    with CPUOffloadOptimizer(make_model().parameters(), foreach=False) as opt:
        assert opt.defaults["fused"] is None and opt.defaults["foreach"] is False
    with CPUOffloadOptimizer(make_model().parameters(), torch.optim.SGD, lr=0.1) as opt:
        assert isinstance(opt.inner, torch.optim.SGD) and opt.defaults["fused"] is None


def test_other_optimizer_class_with_momentum_state() -> None:
    model, ref = make_model(torch.bfloat16), make_model(torch.bfloat16)
    masters = [p.detach().float().clone() for p in ref.parameters()]
    ref_opt = torch.optim.SGD(masters, lr=0.05, momentum=0.9)
    with CPUOffloadOptimizer(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9) as opt:
        for step in range(3):
            loss_of(model, batch(step, torch.bfloat16)).backward()
            opt.step()
            opt.zero_grad()
            loss_of(ref, batch(step, torch.bfloat16)).backward()
            for master, p in zip(masters, ref.parameters(), strict=True):
                master.grad = p.grad.float()
                p.grad = None
            ref_opt.step()
            with torch.no_grad():
                for master, p in zip(masters, ref.parameters(), strict=True):
                    p.copy_(master)
        assert_params_equal(model, ref)
        assert opt.stats().state_bytes == sum(m.nbytes for m in masters)  # momentum buffers


# -- schedulers, groups, state dicts ------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_lr_scheduler_drives_the_update(overlap: bool, dtype: torch.dtype) -> None:
    model, ref_model = make_model(dtype), make_model(dtype)
    ref = Reference(ref_model, **HYPER)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref.opt, step_size=1, gamma=0.25)
    with CPUOffloadOptimizer(model.parameters(), overlap=overlap, **HYPER) as opt:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.25)
        for step in range(4):
            loss_of(model, batch(step, dtype)).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            ref.backward(batch(step, dtype))
            ref.step()
            ref_sched.step()
        assert sched.get_last_lr() == pytest.approx([1e-2 * 0.25 ** 4])
        assert_params_equal(model, ref_model)


def test_param_groups_and_add_param_group() -> None:
    model, ref_model = make_model(torch.bfloat16), make_model(torch.bfloat16)
    first, second = list(model.parameters())[:4], list(model.parameters())[4:]
    ref = Reference(ref_model, **HYPER)
    ref_params = ref.opt.param_groups[0]["params"]
    ref.opt.param_groups[0]["params"] = ref_params[:4]
    ref.opt.add_param_group({"params": ref_params[4:], "lr": 0.1, "weight_decay": 0.0})
    with CPUOffloadOptimizer([{"params": first}], **HYPER) as opt:
        opt.add_param_group({"params": second, "lr": 0.1, "weight_decay": 0.0})
        assert [g["lr"] for g in opt.param_groups] == [1e-2, 0.1]
        for step in range(3):
            loss_of(model, batch(step, torch.bfloat16)).backward()
            opt.step()
            opt.zero_grad()
            ref.backward(batch(step, torch.bfloat16))
            ref.step()
        assert_params_equal(model, ref_model)
        with pytest.raises(ConfigError, match="twice"):
            opt.add_param_group({"params": first[:1]})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_resumes_exactly(dtype: torch.dtype) -> None:
    straight = make_model(dtype)
    with CPUOffloadOptimizer(straight.parameters(), **HYPER) as opt:
        train(straight, opt, 4, dtype)

    model = make_model(dtype)
    with CPUOffloadOptimizer(model.parameters(), **HYPER) as opt:
        train(model, opt, 2, dtype)
        saved_model = copy.deepcopy(model.state_dict())
        saved = opt.state_dict()
    assert set(saved) >= {"state", "param_groups", "masters"}
    assert len(saved["masters"]) == (6 if dtype == torch.bfloat16 else 0)

    resumed = make_model(dtype, seed=1)  # different weights: the checkpoint must win
    resumed.load_state_dict(saved_model)
    with CPUOffloadOptimizer(resumed.parameters(), **HYPER) as opt:
        opt.load_state_dict(saved)
        for step in range(2, 4):
            loss_of(resumed, batch(step, dtype)).backward()
            opt.step()
            opt.zero_grad()
    assert_params_equal(resumed, straight)


def test_loads_a_plain_adamw_state_dict() -> None:
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    train(ref, ref_opt, 2, torch.float32)
    model = copy.deepcopy(ref)
    with CPUOffloadOptimizer(model.parameters(), **HYPER) as opt:
        opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # else they share tensors
        for step in range(2, 4):
            for m, o in ((model, opt), (ref, ref_opt)):
                loss_of(m, batch(step, torch.float32)).backward()
                o.step()
                o.zero_grad()
    assert_params_equal(model, ref)


def test_refresh_masters_picks_up_outside_changes() -> None:
    model = make_model(torch.bfloat16)
    with CPUOffloadOptimizer(model.parameters(), lr=0.0, overlap=False) as opt:
        with torch.no_grad():
            model[0].weight.fill_(0.5)
        opt.refresh_masters()
        loss_of(model, batch(0, torch.bfloat16)).backward()
        opt.step()  # lr 0: the weights become the masters again
        assert torch.all(model[0].weight == 0.5)


# -- gradients: accumulation, clipping, zero_grad, offload ------------------------------------------


def test_offload_gradients_frees_param_grads() -> None:
    model = make_model(torch.bfloat16)
    with CPUOffloadOptimizer(model.parameters(), overlap=False) as opt:
        loss_of(model, batch(0, torch.bfloat16)).backward()
        assert all(p.grad is None for p in model.parameters())
        assert opt.stats().grads_transferred == 6
    model = make_model(torch.bfloat16)
    with CPUOffloadOptimizer(model.parameters(), offload_gradients=False) as opt:
        loss_of(model, batch(0, torch.bfloat16)).backward()
        assert all(p.grad is not None for p in model.parameters())
        assert opt.stats().grads_transferred == 0
        opt.step()
        assert opt.stats().grads_transferred == 6
        assert all(p.grad is not None for p in model.parameters())  # kept until zero_grad
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("offload_gradients", [True, False])
def test_gradient_accumulation_without_overlap(offload_gradients: bool) -> None:
    model, ref_model = make_model(torch.bfloat16), make_model(torch.bfloat16)
    ref = Reference(ref_model, **HYPER)
    with CPUOffloadOptimizer(model.parameters(), offload_gradients=offload_gradients,
                             overlap=False, **HYPER) as opt:
        for step in range(2):
            for micro in range(3):
                x = batch(step * 3 + micro, torch.bfloat16)
                loss_of(model, x).backward()
                ref.backward(x)
            opt.step()
            opt.zero_grad()
            ref.step()
        if offload_gradients:  # summed on the host in fp32, exactly like the reference
            assert_params_equal(model, ref_model)
        else:  # autograd summed the bf16 gradients in bf16: close, not equal
            for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
                torch.testing.assert_close(p, q, atol=2e-2, rtol=2e-2)


def test_zero_grad_clears_host_accumulation() -> None:
    model, ref_model = make_model(torch.bfloat16), make_model(torch.bfloat16)
    ref = Reference(ref_model, **HYPER)
    with CPUOffloadOptimizer(model.parameters(), overlap=False, **HYPER) as opt:
        loss_of(model, batch(7, torch.bfloat16)).backward()
        opt.zero_grad()  # discards the host gradients of that backward
        loss_of(model, batch(0, torch.bfloat16)).backward()
        opt.step()
    ref.backward(batch(0, torch.bfloat16))
    ref.step()
    assert_params_equal(model, ref_model)


def test_zero_grad_set_to_none_false_zeroes() -> None:
    model = make_model()
    with CPUOffloadOptimizer(model.parameters(), overlap=False) as opt:
        loss_of(model, batch(0, torch.float32)).backward()
        opt.zero_grad(set_to_none=False)
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulation_with_overlap_raises(dtype: torch.dtype) -> None:
    model = make_model(dtype)
    with CPUOffloadOptimizer(model.parameters()):
        loss_of(model, batch(0, dtype)).backward()
        with pytest.raises(OffloadError, match="accumulation"):
            loss_of(model, batch(1, dtype)).backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_grad_norm_clips_like_clip_grad_norm(dtype: torch.dtype) -> None:
    model, ref_model = make_model(dtype), make_model(dtype)
    ref = Reference(ref_model, max_grad_norm=0.05, **HYPER)
    with CPUOffloadOptimizer(model.parameters(), overlap=False, max_grad_norm=0.05,
                             **HYPER) as opt:
        for step in range(3):
            loss_of(model, batch(step, dtype)).backward()
            opt.step()
            opt.zero_grad()
            ref.backward(batch(step, dtype))
            ref.step()
    assert_params_equal(model, ref_model)
    unclipped = make_model(dtype)
    with CPUOffloadOptimizer(unclipped.parameters(), overlap=False, **HYPER) as opt:
        train(unclipped, opt, 3, dtype)
    assert not torch.equal(unclipped[0].weight, model[0].weight)  # the clip mattered


def test_frozen_params_are_not_stepped() -> None:
    model = make_model(torch.bfloat16)
    model[0].weight.requires_grad_(False)
    before = model[0].weight.clone()
    with CPUOffloadOptimizer(model.parameters(), **HYPER) as opt:
        train(model, opt, 2, torch.bfloat16)
        assert torch.equal(model[0].weight, before)
        assert not torch.equal(model[2].weight, make_model(torch.bfloat16)[2].weight)


# -- streams, threads, memory ---------------------------------------------------------------------


class ThreadLoggingStreams(HostStreams):
    """HostStreams that also records which thread synchronized on an event."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sync_threads: list[str] = []

    def synchronize(self, event: object) -> None:
        self.sync_threads.append(threading.current_thread().name)
        super().synchronize(event)


@pytest.mark.parametrize("overlap", [True, False])
def test_copy_ordering_and_worker_synchronization(overlap: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    streams = ThreadLoggingStreams(log=[])
    monkeypatch.setattr(offload_optimizer, "transfer_streams", lambda device: streams)
    model = make_model(torch.bfloat16)
    with CPUOffloadOptimizer(model.parameters(), overlap=overlap) as opt:
        loss_of(model, batch(0, torch.bfloat16)).backward()
        log = list(streams.log or [])
        # Per gradient: the d2h stream waits for the producing stream, copies, records its event.
        assert [(op.kind, op.stream) for op in log[:4]] == [
            ("record", "compute"), ("wait", "d2h"), ("copy", "d2h"), ("record", "d2h")]
        assert log[1].event == log[0].event
        assert sum(op.kind == "copy" and op.stream == "d2h" for op in log) == 6
        opt.step()
        # Worker threads, never the main thread, wait for the gradient copies.
        assert len(streams.sync_threads) == 6
        assert set(streams.sync_threads) == {"vramkit-offload-optimizer"}
        upload = streams.log[len(log) + 6 * 0:]
        upload = [op for op in upload if op.kind != "sync"]
        assert [(op.kind, op.stream) for op in upload[:2]] == [("record", "compute"),
                                                              ("wait", "h2d")]
        assert [op.kind for op in upload[2:8]] == ["copy"] * 6
        assert {op.stream for op in upload[2:8]} == {"h2d"}
        assert [(op.kind, op.stream) for op in upload[8:]] == [("record", "h2d"),
                                                              ("wait", "compute")]
        assert upload[9].event == upload[8].event


def test_worker_error_surfaces_as_offload_error() -> None:
    class Broken(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[no-untyped-def, override]
            raise RuntimeError("boom")

    model = make_model(torch.bfloat16)
    with CPUOffloadOptimizer(model.parameters(), Broken, lr=0.1) as opt:
        with pytest.raises(OffloadError, match="boom"):
            loss_of(model, batch(0, torch.bfloat16)).backward()
            opt.step()


def test_uses_the_given_pool_and_returns_its_blocks() -> None:
    pool = MemoryPool("cpu")
    model = make_model(torch.bfloat16)
    opt = CPUOffloadOptimizer(model.parameters(), pool=pool)
    numel = sum(p.numel() for p in model.parameters())
    assert pool.stats().allocated >= numel * (4 + 2)  # fp32 master + bf16 staging
    assert opt.stats().pinned_bytes == pool.stats().allocated
    assert pool.stats().num_allocations == 1  # one flat block for the group
    opt.close()
    assert pool.stats().allocated == 0
    loss_of(model, batch(0, torch.bfloat16)).backward()
    assert all(p.grad is not None for p in model.parameters())  # hooks are gone
    with pytest.raises(OffloadError, match="closed"):
        opt.step()
    opt.close()  # idempotent


def test_stats_count_state_bytes() -> None:
    model = make_model(torch.bfloat16)
    with CPUOffloadOptimizer(model.parameters(), **HYPER) as opt:
        assert opt.stats().state_bytes == 0
        train(model, opt, 1, torch.bfloat16)
        stats = opt.stats()
        numel = sum(p.numel() for p in model.parameters())
        assert stats.state_bytes == 2 * 4 * numel + 6 * 4  # exp_avg, exp_avg_sq, step
        assert stats.host_grad_bytes == 4 * numel
        assert stats.gpu_state_bytes_saved == 0 and stats.gpu_bytes_saved == 0  # all on CPU
        assert stats.steps == 1 and stats.cpu_step_seconds > 0


def test_dropped_optimizer_stops_its_worker() -> None:
    model = make_model(torch.bfloat16)
    opt = CPUOffloadOptimizer(model.parameters())
    train(model, opt, 1, torch.bfloat16)
    worker = opt._worker
    assert worker is not None and worker.is_alive()
    del opt
    gc.collect()
    worker.join(timeout=5)
    assert not worker.is_alive()
    loss_of(model, batch(0, torch.bfloat16)).backward()  # hooks removed with the optimizer
    assert all(p.grad is not None for p in model.parameters())


def test_closure_is_evaluated() -> None:
    model = make_model()
    with CPUOffloadOptimizer(model.parameters(), overlap=False) as opt:
        loss = opt.step(lambda: loss_of(model, batch(0, torch.float32)).backward() or 1.5)
        assert loss == 1.5 and opt.stats().steps == 1


# -- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("params", "kwargs", "match"), [
    ([], {}, "empty"),
    (lambda: torch.zeros(3, requires_grad=True), {}, "single tensor"),
    (lambda: [torch.zeros(3, requires_grad=True) * 2], {}, "non-leaf"),
    (lambda: [torch.zeros(3, dtype=torch.int64)], {}, "floating-point"),
    (lambda: [p := torch.zeros(3, requires_grad=True), p], {}, "twice"),
    (lambda: [{"lr": 0.1}], {}, "'params'"),
    (lambda: ["not a tensor"], {}, "expected a tensor"),
    (lambda: [torch.zeros(3, requires_grad=True)], {"lr": -1.0}, "rejected"),
    (lambda: [torch.zeros(3, requires_grad=True)], {"optimizer_class": dict}, "optimizer_class"),
    (lambda: [torch.zeros(3, requires_grad=True)], {"max_grad_norm": 1.0}, "overlap=False"),
    (lambda: [torch.zeros(3, requires_grad=True)], {"max_grad_norm": 0.0, "overlap": False},
     "max_grad_norm"),
    (lambda: [torch.zeros(3, requires_grad=True)], {"max_grad_norm": True, "overlap": False},
     "max_grad_norm"),
])
def test_invalid_arguments_raise_config_error(params: object, kwargs: dict[str, object],
                                              match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CPUOffloadOptimizer(params() if callable(params) else params, **kwargs)  # type: ignore[arg-type]


def test_import_does_not_touch_cuda() -> None:
    # Building an optimizer over CPU params needs no CUDA (the pool is a plain host pool).
    model = make_model(torch.bfloat16)
    with CPUOffloadOptimizer(model.parameters()) as opt:
        assert opt._pool.kind == "cpu"
