"""CPU tests of vramkit.compress.encoder with the reference decoder: bit-exact round trips,
the edge cases (one symbol, NaN/Inf/subnormals/-0, odd sizes, partial groups, empty tensors),
mixed regions and the size targets."""

from __future__ import annotations

import pytest
import torch

from vramkit.compress.decoder import decode
from vramkit.compress.encoder import byte_kind, encode, encode_tensor, fill_regions
from vramkit.compress.format import GROUP, Region
from vramkit.errors import CompressionError


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _round_trip(t: torch.Tensor) -> float:
    c = encode_tensor(t)
    assert torch.equal(decode(c), _bytes(t))
    return c.ratio


@pytest.mark.parametrize("n", [1, 2, 3, 255, 256, 257, GROUP - 1, GROUP + 1, 2 * GROUP + 77])
def test_bf16_round_trips_at_any_length(n: int) -> None:
    torch.manual_seed(n)
    _round_trip((torch.randn(n) * 0.02).bfloat16())


def test_bf16_normal_weights_take_under_070x() -> None:
    torch.manual_seed(0)
    t = (torch.randn(512, 512) * 0.02).bfloat16()
    assert _round_trip(t) < 0.70


def test_special_values_round_trip() -> None:
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40,
                             -1e-40, 3.0e38, -3.0e38, 1.0], dtype=torch.bfloat16)
    t = torch.cat([specials, (torch.randn(5000) * 0.02).bfloat16()])
    t_bits = _bytes(t)
    assert torch.equal(decode(encode_tensor(t)), t_bits)
    # every one of the 65536 bf16 bit patterns
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    _round_trip(every)


def test_one_exponent_value_is_coded_with_no_stream_bits() -> None:
    t = torch.ones(3 * GROUP, dtype=torch.bfloat16) * torch.where(
        torch.rand(3 * GROUP) > 0.5, 1.0, -1.5).bfloat16()
    c = encode_tensor(t)
    assert torch.equal(decode(c), _bytes(t))
    words = c.section("words", torch.int32)
    assert words.numel() == 2  # only the two spare words
    assert c.ratio < 0.56  # half the bytes, plus the table


def test_empty_and_incompressible_data() -> None:
    empty = encode_tensor(torch.empty(0, dtype=torch.bfloat16))
    assert empty.nbytes == 0 and decode(empty).numel() == 0
    noise = torch.randint(0, 256, (GROUP + 5,), dtype=torch.uint8)
    c = encode_tensor(noise)
    assert c.records()[:, 2].eq(2).all()  # coding would not pay: stored raw
    assert torch.equal(decode(c), noise)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.uint8])
def test_eight_bit_storage_codes_the_whole_byte(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    t = (torch.randn(4 * GROUP + 333) * 3).clamp(-100, 100).to(dtype)
    assert byte_kind(dtype) == "byte"
    c = encode_tensor(t)
    assert torch.equal(decode(c), _bytes(t))
    assert c.records()[:, 2].eq(1).all() and c.ratio < 0.97


def test_other_dtypes_are_raw_and_exact() -> None:
    t = torch.randn(5000)
    assert byte_kind(t.dtype) == "raw"
    assert _round_trip(t) >= 1.0


def test_mixed_regions_cover_the_buffer_with_raw_gaps() -> None:
    torch.manual_seed(2)
    a = (torch.randn(4000) * 0.02).bfloat16()
    b = torch.randint(-5, 5, (3001,), dtype=torch.int8)
    c = torch.randn(100)
    data = torch.zeros(512 * 40, dtype=torch.uint8)
    data[0:8000] = _bytes(a)
    data[8192:8192 + 3001] = _bytes(b)
    data[11776:12176] = _bytes(c)
    data[12176:12200] = 7  # bytes in a gap are kept too
    regions = [Region(0, 8000, "bf16"), Region(8192, 3001, "byte"), Region(11776, 400, "raw")]
    assert [r.kind for r in fill_regions(data.numel(), regions)] == [
        "bf16", "raw", "byte", "raw", "raw", "raw"]
    out = encode(data, regions)
    assert torch.equal(decode(out), data)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(CompressionError, match="1-D uint8"):
        encode(torch.zeros(4, dtype=torch.int16))
    with pytest.raises(CompressionError, match="even"):
        Region(1, 4, "bf16")
    with pytest.raises(CompressionError, match="overlaps"):
        encode(torch.zeros(64, dtype=torch.uint8), [Region(0, 32, "raw"), Region(16, 32, "raw")])
    with pytest.raises(CompressionError, match="allocator"):
        encode(torch.zeros(64, dtype=torch.uint8), alloc=lambda n: torch.empty(n + 1,
                                                                                dtype=torch.uint8))


def test_payload_goes_into_the_allocated_buffer() -> None:
    given: list[torch.Tensor] = []

    def alloc(n: int) -> torch.Tensor:
        given.append(torch.empty(n, dtype=torch.uint8))
        return given[-1]

    t = (torch.randn(GROUP) * 0.02).bfloat16()
    c = encode_tensor(t, alloc=alloc)
    assert c.payload.data_ptr() == given[0].data_ptr()
    assert torch.equal(decode(c), _bytes(t))


def test_the_chunking_does_not_change_the_payload() -> None:
    """encode(chunk_groups=) bounds the temporaries (a background encode beside training uses
    fewer groups at once); the bytes it writes are the same."""
    torch.manual_seed(3)
    data = (torch.randn(5 * 32768 + 77) * 0.02).bfloat16().view(torch.uint8)
    regions = [Region(0, data.numel() - 154, "bf16")]
    default = encode(data, regions, crc=False)
    for groups in (1, 2, 3):
        assert torch.equal(encode(data, regions, crc=False, chunk_groups=groups).payload,
                           default.payload)
