"""Tiny diffusers models and their state dicts written back in the original single-file
layouts (BFL FLUX, LDM SDXL), shared by the format tests."""

from __future__ import annotations

import torch

from vramkit.io._single_file import original_names


def tiny_flux(device: str = "cpu") -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    with torch.device(device):
        return FluxTransformer2DModel(
            patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
            guidance_embeds=True, axes_dims_rope=(4, 4, 8)).eval()


def tiny_sdxl(device: str = "cpu") -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    with torch.device(device):
        return UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=2,
            block_out_channels=(32, 64), norm_num_groups=8,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2), attention_head_dim=(2, 4),
            cross_attention_dim=32, use_linear_projection=True, addition_embed_type="text_time",
            addition_time_embed_dim=8, projection_class_embeddings_input_dim=32 + 6 * 8).eval()


def to_original(kind: str, state: dict[str, torch.Tensor], *, prefix: str = "",
                per_block: int = 2) -> dict[str, torch.Tensor]:
    """A diffusers state dict in the original layout (fused tensors concatenated back)."""
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    out: dict[str, torch.Tensor] = {}
    for name, parts in original_names(kind, shapes, per_block=per_block, prefix=prefix).items():
        pieces = []
        for target, swap in parts:
            t = state[target]
            if swap:
                half = t.shape[0] // 2
                t = torch.cat([t[half:], t[:half]])
            pieces.append(t)
        out[name] = torch.cat(pieces).contiguous()
    return out


def write_gguf(path: str, tensors: dict[str, torch.Tensor], quant: dict[str, str]) -> None:
    """Write ``tensors`` as a GGUF file: those named in ``quant`` quantized to that GGML type
    (with the gguf package's own quantizer), the rest as F32."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, "flux")
    for name, tensor in tensors.items():
        array = tensor.detach().float().numpy()
        kind = quant.get(name)
        if kind is None:
            writer.add_tensor(name, np.ascontiguousarray(array))
            continue
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
