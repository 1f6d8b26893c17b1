"""CPU tests of vramkit.compress.format: the header, crc32 and corruption caught as
CompressionError by the reference decoder (never silent garbage)."""

from __future__ import annotations

import pytest
import torch

from vramkit.compress.decoder import decode
from vramkit.compress.encoder import encode_tensor
from vramkit.compress.format import GROUP, Compressed, Header, check_crc
from vramkit.errors import CompressionError


@pytest.fixture(scope="module")
def weights() -> torch.Tensor:
    torch.manual_seed(0)
    return (torch.randn(2 * GROUP + 100) * 0.02).bfloat16()


def test_bytes_round_trip_with_header(weights: torch.Tensor) -> None:
    c = encode_tensor(weights)
    back = Compressed.from_bytes(c.to_bytes())
    assert back.header == c.header
    assert torch.equal(decode(back), weights.view(torch.uint8))


def test_header_corruption_and_version_are_caught(weights: torch.Tensor) -> None:
    blob = bytearray(encode_tensor(weights).to_bytes())
    bad = bytearray(blob)
    bad[20] ^= 1
    with pytest.raises(CompressionError, match="header is corrupted"):
        Compressed.from_bytes(bytes(bad))
    with pytest.raises(CompressionError, match="not a vramkit"):
        Compressed.from_bytes(b"XXXX" + bytes(blob[4:]))
    with pytest.raises(CompressionError, match="payload holds"):
        Compressed.from_bytes(bytes(blob[:-1]))
    h = Header.from_bytes(bytes(blob[:Header.size()]))
    other = Header(*[getattr(h, f) for f in ("nbytes", "payload_nbytes", "n_groups", "groups",
                                             "tables", "lanes", "plane", "words", "crc")],
                   version=99)
    with pytest.raises(CompressionError, match="version 99"):
        Header.from_bytes(other.to_bytes())


@pytest.mark.parametrize("section", ["tables", "lanes", "plane", "words"])
def test_a_flipped_payload_byte_is_an_error(weights: torch.Tensor, section: str) -> None:
    c = encode_tensor(weights)
    raw = c.section(section, torch.uint8)
    raw[raw.numel() // 3] ^= 0x10
    with pytest.raises(CompressionError, match="crc32"):
        check_crc(c)
    with pytest.raises(CompressionError, match="corrupted"):
        decode(c)


def test_a_group_record_pointing_outside_is_an_error(weights: torch.Tensor) -> None:
    c = encode_tensor(weights)
    c.records()[1, 0] = c.nbytes  # output offset past the end
    with pytest.raises(CompressionError, match="points outside"):
        decode(c)
    c = encode_tensor(weights)
    c.records()[0, 7] += 1  # checksum
    with pytest.raises(CompressionError, match="checksum"):
        decode(c)
    blob = c.to_bytes()
    with pytest.raises(CompressionError):
        Compressed.from_bytes(blob[:Header.size()] + b"\0" * (len(blob) - Header.size()))
