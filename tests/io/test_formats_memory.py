"""Host memory while a GGUF file streams into a model: the packed bytes are held once (the
swapper's masters, or the layers' buffers), never a full-precision copy, never twice."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

from tests._child import run_child
from vramkit.io._gguf_file import write_gguf
from vramkit.io.loader import load_into
from vramkit.quant.gguf import GGUFLinear, dequantize_gguf

psutil = pytest.importorskip("psutil")

WIDTH, BLOCKS = 2048, 48  # 48 Q8_0 weights of 2048 x 2048: 214 MB, 0.4 GB as bf16
Q8_0 = 8
MARGIN = 64 << 20


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _q8_0_blocks() -> torch.Tensor:
    """Every weight's bytes: random Q8_0 codes, all blocks with the scale 0.01."""
    blocks = torch.randint(0, 256, (WIDTH * WIDTH // 32, 34), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    blocks[:, :2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    return blocks


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "stack-Q8_0.gguf"
    weight = _q8_0_blocks().numpy()
    bias = torch.zeros(WIDTH).numpy()
    tensors: list[tuple[str, tuple[int, ...], int, Callable[[], object]]] = []
    for i in range(BLOCKS):
        tensors.append((f"blocks.{i}.fc.weight", (WIDTH, WIDTH), Q8_0, lambda: weight))
        tensors.append((f"blocks.{i}.fc.bias", (WIDTH,), 0, lambda: bias))
    write_gguf(path, tensors)
    return path


@contextmanager
def peak_rss_growth() -> Iterator[list[int]]:
    """Samples this process's resident set every 2 ms; yields [peak growth] (filled on exit)."""
    gc.collect()
    process = psutil.Process()
    baseline = process.memory_info().rss
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss - baseline)
            stop.wait(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
        peak[0] = max(peak[0], process.memory_info().rss - baseline)


def _check_layer(model: Stack) -> None:
    layer = model.blocks[7].fc
    assert isinstance(layer, GGUFLinear)
    packed = model.state_dict()["blocks.7.fc.weight_packed"]  # a swapper's: from its master
    want = _q8_0_blocks().reshape(WIDTH, -1)
    assert torch.equal(packed, want)
    codes = want[:4].reshape(-1, 34)[:, 2:].contiguous().view(torch.int8)
    decoded = dequantize_gguf(packed[:4], "Q8_0", (4, WIDTH))
    scale = torch.tensor(0.01, dtype=torch.float16).float()
    assert torch.equal(decoded, (codes.float() * scale).reshape(4, WIDTH))


def measure(path: str, how: str) -> dict[str, int]:
    """Load the file into a Stack built on meta (``how``: ``"swapper"`` or ``"load_into"``);
    the peak growth of this process's resident set. Run in a fresh interpreter, so that memory
    freed by earlier tests and kept by the allocator cannot hide a copy."""
    from vramkit.offload.swap import BlockSwapper, SwapConfig

    with torch.device("meta"):
        model = Stack()
    model.requires_grad_(False)
    swapper = None
    with peak_rss_growth() as peak:
        if how == "swapper":
            swapper = BlockSwapper(model, config=SwapConfig(min_param_bytes=0), device="cpu",
                                   checkpoint=path)
            swapper.wait_loaded()
        else:
            load_into(model, path)
    _check_layer(model)
    if swapper is not None:
        swapper.detach()
    return {"peak": peak[0], "size": Path(path).stat().st_size}


@pytest.mark.parametrize("how", ["swapper", "load_into"])
def test_the_packed_file_is_held_once(gguf_file: Path, how: str) -> None:
    got = run_child(f"""
        import json
        from tests.io.test_formats_memory import measure
        print(json.dumps(measure({str(gguf_file)!r}, {how!r})))
        """, cwd=Path(__file__).resolve().parents[2])
    peak, size = got["peak"], got["size"]
    # The bytes are there (the growth is real), and nothing more: a bf16 copy would add 1.9x
    # the file, a second copy of the packed bytes 1x.
    assert peak >= 0.9 * size, f"grew by {peak >> 20} MiB for a {size >> 20} MiB file"
    assert peak <= size + MARGIN, f"grew by {peak >> 20} MiB for a {size >> 20} MiB file"
