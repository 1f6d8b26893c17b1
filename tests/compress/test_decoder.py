"""Tests of vramkit.compress.decoder: the output checks on CPU, and on a GPU the Triton kernel
against the reference decoder byte for byte (random weights, every edge case, a corrupted
payload raising the error flag)."""

from __future__ import annotations

import pytest
import torch

from vramkit.compress.decoder import (
    check_flag,
    decode,
    decode_into,
    decode_reference,
    new_flag,
    triton_decoder_available,
)
from vramkit.compress.encoder import encode, encode_tensor
from vramkit.compress.format import GROUP, Region
from vramkit.errors import CompressionError


def test_output_and_device_are_checked() -> None:
    c = encode_tensor((torch.randn(300) * 0.02).bfloat16())
    with pytest.raises(CompressionError, match="600 bytes"):
        decode_into(c, torch.empty(10, dtype=torch.uint8))
    with pytest.raises(CompressionError, match="payload is on"):
        decode_into(c, torch.empty(600, dtype=torch.uint8, device="meta"))
    assert not triton_decoder_available(torch.device("cpu"))


def test_a_set_flag_raises() -> None:
    flag = new_flag("cpu")
    check_flag(flag)
    flag[0] = 1
    with pytest.raises(CompressionError, match="corrupted"):
        check_flag(flag, "swapped block b.0")


def _cases() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return {
        "normal": (torch.randn(3 * GROUP + 17) * 0.02).bfloat16(),
        "large": (torch.randn(1 << 22) * 0.02).bfloat16(),
        "every_pattern": every,
        "one_exponent": torch.where(torch.rand(GROUP + 5) > 0.5, 1.0, -1.25).bfloat16(),
        "tiny": torch.tensor([1.5], dtype=torch.bfloat16),
        "int8": torch.randint(-4, 4, (GROUP * 2 + 3,), dtype=torch.int8),
        "fp8": (torch.randn(GROUP * 4) * 2).to(torch.float8_e4m3fn),
        "raw_fp32": torch.randn(999),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(_cases()))
def test_triton_matches_the_reference(case: str) -> None:
    t = _cases()[case]
    c = encode_tensor(t, device="cuda")
    dev = c.to(c.payload.cuda())
    reference = torch.empty(c.nbytes, dtype=torch.uint8, device="cuda")
    decode_reference(dev, reference)
    out = torch.full((c.nbytes,), 0xAB, dtype=torch.uint8, device="cuda")
    flag = new_flag("cuda")
    decode_into(dev, out, flag)
    check_flag(flag)
    assert torch.equal(out, reference)
    assert torch.equal(out.cpu(), t.view(-1).view(torch.uint8))


@pytest.mark.gpu
def test_triton_mixed_regions_and_gpu_encode_match_cpu_encode() -> None:
    torch.manual_seed(3)
    data = torch.zeros(4 * GROUP, dtype=torch.uint8)
    data[:2 * GROUP] = (torch.randn(GROUP) * 0.02).bfloat16().view(torch.uint8)
    data[2 * GROUP + 512:2 * GROUP + 512 + 9000] = torch.randint(0, 3, (9000,),
                                                                 dtype=torch.uint8)
    regions = [Region(0, 2 * GROUP, "bf16"), Region(2 * GROUP + 512, 9000, "byte")]
    on_cpu = encode(data, regions)
    on_gpu = encode(data, regions, device="cuda")
    assert torch.equal(on_cpu.payload, on_gpu.payload) and on_cpu.header == on_gpu.header
    assert torch.equal(decode(on_gpu, "cuda").cpu(), data)


@pytest.mark.gpu
def test_triton_flags_a_corrupted_payload() -> None:
    t = (torch.randn(2 * GROUP) * 0.02).bfloat16()
    for section in ("words", "plane", "lanes"):
        c = encode_tensor(t)
        raw = c.section(section, torch.uint8)
        raw[raw.numel() // 2] ^= 0x40
        with pytest.raises(CompressionError, match="corrupted"):
            decode(c, "cuda")
