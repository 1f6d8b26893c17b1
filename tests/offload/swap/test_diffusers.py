"""Integration: diffusers' FluxTransformer2DModel with peft LoRA adapters trains under swapping.

Built from a reduced config with random weights (no downloads). diffusers and peft are test
extras, never core dependencies: the module is skipped when they are missing. Runs on the CPU
(the swapper's synchronous path) and, marked ``gpu``, on CUDA.
"""

from __future__ import annotations

import copy

import pytest
import torch

from vramkit.offload.swap import BlockSwapper, SwapConfig

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

HEAD_DIM = 32
TXT, SIDE = 8, 8  # text tokens; latent side in patches


def _flux(num_layers: int = 2, num_single_layers: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=num_layers,
        num_single_layers=num_single_layers, attention_head_dim=HEAD_DIM,
        num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=32,
        guidance_embeds=False, axes_dims_rope=(8, 12, 12))
    model.requires_grad_(False)
    model.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                      target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    return model


def _inputs(device: str, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    img_ids = torch.zeros(SIDE * SIDE, 3)
    img_ids[:, 1] = torch.arange(SIDE).repeat_interleave(SIDE)
    img_ids[:, 2] = torch.arange(SIDE).repeat(SIDE)
    batch = {
        "hidden_states": torch.randn(1, SIDE * SIDE, 16, generator=g),
        "encoder_hidden_states": torch.randn(1, TXT, 64, generator=g),
        "pooled_projections": torch.randn(1, 32, generator=g),
        "timestep": torch.rand(1, generator=g),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(TXT, 3),
    }
    return {k: v.to(device) for k, v in batch.items()}


def _loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**batch, return_dict=False)[0]
    return out.float().square().mean()


def _train_and_compare(device: str, keep: int, checkpointing: bool) -> None:
    ref = _flux().to(device)
    model = copy.deepcopy(ref).cpu()
    swapper = BlockSwapper(model, config=SwapConfig(max_gpu_blocks=keep, min_param_bytes=0,
                                                    checkpointing=checkpointing),
                           device=device)
    assert swapper.swapped_names[0].startswith("transformer_blocks.")
    assert any(n.startswith("single_transformer_blocks.") for n in swapper.swapped_names)
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n in lora)
    params = [p for p in model.parameters() if p.requires_grad]
    params_ref = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt_ref = torch.optim.AdamW(params_ref, lr=1e-3)
    for step in range(4):
        batch = _inputs(device, step)
        loss_ref = _loss(ref, batch)
        loss_ref.backward()
        loss = _loss(model, batch)
        loss.backward()
        assert torch.equal(loss, loss_ref)
        for p, p_ref in zip(params, params_ref, strict=True):
            assert p.grad is not None and torch.equal(p.grad, p_ref.grad)
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    assert swapper.stats().loads > 0
    swapper.detach()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.detach().to(device), p_ref.detach()), name


@pytest.mark.parametrize("checkpointing", [False, True])
def test_flux_lora_trains_identically_under_swapping_on_cpu(checkpointing: bool) -> None:
    _train_and_compare("cpu", keep=2, checkpointing=checkpointing)


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("keep", [3, 0])
def test_flux_lora_trains_identically_under_swapping_on_gpu(keep: int,
                                                            checkpointing: bool) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.matmul.allow_tf32 = False
    # The fused attention kernels' backward accumulates with atomics (not bit-reproducible run
    # to run, swapped or not); the math backend is deterministic.
    with sdpa_kernel(SDPBackend.MATH):
        _train_and_compare("cuda", keep=keep, checkpointing=checkpointing)
