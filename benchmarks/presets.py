"""Memory presets on the cards they are for: one SDXL / FLUX.1-dev LoRA training step per tier.

For each model (``--models sdxl,flux``) and card tier (``--tiers 24,16,12,8``) a fresh subprocess
(so an OOM or a crash in one row is recorded, not fatal):

1. caps PyTorch's allocator with ``torch.cuda.set_per_process_memory_fraction`` at the tier's
   size minus 0.5 GiB (23.5 / 15.5 / 11.5 / 7.5 GiB, what such a card leaves after the CUDA
   context), before anything is allocated; everything below runs under the cap;
2. builds the published model (``SDXL_UNET_CONFIG`` / ``FLUX_DEV_TRANSFORMER_CONFIG`` of
   :mod:`vramkit.recipes.presets`) on the meta device with peft LoRA r16 on ``to_q, to_k, to_v,
   to_out.0`` (fp32 adapters), then gives it random bf16 weights block by block on the GPU
   (normal, std 0.02). Where the preset quantizes the base (Flux) each block is quantized there,
   with the preset's format and the verb's own selection (adapters kept), as a load-and-quantize
   would; blocks the preset may swap then go to host memory;
3. applies the tier's preset (``SDXLMemoryConfig.preset_<N>gb()`` through
   ``optimize_sdxl_memory`` -- without VAE tiling, the VAE is not part of a training step on
   cached latents -- or ``FluxTrainingConfig.preset_<N>gb()`` through ``optimize_flux_memory``);
4. runs ``--steps`` LoRA training steps (default 2: the optimizer's states exist from the
   second step on) at 1024x1024, batch 1 (SDXL: 128x128 latents, 77 text tokens; Flux: 4096
   image + 512 text tokens), bf16 autocast, AdamW (SDXL) or the preset's optimizer (Flux);
5. reports the peak of ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the
   steps next to the card, the cap, the tier plan's predicted peak (the planner's, which chose
   the preset), the preset's estimate (``config.estimate()``), the peak
   reserved while building and applying (also under the cap) and the last step's time.

cuDNN's SDPA backend is disabled (``torch.backends.cuda.enable_cudnn_sdp(False)``): it crashed
with an illegal memory access on Flux shapes on torch 2.11 + Hopper, even in plain diffusers (docs/architecture.md).

Run (GPU, ~6-8 min):  PYTHONPATH=src python3 benchmarks/presets.py --out out/presets
Run (GPU, one model, fewer tiers):  ... --models flux --tiers 24,8
Run (GPU, < 5 min):  ... --quick   (one step per row: the optimizer states are not in the peak)
Run (CPU, code paths only):  PYTHONPATH=src python3 benchmarks/presets.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, parse_variants, write_result
from _timing import log
from vramkit.devices.resolve import resolve_device
from vramkit.observe.oom import is_oom_error
from vramkit.offload.blocks import find_blocks
from vramkit.recipes._preset_memory import IMAGE_SIZE, _meta_model
from vramkit.recipes._preset_plans import tier as tier_plan
from vramkit.recipes.presets import (
    FLUX_DEV_TRANSFORMER_CONFIG,
    SDXL_UNET_CONFIG,
    FluxTrainingConfig,
    SDXLMemoryConfig,
    optimize_flux_memory,
    optimize_sdxl_memory,
    unet_blocks,
)

GIB = 1 << 30
MODELS = ("sdxl", "flux")
TIERS = (24, 16, 12, 8)
CONTEXT_GIB = 0.5  # what a card loses to the CUDA context: a "24 GB" card is capped at 23.5 GiB
INIT_STD = 0.02

# Tiny stand-ins for --tiny (CPU): the same classes and code paths, seconds instead of minutes.
TINY_SDXL = {
    "sample_size": 8, "in_channels": 4, "out_channels": 4, "layers_per_block": 1,
    "block_out_channels": (32, 64), "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"), "cross_attention_dim": 32,
    "attention_head_dim": (2, 4), "norm_num_groups": 8, "addition_embed_type": "text_time",
    "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 32 + 6 * 8,
}
TINY_FLUX = {
    "patch_size": 1, "in_channels": 16, "num_layers": 2, "num_single_layers": 2,
    "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
    "pooled_projection_dim": 16, "guidance_embeds": True, "axes_dims_rope": (4, 6, 6),
}


@dataclass
class Settings:
    """One run's choices (defaults: the full GPU run)."""

    device: str = "cuda"
    tiny: bool = False
    steps: int = 2
    seed: int = 0


@dataclass
class Shapes:
    """The model config and the step's input sizes."""

    unet: dict[str, Any]
    flux: dict[str, Any]
    latent_side: int  # SDXL latents (image / 8)
    image_tokens: int  # Flux (image / 16) ** 2
    text_tokens_sdxl: int = 77
    text_tokens_flux: int = 512


