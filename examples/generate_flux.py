"""Generate an image with a diffusers ``FluxPipeline`` whose transformer is fitted to a GPU
memory budget.

``vramkit.fit(..., mode="infer")`` plans the transformer's forward for ``--vram_budget``
(which blocks, or parts of blocks, stream through GPU slots) and applies the plan; the
pipeline then runs as usual. The VAE and the text encoders are small beside the transformer and
go to the GPU whole.

Prompts come as text (the folder's CLIP and T5 text encoders encode them) or, with
``--prompt_embeds FILE``, as precomputed embeddings (a ``torch.save`` dict with
``prompt_embeds`` [1, seq, dim] and ``pooled_prompt_embeds`` [1, dim]) so a folder without text
encoders works; ``--random_embeddings`` makes random ones (smoke tests).

    python examples/generate_flux.py --model /tmp/tiny/flux --random_embeddings \\
        --max_sequence_length 16 --height 32 --width 32 --steps 2 --dtype fp32 --cpu \\
        --vram_budget 4MiB --output /tmp/flux.png

``--no_fit`` runs the pipeline without vramkit (the reference the fitted image must equal).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

import vramkit


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="FLUX text-to-image with the transformer fitted "
                                            "to a GPU memory budget by vramkit.")
    p.add_argument("--model", required=True, help="local diffusers FLUX pipeline folder")
    p.add_argument("--prompt", default="a photo of a cat")
    p.add_argument("--prompt_embeds", default=None,
                   help="torch.save'd {prompt_embeds, pooled_prompt_embeds} instead of text")
    p.add_argument("--random_embeddings", action="store_true",
                   help="random prompt embeddings of the transformer's shapes")
    p.add_argument("--max_sequence_length", type=int, default=512)
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--guidance_scale", type=float, default=3.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--output", default="flux.png")
    p.add_argument("--vram_budget", default="12GiB",
                   help="GPU memory the transformer's forward may use (vramkit.fit)")
    p.add_argument("--hardware", default=None,
                   help="plan for a named GPU instead of measuring this one")
    p.add_argument("--host_memory", choices=("auto", "pinned", "pageable"), default="auto",
                   help="where swapped weights live on the host (vramkit.fit's host_memory)")
    p.add_argument("--no_fit", action="store_true", help="run without vramkit (reference)")
    p.add_argument("--cpu", action="store_true",
                   help="run on the CPU even when a GPU is visible (smoke tests)")
    return p.parse_args(argv)


def embeddings(args: argparse.Namespace, config: Any, dtype: torch.dtype
               ) -> dict[str, torch.Tensor] | None:
    """``prompt_embeds`` / ``pooled_prompt_embeds`` for the pipeline, or ``None`` (text)."""
    if args.prompt_embeds:
        table = torch.load(args.prompt_embeds, map_location="cpu", weights_only=True)
        return {k: table[k].to(dtype) for k in ("prompt_embeds", "pooled_prompt_embeds")}
    if args.random_embeddings:
        g = torch.Generator().manual_seed(args.seed + 1)
        return {"prompt_embeds": torch.randn(1, args.max_sequence_length,
                                             config.joint_attention_dim, generator=g).to(dtype),
                "pooled_prompt_embeds": torch.randn(1, config.pooled_projection_dim,
                                                    generator=g).to(dtype)}
    return None


def example_inputs(pipe: Any, args: argparse.Namespace, seq_len: int, device: torch.device,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One denoising step's transformer inputs at the size generated (what the plan is for)."""
    config = pipe.transformer.config
    h = 2 * (args.height // (pipe.vae_scale_factor * 2))
    w = 2 * (args.width // (pipe.vae_scale_factor * 2))
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    inputs = {"hidden_states": torch.randn(1, (h // 2) * (w // 2), config.in_channels),
              "encoder_hidden_states": torch.randn(1, seq_len, config.joint_attention_dim),
              "pooled_projections": torch.randn(1, config.pooled_projection_dim),
              "timestep": torch.full((1,), 0.5), "img_ids": ids.reshape(-1, 3),
              "txt_ids": torch.zeros(seq_len, 3)}
    if config.guidance_embeds:
        inputs["guidance"] = torch.full((1,), args.guidance_scale)
    return {k: v.to(device, dtype) for k, v in inputs.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from diffusers import FluxPipeline

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    # components the folder does not have (no text encoders) are passed as None
    index = json.loads((Path(args.model) / "model_index.json").read_text())
    absent = {name: None for name, entry in index.items()
              if isinstance(entry, list) and entry[0] is None}
    pipe = FluxPipeline.from_pretrained(args.model, torch_dtype=dtype, **absent)
    embeds = embeddings(args, pipe.transformer.config, dtype)
    if embeds is None and pipe.text_encoder_2 is None:
        raise SystemExit(f"{args.model} has no text encoders: pass --prompt_embeds FILE (or "
                         "--random_embeddings)")
    # everything but the transformer goes to the device whole
    for name in ("vae", "text_encoder", "text_encoder_2"):
        component = getattr(pipe, name, None)
        if component is not None:
            component.to(device)
    pipe.transformer.requires_grad_(False)  # inference: frozen weights are what swaps
    fitted = None
    if args.no_fit:
        pipe.transformer.to(device)
    else:
        seq_len = (embeds["prompt_embeds"].shape[1] if embeds is not None
                   else args.max_sequence_length)
        fitted = vramkit.fit(pipe.transformer, example_inputs(pipe, args, seq_len, device, dtype),
                             args.vram_budget, mode="infer", device=device,
                             hardware=args.hardware, host_memory=args.host_memory,
                             autocast=None)
        print(fitted.plan.explain())
    generator = torch.Generator("cpu").manual_seed(args.seed)
    prompt: dict[str, Any] = ({k: v.to(device) for k, v in embeds.items()} if embeds is not None
                              else {"prompt": args.prompt,
                                    "max_sequence_length": args.max_sequence_length})
    with torch.inference_mode():
        image = pipe(height=args.height, width=args.width, num_inference_steps=args.steps,
                     guidance_scale=args.guidance_scale, generator=generator, **prompt).images[0]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    image.save(args.output)
    print(f"saved {args.output}")
    if fitted is not None:
        fitted.detach()
    return {"image": image, "plan": fitted.plan if fitted is not None else None}


if __name__ == "__main__":
    main()
