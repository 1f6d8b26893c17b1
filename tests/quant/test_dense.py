"""DenseGroup: a block's quantized linears dequantized together, with results identical to the
per-layer path (forward, backward, checkpointed, swapped), re-dequantized exactly when needed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests._toys import assert_all_equal
from vramkit.errors import QuantizationError
from vramkit.quant import kernels
from vramkit.quant.dense import DenseGroup, DenseScratch, group_dense, ungroup_dense
from vramkit.quant.linear import QuantizedLinear
from vramkit.quant.model import QuantizationConfig, quantize_model


class Block(nn.Module):
    """Three linears (two fp8-able, one kept by the test in another format) and a trainable
    adapter in front, so the input of the quantized layers requires grad."""

    def __init__(self, width: int = 48) -> None:
        super().__init__()
        self.adapter = nn.Linear(width, width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width, bias=False)
        self.gate = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.adapter(x)
        return x + self.down(torch.relu(self.up(h))) * torch.sigmoid(self.gate(h))


class Net(nn.Module):
    def __init__(self, blocks: int = 2, width: int = 48, fmt: str = "fp8",
                 ckpt: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.ckpt = ckpt
        for block in self.blocks:
            for p in block.parameters():
                p.requires_grad_(False)
            block.adapter.requires_grad_(True)
            quantize_model(block, QuantizationConfig(fmt, modules_to_not_quantize=("adapter",)))
        if fmt == "fp8":  # one layer of each block in another format: the per-layer branch
            for block in self.blocks:
                block.gate = QuantizedLinear.from_linear(
                    nn.Linear(width, width).requires_grad_(False), "int8")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        return x


def _grouped(net: Net) -> tuple[Net, DenseScratch]:
    twin = copy.deepcopy(net)
    scratch = DenseScratch()
    for block in twin.blocks:
        assert group_dense(block, scratch) is not None
    return twin, scratch


def _step(net: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                      list[torch.Tensor]]:
    x = x.clone().requires_grad_(True)
    out = net(x)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    net.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def _assert_same(ref: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]],
                 got: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]) -> None:
    """Output, input gradient and parameter gradients equal bit for bit."""
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert_all_equal(ref[2], got[2])


def _count(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts group dequantizes and per-layer dequantizes."""
    counts = {"expand": 0, "layer": 0}
    expand = DenseGroup._expand
    plan_call = kernels.DequantPlan.__call__

    def counting_expand(self: DenseGroup, *args: object) -> None:
        counts["expand"] += 1
        expand(self, *args)

    def counting_plan(self: kernels.DequantPlan, *args: object) -> torch.Tensor:
        counts["layer"] += 1
        return plan_call(self, *args)

    monkeypatch.setattr(DenseGroup, "_expand", counting_expand)
    monkeypatch.setattr(kernels.DequantPlan, "__call__", counting_plan)
    return counts


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("fmt", ["fp8", "int8", "nf4"])
def test_grouped_step_equals_the_per_layer_step(fmt: str, ckpt: bool) -> None:
    net = Net(fmt=fmt, ckpt=ckpt)
    twin, scratch = _grouped(net)
    x = torch.randn(3, 5, 48)
    out, gx, grads = _step(net, x)
    out2, gx2, grads2 = _step(twin, x)
    assert torch.equal(out, out2)
    assert torch.equal(gx, gx2)
    assert len(grads) == len(grads2) == 4
    for a, b in zip(grads, grads2, strict=True):
        assert torch.equal(a, b)
    assert scratch.nbytes > 0


def test_the_view_holds_the_layers_own_dequantize() -> None:
    layer = QuantizedLinear.from_linear(nn.Linear(40, 24), "fp8")
    block = nn.Sequential(layer)
    group = group_dense(block, DenseScratch())
    assert group is not None
    weight = group.weight(0, torch.bfloat16, torch.device("cpu"))
    assert torch.equal(weight, layer.dequantized_weight(torch.bfloat16))


def test_one_dequantize_per_block_call_and_backward_reuses_it_after_recompute(
        monkeypatch: pytest.MonkeyPatch) -> None:
    twin, _ = _grouped(Net(blocks=2, fmt="fp8", ckpt=True))
    counts = _count(monkeypatch)
    x = torch.randn(2, 4, 48, requires_grad=True)
    out = twin(x)
    # one group dequantize per block; the int8 layer's view is filled by its own dequantize
    assert counts == {"expand": 2, "layer": 2}
    out.sum().backward()
    # the last block's views are still in the scratch (its recomputation needs no dequantize);
    # the first block's recomputation dequantizes it once; both backwards use the views
    assert counts == {"expand": 3, "layer": 3}


def test_backward_falls_back_once_the_scratch_moved_on(monkeypatch: pytest.MonkeyPatch) -> None:
    net = Net(blocks=2, fmt="fp8")
    twin, _ = _grouped(net)
    x = torch.randn(2, 4, 48)
    reference = _step(net, x)
    counts = _count(monkeypatch)
    result = _step(twin, x)
    # forward: 2 groups; backward: the last block's views are still there (no dequantize), the
    # first block's are not: its 3 quantized layers dequantize their saved bytes
    assert counts["expand"] == 2
    assert counts["layer"] == 2 + 3
    _assert_same(reference, result)


