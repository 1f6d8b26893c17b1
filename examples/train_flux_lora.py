"""DreamBooth-style LoRA training of a FLUX transformer under a GPU memory budget.

The shape of diffusers' ``examples/dreambooth/train_dreambooth_lora_flux.py`` (a folder of
images with captions, a LoRA on the transformer's attention, a flow-matching loss, ``accelerate``
for mixed precision, gradient accumulation and ``save_state``/resume), with one difference: the
transformer does not need to fit the GPU. Its only memory code is ``vramkit.fit``, which plans
which blocks to swap and checkpoint for ``--vram_budget`` and applies the plan.

Inputs:

* ``--pretrained_model_name_or_path``: a local diffusers FLUX folder (``transformer/`` with its
  ``config.json`` and safetensors, ``vae/``); ``--transformer_file`` reads the transformer's
  weights from one file instead (diffusers key names, Black Forest Labs' or ComfyUI's layout,
  fp8_scaled, GGUF), built from the folder's ``transformer/config.json``.
* ``--instance_data_dir``: images, each with a ``.txt`` caption of the same name (or
  ``--instance_prompt`` for all).
* Text embeddings are precomputed (no text encoder is loaded): ``--embeddings_file`` (a
  ``torch.save`` dict ``{caption: {"prompt_embeds": [seq, dim], "pooled_prompt_embeds": [dim]}}``)
  or ``--random_embeddings`` (random ones of the transformer's shapes, for smoke tests).

It prints ``time from command to first step: X s`` (from the start of the script to the end of
the first optimizer step: reading the model, planning, the first step).

    python examples/train_flux_lora.py --pretrained_model_name_or_path /tmp/tiny/flux \\
        --instance_data_dir /tmp/tiny/images --random_embeddings --output_dir /tmp/out \\
        --resolution 32 --max_train_steps 4 --vram_budget 6MiB --mixed_precision no --cpu
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # "time from command to first step" counts from here

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from vramkit.io.prefetch import prefetch_checkpoint  # noqa: E402  (stdlib only: no torch yet)


def _prefetch_from_argv(argv: list[str]) -> None:
    """Start reading the transformer's weights into the page cache now, while torch,
    diffusers and accelerate import (seconds the disk would otherwise idle)."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    early.add_argument("--transformer_file")
    early.add_argument("--pretrained_model_name_or_path")
    try:
        known, _ = early.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit):  # malformed: the full parser says so below
        return
    if known.transformer_file:
        prefetch_checkpoint(known.transformer_file)
    elif known.pretrained_model_name_or_path:
        prefetch_checkpoint(Path(known.pretrained_model_name_or_path) / "transformer")


if __name__ == "__main__":
    _prefetch_from_argv(sys.argv[1:])

