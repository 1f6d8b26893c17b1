"""BlockSwapper(model_on_meta, checkpoint=path): a model filled from a checkpoint as the swapper
attaches (single file, sharded, diffusers folder), equal to a normally loaded model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tests._toys import ResidualMLP, assert_all_equal, grad_step
from vramkit.errors import ConfigError
from vramkit.offload.swap import BlockSwapper, SwapConfig

D = 64


class Net(nn.Module):
    def __init__(self, blocks: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(16, D)
        self.blocks = nn.ModuleList(ResidualMLP(D, 2 * D, act=nn.ReLU()) for _ in range(blocks))
        self.head = nn.Linear(D, 4)
        self.register_buffer("scale", torch.full((D,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) * self.scale
        for block in self.blocks:
            h = block(h)
        return self.head(h)


CONFIG = SwapConfig(min_param_bytes=1024)


def _reference(seed: int = 0, dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(seed)
    net = Net().to(dtype)
    for p in net.blocks.parameters():
        p.requires_grad_(False)  # a frozen base; embed/head train (LoRA-like)
    return net


def _meta(dtype: torch.dtype = torch.float32) -> Net:
    with torch.device("meta"):
        net = Net().to(dtype)
    for p in net.blocks.parameters():
        p.requires_grad_(False)
    return net


def _assert_same(net: nn.Module, ref: nn.Module) -> None:
    x = torch.randn(3, 16, dtype=next(ref.parameters()).dtype)
    y0, g0 = grad_step(ref, x)
    for _ in range(2):  # the second pass runs on the learnt order and cached slots
        y, g = grad_step(net, x)
        assert torch.equal(y, y0)
        assert_all_equal(g, g0)


def _save_sharded(state: dict[str, torch.Tensor], folder: Path, stem: str, shards: int) -> None:
    names = list(state)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = f"{stem}-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n].contiguous() for n in names[i * per:(i + 1) * per]}
        save_file(part, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    (folder / f"{stem}.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture()
def reference() -> Net:
    return _reference()


@pytest.mark.parametrize("background", [True, False], ids=["background", "foreground"])
@pytest.mark.parametrize("layout", ["file", "sharded", "diffusers", "diffusers-sharded"])
def test_loads_into_the_swapped_layout_equal_to_a_normal_load(tmp_path: Path, reference: Net,
                                                              layout: str,
                                                              background: bool) -> None:
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    if layout == "file":
        path = tmp_path / "model.safetensors"
        save_file(state, str(path))
    elif layout == "sharded":
        path = tmp_path
        _save_sharded(state, tmp_path, "model", 3)
    else:  # a diffusers component folder: config.json + diffusion_pytorch_model*.safetensors
        path = tmp_path / "transformer"
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"_class_name": "Net"}))
        if layout == "diffusers":
            save_file(state, str(path / "diffusion_pytorch_model.safetensors"))
        else:
            _save_sharded(state, path, "diffusion_pytorch_model", 2)
    net = _meta()
    swapper = BlockSwapper(net, config=CONFIG, device="cpu", checkpoint=path,
                           load_in_background=background)
    assert not any(t.is_meta for t in (*net.parameters(), *net.buffers()))
    _assert_same(net, reference)  # in the background: each block waits for its own bytes
    swapper.wait_loaded()
    stats = swapper.stats()
    assert stats.swapped_blocks == 5 and not stats.loading and stats.checkpoint_bytes == sum(
        v.numel() * v.element_size() for v in state.values())
    saved = net.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in state.items())
    swapper.detach()  # built on meta: the weights come back to the CPU, with their values
    assert all(p.device.type == "cpu" for p in net.parameters())
    assert all(torch.equal(net.state_dict()[k], v) for k, v in state.items())


def test_prefix_dtype_conversion_and_trainable_flags(tmp_path: Path) -> None:
    ref = _reference(dtype=torch.bfloat16)
    path = tmp_path / "model.safetensors"
    save_file({f"model.{k}": v.float() for k, v in ref.state_dict().items()}, str(path))
    net = _meta(torch.bfloat16)
    with BlockSwapper(net, config=CONFIG, device="cpu", checkpoint=path, prefix="model."):
        assert all(p.dtype == torch.bfloat16 for p in net.parameters())
        assert net.embed.weight.requires_grad and not net.blocks[0].up.weight.requires_grad
        _assert_same(net, ref)


def test_keys_are_checked_before_anything_is_allocated(tmp_path: Path, reference: Net) -> None:
    state = reference.state_dict()
    path = tmp_path / "model.safetensors"
    save_file({k: v for k, v in state.items() if k != "blocks.1.up.weight"}, str(path))
    net = _meta()
    with pytest.raises(ConfigError, match="missing key"):
        BlockSwapper(net, config=CONFIG, device="cpu", checkpoint=path)
    assert net.blocks[1].up.weight.is_meta and net.embed.weight.is_meta  # nothing was touched
    # strict=False loads what matches; a swapped tensor it lacks cannot be run
    with pytest.raises(ConfigError, match="meta device"):
        BlockSwapper(net, config=CONFIG, device="cpu", checkpoint=path, strict=False)


def test_a_resident_meta_tensor_the_checkpoint_lacks_is_named(tmp_path: Path,
                                                              reference: Net) -> None:
    path = tmp_path / "model.safetensors"
    save_file({k: v for k, v in reference.state_dict().items() if k != "head.bias"}, str(path))
    with pytest.raises(ConfigError, match=r"head\.bias"):
        BlockSwapper(_meta(), config=CONFIG, device="cpu", checkpoint=path, strict=False)


def test_unexpected_keys_and_shape_mismatch(tmp_path: Path, reference: Net) -> None:
    state = dict(reference.state_dict())
    state["extra.weight"] = torch.zeros(2)
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    with pytest.raises(ConfigError, match="unexpected key"):
        BlockSwapper(_meta(), config=CONFIG, device="cpu", checkpoint=path)
    state.pop("extra.weight")
    state["head.weight"] = torch.zeros(5, D)
    save_file(state, str(path))
    with pytest.raises(ConfigError, match="shape"):
        BlockSwapper(_meta(), config=CONFIG, device="cpu", checkpoint=path)


def test_a_materialized_model_is_overwritten_and_detach_keeps_its_devices(
        tmp_path: Path, reference: Net) -> None:
    path = tmp_path / "model.safetensors"
    save_file(reference.state_dict(), str(path))
    net = _reference(seed=1)  # other values, on the CPU: the checkpoint's win
    params = list(net.parameters())
    swapper = BlockSwapper(net, config=CONFIG, device="cpu", checkpoint=path)
    assert all(a is b for a, b in zip(params, net.parameters(), strict=True))  # identity kept
    _assert_same(net, reference)
    swapper.detach()
    assert all(torch.equal(net.state_dict()[k], v) for k, v in reference.state_dict().items())


def test_prefix_without_checkpoint_is_refused(reference: Net) -> None:
    with pytest.raises(ConfigError, match="prefix"):
        BlockSwapper(reference, config=CONFIG, device="cpu", prefix="model.")


def test_a_model_on_meta_without_checkpoint_is_refused() -> None:
    with pytest.raises(ConfigError, match="checkpoint"):
        BlockSwapper(_meta(), config=CONFIG, device="cpu")


_RSS_CHILD = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {test_dir!r})
    from test_source import Net, CONFIG
    from vramkit.offload.swap import BlockSwapper
    from safetensors.torch import load_file

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    mode, path = sys.argv[1], sys.argv[2]
    import test_source as t
    t.D = 1024
    torch.manual_seed(0)
    base = hwm()
    if mode == "checkpoint":
        with torch.device("meta"):
            net = t.Net(blocks=12)
        net.blocks.requires_grad_(False)
        swapper = BlockSwapper(net, config=CONFIG, device="cpu", checkpoint=path)
        swapper.wait_loaded()  # the masters fill in the background
    else:  # today's way: the whole model on the CPU, then attached
        net = t.Net(blocks=12)
        net.load_state_dict(load_file(path))
        net.blocks.requires_grad_(False)
        swapper = BlockSwapper(net, config=CONFIG, device="cpu")
    stats = swapper.stats()
    print(hwm() - base, stats.pinned_bytes, stats.swapped_bytes)
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_peak_host_memory_is_the_masters_not_twice_the_model(tmp_path: Path) -> None:
    import tests.offload.swap.test_source as module

    old = module.D
    module.D = 1024
    try:
        torch.manual_seed(0)
        big = Net(blocks=12)  # ~100 MB of fp32
        path = tmp_path / "model.safetensors"
        save_file(big.state_dict(), str(path))
        model_bytes = sum(v.numel() * v.element_size() for v in big.state_dict().values())
        del big
    finally:
        module.D = old
    script = tmp_path / "child.py"
    script.write_text(_RSS_CHILD.format(test_dir=str(Path(__file__).parent)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    peaks = {}
    for mode in ("checkpoint", "attach"):
        out = subprocess.run([sys.executable, str(script), mode, str(path)], env=env,
                             capture_output=True, text=True, timeout=300, check=True)
        grown, pinned, swapped = map(int, out.stdout.split()[-3:])
        peaks[mode] = grown
        assert pinned >= swapped > 0.9 * model_bytes
    # Into the swapped layout: the masters (+ the small resident rest) and a little more.
    assert peaks["checkpoint"] <= pinned + (model_bytes - swapped) + (48 << 20), peaks
    # Today's way holds the model and its pinned copy at once.
    assert peaks["attach"] >= 1.7 * swapped, peaks