def shapes(tiny: bool) -> Shapes:
    if tiny:
        return Shapes(TINY_SDXL, TINY_FLUX, latent_side=8, image_tokens=16,
                      text_tokens_sdxl=5, text_tokens_flux=8)
    return Shapes(SDXL_UNET_CONFIG, FLUX_DEV_TRANSFORMER_CONFIG, latent_side=IMAGE_SIZE // 8,
                  image_tokens=(IMAGE_SIZE // 16) ** 2)


def cap_bytes(tier: int) -> int:
    return int((tier - CONTEXT_GIB) * GIB)


# -- building: meta model, LoRA, random weights block by block --------------------------------


def meta_model(model: str, shape: Shapes) -> nn.Module:
    """The model on the meta device: frozen bf16 weights and fp32 peft LoRA adapters (the
    profiles' own builder, given this run's config)."""
    return _meta_model(model, shape.unet if model == "sdxl" else shape.flux)


def block_names(module: nn.Module, model: str) -> list[str]:
    """The blocks the presets' verbs checkpoint and swap."""
    return [n for n, _ in find_blocks(module, unet_blocks(module) if model == "sdxl" else "auto")]


@torch.no_grad()
def fill_random(module: nn.Module, recurse: bool = True) -> None:
    """Random weights in place: matrices N(0, 0.02), norm scales 1, biases 0, LoRA B 0 (as peft
    initialises it, so the adapters start as the identity)."""
    for name, t in [*module.named_parameters(recurse=recurse),
                    *module.named_buffers(recurse=recurse)]:
        if not t.is_floating_point():
            continue
        if t.dim() >= 2 and "lora_B" not in name:
            t.normal_(0.0, INIT_STD)
        else:
            t.fill_(1.0 if name.endswith("weight") and t.dim() == 1 else 0.0)


def trainable_module_names(module: nn.Module) -> list[str]:
    return [n for n, m in module.named_modules()
            if n and any(p.requires_grad for p in m.parameters(recurse=False))]


def materialize(module: nn.Module, names: list[str], init_device: torch.device,
                home: torch.device, quantize: str | None) -> None:
    """Give ``module`` real random weights, one block at a time on ``init_device``, quantized
    there when asked, and leave each block on ``home``. Only one block's full-precision weights
    exist at a time, so this fits the card's cap."""
    for name in names:
        block = module.get_submodule(name)
        block.to_empty(device=init_device)
        fill_random(block)
        if quantize is not None:
            from vramkit.quant.model import QuantizationConfig, quantize_model

            quantize_model(block, QuantizationConfig(
                weights_dtype=quantize,
                modules_to_not_quantize=tuple(trainable_module_names(block))))
        if home != init_device:
            block.to(home)
    inside = tuple(n + "." for n in names)
    for qual, sub in module.named_modules():
        if qual in names or qual.startswith(inside):
            continue
        if any(t.device.type == "meta" for t in (*sub.parameters(recurse=False),
                                                 *sub.buffers(recurse=False))):
            sub.to_empty(device=init_device, recurse=False)
            fill_random(sub, recurse=False)
    if home != init_device:
        module.to(home)


# -- the presets, and their tiny versions ------------------------------------------------------


def preset(model: str, tier: int) -> Any:
    cls = SDXLMemoryConfig if model == "sdxl" else FluxTrainingConfig
    return getattr(cls, f"preset_{tier}gb")()


def scaled(config: Any, blocks: int, full_blocks: int) -> Any:
    """The preset for a tiny model: the same options, swapped/resident block counts scaled to its
    ``blocks``, every tensor swappable (tiny tensors are below the 64 KiB threshold) and no
    ``vram`` check (the estimate is of the full model)."""
    if isinstance(config, SDXLMemoryConfig):
        resident = round(config.offload_resident_blocks * blocks / full_blocks)
        return dataclasses.replace(config, offload_resident_blocks=resident, vram=None)
    swapped = math.ceil(config.blocks_to_swap * blocks / full_blocks)
    return dataclasses.replace(config, blocks_to_swap=swapped, swap_min_tensor_bytes=0,
                               vram=None)


def describe(config: Any, blocks: int) -> str:
    if isinstance(config, SDXLMemoryConfig):
        parts = ["ckpt" if config.enable_gradient_checkpointing else "no ckpt"]
        parts.append(f"{blocks - config.offload_resident_blocks}/{blocks} swapped"
                     if config.enable_cpu_offload else "resident")
        return ", ".join(parts)
    base = config.base_model_format if config.quantize_base_model else "bf16"
    parts = [base, "ckpt" if config.gradient_checkpointing else "no ckpt",
             f"{config.blocks_to_swap}/{blocks} swapped" if config.blocks_to_swap else "resident"]
    if config.cpu_offload_optimizer:
        parts.append("optimizer on host")
    return ", ".join(parts)


# -- one row ------------------------------------------------------------------------------------


def sdxl_batch(shape: Shapes, device: torch.device, g: torch.Generator) -> dict[str, Any]:
    cfg = shape.unet
    side, bf16 = shape.latent_side, torch.bfloat16
    pooled = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g).to(device, bf16)

    return {"sample": rand(1, cfg["in_channels"], side, side),
            "timestep": torch.tensor([500], device=device),
            "encoder_hidden_states": rand(1, shape.text_tokens_sdxl, cfg["cross_attention_dim"]),
            "added_cond_kwargs": {"text_embeds": rand(1, pooled), "time_ids": rand(1, 6)},
            "target": rand(1, cfg["in_channels"], side, side)}


def flux_batch(shape: Shapes, device: torch.device, g: torch.Generator) -> dict[str, Any]:
    cfg, bf16 = shape.flux, torch.bfloat16

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g).to(device, bf16)

    batch = {"hidden_states": rand(1, shape.image_tokens, cfg["in_channels"]),
             "encoder_hidden_states": rand(1, shape.text_tokens_flux, cfg["joint_attention_dim"]),
             "pooled_projections": rand(1, cfg["pooled_projection_dim"]),
             "timestep": torch.full((1,), 0.5, device=device),
             "target": rand(1, shape.image_tokens, cfg["in_channels"])}
    if cfg.get("guidance_embeds"):
        batch["guidance"] = torch.full((1,), 3.5, device=device)
    return batch


