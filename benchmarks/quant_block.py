"""Quantized DiT block benchmark: LoRA training on a quantized frozen base vs the bf16 block.

Part 1 (resident block): one :class:`vramkit.recipes.dit.DoubleStreamBlock` at Flux width (hidden
3072, 24 heads, MLP 4x, bf16) on ``--tokens`` tokens (default 4608 = 512 text + 4096 image
tokens, Flux at 1024 px), rank-16 LoRA adapters on its qkv/proj layers (vramkit's ``LoRALinear``),
trainable inputs (so backward computes input gradients through every quantized layer, as in a
stack). One training step (forward + backward, no optimizer) is timed with CUDA events (median of
the measured steps) for:

* **bf16**: the float block;
* **int8 / int4 / nf4 / fp8**: the same block after
  ``quantize_model(block, QuantizationConfig(fmt))`` (weight-only: dequantize + bf16 GEMM);
* **fp8+fp8gemm**: ``QuantizationConfig("fp8", activations_dtype="fp8")``: the forward GEMMs run
  in fp8 (per-token activation scales), backward in bf16. Skipped where the GPU/torch lacks it.

Per row: forward/backward/step ms, ratio to bf16 (target: step <= 1.10x bf16), weight bytes and
their ratio to bf16, peak memory, output error vs the bf16 block.

Part 2 (swapped stack): ``--stack`` such blocks (default 6), every one swapped by
:class:`vramkit.offload.swap.BlockSwapper` (``max_gpu_blocks=0``, R=2 slots): step time and
host->device bytes per step for the bf16 stack and each quantized stack. A quantized block
crosses PCIe as its packed bytes (about 0.52x of bf16 for int8/fp8, 0.27x for int4/nf4), so a
transfer-bound stack gets faster by about that factor.

Run (GPU, ~3-4 min):  PYTHONPATH=src python benchmarks/quant_block.py --out out
Run (GPU, < 2 min):   PYTHONPATH=src python benchmarks/quant_block.py --quick --out out
Run (CPU, proves the code paths only): PYTHONPATH=src python benchmarks/quant_block.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from _timing import Timer, log
from vramkit.offload.swap import BlockSwapper, SwapConfig
from vramkit.quant import kernels
from vramkit.quant.model import QuantizationConfig, model_bytes, quantize_model
from vramkit.recipes.demo import add_lora_adapters
from vramkit.recipes.dit import DiTConfig, DoubleStreamBlock, rotary_embedding

STEP_TARGET = 1.10  # quantized block step time vs bf16
# name -> QuantizationConfig kwargs (None: the bf16 baseline)
VARIANTS: dict[str, dict[str, Any] | None] = {
    "bf16": None,
    "int8": dict(weights_dtype="int8"),
    "int4": dict(weights_dtype="int4"),
    "nf4": dict(weights_dtype="nf4"),
    "fp8": dict(weights_dtype="fp8"),
    "fp8+fp8gemm": dict(weights_dtype="fp8", activations_dtype="fp8"),
}


@dataclass
class Settings:
    """What one run measures (defaults: the full GPU run)."""

    device: str = "cuda"
    hidden: int = 3072
    heads: int = 24
    text_tokens: int = 512
    tokens: int = 4608
    rank: int = 16
    dtype: str = "bfloat16"
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    steps: int = 10
    warmup: int = 3
    stack: int = 6
    stack_variants: list[str] = field(default_factory=lambda: ["bf16", "int8", "nf4", "fp8"])
    slots: int = 2
    min_param_bytes: int = 64 * 1024


def settings_from_args(args: argparse.Namespace) -> Settings:
    if args.device == "cpu":  # tiny shapes: numbers are meaningless, the code paths are the point
        s = Settings(device="cpu", hidden=128, heads=2, text_tokens=16, tokens=80, rank=4,
                     dtype="float32", steps=2, warmup=1, stack=3, min_param_bytes=1024)
    elif args.quick:
        s = Settings(steps=5, warmup=2, stack=4, stack_variants=["bf16", "int8", "nf4"])
    else:
        s = Settings()
    for name in ("hidden", "heads", "tokens", "rank", "steps", "warmup", "stack", "slots"):
        value = getattr(args, name)
        if value is not None:
            setattr(s, name, value)
    if args.variants:
        s.variants = args.variants
    return s


def cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def dit_config(s: Settings) -> DiTConfig:
    image_tokens = s.tokens - s.text_tokens
    grid = round(image_tokens ** 0.5)
    if grid * grid != image_tokens:
        raise SystemExit(f"--tokens minus {s.text_tokens} text tokens must be a square, "
                         f"got {image_tokens}")
    return DiTConfig(hidden_size=s.hidden, num_heads=s.heads, num_double_blocks=1,
                     num_single_blocks=0, in_channels=16, image_size=2 * grid, text_dim=64,
                     text_tokens=s.text_tokens, dtype=s.dtype)


class BlockStack(nn.Module):
    """``n`` double-stream blocks applied in sequence (the swapper finds ``blocks``)."""

    def __init__(self, config: DiTConfig, n: int, device: torch.device) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_new_block(config, device, seed=i) for i in range(n))

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor,
                rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for block in self.blocks:
            img, txt = block(img, txt, vec, rope)
        return img, txt


@torch.no_grad()
def _new_block(config: DiTConfig, device: torch.device, seed: int) -> DoubleStreamBlock:
    """A block with the DiT init (N(0, 1/fan_in) weights), filled on the device."""
    with torch.device(device):  # built in place: no multi-GB CPU init per block
        block = DoubleStreamBlock(config).to(config.torch_dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    for param in block.parameters():
        if param.dim() == 2:
            param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
        elif param.dim() == 1 and param.shape[0] == config.head_dim:
            param.fill_(1.0)  # RMSNorm scales
        else:
            param.normal_(0.0, 0.02, generator=generator)
    return block


def _lora_and_quantize(model: nn.Module, block_names: list[str], rank: int,
                       variant: str) -> list[nn.Parameter]:
    params = add_lora_adapters(model, block_names, rank, seed=0)
    with torch.no_grad():  # non-zero "up" so every adapter gets a real gradient
        for p in params[1::2]:
            p.normal_(0.0, 0.01)
    kwargs = VARIANTS[variant]
    if kwargs is not None:
        quantize_model(model, QuantizationConfig(**kwargs))
    return params


def _inputs(config: DiTConfig, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    dtype = config.torch_dtype
    grid = config.image_size // config.patch_size
    img = torch.randn(1, grid * grid, config.hidden_size, generator=g).to(device, dtype)
    txt = torch.randn(1, config.text_tokens, config.hidden_size, generator=g).to(device, dtype)
    vec = torch.randn(1, config.hidden_size, generator=g).to(device, dtype)
    rope = rotary_embedding(config.text_tokens, grid, config.head_dim, device=device)
    return {"img": img.requires_grad_(True), "txt": txt.requires_grad_(True), "vec": vec,
            "rope": rope}


def measure(step: Callable[[], torch.Tensor], zero: Callable[[], None], timer: Timer,
            warmup: int, steps: int, after_warmup: Callable[[], None] | None = None
            ) -> dict[str, Any]:
    """Median forward / backward / step ms of ``steps`` training steps after warm-up."""
    for _ in range(warmup):
        zero()
        step().backward()
    timer.sync()
    if after_warmup is not None:
        after_warmup()
    if timer.cuda:
        torch.cuda.reset_peak_memory_stats()
    marks = []
    for _ in range(steps):
        zero()
        m0 = timer.mark()
        loss = step()
        m1 = timer.mark()
        loss.backward()
        marks.append((m0, m1, timer.mark()))
    timer.sync()
    return {"step_ms": statistics.median(timer.ms(a, c) for a, _, c in marks),
            "fwd_ms": statistics.median(timer.ms(a, b) for a, b, _ in marks),
            "bwd_ms": statistics.median(timer.ms(b, c) for _, b, c in marks),
            "steps": steps, "loss": float(loss.detach()),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if timer.cuda else None}


def _available(variant: str, device: torch.device) -> str | None:
    """Why ``variant`` cannot run here, or None."""
    kwargs = VARIANTS[variant]
    if kwargs and kwargs.get("activations_dtype") == "fp8" and not (
            device.type == "cuda" and kernels.has_fp8_gemm(device)):
        return "no fp8 GEMM on this device/torch"
    return None


def run_block(s: Settings, variant: str, reference: dict[str, Any]) -> dict[str, Any]:
    """Part 1: one resident block, LoRA on its (quantized) base."""
    device = torch.device(s.device)
    config = dit_config(s)
    model = nn.ModuleDict({"block": _new_block(config, device, seed=0)})
    float_bytes = model_bytes(model)
    params = _lora_and_quantize(model, ["block"], s.rank, variant)
    lora_bytes = sum(p.numel() * p.element_size() for p in params)
    weight_bytes = model_bytes(model) - lora_bytes
    x = _inputs(config, device)
    block = model["block"]

    def step() -> torch.Tensor:
        img, txt = block(x["img"], x["txt"], x["vec"], x["rope"])
        return img.float().square().mean() + txt.float().square().mean()

    def zero() -> None:
        for t in [*params, x["img"], x["txt"]]:
            t.grad = None

    timer = Timer(device)
    row: dict[str, Any] = {"part": "block", "variant": variant, "tokens": s.tokens,
                           "weight_bytes": weight_bytes,
                           "weight_ratio": weight_bytes / max(float_bytes, 1)}
    row.update(measure(step, zero, timer, s.warmup, s.steps))
    with torch.no_grad():
        img, _ = block(x["img"], x["txt"], x["vec"], x["rope"])
    if variant == "bf16":
        reference["img"] = img.float()
    elif "img" in reference:
        ref = reference["img"]
        row["out_rel_err"] = float((img.float() - ref).norm() / ref.norm())
    return row


def run_stack(s: Settings, variant: str) -> dict[str, Any]:
    """Part 2: every block of a stack swapped; h2d bytes and step time."""
    device = torch.device(s.device)
    config = dit_config(s)
    model = BlockStack(config, s.stack, device)
    names = [f"blocks.{i}" for i in range(s.stack)]
    params = _lora_and_quantize(model, names, s.rank, variant)
    x = _inputs(config, device)
    swap_config = SwapConfig(max_gpu_blocks=0, num_slots=s.slots,
                             min_param_bytes=s.min_param_bytes)
    row: dict[str, Any] = {"part": "stack", "variant": variant, "tokens": s.tokens,
                           "blocks": s.stack, "slots": s.slots}
    with BlockSwapper(model, config=swap_config, device=device) as swapper:

        def step() -> torch.Tensor:
            img, txt = model(x["img"], x["txt"], x["vec"], x["rope"])
            return img.float().square().mean() + txt.float().square().mean()

        def zero() -> None:
            for t in [*params, x["img"], x["txt"]]:
                t.grad = None

        row.update(measure(step, zero, Timer(device), s.warmup, s.steps,
                           after_warmup=swapper.reset_stats))
        stats = swapper.stats()
    row["swapped_bytes"] = stats.swapped_bytes
    row["h2d_bytes_per_step"] = stats.h2d_bytes / row["steps"]
    row["h2d_gbps"] = row["h2d_bytes_per_step"] / row["step_ms"] / 1e6
    return row


def _markdown(row: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    if "error" in row or "skipped" in row:
        return {"part": row["part"], "variant": row["variant"], "step ms": "-",
                "vs bf16": row.get("skipped", row.get("error", ""))[:60], "bytes vs bf16": "-",
                "h2d GB/step": "-", "PASS": "-"}
    ratio = row["step_ms"] / base["step_ms"] if base and "step_ms" in base else None
    if row["part"] == "block":
        bytes_ratio = row["weight_ratio"]
        verdict = "" if ratio is None or row["variant"] == "bf16" else (
            "PASS" if ratio <= STEP_TARGET else "FAIL")
    else:
        bytes_ratio = (row["swapped_bytes"] / base["swapped_bytes"]
                       if base and "swapped_bytes" in base else None)
        verdict = ""
    return {"part": row["part"], "variant": row["variant"], "step ms": row["step_ms"],
            "vs bf16": "-" if ratio is None else f"{ratio:.3f}x",
            "bytes vs bf16": "-" if bytes_ratio is None else f"{bytes_ratio:.3f}x",
            "h2d GB/step": f"{row['h2d_bytes_per_step'] / 1e9:.2f}"
            if "h2d_bytes_per_step" in row else "-", "PASS": verdict}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cuda", "cpu"], help="default: cuda when available")
    parser.add_argument("--quick", action="store_true", help="fewer steps and a shorter stack")
    parser.add_argument("--hidden", type=int, help="hidden size (default 3072)")
    parser.add_argument("--heads", type=int, help="attention heads (default 24)")
    parser.add_argument("--tokens", type=int, help="tokens, 512 text + a square of image tokens "
                                                   "(default 4608)")
    parser.add_argument("--rank", type=int, help="LoRA rank (default 16)")
    parser.add_argument("--steps", type=int, help="measured steps (default 10; quick 5)")
    parser.add_argument("--warmup", type=int, help="warm-up steps (default 3; quick 2)")
    parser.add_argument("--stack", type=int, help="blocks in the swapped stack, 0 = skip "
                                                  "(default 6; quick 4)")
    parser.add_argument("--slots", type=int, help="SwapConfig.num_slots (default 2)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                        help="block variants (default all)")
    add_common_args(parser)
    args = parser.parse_args()
    s = settings_from_args(args)
    device = torch.device(s.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs CUDA; use --device cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    reference: dict[str, Any] = {}
    variants = ["bf16"] + [v for v in s.variants if v != "bf16"]
    parts = [("block", v) for v in variants]
    if s.stack > 0:
        parts += [("stack", v) for v in s.stack_variants]
    for part, variant in parts:
        why = _available(variant, device)
        if why is not None:
            rows.append({"part": part, "variant": variant, "skipped": why})
            log(f"{part} {variant}: skipped ({why})")
            continue
        try:
            row = run_block(s, variant, reference) if part == "block" else run_stack(s, variant)
            log(f"{part} {variant}: {row['step_ms']:.2f} ms (fwd {row['fwd_ms']:.2f}, "
                f"bwd {row['bwd_ms']:.2f})")
        except Exception as exc:  # a failing row must not lose the others
            row = {"part": part, "variant": variant, "error": f"{type(exc).__name__}: {exc}"}
            log(f"{part} {variant}: ERROR {row['error']}\n{traceback.format_exc()}")
        rows.append(row)
        cleanup(device)
    reference.clear()
    bases = {part: next((r for r in rows if r["part"] == part and r["variant"] == "bf16"
                         and "step_ms" in r), None) for part in ("block", "stack")}
    table = [_markdown(r, bases[r["part"]]) for r in rows]
    result = {"settings": asdict(s), "rows": rows, "target_step_ratio": STEP_TARGET,
              "notes": _NOTES}
    write_result("quant_block", result, table, args.out)


_NOTES = {
    "bf16": "the unquantized block in the run's dtype (bfloat16 on GPU; float32 in the CPU run)",
    "step": "one forward+backward (no optimizer) with LoRA adapters (rank --rank) on the qkv and "
            "proj layers and trainable block inputs; CUDA-event time, median of measured steps",
    "weight_bytes": "parameters + buffers of the block without the LoRA adapters (scales "
                    "included); weight_ratio is vs the bf16 block",
    "fp8+fp8gemm": "QuantizationConfig('fp8', activations_dtype='fp8'): forward GEMMs in fp8 via "
                   "torch._scaled_mm with row-wise scales, backward in bf16",
    "stack": "BlockSwapper(max_gpu_blocks=0, num_slots=--slots) over --stack blocks; "
             "h2d_bytes_per_step from SwapStats after warm-up",
}


if __name__ == "__main__":
    main()
