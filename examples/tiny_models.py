"""Write tiny random models to disk in the layouts the examples read, so every example runs
end to end on a CPU in seconds (and its test does exactly that).

* ``flux/``: a diffusers FLUX pipeline folder (``model_index.json``, ``transformer/``,
  ``vae/``, ``scheduler/``; no text encoders: the examples take prompt embeddings), plus
  ``flux-transformer.safetensors``, the transformer as one file;
* ``images/``: a few images with ``.txt`` captions beside them (DreamBooth's layout);
* ``llama/``: a causal LM (``LlamaConfig`` + safetensors) and ``train.txt``.

    python examples/tiny_models.py --out /tmp/tiny
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

#: The tiny FLUX transformer: the real one's structure (double and single blocks, guidance,
#: rotary axes) at a width that trains in milliseconds, with linears of >= 64 KiB (the
#: smallest tensor a swapper moves) so that blocks can swap.
FLUX_TRANSFORMER = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=4,
                        attention_head_dim=32, num_attention_heads=4, joint_attention_dim=32,
                        pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(8, 12, 12))
#: Its VAE: 4 latent channels (packed 2x2 into the transformer's 16), 2x downsampling.
FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=4,
                block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=8,
                down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2,
                shift_factor=0.1159, scaling_factor=0.3611,
                use_quant_conv=False, use_post_quant_conv=False)


def write_flux(folder: str | Path, seed: int = 0) -> Path:
    """A tiny FLUX pipeline folder (random weights) and its transformer as one file."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from safetensors.torch import save_file

    folder = Path(folder)
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(**FLUX_TRANSFORMER)
    vae = AutoencoderKL(**FLUX_VAE)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=transformer)
    pipe.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in transformer.state_dict().items()},
              str(folder / "flux-transformer.safetensors"))
    return folder


def write_images(folder: str | Path, count: int = 3, size: int = 32, seed: int = 0) -> Path:
    """``count`` random images with a caption each (``0.png`` + ``0.txt``, ...)."""
    from PIL import Image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(count):
        pixels = torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(f"a photo of sks object number {i}\n")
    return folder


def write_llama(folder: str | Path, seed: int = 0) -> Path:
    """A tiny Llama (byte-level vocabulary: no tokenizer files needed) and a text to train on."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=256,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(folder)
    (folder / "train.txt").write_text(
        "\n".join(f"line {i}: vramkit swaps the blocks that do not fit." for i in range(64)))
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write flux/, images/, llama/")
    args = parser.parse_args(argv)
    out = Path(args.out)
    print("wrote", write_flux(out / "flux"), write_images(out / "images"),
          write_llama(out / "llama"))


if __name__ == "__main__":
    main()
