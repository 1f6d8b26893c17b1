"""A diffusion transformer with Flux-style double- and single-stream blocks.

vramkit ships this model so that ``vramkit demo``, the tests and the swapping benchmarks have a
realistic network of any size without downloading weights. The architecture follows the MMDiT /
Flux family:

- image latents ``[B, C, H, W]`` are cut into ``patch_size`` x ``patch_size`` patches and embedded
  by one ``Linear``; text embeddings ``[B, T, text_dim]`` are projected to the hidden size;
- a conditioning vector comes from the timestep (sinusoidal features + MLP) plus the mean-pooled
  text (MLP); every block reads it through adaLN modulation (shift, scale, gate);
- :class:`DoubleStreamBlock` keeps separate weights for the image and the text stream and attends
  jointly over ``concat(text, image)`` tokens;
- :class:`SingleStreamBlock` runs the concatenated stream through one fused ``Linear`` (qkv and
  MLP input) with attention and MLP in parallel;
- image tokens carry 2-D rotary position embeddings (row, column); text tokens sit at position 0,
  which leaves them unrotated;
- a final adaLN layer and ``Linear`` map tokens back to patches, which are folded back to latents.

The repeated blocks sit in ``double_blocks`` and ``single_blocks`` (``nn.ModuleList``), so
:func:`vramkit.offload.blocks.find_blocks` finds them in execution order. Nearly all bytes of a
block are in large ``Linear`` weights; the only other parameters are the q/k RMSNorm scales.

Example:
    >>> config = DiTConfig.preset("tiny")
    >>> model = DiT(config, seed=0)
    >>> batch = synthetic_batch(config, batch_size=2, generator=torch.Generator().manual_seed(0))
    >>> loss = flow_matching_loss(model, batch)
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vramkit._validate import (
    check_bool,
    check_choice,
    check_int,
    check_known_fields,
    check_number,
    check_size,
)
from vramkit.errors import ConfigError
from vramkit.units import format_size

__all__ = [
    "DiT",
    "DiTConfig",
    "DoubleStreamBlock",
    "SingleStreamBlock",
    "flow_matching_loss",
    "rotary_embedding",
    "synthetic_batch",
    "timestep_features",
]

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# Width of the sinusoidal timestep features fed to the timestep MLP (as in DiT and Flux).
TIMESTEP_FEATURES = 256
# Timesteps live in [0, 1]; the sinusoidal features are computed for t * 1000, the range the
# classic frequency table was designed for.
_TIMESTEP_SCALE = 1000.0
_ROPE_THETA = 10_000.0
_NORM_EPS = 1e-6

_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=96, num_heads=4, num_double_blocks=2, num_single_blocks=2,
                 in_channels=4, image_size=8, text_dim=32, text_tokens=8, dtype="float32"),
    "small": dict(hidden_size=192, num_heads=3, num_double_blocks=4, num_single_blocks=8,
                  in_channels=16, image_size=16, text_dim=128, text_tokens=16, dtype="float32"),
    "base": dict(hidden_size=512, num_heads=8, num_double_blocks=6, num_single_blocks=12,
                 in_channels=16, image_size=32, text_dim=512, text_tokens=64, dtype="bfloat16"),
    "large": dict(hidden_size=1024, num_heads=8, num_double_blocks=8, num_single_blocks=16,
                  in_channels=16, image_size=32, text_dim=768, text_tokens=64, dtype="bfloat16"),
    "xl": dict(hidden_size=2048, num_heads=16, num_double_blocks=10, num_single_blocks=24,
               in_channels=16, image_size=64, text_dim=1024, text_tokens=128, dtype="bfloat16"),
}
# Fields that DiTConfig.for_bytes chooses itself; the others may be overridden.
_SIZED_FIELDS = ("hidden_size", "num_heads", "num_double_blocks", "num_single_blocks")
_FOR_BYTES_DEFAULTS: dict[str, Any] = dict(in_channels=16, image_size=32, text_dim=512,
                                           text_tokens=64)
# for_bytes keeps Flux's proportions: twice as many single as double blocks, and about 160
# hidden units per double block (Flux: 3072 / 19).
_WIDTH_PER_DEPTH = 160.0
_FOR_BYTES_TOLERANCE = 0.05


def _linear_params(fan_in: int, fan_out: int) -> int:
    return fan_in * fan_out + fan_out


@dataclass(frozen=True)
class DiTConfig:
    """Shape of a :class:`DiT`.

    Args:
        hidden_size: token width. Must be divisible by ``num_heads``.
        num_heads: attention heads; ``hidden_size // num_heads`` must be a multiple of 4 (the
            head is split in two halves, row and column, each rotated in pairs).
        num_double_blocks: number of :class:`DoubleStreamBlock` (>= 0).
        num_single_blocks: number of :class:`SingleStreamBlock` (>= 0); the two together >= 1.
        mlp_ratio: MLP hidden width as a multiple of ``hidden_size``. Default 4.0.
        in_channels: latent channels (16 for Flux/SD3 latents).
        patch_size: side of a square patch in latent pixels. Default 2.
        text_dim: width of the (synthetic) text encoder embeddings.
        text_tokens: number of text tokens per sample.
        image_size: latent height = width; a multiple of ``patch_size``.
        dtype: parameter dtype, ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``.
        qk_norm: RMSNorm on queries and keys per head (Flux does). Default True.

    Raises:
        ConfigError: for any value out of range.
    """

    hidden_size: int
    num_heads: int
    num_double_blocks: int
    num_single_blocks: int
    mlp_ratio: float = 4.0
    in_channels: int = 16
    patch_size: int = 2
    text_dim: int = 512
    text_tokens: int = 64
    image_size: int = 32
    dtype: str = "float32"
    qk_norm: bool = True

    def __post_init__(self) -> None:
        for name, minimum in (("hidden_size", 1), ("num_heads", 1), ("num_double_blocks", 0),
                              ("num_single_blocks", 0), ("in_channels", 1), ("patch_size", 1),
                              ("text_dim", 1), ("text_tokens", 1), ("image_size", 1)):
            check_int(f"DiTConfig.{name}", getattr(self, name), minimum=minimum)
        if self.num_double_blocks + self.num_single_blocks < 1:
            raise ConfigError("DiTConfig needs at least one block "
                              "(num_double_blocks + num_single_blocks >= 1)",
                              hint="Set num_double_blocks or num_single_blocks to 1 or more.")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"DiTConfig.hidden_size ({self.hidden_size}) must be divisible by "
                              f"num_heads ({self.num_heads})",
                              hint="Pick num_heads that divides hidden_size, e.g. hidden_size=3072 "
                                   "with num_heads=24 (Flux).")
        if self.head_dim % 4:
            raise ConfigError(
                f"DiTConfig head_dim = hidden_size / num_heads = {self.head_dim} must be a "
                "multiple of 4 for 2-D rotary embeddings",
                hint="Pick hidden_size and num_heads with a head size of 64 or 128, as Flux does.")
        object.__setattr__(self, "mlp_ratio", check_number(
            "DiTConfig.mlp_ratio", self.mlp_ratio, minimum=0, low_open=True))
        if self.mlp_hidden_size < 1:
            raise ConfigError(f"DiTConfig.mlp_ratio {self.mlp_ratio} gives an empty MLP for "
                              f"hidden_size {self.hidden_size}",
                              hint="Raise DiTConfig.mlp_ratio (Flux uses 4.0) so hidden_size * "
                                   "mlp_ratio is at least 1.")
        if self.image_size % self.patch_size:
            raise ConfigError(f"DiTConfig.image_size ({self.image_size}) must be a multiple of "
                              f"patch_size ({self.patch_size})",
                              hint="Pick image_size as a multiple of patch_size, e.g. "
                                   "image_size=64 with patch_size=2.")
        check_choice("DiTConfig.dtype", self.dtype, _DTYPES)
        check_bool("DiTConfig.qk_norm", self.qk_norm)

    # -- derived sizes -----------------------------------------------------------------------

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden_size(self) -> int:
        """Width of the MLP's hidden layer: ``int(hidden_size * mlp_ratio)``."""
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def patch_dim(self) -> int:
        """Values in one patch: ``in_channels * patch_size**2``."""
        return self.in_channels * self.patch_size ** 2

    @property
    def num_image_tokens(self) -> int:
        """Image tokens per sample: ``(image_size / patch_size) ** 2``."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_tokens(self) -> int:
        """Tokens in the joint sequence: text plus image."""
        return self.text_tokens + self.num_image_tokens

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype``."""
        return _DTYPES[self.dtype]

    # -- parameter counts (exact; tested against built models) -------------------------------

    def double_block_parameters(self) -> int:
        """Parameters of one :class:`DoubleStreamBlock`."""
        h, m = self.hidden_size, self.mlp_hidden_size
        qk = 2 * self.head_dim if self.qk_norm else 0
        stream = (_linear_params(h, 6 * h) + _linear_params(h, 3 * h) + qk
                  + _linear_params(h, h) + _linear_params(h, m) + _linear_params(m, h))
        return 2 * stream

    def single_block_parameters(self) -> int:
        """Parameters of one :class:`SingleStreamBlock`."""
        h, m = self.hidden_size, self.mlp_hidden_size
        qk = 2 * self.head_dim if self.qk_norm else 0
        return (_linear_params(h, 3 * h) + _linear_params(h, 3 * h + m) + qk
                + _linear_params(h + m, h))

    def num_parameters(self) -> int:
        """Exact number of parameters of ``DiT(self)``, computed without building it."""
        h = self.hidden_size
        embed = (_linear_params(self.patch_dim, h)
                 + _linear_params(TIMESTEP_FEATURES, h) + _linear_params(h, h)
                 + _linear_params(self.text_dim, h) + _linear_params(h, h)
                 + _linear_params(self.text_dim, h))
        final = _linear_params(h, 2 * h) + _linear_params(h, self.patch_dim)
        return (embed + final + self.num_double_blocks * self.double_block_parameters()
                + self.num_single_blocks * self.single_block_parameters())

    def weight_bytes(self) -> int:
        """Bytes of all parameters in ``dtype``."""
        return self.num_parameters() * self.torch_dtype.itemsize

    # -- construction helpers ----------------------------------------------------------------

    @classmethod
    def preset_names(cls) -> tuple[str, ...]:
        """Names accepted by :meth:`preset`, smallest first."""
        return tuple(_PRESETS)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> DiTConfig:
        """A named configuration.

        Args:
            name: ``"tiny"`` (~1 M parameters, float32, trains in seconds on a CPU),
                ``"small"`` (~10 M, float32), ``"base"`` (~100 M, bfloat16), ``"large"``
                (~0.57 B, bfloat16) or ``"xl"`` (~3 B, bfloat16: about 6 GB of weights).
            **overrides: fields to replace, e.g. ``dtype="float32"`` or ``image_size=64``.

        Returns:
            The validated config.

        Raises:
            ConfigError: for an unknown name or an invalid override.
        """
        if name not in _PRESETS:
            raise ConfigError(f"unknown DiT preset {name!r}",
                              hint=f"Use one of {', '.join(_PRESETS)}.")
        fields = {**_PRESETS[name], **overrides}
        try:
            return cls(**fields)
        except TypeError as exc:  # an override naming no field
            raise ConfigError(f"invalid override for DiT preset {name!r}: {exc}",
                              hint="Override only DiTConfig fields, e.g. "
                                   "DiTConfig.preset('tiny', num_single_blocks=4).") from None

    @classmethod
    def for_bytes(cls, target_bytes: int | str, dtype: str = "bfloat16",
                  **overrides: Any) -> DiTConfig:
        """A config whose weights take about ``target_bytes`` in ``dtype``.

        Width and depth grow together, keeping Flux's proportions (two single blocks per double
        block, about 160 hidden units per double block, head size 64 below width 1024 and 128
        from there): among all widths (multiples of 64 up to 8192) and depths (2 to 19 double
        blocks) whose bytes are within 5% of the target, the one closest to those proportions
        wins; when none is that close, the closest in bytes does.

        Args:
            target_bytes: bytes as an int or a string such as ``"6GiB"``.
            dtype: parameter dtype. Default ``"bfloat16"``.
            **overrides: other fields (``image_size``, ``text_tokens``, ``in_channels``, ...).
                Defaults: ``in_channels=16, image_size=32, text_dim=512, text_tokens=64``.

        Returns:
            The validated config; ``config.weight_bytes()`` says how close it came.

        Raises:
            ConfigError: for a size that is not positive, an unknown dtype, or overrides of the
                fields this method chooses (hidden_size, num_heads, block counts).
        """
        name = "DiTConfig.for_bytes target_bytes"
        target: int = check_size(name, target_bytes)  # bytes, or text such as "6GiB"
        check_number(name, target, minimum=0, low_open=True,  # and not 0
                     hint="Give the weight size to aim at, such as '6GiB' or 10**9.")
        chosen = sorted(set(overrides) & set(_SIZED_FIELDS))
        if chosen:
            raise ConfigError(f"DiTConfig.for_bytes chooses {', '.join(chosen)} itself",
                              hint="Use DiTConfig(...) or DiTConfig.preset(...) to fix them.")
        check_choice("DiTConfig.dtype", dtype, _DTYPES)
        fields = {**_FOR_BYTES_DEFAULTS, **overrides, "dtype": dtype}
        template = cls(hidden_size=64, num_heads=1, num_double_blocks=1, num_single_blocks=1,
                       **fields)
        scored: list[tuple[tuple[int, float, float], DiTConfig]] = []
        for hidden in range(64, 8192 + 1, 64):
            head_dim = 64 if hidden < 1024 else 128
            if hidden % head_dim:
                continue
            for depth in range(2, 20):
                candidate = dataclasses.replace(
                    template, hidden_size=hidden, num_heads=hidden // head_dim,
                    num_double_blocks=depth, num_single_blocks=2 * depth)
                miss = abs(math.log(candidate.weight_bytes() / target))
                shape = abs(math.log(hidden / depth / _WIDTH_PER_DEPTH))
                close = miss <= math.log1p(_FOR_BYTES_TOLERANCE)
                # Close candidates compete on shape, the others on bytes alone.
                scored.append(((0, shape, miss) if close else (1, miss, shape), candidate))
        config = min(scored, key=lambda item: item[0])[1]
        logger.debug("DiTConfig.for_bytes(%s): hidden %d, %d+%d blocks, %s",
                     format_size(target), config.hidden_size, config.num_double_blocks,
                     config.num_single_blocks, format_size(config.weight_bytes()))
        return config

    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON-serializable dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DiTConfig:
        """Rebuild a config from :meth:`to_dict` output.

        Raises:
            ConfigError: for unknown keys or invalid values.
        """
        return cls(**check_known_fields(cls, data))


