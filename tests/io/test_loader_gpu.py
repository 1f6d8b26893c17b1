"""Direct-to-GPU loading through pinned staging buffers (needs CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.io.test_loader import TinyModel, meta_model, real_quant
from vramkit.io.lazy import LazySafetensors
from vramkit.io.loader import MemoryEfficientLoader

pytestmark = pytest.mark.gpu


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    tensors = {
        "big.bf16": torch.randn(1280, 1024).to(torch.bfloat16),  # 2.5 MiB: several chunks
        "mid.f32": torch.randn(300, 77),
        "fp8": torch.randn(64, 64).to(torch.float8_e4m3fn),
        "f16": torch.randn(333).half(),
        "ids": torch.arange(1001),
        "mask": torch.rand(17) > 0.5,
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 8),
        "i8": torch.randint(-100, 100, (5, 3), dtype=torch.int8),
    }
    save_file(tensors, tmp_path / "mixed.safetensors")
    return tmp_path / "mixed.safetensors"


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("use_mmap", [True, False])
@pytest.mark.parametrize("chunk_bytes", [64 << 10, 1 << 20, 64 << 20])
def test_cuda_load_matches_the_file(mixed: Path, use_mmap: bool, chunk_bytes: int) -> None:
    loader = MemoryEfficientLoader("cuda", use_mmap=use_mmap, chunk_bytes=chunk_bytes)
    loaded = loader.load_safetensors(mixed)
    reference = load_file(mixed)  # the safetensors library, on the CPU
    assert sorted(loaded) == sorted(reference)
    # used at once on the current stream, without any host synchronization in between
    sums = {name: t.double().sum() for name, t in loaded.items()
            if t.dtype not in (torch.bool,) and t.numel()}
    for name, tensor in loaded.items():
        assert tensor.device.type == "cuda"
        assert same(tensor, reference[name]), name
    for name, total in sums.items():
        assert torch.allclose(total.cpu(), reference[name].double().sum()), name
    stats = loader.last_stats
    assert stats is not None and stats.staged and stats.mode == ("mmap" if use_mmap else "pread")
    file_bytes = sum(t.numel() * t.element_size() for t in reference.values())
    assert stats.h2d_bytes == file_bytes == stats.file_bytes
    if chunk_bytes == 64 << 10:
        assert stats.chunks >= file_bytes // (64 << 10)
    assert loader._pinned_pool is not None and loader._pinned_pool.kind == "pinned"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_conversion_on_the_gpu_matches_cpu_conversion(mixed: Path, dtype: torch.dtype) -> None:
    loaded = MemoryEfficientLoader("cuda", dtype=dtype, chunk_bytes=256 << 10).load_safetensors(
        mixed)
    reference = load_file(mixed)
    for name, tensor in loaded.items():
        want = reference[name]
        if want.is_floating_point():
            want = want.to(dtype)
        assert same(tensor, want), name


def test_matches_safetensors_load_file_on_cuda(mixed: Path) -> None:
    ours = MemoryEfficientLoader("cuda").load_safetensors(mixed)
    theirs = load_file(mixed, device="cuda")
    for name, tensor in theirs.items():
        assert same(ours[name], tensor), name


def test_stream_weights_keeps_device_memory_bounded(tmp_path: Path) -> None:
    path = tmp_path / "stream.safetensors"
    count, numel = 24, 2 << 20  # 24 x 8 MiB fp32
    save_file({f"t{i:02d}": torch.full((numel,), float(i)) for i in range(count)}, path)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    peak = 0
    totals = []

    def consume(name: str, tensor: torch.Tensor) -> None:
        nonlocal peak
        totals.append(tensor[:4].sum())  # device work on the current stream, no host sync
        peak = max(peak, torch.cuda.memory_allocated() - base)

    loader = MemoryEfficientLoader("cuda", chunk_bytes=8 << 20)
    stats = loader.stream_weights(path, consume)
    assert stats.tensors == count
    assert [float(t) for t in totals] == [4.0 * i for i in range(count)]
    # at most a chunk's worth of tensors is alive at once: far below the 192 MiB file
    assert peak <= 3 * (8 << 20), f"{peak >> 20} MiB"


def test_load_into_meta_module_on_cuda(tmp_path: Path) -> None:
    torch.manual_seed(1)
    reference = TinyModel().cuda()
    state = {k: v.contiguous().cpu() for k, v in reference.state_dict().items()
             if k != "head.weight"}
    save_file(state, tmp_path / "m.safetensors")
    model = meta_model()
    result = MemoryEfficientLoader("cuda", chunk_bytes=4096).load_into(model,
                                                                       tmp_path / "m.safetensors")
    assert result.still_meta == ["cache"] and result.stats.h2d_bytes > 0
    model.cache = torch.zeros(3, device="cuda")
    ids = torch.tensor([[1, 2, 3]], device="cuda")
    assert torch.equal(model(ids), reference(ids))
    assert model.head.weight is model.embed.weight and model.embed.weight.is_cuda


def test_load_and_quantize_on_cuda(tmp_path: Path) -> None:
    config_type, linear_type = real_quant()
    torch.manual_seed(1)
    reference = TinyModel()
    state = {k: v.contiguous() for k, v in reference.state_dict().items() if k != "head.weight"}
    save_file(state, tmp_path / "m.safetensors")
    model = meta_model()
    result = MemoryEfficientLoader("cuda").load_into(model, tmp_path / "m.safetensors",
                                                     quantization=config_type(weights_dtype="int8"))
    assert {"blocks.0", "blocks.1"} <= set(result.quantized_modules)
    assert isinstance(model.blocks[0], linear_type)
    assert all(t.is_cuda for t in model.blocks[0].buffers())


def test_lazy_open_does_not_touch_the_gpu(mixed: Path) -> None:
    with LazySafetensors.open(mixed) as checkpoint:
        assert checkpoint.load_tensor("ids").device.type == "cpu"
