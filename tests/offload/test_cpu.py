"""CPUOffloadManager on the CPU: identity, keep patterns, round trips, write-back, stats, errors.

The manager runs with ``device="cpu"``: masters live in a plain host pool and the copy streams
are the synchronous :class:`HostStreams`, whose log lets the tests check event ordering.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.offload._helpers import train_offloaded
from vramkit.errors import ConfigError, DeviceError, OffloadError, PoolExhaustedError
from vramkit.memory.pool import MemoryPool, PoolConfig
from vramkit.memory.transfer import HostStreams, StreamOp
from vramkit.offload import cpu as cpu_module
from vramkit.offload.cpu import CPUOffloadConfig, CPUOffloadManager, LoadHandle


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _is_placeholder(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() <= t.element_size() and t.numel() > 1


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> list[StreamOp]:
    """Give managers created in the test a logging HostStreams."""
    ops: list[StreamOp] = []
    streams = HostStreams(log=ops)
    monkeypatch.setattr(cpu_module, "transfer_streams", lambda device: streams)
    return ops


# -- identity and storage -------------------------------------------------------------------


def test_offload_keeps_parameter_identity_and_drops_storage() -> None:
    model = _mlp()
    before = {n: id(p) for n, p in model.named_parameters()}
    shapes = {n: p.shape for n, p in model.named_parameters()}
    mgr = CPUOffloadManager("cpu")
    names = mgr.offload_weights(model)
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for n, p in model.named_parameters():
        assert id(p) == before[n]
        assert isinstance(p, nn.Parameter) and p.requires_grad
        assert p.shape == shapes[n]
        assert _is_placeholder(p)
    with pytest.raises(RuntimeError):
        model[0].weight.data.add_(1.0)  # a write to a placeholder cannot go unnoticed


def test_load_clear_round_trip_is_bit_exact() -> None:
    model = _mlp()
    reference = _snapshot(model)
    mgr = CPUOffloadManager("cpu")
    mgr.offload_weights(model)
    for _ in range(2):
        handle = mgr.load_to_gpu(["0", "2"])
        assert set(handle.names) == set(reference)
        for n, t in model.state_dict().items():
            assert torch.equal(t, reference[n])
            assert not _is_placeholder(t)
        mgr.release()
        assert mgr.clear_inactive() == sum(t.nbytes for t in reference.values())
        assert all(_is_placeholder(p) for p in model.parameters())


def test_forward_on_unloaded_module_raises_and_loaded_forward_matches() -> None:
    model = _mlp()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 8)
    mgr = CPUOffloadManager("cpu")
    mgr.offload_weights(model, keep_on_gpu=["2"])
    with pytest.raises(OffloadError, match=r"'0'.*0\.weight"):
        model(x)
    mgr.load_to_gpu("0")
    assert torch.equal(model(x), reference(x))


def test_auto_load_loads_inactive_on_demand() -> None:
    model = _mlp()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 8)
    mgr = CPUOffloadManager("cpu", config=CPUOffloadConfig(auto_load=True))
    mgr.offload_weights(model)
    assert torch.equal(model(x), reference(x))
    assert mgr.loaded == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert mgr.active == frozenset()
    assert mgr.clear_inactive() > 0
    assert mgr.loaded == frozenset()


# -- keep patterns --------------------------------------------------------------------------


def test_keep_patterns_prefix_and_glob() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(12))
    mgr = CPUOffloadManager("cpu")
    offloaded = mgr.offload_weights(model, keep_on_gpu=["layers.1", "layers.*.bias"])
    kept = set(mgr.kept)
    assert kept == {"layers.1.weight"} | {f"layers.{i}.bias" for i in range(12)}
    assert "layers.10.weight" in offloaded and "layers.11.weight" in offloaded  # not prefix "1"
    assert not _is_placeholder(model.layers[1].weight)
    assert _is_placeholder(model.layers[10].weight)


def test_tied_weights_are_one_record_reachable_by_either_name() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(10, 4)
    model.head = nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight
    value = model.embed.weight.detach().clone()
    mgr = CPUOffloadManager("cpu")
    assert mgr.offload_weights(model) == ["embed.weight"]
    mgr.load_to_gpu("head.weight")
    assert torch.equal(model.head.weight, value) and model.head.weight is model.embed.weight
    assert mgr.stats().loads == 1
    # keeping by the alias keeps the shared tensor
    other = nn.Module()
    other.a = nn.Linear(2, 2, bias=False)
    other.b = nn.Linear(2, 2, bias=False)
    other.b.weight = other.a.weight
    assert CPUOffloadManager("cpu").offload_weights(other, keep_on_gpu=["b"]) == []


# -- training -------------------------------------------------------------------------------


@pytest.mark.parametrize("opt_name", ["sgd_foreach", "adam_single", "adamw_fused"])
def test_optimizer_built_before_offloading_trains_identically(opt_name: str) -> None:
    def make_opt(m: nn.Module) -> torch.optim.Optimizer:
        if opt_name == "sgd_foreach":
            return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=True)
        if opt_name == "adamw_fused":  # steps without bumping the version counter
            return torch.optim.AdamW(m.parameters(), lr=0.01, fused=True)
        return torch.optim.Adam(m.parameters(), lr=0.01, foreach=False)

    torch.manual_seed(1)
    xs = [torch.randn(5, 8) for _ in range(4)]
    reference = _mlp()
    ref_losses = train_offloaded(reference, make_opt(reference), xs, None, [])
    model = _mlp()
    opt = make_opt(model)  # before offloading: holds the same Parameter objects
    mgr = CPUOffloadManager("cpu")
    mgr.offload_weights(model)
    losses = train_offloaded(model, opt, xs, mgr, ["0", "2"])
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    assert mgr.stats().writebacks == 4 * 4  # every parameter stepped, every step
    for name, param in reference.named_parameters():
        assert torch.equal(mgr.host_tensor(name), param.detach())
    mgr.restore()
    for (_, a), (_, b) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(a, b)


def test_gradients_flow_to_loaded_params_only_for_trainable() -> None:
    model = _mlp()
    reference = copy.deepcopy(model)
    model[0].weight.requires_grad_(False)
    reference[0].weight.requires_grad_(False)
    mgr = CPUOffloadManager("cpu")
    mgr.offload_weights(model)
    mgr.load_to_gpu(["0", "2"])
    x = torch.randn(4, 8)
    model(x).sum().backward()
    reference(x).sum().backward()
    assert model[0].weight.grad is None
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad)


def test_a_gradient_marks_a_tensor_for_writeback() -> None:
    # What a fused optimizer leaves behind: a gradient came and went, the version counter did
    # not move. The write-back must still happen.
    model = _mlp()
    mgr = CPUOffloadManager("cpu")
    mgr.offload_weights(model)
    mgr.load_to_gpu(["0", "2"])
    versions = [p._version for p in model.parameters()]
    model(torch.randn(2, 8)).sum().backward()
    for p in model.parameters():
        p.grad = None
    assert [p._version for p in model.parameters()] == versions
    mgr.release("0")
    mgr.clear_inactive()
    assert mgr.stats().writebacks == 2  # 0.weight and 0.bias got gradients while loaded
    mgr.load_to_gpu("0")
    mgr.release()
    mgr.clear_inactive()  # 0.* have had no gradient since this load; 2.* had one before
    assert mgr.stats().writebacks == 2 + 2


def test_backward_after_clear_fails_loudly() -> None:
    model = _mlp()
    mgr = CPUOffloadManager("cpu")
    mgr.offload_weights(model)
    mgr.load_to_gpu(["0", "2"])
    loss = model(torch.randn(2, 8)).sum()
    mgr.release()
    mgr.clear_inactive()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_frozen_weights_are_never_copied_back(log: list[StreamOp]) -> None:
    model = _mlp().requires_grad_(False)
    mgr = CPUOffloadManager("cpu")
    mgr.offload_weights(model)
    d2h_after_offload = mgr.stats().d2h_bytes
    mgr.load_to_gpu(["0", "2"])
    model(torch.randn(2, 8))
    mgr.release()
    log.clear()
    mgr.clear_inactive()
    assert not [op for op in log if op.kind == "copy"]
    stats = mgr.stats()
    assert stats.writebacks == 0 and stats.d2h_bytes == d2h_after_offload


@pytest.mark.parametrize("policy, survives", [("modified", False), ("trainable", True)])
def test_writeback_policy_for_data_mutation(policy: str, survives: bool) -> None:
    model = _mlp()
    original = model[0].weight.detach().clone()
    mgr = CPUOffloadManager("cpu", config=CPUOffloadConfig(writeback=policy))
    mgr.offload_weights(model)
    mgr.load_to_gpu("0.weight")
    model[0].weight.data.add_(1.0)  # .data bypasses the version counter
    mgr.release()
    mgr.clear_inactive()
    mgr.load_to_gpu("0.weight")
    assert torch.equal(model[0].weight.detach(), original + 1.0) is survives
    assert mgr.stats().writebacks == (1 if survives else 0)


def test_modified_buffers_are_written_back() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4)
    mgr = CPUOffloadManager("cpu")
    mgr.offload_weights(model, keep_on_gpu=["0"])
    mgr.load_to_gpu("1")
    model(x)
    reference(x)
    mgr.release()
    mgr.clear_inactive()
    assert torch.equal(mgr.host_tensor("1.running_mean"), reference[1].running_mean)
    assert int(mgr.host_tensor("1.num_batches_tracked")) == 1
    writebacks = mgr.stats().writebacks
    model.eval()  # an eval forward leaves the running statistics alone: nothing to copy back
    mgr.load_to_gpu("1")
    model(x)
    mgr.release()
    mgr.clear_inactive()
    assert mgr.stats().writebacks == writebacks


def test_writeback_is_ordered_before_the_next_load(log: list[StreamOp]) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = CPUOffloadManager("cpu")
    mgr.offload_weights(model)
    mgr.load_to_gpu("0.weight")
    model[0].weight.grad = torch.ones_like(model[0].weight)
    opt.step()
    mgr.release()
    log.clear()
    mgr.clear_inactive()
    kinds = [(op.kind, op.stream) for op in log]
    assert kinds == [("record", "compute"), ("wait", "d2h"), ("copy", "d2h"), ("record", "d2h")]
    written = log[-1].event
    log.clear()
    mgr.load_to_gpu("0.weight")
    assert [(op.kind, op.stream, op.event) for op in log[:2]] == [("wait", "h2d", written),
                                                                  ("copy", "h2d", None)]


def test_wait_false_defers_the_wait_to_the_handle_or_forward(log: list[StreamOp]) -> None:
    model = _mlp()
    mgr = CPUOffloadManager("cpu")
    mgr.offload_weights(model)
    log.clear()
    handle = mgr.load_to_gpu("0", wait=False)
    assert isinstance(handle, LoadHandle) and handle.event is not None
    loaded = handle.event.id
    assert not [op for op in log if op.kind == "wait" and op.stream == "compute"]
    model[0](torch.randn(1, 8))  # the pre-hook makes the compute stream wait
    assert [(op.kind, op.stream, op.event) for op in log][-1] == ("wait", "compute", loaded)
    log.clear()
    handle.wait()  # already waited by the hook: nothing more to do
    assert log == []
    log.clear()
    assert mgr.load_to_gpu("0").event is None  # already loaded: no copy
    assert not [op for op in log if op.kind == "copy"]


def test_load_marks_active_and_release_marks_inactive() -> None:
    model = _mlp()
    mgr = CPUOffloadManager("cpu")
    mgr.offload_weights(model)
    mgr.load_to_gpu(["0", "2"])
    mgr.release("2")
    assert mgr.active == {"0.weight", "0.bias"}
    released = mgr.clear_inactive()
    assert released == (16 * 4 + 4) * 4
    assert mgr.loaded == {"0.weight", "0.bias"}
    assert mgr.clear_inactive() == 0


# -- state dicts ----------------------------------------------------------------------------


def test_state_dict_mode_repoints_the_dict_tensors() -> None:
    torch.manual_seed(0)
    state = {"a": torch.randn(3, 5), "b": torch.arange(7), "c": torch.randn(2)}
    values = {k: v.clone() for k, v in state.items()}
    ids = {k: id(v) for k, v in state.items()}
    mgr = CPUOffloadManager("cpu")
    assert mgr.offload_weights(state, keep_on_gpu=["c"]) == ["a", "b"]
    assert {k: id(v) for k, v in state.items()} == ids
    assert _is_placeholder(state["a"]) and _is_placeholder(state["b"])
    handle = mgr.load_to_gpu(["a", "b", "c"])
    assert set(handle.tensors) == {"a", "b", "c"}
    for k in state:
        assert handle.tensors[k] is state[k]
        assert torch.equal(state[k], values[k])


# -- stats ----------------------------------------------------------------------------------


def test_stats_are_exact() -> None:
    model = _mlp()  # 0: 16x8 + 16 floats, 2: 4x16 + 4 floats
    sizes = {"0.weight": 512, "0.bias": 64, "2.weight": 256, "2.bias": 16}
    mgr = CPUOffloadManager("cpu")
    mgr.offload_weights(model, keep_on_gpu=["2.bias"])
    offloaded = 512 + 64 + 256
    s = mgr.stats()
    assert (s.offloaded_tensors, s.offloaded_bytes, s.kept_tensors, s.kept_bytes) == (
        3, offloaded, 1, 16)
    assert (s.loaded_tensors, s.resident_bytes, s.loads, s.h2d_bytes) == (0, 16, 0, 0)
    assert s.host_bytes == 512 + 256 + 256  # each tensor at a 256-byte offset
    assert s.pinned_bytes == 0  # a plain host pool on the CPU
    assert s.d2h_bytes == offloaded
    mgr.load_to_gpu(["0.weight", "2"])
    s = mgr.stats()
    assert (s.loaded_tensors, s.active_tensors, s.loads) == (2, 2, 2)
    assert s.h2d_bytes == sizes["0.weight"] + sizes["2.weight"]
    assert s.resident_bytes == 16 + 512 + 256
    mgr.release("0")
    assert mgr.clear_inactive() == 512
    s = mgr.stats()
    assert (s.loaded_tensors, s.active_tensors, s.released_bytes, s.writebacks) == (1, 1, 512, 0)


# -- restore --------------------------------------------------------------------------------


def test_restore_puts_everything_back_and_closes() -> None:
    model = _mlp()
    reference = _snapshot(model)
    ids = [id(p) for p in model.parameters()]
    pool = MemoryPool("cpu")
    mgr = CPUOffloadManager("cpu", pinned_pool=pool)
    mgr.offload_weights(model, keep_on_gpu=["2.bias"])
    assert pool.stats().allocated > 0
    mgr.load_to_gpu("0.weight")
    mgr.restore()
    assert pool.stats().allocated == 0  # the caller's pool keeps its segments, not our blocks
    assert [id(p) for p in model.parameters()] == ids
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference[name]) and tensor.is_contiguous()
    model(torch.randn(2, 8))  # hooks are gone
    mgr.restore()  # a second restore does nothing
    for call in (lambda: mgr.load_to_gpu("0"), mgr.clear_inactive, lambda: mgr.offload_weights(
            _mlp()), lambda: mgr.host_tensor("0.weight"), mgr.release):
        with pytest.raises(OffloadError, match="restored"):
            call()


def test_context_manager_restores() -> None:
    model = _mlp()
    reference = _snapshot(model)
    with CPUOffloadManager("cpu") as mgr:
        mgr.offload_weights(model)
        assert _is_placeholder(model[0].weight)
    assert all(torch.equal(t, reference[n]) for n, t in model.state_dict().items())


# -- errors and config ----------------------------------------------------------------------


def test_max_host_bytes_caps_the_pool_and_changes_nothing_on_failure() -> None:
    model = _mlp()
    weight = model[0].weight
    mgr = CPUOffloadManager("cpu", config=CPUOffloadConfig(max_host_bytes="1KiB"))
    with pytest.raises(PoolExhaustedError):
        mgr.offload_weights(model)
    assert not _is_placeholder(weight) and mgr.offloaded == ()
    assert mgr.offload_weights(model, keep_on_gpu=["0.weight"]) == ["0.bias", "2.weight", "2.bias"]


def test_errors_for_bad_names_and_inputs() -> None:
    model = _mlp()
    mgr = CPUOffloadManager("cpu")
    mgr.offload_weights(model)
    with pytest.raises(OffloadError, match="matches no tensor"):
        mgr.load_to_gpu("nope")
    with pytest.raises(OffloadError, match="already managed"):
        mgr.offload_weights(model)
    with pytest.raises(OffloadError, match="already managed"):
        mgr.offload_weights({"x": model[0].weight})
    assert mgr.offload_weights({"0.weight": torch.ones(2)}, prefix="other.") == ["other.0.weight"]
    with pytest.raises(OffloadError, match="not a tensor"):
        mgr.offload_weights({"y": [1, 2]})
    with pytest.raises(OffloadError, match="meta"):
        mgr.offload_weights({"m": torch.empty(2, device="meta")})
    with pytest.raises(OffloadError, match=r"nn\.Module or a mapping"):
        mgr.offload_weights(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        mgr.load_to_gpu([""])
    with pytest.raises(OffloadError, match="not an offloaded tensor"):
        mgr.host_tensor("missing")


@pytest.mark.parametrize("kwargs", [dict(auto_load=1), dict(writeback="always"),
                                    dict(max_host_bytes=0), dict(max_host_bytes="lots"),
                                    dict(max_host_bytes=True)])
def test_config_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        CPUOffloadConfig(**kwargs)  # type: ignore[arg-type]


def test_config_parses_sizes() -> None:
    assert CPUOffloadConfig(max_host_bytes="2KiB").max_host_bytes == 2048


def test_manager_argument_errors() -> None:
    with pytest.raises(ConfigError):
        CPUOffloadManager("meta")
    with pytest.raises(ConfigError):
        CPUOffloadManager("cpu", config={"auto_load": True})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="MemoryPool"):
        CPUOffloadManager("cpu", pinned_pool=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_host_bytes"):
        CPUOffloadManager("cpu", pinned_pool=MemoryPool("cpu"),
                          config=CPUOffloadConfig(max_host_bytes=4096))
    pool = MemoryPool("cpu", PoolConfig(max_size="1KiB"))
    with pytest.raises(PoolExhaustedError):  # the caller's pool and its cap are used
        CPUOffloadManager("cpu", pinned_pool=pool).offload_weights(_mlp())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda_is_a_device_error() -> None:
    with pytest.raises(DeviceError, match="CUDA is not available"):
        CPUOffloadManager("cuda")