def flux_ids(shape: Shapes, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    side = math.isqrt(shape.image_tokens)
    img = torch.zeros(shape.image_tokens, 3)
    img[:, 1] = torch.arange(side).repeat_interleave(side)
    img[:, 2] = torch.arange(side).repeat(side)
    return img.to(device), torch.zeros(shape.text_tokens_flux, 3, device=device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_row(model: str, tier: int, s: Settings) -> dict[str, Any]:
    """Build, apply the preset, train ``s.steps`` steps; the row's numbers (raises on failure)."""
    device = resolve_device(s.device, owner="benchmarks/presets.py")  # cuda -> cuda:N
    cuda = device.type == "cuda"
    row: dict[str, Any] = {"model": model, "tier_gb": tier}
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)  # crashes on Flux shapes (docs/architecture.md)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(cap_bytes(tier) / total, device)
        row["cap_gib"] = cap_bytes(tier) / GIB
    torch.manual_seed(s.seed)
    shape = shapes(s.tiny)
    full = preset(model, tier)
    row["estimate_gib"] = full.estimate().needed / GIB
    row["planned_gib"] = tier_plan(model, tier).predicted_peak_bytes / GIB
    t0 = time.perf_counter()
    module = meta_model(model, shape)
    names = block_names(module, model)
    full_blocks = full.estimate().blocks
    config = scaled(full, len(names), full_blocks) if s.tiny else full
    if model == "sdxl":
        config = dataclasses.replace(config, vae_tiling=False)  # no VAE in the step
        swaps = config.enable_cpu_offload
        quantize = None
    else:
        swaps = config.blocks_to_swap > 0
        quantize = config.base_model_format if config.quantize_base_model else None
    row["preset"] = describe(full, full_blocks)
    row["settings"] = config.to_dict()
    materialize(module, names, device, torch.device("cpu") if swaps else device, quantize)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    row["build_s"] = time.perf_counter() - t0
    g = torch.Generator().manual_seed(s.seed + 1)
    t1 = time.perf_counter()
    if model == "sdxl":
        handle = optimize_sdxl_memory(config, {"unet": module}, device=device)
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        batch = sdxl_batch(shape, device, g)
        target = batch.pop("target")

        def step() -> float:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = module(**batch).sample
            loss = F.mse_loss(out.float(), target.float())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(loss.detach())
    else:
        handle = optimize_flux_memory(config, module, device=device)
        batch = flux_batch(shape, device, g)
        img_ids, txt_ids = flux_ids(shape, device)

        def micro(mb: dict[str, torch.Tensor]) -> torch.Tensor:
            inputs = {k: v for k, v in mb.items() if k != "target"}
            out = module(**inputs, img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]
            return F.mse_loss(out.float(), mb["target"].float())

        def step() -> float:
            return float(handle.train_step(micro, batch).loss)
    sync(device)
    row["apply_s"] = time.perf_counter() - t1
    row["applied"] = dict(handle.applied)
    if handle.swapper is not None:
        stats = handle.swapper.stats()
        row["swapped_blocks"] = f"{stats.swapped_blocks}/{stats.blocks}"
        row["slot_gib"] = stats.slot_bytes / GIB
    if cuda:
        gc.collect()
        # Building and applying ran under the cap too: their peak, then the steps' own.
        row["setup_peak_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        row["before_step_gib"] = torch.cuda.memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(s.steps):
        start = time.perf_counter()
        losses.append(step())
        sync(device)
        times.append(time.perf_counter() - start)
    row["step_s"] = times
    row["loss"] = losses
    if not all(math.isfinite(v) for v in losses):
        raise RuntimeError(f"non-finite loss {losses}")
    if cuda:
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        row["under_cap"] = row["peak_reserved_gib"] <= row["cap_gib"]
    handle.undo()
    return row


# -- driver: one subprocess per row ----------------------------------------------------------------


def row_main(spec: str, result_file: Path, s: Settings) -> int:
    """Child process: run one row and write its JSON (a failure is a row too)."""
    model, tier = spec.split(":")
    try:
        row = run_row(model, int(tier), s)
        row["status"] = "ok"
    except BaseException as exc:  # recorded, not fatal: the parent goes on with the next row
        oom = is_oom_error(exc) or type(exc).__name__ == "RecoveryError"
        row = {"model": model, "tier_gb": int(tier), "status": "OOM" if oom else "error",
               "error": f"{type(exc).__name__}: {str(exc)[:600]}",
               "traceback": traceback.format_exc()[-3000:]}
        if torch.cuda.is_available() and s.device == "cuda":
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    result_file.write_text(json.dumps(row, default=str), encoding="utf-8")
    return 0


def run_child(spec: str, s: Settings, timeout_s: float) -> dict[str, Any]:
    model, tier = spec.split(":")
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "row.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--row", spec,
               "--result-file", str(result), "--device", s.device, "--steps", str(s.steps)]
        if s.tiny:
            cmd.append("--tiny")
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                  env=os.environ.copy())
        except subprocess.TimeoutExpired:
            return {"model": model, "tier_gb": int(tier), "status": "timeout",
                    "error": f"no result within {timeout_s:.0f} s"}
        if result.exists():
            row = json.loads(result.read_text(encoding="utf-8"))
        else:
            row = {"model": model, "tier_gb": int(tier), "status": "crashed",
                   "error": f"exit code {proc.returncode}: {proc.stderr[-1500:]}"}
        row["wall_s"] = time.perf_counter() - start
        return row