def test_a_second_call_reuses_the_scratch_until_the_weights_change(
        monkeypatch: pytest.MonkeyPatch) -> None:
    layer = QuantizedLinear.from_linear(nn.Linear(32, 16), "fp8")
    block = nn.Sequential(layer)
    group_dense(block, DenseScratch())
    counts = _count(monkeypatch)
    x = torch.randn(3, 32)
    first = block(x)
    block(x)
    assert counts["expand"] == 1
    # a write into the packed bytes (load_state_dict, a swapper's slot copy) bumps its version
    with torch.no_grad():
        layer.weight_data.copy_(torch.zeros_like(layer.weight_data))
    assert torch.count_nonzero(block(x) - layer.bias) == 0
    assert counts["expand"] == 2
    # a new tensor object (a swapper pointing the buffer at another slot)
    layer.weight_data = torch.zeros_like(layer.weight_data)
    block(x)
    assert counts["expand"] == 3
    assert not torch.equal(first, block(x))


def test_invalidate_makes_the_next_call_dequantize_again_into_the_same_buffer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    layer = QuantizedLinear.from_linear(nn.Linear(32, 16), "fp8")
    block = nn.Sequential(layer)
    scratch = DenseScratch()
    group_dense(block, scratch)
    counts = _count(monkeypatch)
    x = torch.randn(3, 32)
    first = block(x)
    block(x)
    assert counts["expand"] == 1
    nbytes = scratch.nbytes
    scratch.invalidate()
    assert torch.equal(block(x), first)
    assert counts["expand"] == 2 and scratch.nbytes == nbytes


def test_views_are_cut_once_per_buffer_and_dropped_with_it() -> None:
    net = Net(blocks=2, fmt="fp8")
    twin, scratch = _grouped(net)
    x = torch.randn(2, 48)
    with torch.no_grad():
        twin(x)
        first = [list(block.up._dense[0]._views) for block in twin.blocks]
        twin(x)  # both groups dequantize again (the scratch moved on): the same views
        again = [list(block.up._dense[0]._views) for block in twin.blocks]
    assert all(a is b for f, g in zip(first, again, strict=True)
               for a, b in zip(f, g, strict=True))
    buffer = scratch._buffer
    assert all(v.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
               for views in again for v in views)
    scratch.release()  # no cached view keeps the old buffer alive
    assert not scratch._carved
    with torch.no_grad():
        assert torch.equal(twin(x), net(x))
    assert twin.blocks[0].up._dense[0]._views[0] is not again[0][0]
    leaving, staying = (block.up._dense[0] for block in twin.blocks)
    ungroup_dense(twin.blocks[0])  # a group that leaves forgets its views
    assert [group for group, _ in scratch._carved] == [staying]
    assert leaving.layers[0]._dense is None


def test_a_layer_that_decodes_is_left_out_until_it_asks_for_its_weight() -> None:
    net = Net(blocks=1, fmt="fp8")
    twin, scratch = _grouped(net)
    block = twin.blocks[0]
    group = block.up._dense[0]
    down = group.layers.index(block.down)
    x = torch.randn(2, 48)
    with torch.no_grad():
        twin(x)
        group.decodes(down)  # as a call with a few tokens on CUDA marks it
        scratch.invalidate()
        scratch._buffer.zero_()
        h = torch.relu(block.up(block.adapter(x)))  # dequantizes the group, without `down`
        assert torch.count_nonzero(group._views[down]) == 0
        assert group.current(down, group._dtype) is None  # backward: its own dequantize
        assert group.current(0, group._dtype) is not None
        # asked for its weight (many tokens again): in the group's dequantize from now on
        assert torch.equal(block.down(h), net.blocks[0].down(h))
        assert torch.equal(group._views[down], block.down.dequantized_weight(torch.float32))
        assert down not in group._decoding


def test_ungroup_and_grouping_twice() -> None:
    net = Net(blocks=1, fmt="fp8")
    scratch = DenseScratch()
    group_dense(net.blocks[0], scratch)
    with pytest.raises(QuantizationError, match="already in a DenseGroup"):
        group_dense(net.blocks[0], scratch)
    assert ungroup_dense(net) == 1
    assert all(m._dense is None for m in net.modules() if isinstance(m, QuantizedLinear))
    assert group_dense(net.blocks[0], scratch) is not None
    assert group_dense(nn.Sequential(nn.Linear(2, 2)), scratch) is None
    with pytest.raises(QuantizationError, match="at least one"):
        DenseGroup([], scratch)


def test_no_grad_and_deepcopy() -> None:
    net = Net(blocks=2, fmt="fp8")
    twin, scratch = _grouped(net)
    x = torch.randn(2, 48)
    with torch.no_grad():
        assert torch.equal(net(x), twin(x))
    copied = copy.deepcopy(twin)
    group = copied.blocks[0].up._dense[0]
    assert group.scratch is not scratch and group.scratch.nbytes == 0
    assert group.layers[0] is copied.blocks[0].up
    with torch.no_grad():
        assert torch.equal(copied(x), twin(x))
    scratch.release()
    assert scratch.nbytes == 0
    with torch.no_grad():
        assert torch.equal(twin(x), net(x))


