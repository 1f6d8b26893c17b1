"""Quantization format configs: one frozen, validated dataclass per weight format.

Re-exported by :mod:`vramkit.quant.formats`; kept apart so the torch reference and the kernels can
import them without importing :class:`~vramkit.quant.formats.QuantizedTensor`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, TypeAlias

from vramkit._validate import check_bool, check_choice, check_int, check_known_fields
from vramkit.errors import ConfigError

__all__ = [
    "FP8Config",
    "Int4Config",
    "Int8Config",
    "NF4Config",
    "QuantConfigT",
    "QuantFormat",
    "config_from_dict",
    "format_config",
]

logger = logging.getLogger(__name__)

# Most candidate scales a clipping search may try per group (each is one pass over the tensor).
_MAX_CLIP_SEARCH = 64


class QuantFormat(str, Enum):
    """The weight formats vramkit stores."""

    INT8 = "int8"
    INT4 = "int4"
    NF4 = "nf4"
    FP8 = "fp8"


_CLIP_SEARCH_HINT = "1 keeps the full range (absmax / min-max); 8 is the default."


def _size_hint(name: str) -> str:
    return f"Use e.g. {name}=32 (a power of two is fastest on GPU)."


def _check_even(owner: str, name: str, value: int) -> None:
    """The 4-bit formats' rule on a (validated) group size: two codes share a byte."""
    if value % 2:
        raise ConfigError(f"{owner}.{name} must be even for a 4-bit format (two codes share a "
                          f"byte), got {value}", hint=f"Use an even {name}, e.g. 32 or 64.")


def _set_key(config: Any) -> None:
    """Store the config's canonical JSON key on the (frozen) instance.

    The GPU custom ops take the config as this string; computing it with ``json.dumps`` inside
    a ``torch.compile``d region is untraceable, so it is computed once here, eagerly, and read
    as a plain attribute (``config._key``) on the hot path.
    """
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    object.__setattr__(config, "_key", json.dumps({"format": config.format.value, **fields},
                                                  sort_keys=True))


@dataclass(frozen=True)
class Int8Config:
    """Block-wise absmax int8: symmetric codes in [-127, 127], one scale per block of a row.

    Args:
        block_size: elements per block along a row (default 32). Smaller blocks follow
            heavy-tailed weights better; 32 with compact scales keeps memory at 0.516x of bf16.
        compact_scales: store each block's scale as a uint8 log-step code relative to an fp32
            per-row scale (default True: 1 byte per block) instead of an fp32 scale per block.
    """

    block_size: int = 32
    compact_scales: bool = True

    def __post_init__(self) -> None:
        check_int("Int8Config.block_size", self.block_size, minimum=1,
                  hint=_size_hint("block_size"))
        check_bool("Int8Config.compact_scales", self.compact_scales)
        _set_key(self)

    @property
    def format(self) -> QuantFormat:
        """The format this config describes (``QuantFormat.INT8``)."""
        return QuantFormat.INT8

    @property
    def group(self) -> int:
        """Elements sharing one scale along a row."""
        return self.block_size


@dataclass(frozen=True)
class Int4Config:
    """Group-wise asymmetric int4: codes in [0, 15], a scale and an integer zero point per group.

    Args:
        group_size: elements per group along a row; even (default 32).
        compact_scales: scales as uint8 log-step codes relative to an fp32 per-row scale and zero
            points packed two per byte (default True: 1.5 bytes per group, 0.273x of bf16); False
            stores fp32 scales and one uint8 zero point per group.
        clip_search: candidate scales tried per group, each 2**(-1/16) smaller than the last
            (default 8); the one with the least squared group error wins. 1 = plain min/max.
    """

    group_size: int = 32
    compact_scales: bool = True
    clip_search: int = 8

    def __post_init__(self) -> None:
        check_int("Int4Config.group_size", self.group_size, minimum=1,
                  hint=_size_hint("group_size"))
        _check_even("Int4Config", "group_size", self.group_size)
        check_bool("Int4Config.compact_scales", self.compact_scales)
        check_int("Int4Config.clip_search", self.clip_search, minimum=1,
                  maximum=_MAX_CLIP_SEARCH, hint=_CLIP_SEARCH_HINT)
        _set_key(self)

    @property
    def format(self) -> QuantFormat:
        """The format this config describes (``QuantFormat.INT4``)."""
        return QuantFormat.INT4

    @property
    def group(self) -> int:
        """Elements sharing one scale along a row."""
        return self.group_size


