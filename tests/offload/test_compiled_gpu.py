"""Compiled blocks on a CUDA GPU: CUDA-graph modes (inference) under block swapping, where every
swapped block runs in one of the swapper's slots at fixed addresses; the graphs recorded once per
slot replay each block's own weights, and the outputs equal the eager swapped model's."""

from __future__ import annotations

import pytest
import torch

from tests._toys import ResidualMLP, Stack
from vramkit.errors import OffloadError
from vramkit.offload.compiled import compile_blocks
from vramkit.offload.swap import BlockSwapper, SwapConfig

pytestmark = pytest.mark.gpu
dynamo = pytest.importorskip("torch._dynamo")


def _swapped(mode: str | None, width: int = 256) -> Stack:
    model = Stack(lambda: ResidualMLP(width), 6, seed=0).requires_grad_(False)
    if mode is not None:
        compile_blocks(model, mode=mode)
    BlockSwapper(model, "blocks", SwapConfig(max_gpu_blocks=2, num_slots=2, min_param_bytes=0),
                 device="cuda")
    return model


@pytest.mark.parametrize("mode", ["reduce-overhead"])
def test_gpu_cuda_graphs_replay_each_swapped_block_in_its_slot(mode: str) -> None:
    dynamo.reset()
    graphed, eager = _swapped(mode), _swapped(None)
    for step in range(4):  # records on the first calls, replays after
        x = torch.randn(2, 64, 256, device="cuda",
                        generator=torch.Generator("cuda").manual_seed(step))
        with torch.no_grad():
            got, want = graphed(x), eager(x)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    # The weights in the slots changed under the recorded graphs: a wrong replay (an old
    # block's bytes, or a stale address) would not give the eager outputs above.


def test_gpu_cuda_graph_modes_refuse_a_training_step() -> None:
    model = _swapped("reduce-overhead")
    model.blocks[0].norm.weight.requires_grad_(True)
    x = torch.randn(2, 64, 256, device="cuda")
    with pytest.raises(OffloadError, match="inference only"):
        model(x).sum().backward()