def markdown_row(row: dict[str, Any]) -> dict[str, Any]:
    def gib(key: str) -> str:
        value = row.get(key)
        return "-" if value is None else f"{value:.2f}"

    steps = row.get("step_s") or []
    return {
        "model": {"sdxl": "SDXL UNet (2.6 B)", "flux": "FLUX.1-dev (11.9 B)"}[row["model"]],
        "card": f"{row['tier_gb']} GB", "cap GiB": gib("cap_gib"),
        "preset": row.get("preset", "-"), "planned GiB": gib("planned_gib"),
        "estimate GiB": gib("estimate_gib"),
        "peak allocated GiB": gib("peak_allocated_gib"),
        "peak reserved GiB": gib("peak_reserved_gib"),
        "peak / estimate": (f"{row['peak_allocated_gib'] / row['estimate_gib']:.2f}"
                            if row.get("peak_allocated_gib") and row.get("estimate_gib")
                            else "-"),
        "setup peak GiB": gib("setup_peak_gib"),
        "step s": f"{steps[-1]:.2f}" if steps else "-",
        "status": row["status"] if row["status"] != "ok" or row.get("under_cap", True)
        else "over cap",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cuda", "cpu"])
    parser.add_argument("--models", default=",".join(MODELS), help="sdxl,flux (default both)")
    parser.add_argument("--tiers", default=",".join(map(str, TIERS)),
                        help="card sizes in GB (default 24,16,12,8)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per row (default 2; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="one step per row")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny models (for --device cpu: the code paths, not the numbers)")
    parser.add_argument("--row-timeout", type=float, default=300.0,
                        help="seconds before a row's process is given up (default 300)")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", type=Path, help=argparse.SUPPRESS)
    add_common_args(parser)
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (1 if args.quick else 2)
    s = Settings(device=args.device, tiny=args.tiny or args.device == "cpu", steps=steps)
    if args.row:
        return row_main(args.row, args.result_file, s)
    models = parse_variants(parser, args.models, MODELS)
    tiers = [int(t) for t in parse_variants(parser, args.tiers, [str(t) for t in TIERS])]
    rows = []
    for model in models:
        for tier in tiers:
            log(f"{model} at {tier} GB ...")
            row = run_child(f"{model}:{tier}", s, args.row_timeout)
            log(f"{model} at {tier} GB: {row['status']}, peak reserved "
                f"{row.get('peak_reserved_gib', float('nan')):.2f} GiB"
                + (f" ({row['error'][:200]})" if row.get("error") else ""))
            rows.append(row)
    write_result("presets", {"settings": dataclasses.asdict(s), "rows": rows},
                 [markdown_row(r) for r in rows], args.out)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
