"""benchmarks/gguf_decode.py on the CPU: its Q8_0 bytes decode to finite weights, every decoder
it compares gives the same shape (the Triton and torch ones the same bits), and without a GPU it
says so and exits 2 instead of timing nothing."""

from __future__ import annotations

import pytest
import torch

from tests._benchmarks import load_benchmark

gguf_decode = load_benchmark("gguf_decode")


def test_the_benchmarks_bytes_decode_alike_through_every_decoder() -> None:
    raw = gguf_decode.q8_0_bytes(8, 64, torch.device("cpu"), seed=1)
    assert raw.dtype == torch.uint8 and raw.shape == (8, 64 // 32 * 34)
    ops = gguf_decode.decoders(raw, 8, 64)
    assert {"triton", "torch"} <= set(ops)
    first = ops["triton"]()
    assert first.shape == (8, 64) and first.dtype == torch.bfloat16
    assert torch.isfinite(first.float()).all() and first.abs().sum() > 0
    assert torch.equal(first, ops["torch"]())
    if "diffusers" in ops:  # rounds the scale to bf16 first: close, not always the same bits
        torch.testing.assert_close(ops["diffusers"](), first, rtol=1e-2, atol=1e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_says_so_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert gguf_decode.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