def test_grouped_blocks_under_a_swapper_train_identically() -> None:
    from vramkit.offload.swap import BlockSwapper, SwapConfig

    net = Net(blocks=3, fmt="fp8")
    twin, _ = _grouped(net)
    swapper = BlockSwapper(twin, "blocks", config=SwapConfig(min_param_bytes=256), device="cpu")
    try:
        assert len(swapper.swapped_names) == 3
        x = torch.randn(2, 3, 48)
        for _ in range(2):
            ref = _step(net, x)
            got = _step(twin, x)
            _assert_same(ref, got)
    finally:
        swapper.detach()


@pytest.mark.gpu
@pytest.mark.parametrize("ckpt", [False, True])
def test_gpu_grouped_step_equals_the_per_layer_step(ckpt: bool) -> None:
    net = Net(blocks=3, width=256, fmt="fp8", ckpt=ckpt).cuda()
    twin, scratch = _grouped(net)
    x = torch.randn(2, 64, 256, device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        ref = _step(net, x)
        got = _step(twin, x)
    _assert_same(ref, got)
    # the largest block's three layers (up, down, gate) in the compute dtype (bf16), not in
    # the float32 the layers were built in
    weights = 256 * 512 + 512 * 256 + 256 * 256
    assert weights * 2 <= scratch.nbytes < weights * 4


@pytest.mark.gpu
def test_gpu_fp8_layers_take_one_launch_and_swapped_blocks_match(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vramkit.offload.swap import BlockSwapper, SwapConfig
    from vramkit.quant import _triton

    launches = []
    real = _triton.dequantize_fp8_rows_many

    def counting(*args: object) -> None:
        launches.append(1)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_triton, "dequantize_fp8_rows_many", counting)
    net = Net(blocks=4, width=256, fmt="fp8", ckpt=True).cuda()
    twin, _ = _grouped(net)
    swapper = BlockSwapper(twin, "blocks", config=SwapConfig(min_param_bytes=4096, num_slots=2),
                           device="cuda")
    try:
        x = torch.randn(2, 64, 256, device="cuda")
        for _ in range(2):
            with torch.autocast("cuda", torch.bfloat16):
                ref = _step(net, x)
                got = _step(twin, x)
            _assert_same(ref, got)
        assert launches  # the fp8 layers went through the batched kernel
        group = twin.blocks[0].up._dense[0]
        assert 1 <= len(group._tables) <= 2  # one table per slot the block landed in
    finally:
        swapper.detach()


class _Modulated(nn.Module):
    """A FLUX-like block: a modulation layer on one conditioning token (the fused decode
    kernel) beside layers on many tokens (the group's dense weights)."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.mod = nn.Linear(width, 2 * width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        shift, scale = self.mod(cond).chunk(2, dim=-1)
        return x + self.down(torch.relu(self.up(x * (1 + scale) + shift)))


@pytest.mark.gpu
def test_gpu_a_one_token_layer_decodes_and_the_group_leaves_it_out() -> None:
    from vramkit.quant import _triton

    torch.manual_seed(0)
    ref = _Modulated().cuda().requires_grad_(False)
    quantize_model(ref, QuantizationConfig("fp8"))
    twin = copy.deepcopy(ref)
    group = group_dense(twin, DenseScratch())
    assert group is not None
    x = torch.randn(2, 64, 256, device="cuda", requires_grad=True)
    cond = torch.randn(1, 1, 256, device="cuda")
    grads = []
    for model in (ref, twin, twin):  # the second call of twin replays the fused launch
        with torch.autocast("cuda", torch.bfloat16):
            out = model(x, cond)
        out.float().square().sum().backward()
        grads.append((out.detach(), x.grad.clone()))
        x.grad = None
    for out, grad in grads[1:]:
        assert torch.equal(out, grads[0][0]) and torch.equal(grad, grads[0][1])
    assert group._decoding == {group.layers.index(twin.mod)}
    assert _triton._FAST_LAUNCH[0] and _triton._GEMV_LAUNCH._compiled


def test_the_scratch_is_sized_once_for_the_largest_group_in_the_compute_dtype() -> None:
    net = Net(blocks=2, fmt="fp8")
    small = nn.Sequential(QuantizedLinear.from_linear(nn.Linear(16, 8), "fp8"))
    scratch = DenseScratch()
    group_dense(small, scratch)
    for block in net.blocks:
        group_dense(block, scratch)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        small(torch.randn(2, 16))  # the first claim: a small group
    from vramkit.quant.dense import dense_nbytes

    largest = dense_nbytes(net.blocks[0], torch.bfloat16)
    # sized for the largest group at bf16 (not its float32 weights), within 512 B per layer
    assert largest <= scratch.nbytes <= largest + 3 * 512
    before = scratch._buffer
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        net(torch.randn(2, 48))
    assert scratch._buffer is before  # no second allocation