# -- building blocks -------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension with a learned scale (computed in float32)."""

    def __init__(self, dim: int, eps: float = _NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def _layer_norm(x: torch.Tensor) -> torch.Tensor:
    # adaLN supplies shift and scale, so the norm itself carries no parameters (as in DiT/Flux).
    return F.layer_norm(x, (x.shape[-1],), eps=_NORM_EPS)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None, :]) + shift[:, None, :]


class Modulation(nn.Module):
    """adaLN: ``count`` vectors of width ``hidden_size`` from the conditioning vector."""

    def __init__(self, hidden_size: int, count: int) -> None:
        super().__init__()
        self.count = count
        self.linear = nn.Linear(hidden_size, count * hidden_size)

    def forward(self, vec: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(F.silu(vec)).chunk(self.count, dim=-1)


class FeedForward(nn.Module):
    """Two-layer MLP with tanh-approximated GELU."""

    def __init__(self, hidden_size: int, mlp_hidden_size: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, mlp_hidden_size)
        self.fc2 = nn.Linear(mlp_hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class QKNorm(nn.Module):
    """Per-head RMSNorm of queries and keys, or nothing when disabled."""

    def __init__(self, head_dim: int, enabled: bool) -> None:
        super().__init__()
        self.query = RMSNorm(head_dim) if enabled else nn.Identity()
        self.key = RMSNorm(head_dim) if enabled else nn.Identity()

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.query(q), self.key(k)


class AttentionProjections(nn.Module):
    """One stream's attention weights: fused qkv, q/k norm and output projection."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.norm = QKNorm(config.head_dim, config.qk_norm)
        self.proj = nn.Linear(h, h)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, L, hidden]`` -> normed ``q, k`` and ``v``, each ``[B, heads, L, head_dim]``."""
        return _split_heads(self.qkv(x), self.num_heads, self.norm)


def _split_heads(qkv: torch.Tensor, num_heads: int,
                 norm: QKNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, length, width = qkv.shape
    q, k, v = qkv.view(batch, length, 3, num_heads, width // (3 * num_heads)).permute(
        2, 0, 3, 1, 4)
    q, k = norm(q, k)
    return q, k, v


def _apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x [B, H, L, D]`` by ``rope [L, D/2, 2]`` (cos, sin), in float32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = rope[..., 0], rope[..., 1]
    first, second = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rope: torch.Tensor) -> torch.Tensor:
    """Joint attention with rotary positions; returns ``[B, L, heads * head_dim]``."""
    out = F.scaled_dot_product_attention(_apply_rope(q, rope), _apply_rope(k, rope), v)
    return out.transpose(1, 2).flatten(2)


def rotary_embedding(text_tokens: int, grid_size: int, head_dim: int,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """Rotary angles for ``concat(text, image)`` tokens as ``[L, head_dim / 2, 2]`` (cos, sin).

    The first half of each head's pairs turns with the image row, the second half with the
    column; text tokens have position (0, 0) and so are not rotated.

    Args:
        text_tokens: number of text tokens (placed first).
        grid_size: image tokens per side.
        head_dim: attention head width (a multiple of 4).
        device: where to build the table. Default CPU.

    Returns:
        A float32 tensor of shape ``[text_tokens + grid_size**2, head_dim // 2, 2]``.
    """
    axis_pairs = head_dim // 4
    freqs = _ROPE_THETA ** (-torch.arange(axis_pairs, dtype=torch.float64, device=device)
                            / axis_pairs)
    coords = torch.arange(grid_size, dtype=torch.float64, device=device)
    rows = coords.repeat_interleave(grid_size)
    cols = coords.repeat(grid_size)
    zeros = torch.zeros(text_tokens, dtype=torch.float64, device=device)
    angles = torch.cat((torch.cat((zeros, rows))[:, None] * freqs,
                        torch.cat((zeros, cols))[:, None] * freqs), dim=-1)
    return torch.stack((angles.cos(), angles.sin()), dim=-1).float()


def timestep_features(timesteps: torch.Tensor, dim: int = TIMESTEP_FEATURES) -> torch.Tensor:
    """Sinusoidal features ``[B, dim]`` (float32) of timesteps in [0, 1]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0)
                      * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half)
    angles = (timesteps.float() * _TIMESTEP_SCALE)[:, None] * freqs
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


class MLPEmbedder(nn.Module):
    """``Linear -> SiLU -> Linear`` embedding of a vector into the hidden size."""

    def __init__(self, in_dim: int, hidden_size: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden_size)
        self.fc2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(x)))


# -- the blocks ------------------------------------------------------------------------------


class DoubleStreamBlock(nn.Module):
    """Separate image and text weights, joint attention over ``concat(text, image)``.

    Call as ``block(img [B, N, h], txt [B, T, h], vec [B, h], rope [T + N, d/2, 2])``;
    returns the updated ``(img, txt)``.
    """

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        h, m = config.hidden_size, config.mlp_hidden_size
        self.img_mod = Modulation(h, 6)
        self.img_attn = AttentionProjections(config)
        self.img_mlp = FeedForward(h, m)
        self.txt_mod = Modulation(h, 6)
        self.txt_attn = AttentionProjections(config)
        self.txt_mlp = FeedForward(h, m)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor,
                rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        img_shift1, img_scale1, img_gate1, img_shift2, img_scale2, img_gate2 = self.img_mod(vec)
        txt_shift1, txt_scale1, txt_gate1, txt_shift2, txt_scale2, txt_gate2 = self.txt_mod(vec)

        img_q, img_k, img_v = self.img_attn.heads(_modulate(_layer_norm(img), img_shift1,
                                                            img_scale1))
        txt_q, txt_k, txt_v = self.txt_attn.heads(_modulate(_layer_norm(txt), txt_shift1,
                                                            txt_scale1))
        joint = _attention(torch.cat((txt_q, img_q), dim=2), torch.cat((txt_k, img_k), dim=2),
                           torch.cat((txt_v, img_v), dim=2), rope)
        text_len = txt.shape[1]
        txt_out, img_out = joint[:, :text_len], joint[:, text_len:]

        img = img + img_gate1[:, None] * self.img_attn.proj(img_out)
        img = img + img_gate2[:, None] * self.img_mlp(
            _modulate(_layer_norm(img), img_shift2, img_scale2))
        txt = txt + txt_gate1[:, None] * self.txt_attn.proj(txt_out)
        txt = txt + txt_gate2[:, None] * self.txt_mlp(
            _modulate(_layer_norm(txt), txt_shift2, txt_scale2))
        return img, txt


class SingleStreamBlock(nn.Module):
    """One stream of ``concat(text, image)`` tokens; attention and MLP in parallel.

    ``linear1`` produces qkv and the MLP input in one matmul; ``linear2`` maps
    ``concat(attention, GELU(mlp))`` back to the hidden size. Call as
    ``block(x [B, L, h], vec [B, h], rope [L, d/2, 2])``; returns the updated ``x``.
    """

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        h, m = config.hidden_size, config.mlp_hidden_size
        self.hidden_size = h
        self.mlp_hidden_size = m
        self.num_heads = config.num_heads
        self.modulation = Modulation(h, 3)
        self.linear1 = nn.Linear(h, 3 * h + m)
        self.norm = QKNorm(config.head_dim, config.qk_norm)
        self.linear2 = nn.Linear(h + m, h)

    def forward(self, x: torch.Tensor, vec: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.modulation(vec)
        qkv, mlp = self.linear1(_modulate(_layer_norm(x), shift, scale)).split(
            (3 * self.hidden_size, self.mlp_hidden_size), dim=-1)
        q, k, v = _split_heads(qkv, self.num_heads, self.norm)
        attn = _attention(q, k, v, rope)
        out = self.linear2(torch.cat((attn, F.gelu(mlp, approximate="tanh")), dim=-1))
        return x + gate[:, None] * out


class FinalLayer(nn.Module):
    """adaLN (shift, scale) then a ``Linear`` from tokens to patches."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.modulation = Modulation(config.hidden_size, 2)
        self.linear = nn.Linear(config.hidden_size, config.patch_dim)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.modulation(vec)
        return self.linear(_modulate(_layer_norm(x), shift, scale))


# -- the model -------------------------------------------------------------------------------


class DiT(nn.Module):
    """Diffusion transformer with Flux-style double- and single-stream blocks.

    The modules are created on the ``meta`` device (no memory, no default init), then
    materialized on ``device`` and filled by :meth:`init_weights` — so a multi-GB model is
    initialized once, not twice.

    Args:
        config: the model's shape and dtype.
        seed: seed of :meth:`init_weights`. Default 0.
        device: where to put the weights. Default CPU. ``"meta"`` builds the structure only
            (no storage, no init): enough to count parameters or plan memory.

    Raises:
        ConfigError: when ``config`` is not a :class:`DiTConfig`.
    """

    def __init__(self, config: DiTConfig, *, seed: int = 0,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(config, DiTConfig):
            raise ConfigError(f"DiT needs a DiTConfig, got {type(config).__name__}",
                              hint="Pass a DiTConfig, e.g. DiT(DiTConfig.preset('tiny')).")
        self.config = config
        h = config.hidden_size
        target = torch.device(device if device is not None else "cpu")
        with torch.device("meta"):
            self.img_in = nn.Linear(config.patch_dim, h)
            self.time_in = MLPEmbedder(TIMESTEP_FEATURES, h)
            self.vector_in = MLPEmbedder(config.text_dim, h)
            self.txt_in = nn.Linear(config.text_dim, h)
            self.double_blocks = nn.ModuleList(
                DoubleStreamBlock(config) for _ in range(config.num_double_blocks))
            self.single_blocks = nn.ModuleList(
                SingleStreamBlock(config) for _ in range(config.num_single_blocks))
            self.final_layer = FinalLayer(config)
        self.to(dtype=config.torch_dtype)
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Fill every parameter from a seeded CPU generator (same values on any device).

        ``Linear`` weights are drawn from N(0, 1/fan_in) (unit gain, so activations keep their
        scale through depth), biases from N(0, 0.02²), RMSNorm scales are 1. Nothing is
        zero-initialized, so every parameter gets a non-trivial gradient from the first step.

        Args:
            seed: generator seed. Default 0.

        Raises:
            ConfigError: when the model lives on the meta device.
        """
        norm_scales = {id(m.weight) for m in self.modules() if isinstance(m, RMSNorm)}
        generator = torch.Generator(device="cpu").manual_seed(seed)
        for param in self.parameters():
            if param.device.type == "meta":
                raise ConfigError("cannot initialize a DiT on the meta device",
                                  hint="Build it with device='cpu' or 'cuda', or call "
                                       "model.to_empty(device=...) first.")
            if id(param) in norm_scales:
                param.fill_(1.0)
                continue
            std = param.shape[1] ** -0.5 if param.dim() == 2 else 0.02
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(values.mul_(std))

    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor,
                text: torch.Tensor) -> torch.Tensor:
        """Predict the flow (velocity) for noisy latents.

        Args:
            latents: ``[B, in_channels, image_size, image_size]``.
            timesteps: ``[B]`` in [0, 1] (1 = pure noise).
            text: ``[B, text_tokens, text_dim]`` text embeddings.

        Returns:
            ``[B, in_channels, image_size, image_size]`` in the model's dtype.

        Raises:
            ConfigError: when the input shapes do not match the config.
        """
        config = self.config
        self._check_inputs(latents, timesteps, text)
        dtype = config.torch_dtype
        batch = latents.shape[0]
        grid = config.image_size // config.patch_size

        text = text.to(dtype)
        img = self.img_in(_patchify(latents.to(dtype), config.patch_size))
        txt = self.txt_in(text)
        vec = (self.time_in(timestep_features(timesteps).to(dtype))
               + self.vector_in(text.mean(dim=1)))
        rope = rotary_embedding(config.text_tokens, grid, config.head_dim, device=latents.device)

        for block in self.double_blocks:
            img, txt = block(img, txt, vec, rope)
        x = torch.cat((txt, img), dim=1)
        for block in self.single_blocks:
            x = block(x, vec, rope)
        patches = self.final_layer(x[:, config.text_tokens:], vec)
        return _unpatchify(patches, batch, config.in_channels, grid, config.patch_size)

    def _check_inputs(self, latents: torch.Tensor, timesteps: torch.Tensor,
                      text: torch.Tensor) -> None:
        c = self.config
        expected = (c.in_channels, c.image_size, c.image_size)
        if latents.dim() != 4 or tuple(latents.shape[1:]) != expected:
            raise ConfigError(f"DiT expects latents [B, {c.in_channels}, {c.image_size}, "
                              f"{c.image_size}], got {list(latents.shape)}",
                              hint="Build the model with a DiTConfig matching your data.")
        batch = latents.shape[0]
        if timesteps.shape != (batch,):
            raise ConfigError(f"DiT expects timesteps [{batch}], got {list(timesteps.shape)}",
                              hint="Pass one timestep per sample: a 1-D tensor of shape [batch], "
                                   "e.g. torch.rand(batch).")
        if text.dim() != 3 or tuple(text.shape) != (batch, c.text_tokens, c.text_dim):
            raise ConfigError(f"DiT expects text [{batch}, {c.text_tokens}, {c.text_dim}], "
                              f"got {list(text.shape)}",
                              hint="Pass text embeddings of shape [batch, DiTConfig.text_tokens, "
                                   "DiTConfig.text_dim].")


def _patchify(latents: torch.Tensor, patch: int) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B, (H/p)(W/p), C p p]``, tokens in row-major order."""
    b, c, height, width = latents.shape
    x = latents.reshape(b, c, height // patch, patch, width // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (height // patch) * (width // patch),
                                               c * patch * patch)


def _unpatchify(patches: torch.Tensor, batch: int, channels: int, grid: int,
                patch: int) -> torch.Tensor:
    """Inverse of :func:`_patchify`."""
    x = patches.reshape(batch, grid, grid, channels, patch, patch)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(batch, channels, grid * patch, grid * patch)


# -- synthetic data and loss -----------------------------------------------------------------


def synthetic_batch(config: DiTConfig, batch_size: int, *,
                    generator: torch.Generator | None = None,
                    device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """A rectified-flow training batch of synthetic data.

    Clean latents ``x0`` are smooth (2x2 blocks of one random value, so there is spatial
    structure to learn); ``x_t = (1 - t) x0 + t noise`` and the regression target is the
    velocity ``noise - x0``.

    Args:
        config: the model's config (shapes and dtype).
        batch_size: samples (>= 1).
        generator: random source; values are drawn on its device, so a seeded generator gives
            the same batch whatever ``device`` is. Default: the global RNG of ``device``.
        device: where the returned tensors live. Default: the generator's device, else CPU.

    Returns:
        ``{"latents": x_t, "timesteps": t, "text": ..., "target": noise - x0}``; latents, text and
        target in ``config.dtype``, timesteps float32.

    Raises:
        ConfigError: for a batch size < 1.
    """
    check_int("batch_size", batch_size, minimum=1)
    if generator is not None:
        source = generator.device
    else:
        source = torch.device(device if device is not None else "cpu")
    out_device = torch.device(device) if device is not None else source
    size = config.image_size
    coarse_size = (size + 1) // 2

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=source, dtype=torch.float32)

    coarse = draw(batch_size, config.in_channels, coarse_size, coarse_size)
    x0 = coarse.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)[..., :size, :size]
    noise = draw(batch_size, config.in_channels, size, size)
    timesteps = torch.rand((batch_size,), generator=generator, device=source,
                           dtype=torch.float32)
    text = draw(batch_size, config.text_tokens, config.text_dim)
    t = timesteps[:, None, None, None]
    dtype = config.torch_dtype
    batch = {
        "latents": ((1 - t) * x0 + t * noise).to(dtype),
        "timesteps": timesteps,
        "text": text.to(dtype),
        "target": (noise - x0).to(dtype),
    }
    return {name: value.to(out_device) for name, value in batch.items()}


def flow_matching_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean squared error between the model's velocity and ``batch["target"]``, in float32.

    Args:
        model: a :class:`DiT` (or anything with its forward signature).
        batch: a dict from :func:`synthetic_batch`.

    Returns:
        A scalar float32 loss tensor (not synchronized to the host).
    """
    prediction = model(batch["latents"], batch["timesteps"], batch["text"])
    return F.mse_loss(prediction.float(), batch["target"].float())