@dataclass(frozen=True)
class NF4Config:
    """4-bit NormalFloat (the QLoRA code table), block-wise absmax.

    Args:
        block_size: elements per block along a row; even (default 32).
        double_quant: store the per-block scales as uint8 log-step codes relative to an fp32
            scale per ``double_quant_block_size`` blocks (default True: 0.266x of bf16) instead
            of one fp32 scale per block.
        double_quant_block_size: scales per second-level block (default 256).
        clip_search: candidate scales tried per block, each 2**(-1/16) smaller than the last
            (default 8); the one with the least squared block error wins. 1 = plain absmax.
    """

    block_size: int = 32
    double_quant: bool = True
    double_quant_block_size: int = 256
    clip_search: int = 8

    def __post_init__(self) -> None:
        check_int("NF4Config.block_size", self.block_size, minimum=1,
                  hint=_size_hint("block_size"))
        _check_even("NF4Config", "block_size", self.block_size)
        check_bool("NF4Config.double_quant", self.double_quant)
        check_int("NF4Config.double_quant_block_size", self.double_quant_block_size, minimum=1,
                  hint=_size_hint("double_quant_block_size"))
        check_int("NF4Config.clip_search", self.clip_search, minimum=1,
                  maximum=_MAX_CLIP_SEARCH, hint=_CLIP_SEARCH_HINT)
        _set_key(self)

    @property
    def format(self) -> QuantFormat:
        """The format this config describes (``QuantFormat.NF4``)."""
        return QuantFormat.NF4

    @property
    def group(self) -> int:
        """Elements sharing one scale along a row."""
        return self.block_size


@dataclass(frozen=True)
class FP8Config:
    """float8 e4m3 with fp32 absmax scales per output channel (row) or per block of a row.

    Args:
        granularity: ``"channel"`` (default; one scale per row, the layout the fp8 GEMM takes)
            or ``"block"`` (one scale per ``block_size`` elements of a row).
        block_size: elements per block for ``granularity="block"`` (default 128).
    """

    granularity: Literal["channel", "block"] = "channel"
    block_size: int = 128

    def __post_init__(self) -> None:
        check_choice("FP8Config.granularity", self.granularity, ("channel", "block"))
        check_int("FP8Config.block_size", self.block_size, minimum=1,
                  hint=_size_hint("block_size"))
        _set_key(self)

    @property
    def format(self) -> QuantFormat:
        """The format this config describes (``QuantFormat.FP8``)."""
        return QuantFormat.FP8


QuantConfigT: TypeAlias = Int8Config | Int4Config | NF4Config | FP8Config

_CONFIG_CLASSES: dict[QuantFormat, type[Any]] = {
    QuantFormat.INT8: Int8Config,
    QuantFormat.INT4: Int4Config,
    QuantFormat.NF4: NF4Config,
    QuantFormat.FP8: FP8Config,
}
_SIZE_FIELD: dict[QuantFormat, str] = {
    QuantFormat.INT8: "block_size",
    QuantFormat.INT4: "group_size",
    QuantFormat.NF4: "block_size",
    QuantFormat.FP8: "block_size",
}


def _parse_format(fmt: str | QuantFormat) -> QuantFormat:
    if isinstance(fmt, QuantFormat):
        return fmt
    if isinstance(fmt, str):
        try:
            return QuantFormat(fmt.strip().lower())
        except ValueError:
            pass
    supported = ", ".join(f.value for f in QuantFormat)
    raise ConfigError(f"unknown quantization format {fmt!r}; supported: {supported}",
                      hint="Pass one of the names above or an Int8Config/Int4Config/NF4Config/"
                           "FP8Config instance.")


def format_config(fmt: str | QuantFormat | QuantConfigT,
                  group_size: int | None = None) -> QuantConfigT:
    """Resolve a format name, enum member or config to a config.

    Args:
        fmt: ``"int8"``, ``"int4"``, ``"nf4"``, ``"fp8"``, a :class:`QuantFormat` or a config.
        group_size: optional override of the group/block size (default None: keep the config's).
            For fp8 it selects ``granularity="block"`` with that block size.

    Returns:
        The config.

    Raises:
        ConfigError: unknown format name or invalid group size.
    """
    if isinstance(fmt, Int8Config | Int4Config | NF4Config | FP8Config):
        config: QuantConfigT = fmt
    else:
        config = _CONFIG_CLASSES[_parse_format(fmt)]()
    if group_size is None:
        return config
    changes: dict[str, Any] = {_SIZE_FIELD[config.format]: group_size}
    if isinstance(config, FP8Config):
        changes["granularity"] = "block"
    return dataclasses.replace(config, **changes)


def config_from_dict(fmt: str, fields: dict[str, Any]) -> QuantConfigT:
    """Rebuild a config from its format name and field values (the inverse of ``asdict``).

    Args:
        fmt: the format name.
        fields: the dataclass fields.

    Returns:
        The config.

    Raises:
        ConfigError: unknown format, unknown field or invalid value.
    """
    cls = _CONFIG_CLASSES[_parse_format(fmt)]
    return cls(**check_known_fields(cls, fields))