import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import vramkit  # noqa: E402

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="FLUX LoRA (DreamBooth) training under a GPU "
                                            "memory budget, fitted by vramkit.")
    p.add_argument("--pretrained_model_name_or_path", required=True,
                   help="local diffusers FLUX folder (transformer/, vae/)")
    p.add_argument("--transformer_file", default=None,
                   help="read the transformer's weights from this single file (safetensors "
                        "in diffusers', BFL's or ComfyUI's layout, fp8_scaled, or GGUF)")
    p.add_argument("--instance_data_dir", required=True,
                   help="images with .txt captions of the same name")
    p.add_argument("--instance_prompt", default=None,
                   help="caption for images without a .txt file")
    p.add_argument("--embeddings_file", default=None,
                   help="torch.save'd {caption: {prompt_embeds, pooled_prompt_embeds}}")
    p.add_argument("--random_embeddings", action="store_true",
                   help="random prompt embeddings of the transformer's shapes (smoke tests)")
    p.add_argument("--max_sequence_length", type=int, default=512,
                   help="text tokens of random embeddings (default 512)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--train_batch_size", type=int, default=1)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--max_train_steps", type=int, default=500)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--lr_scheduler", choices=("constant", "linear", "cosine"),
                   default="constant")
    p.add_argument("--lr_warmup_steps", type=int, default=0)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--lora_layers", default="to_k,to_q,to_v,to_out.0",
                   help="comma-separated module names the LoRA adapts")
    p.add_argument("--guidance_scale", type=float, default=1.0)
    p.add_argument("--weighting_scheme", choices=("logit_normal", "uniform"),
                   default="logit_normal", help="how training timesteps are sampled")
    p.add_argument("--mixed_precision", choices=("no", "fp16", "bf16"), default="bf16")
    p.add_argument("--checkpointing_steps", type=int, default=500,
                   help="accelerator.save_state every N optimizer steps")
    p.add_argument("--resume_from_checkpoint", default=None,
                   help="a checkpoint-N folder, or 'latest' in --output_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true",
                   help="train on the CPU even when a GPU is visible (smoke tests)")
    p.add_argument("--vram_budget", default="12GiB",
                   help="GPU memory the training step may use (vramkit.fit)")
    p.add_argument("--hardware", default=None,
                   help="plan for a named GPU instead of measuring this one (vramkit plan "
                        "--list)")
    p.add_argument("--host_memory", choices=("auto", "pinned", "pageable"), default="auto",
                   help="where swapped weights live on the host (vramkit.fit's host_memory)")
    p.add_argument("--plan_file", default=None,
                   help="apply the plan saved here (no planning: the fastest start), or plan "
                        "and save it here when the file does not exist yet")
    return p.parse_args(argv)


# -- data ---------------------------------------------------------------------------------------


def load_examples(folder: str, default_prompt: str | None) -> list[tuple[Path, str]]:
    """(image, caption) pairs: each image's ``.txt`` caption, or ``default_prompt``."""
    pairs = []
    for image in sorted(Path(folder).iterdir()):
        if image.suffix.lower() not in IMAGE_SUFFIXES:
            continue
        caption_file = image.with_suffix(".txt")
        caption = (caption_file.read_text().strip() if caption_file.exists()
                   else default_prompt)
        if caption is None:
            raise SystemExit(f"{image} has no caption ({caption_file.name}); pass "
                             "--instance_prompt")
        pairs.append((image, caption))
    if not pairs:
        raise SystemExit(f"no images in {folder}")
    return pairs


class DreamBoothDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Images as [-1, 1] tensors at ``size`` (resized, center-cropped) with their captions."""

    def __init__(self, pairs: list[tuple[Path, str]], size: int) -> None:
        self.pairs, self.size = pairs, size

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, Any]:
        from PIL import Image

        path, caption = self.pairs[i]
        image = Image.open(path).convert("RGB")
        scale = self.size / min(image.size)
        image = image.resize((max(self.size, round(image.width * scale)),
                              max(self.size, round(image.height * scale))), Image.BICUBIC)
        left, top = (image.width - self.size) // 2, (image.height - self.size) // 2
        image = image.crop((left, top, left + self.size, top + self.size))
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        pixels = pixels.view(self.size, self.size, 3).permute(2, 0, 1).float() / 127.5 - 1.0
        return {"pixels": pixels, "caption": caption}


def collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"pixels": torch.stack([r["pixels"] for r in rows]),
            "captions": [r["caption"] for r in rows]}


def prompt_embeddings(args: argparse.Namespace, captions: list[str],
                      config: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """caption -> (prompt_embeds [seq, dim], pooled [dim]), from the file or random."""
    if args.embeddings_file:
        table = torch.load(args.embeddings_file, map_location="cpu", weights_only=True)
        missing = [c for c in captions if c not in table]
        if missing:
            raise SystemExit(f"{args.embeddings_file} has no embeddings for {missing[:3]}")
        return {c: (table[c]["prompt_embeds"], table[c]["pooled_prompt_embeds"])
                for c in captions}
    if not args.random_embeddings:
        raise SystemExit("pass --embeddings_file (precomputed T5/CLIP embeddings) or "
                         "--random_embeddings")
    g = torch.Generator().manual_seed(args.seed)
    return {c: (torch.randn(args.max_sequence_length, config.joint_attention_dim, generator=g),
                torch.randn(config.pooled_projection_dim, generator=g)) for c in captions}


# -- FLUX latents -------------------------------------------------------------------------------


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, 4C]: 2x2 patches as tokens, as FLUX takes them."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    b, _, d = tokens.shape
    x = tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


def image_ids(h: int, w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Each packed token's (0, row, column): FLUX's rotary positions."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3).to(device, dtype)


def sample_sigmas(batch: int, scheme: str, generator: torch.Generator) -> torch.Tensor:
    """Flow-matching noise levels in (0, 1): logit-normal (SD3's default) or uniform."""
    if scheme == "logit_normal":
        return torch.sigmoid(torch.randn(batch, generator=generator))
    return torch.rand(batch, generator=generator)


# -- model --------------------------------------------------------------------------------------


def load_transformer(args: argparse.Namespace, dtype: torch.dtype,
                     say: Any = print) -> tuple[Any, str | None]:
    """The transformer: from the folder, or built on meta for ``--transformer_file`` (which
    ``vramkit.fit`` then reads straight into place). Returns (model, checkpoint file).

    A single file may be in diffusers' key names, Black Forest Labs' or ComfyUI's layout, a
    ComfyUI fp8_scaled file (its fp8 weights stay fp8, as stored) or a GGUF file (Q8_0, Q4_K,
    ...: its quantized weights stay packed and are decoded on the GPU at each call): the layers
    whose weights the file keeps packed are replaced before LoRA is added, so LoRA trains on
    top of them. ``say`` prints what the file is (``accelerator.print``: one process)."""
    from diffusers import FluxTransformer2DModel

    folder = Path(args.pretrained_model_name_or_path)
    if args.transformer_file is None:
        model = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer",
                                                       torch_dtype=dtype)
        return model, None
    path = Path(args.transformer_file)
    if not path.is_file():
        raise SystemExit(f"--transformer_file {path} is not a file")
    described = describe_single_file(path)
    say(f"--transformer_file: {described}")
    config = json.loads((folder / "transformer" / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
    from vramkit.io.formats import prepare_module
    from vramkit.quant import QuantizationConfig

    # GGUF weights become GGUFLinear, fp8_scaled ones fp8 QuantizedLinear (nothing for bf16)
    prepare_module(model, path, QuantizationConfig("fp8"))
    return (model.to(dtype) if dtype != torch.float32 else model), str(path)


def describe_single_file(path: Path) -> str:
    """What the file is (``vramkit.io.formats.detect_format``), or exit with why not."""
    from vramkit.errors import VramkitError
    from vramkit.io.formats import detect_format

    try:
        return detect_format(path).describe()
    except VramkitError as err:
        raise SystemExit(f"--transformer_file {path} cannot be read as a checkpoint: "
                         f"{err.message} ({err.hint})") from None


def add_lora(model: Any, args: argparse.Namespace) -> None:
    from peft import LoraConfig

    from vramkit.quant.linear import register_peft_lora

    model.requires_grad_(False)
    # register_peft_lora: peft adapts vramkit's packed layers (a GGUF or fp8 file's) too
    model.add_adapter(register_peft_lora(LoraConfig(
        r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian",
        target_modules=[m.strip() for m in args.lora_layers.split(",")])))


class LoraState:
    """The LoRA weights as ``accelerator.save_state`` saves them (not the frozen base)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        from peft.utils import get_peft_model_state_dict

        return {k: v.detach().cpu() for k, v in get_peft_model_state_dict(self.model).items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        from peft.utils import set_peft_model_state_dict

        set_peft_model_state_dict(self.model, state)


def example_inputs(config: Any, batch: int, seq_len: int, guidance: float,
                   latent_hw: tuple[int, int], device: torch.device,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One training step's transformer inputs at the batch and resolution trained (what
    ``vramkit.fit`` plans for)."""
    h, w = latent_hw
    inputs = {
        "hidden_states": torch.randn(batch, (h // 2) * (w // 2), config.in_channels),
        "encoder_hidden_states": torch.randn(batch, seq_len, config.joint_attention_dim),
        "pooled_projections": torch.randn(batch, config.pooled_projection_dim),
        "timestep": torch.full((batch,), 0.5),
        "img_ids": image_ids(h, w, torch.device("cpu"), torch.float32),
        "txt_ids": torch.zeros(seq_len, 3),
    }
    if config.guidance_embeds:
        inputs["guidance"] = torch.full((batch,), guidance)
    return {k: v.to(device, dtype) for k, v in inputs.items()}


# -- training -----------------------------------------------------------------------------------


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = [p for p in output_dir.glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name)]
    return max(found, key=lambda p: int(p.name.split("-")[1])) if found else None


def stamp(accelerator: Any, what: str) -> None:
    """One progress line: seconds since the command started, and what is done."""
    accelerator.print(f"[{time.perf_counter() - STARTED:6.1f} s] {what}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from diffusers import AutoencoderKL, FluxPipeline
    from diffusers.optimization import get_scheduler
    from peft.utils import get_peft_model_state_dict

    output_dir = Path(args.output_dir)
    accelerator = Accelerator(
        cpu=args.cpu, mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        project_config=ProjectConfiguration(project_dir=str(output_dir)))
    set_seed(args.seed)
    device = accelerator.device
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.mixed_precision,
                                                                       torch.float32)

    stamp(accelerator, "imports and accelerate")
    vae = AutoencoderKL.from_pretrained(args.pretrained_model_name_or_path, subfolder="vae")
    vae.requires_grad_(False).to(device)
    stamp(accelerator, "VAE")
    transformer, checkpoint = load_transformer(args, weight_dtype, accelerator.print)
    add_lora(transformer, args)
    # LoRA weights train in fp32 (mixed precision computes in bf16/fp16 under autocast).
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()

    pairs = load_examples(args.instance_data_dir, args.instance_prompt)
    embeds = prompt_embeddings(args, sorted({c for _, c in pairs}), transformer.config)
    seq_len = next(iter(embeds.values()))[0].shape[0]
    loader = torch.utils.data.DataLoader(DreamBoothDataset(pairs, args.resolution),
                                         batch_size=args.train_batch_size, shuffle=True,
                                         collate_fn=collate)
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    latent_hw = (args.resolution // factor, args.resolution // factor)
    if latent_hw[0] % 2:
        raise SystemExit(f"--resolution must be a multiple of {2 * factor}")

    # The one memory call: plan swapping/checkpointing for the budget and apply it.
    saved_plan = (args.plan_file if args.plan_file and Path(args.plan_file).is_file()
                  else None)
    fitted = vramkit.fit(
        transformer, example_inputs(transformer.config, args.train_batch_size, seq_len,
                                    args.guidance_scale, latent_hw, device, weight_dtype),
        args.vram_budget, device=device, checkpoint=checkpoint, plan=saved_plan,
        host_memory=args.host_memory,
        **({} if saved_plan else {"hardware": args.hardware, "autocast": (
            weight_dtype if weight_dtype != torch.float32 else None)}))
    stamp(accelerator, "planned and attached (the plan " + ("loaded" if saved_plan else
                                                             "made here") + ")")
    if args.plan_file and not saved_plan and accelerator.is_main_process:
        fitted.plan.save(args.plan_file)
    accelerator.print(fitted.plan.explain())

    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate)
    steps_per_epoch = math.ceil(len(loader) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer,
                                 num_warmup_steps=args.lr_warmup_steps,
                                 num_training_steps=args.max_train_steps)
    # The transformer is not prepared: vramkit has placed it (accelerate would move it), and
    # mixed precision comes from accelerator.autocast().
    optimizer, loader, lr_scheduler = accelerator.prepare(optimizer, loader, lr_scheduler)
    lora_state = LoraState(transformer)
    accelerator.register_for_checkpointing(lora_state)

    global_step = 0
    if args.resume_from_checkpoint:
        path = (latest_checkpoint(output_dir) if args.resume_from_checkpoint == "latest"
                else Path(args.resume_from_checkpoint))
        if path is None:
            accelerator.print("no checkpoint to resume from: starting fresh")
        else:
            accelerator.load_state(str(path))
            global_step = int(path.name.split("-")[1])
            accelerator.print(f"resumed from {path.name} (step {global_step})")

    shift = vae.config.shift_factor or 0.0
    generator = torch.Generator().manual_seed(args.seed + global_step)
    first_step_seconds = None
    losses: list[float] = []
    transformer.train()
    epochs = math.ceil((args.max_train_steps - global_step) / max(1, steps_per_epoch)) + 1
    for _ in range(epochs):
        for batch in loader:
            if global_step >= args.max_train_steps:
                break
            with accelerator.accumulate(transformer):
                pixels = batch["pixels"].to(device)
                with torch.no_grad():
                    latents = vae.encode(pixels).latent_dist.sample(generator=None)
                    latents = (latents - shift) * vae.config.scaling_factor
                b, _, h, w = latents.shape
                noise = torch.randn(latents.shape, generator=generator).to(device)
                sigmas = sample_sigmas(b, args.weighting_scheme, generator).to(device)
                s = sigmas.view(b, 1, 1, 1)
                noisy = (1.0 - s) * latents + s * noise
                prompt = torch.stack([embeds[c][0] for c in batch["captions"]]).to(device)
                pooled = torch.stack([embeds[c][1] for c in batch["captions"]]).to(device)
                extra = ({"guidance": torch.full((b,), args.guidance_scale, device=device)}
                         if transformer.config.guidance_embeds else {})
                with accelerator.autocast():
                    pred = transformer(
                        hidden_states=pack_latents(noisy), timestep=sigmas,
                        encoder_hidden_states=prompt, pooled_projections=pooled,
                        txt_ids=torch.zeros(prompt.shape[1], 3, device=device),
                        img_ids=image_ids(h, w, device, prompt.dtype), return_dict=False,
                        **extra)[0]
                pred = unpack_latents(pred.float(), h, w)
                loss = F.mse_loss(pred, (noise - latents).float())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params, args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                global_step += 1
                losses.append(loss.item())
                if first_step_seconds is None:
                    first_step_seconds = time.perf_counter() - STARTED
                    accelerator.print(f"time from command to first step: "
                                      f"{first_step_seconds:.2f} s")
                accelerator.print(f"step {global_step}: loss {losses[-1]:.4f}")
                if global_step % args.checkpointing_steps == 0:
                    saved = output_dir / f"checkpoint-{global_step}"
                    accelerator.save_state(str(saved))
                    accelerator.print(f"saved {saved}")
        if global_step >= args.max_train_steps:
            break

    accelerator.wait_for_everyone()
    report = fitted.report() if global_step else None
    if report is not None and report.steps:
        accelerator.print(report.describe())
    lora = get_peft_model_state_dict(transformer)
    if accelerator.is_main_process:
        FluxPipeline.save_lora_weights(str(output_dir), transformer_lora_layers=lora)
        accelerator.print(f"saved the LoRA weights in {output_dir}")
    fitted.detach()
    accelerator.end_training()
    return {"global_step": global_step, "losses": losses,
            "first_step_seconds": first_step_seconds, "plan": fitted.plan}


if __name__ == "__main__":
    main()
