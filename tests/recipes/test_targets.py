"""vramkit.recipes.targets: the planner's models, built on the meta device with one step's inputs."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import pytest
import torch

from vramkit.errors import ConfigError
from vramkit.recipes.targets import (
    LORA_TARGETS_BY_FAMILY,
    MODEL_PRESETS,
    PlanTarget,
    build_target,
    list_presets,
)

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

#: What the models' publishers give (parameters of the denoiser / the LM).
PUBLISHED = {"flux-dev": 11.9e9, "sdxl": 2.57e9, "sd3.5-large": 8.1e9, "qwen-image": 20.4e9,
             "wan2.1-14b": 14.3e9, "hunyuanvideo": 13e9, "llama-3.1-8b": 8.03e9}
#: How closely each publisher's figure pins the count: HunyuanVideo says "13B" (two digits).
ROUNDING = {"hunyuanvideo": 0.04}


def _base_params(target: PlanTarget) -> int:
    return sum(p.numel() for n, p in target.model.named_parameters() if "lora_" not in n)


def test_the_presets() -> None:
    assert list_presets() == list(MODEL_PRESETS)
    assert set(PUBLISHED) <= set(list_presets())


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_trains_on_meta(name: str) -> None:
    target = build_target(name)
    assert target.name == name and target.mode == "train"
    model = target.model
    assert {p.device.type for p in model.parameters()} == {"meta"}
    # The meta build has the published size (and exactly the count recorded with the preset).
    assert _base_params(target) == MODEL_PRESETS[name].parameters
    assert abs(_base_params(target) / PUBLISHED[name] - 1) < ROUNDING.get(name, 0.01)
    # Only the LoRA adapters train, in fp32; the base is frozen in bf16.
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    targets = LORA_TARGETS_BY_FAMILY[target.family]
    assert all(n.split(".lora_")[0].endswith(targets) for n in trainable)
    assert f"{sum(p.numel() for p in trainable.values()):,} parameters" in target.trainable
    assert "LoRA r16" in target.trainable
    # Forward and backward on meta.
    loss = target.step(model, target.inputs)
    assert loss.shape == () and loss.is_meta and loss.requires_grad
    loss.backward()
    # Every adapter gets a gradient, except Qwen-Image's last text-stream output projection:
    # its last block's text output is discarded (as in real training).
    unused = {"transformer_blocks.59.attn.to_add_out"} if name == "qwen-image" else set()
    assert {n.split(".lora_")[0] for n, p in trainable.items() if p.grad is None} == unused
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_infers_on_meta(name: str) -> None:
    target = build_target(name, mode="infer", lora_rank=8)
    assert target.trainable == "nothing (inference)" and not target.model.training
    assert not any(p.requires_grad for p in target.model.parameters())
    assert not any("lora_" in n for n, _ in target.model.named_parameters())
    loss = target.loss()
    assert loss.is_meta and loss.shape == () and not loss.requires_grad


def test_diffusers_presets_give_the_class_only_fields_it_takes() -> None:
    for preset in MODEL_PRESETS.values():
        cls = getattr(diffusers if preset.library == "diffusers" else transformers,
                      preset.class_name)
        if preset.library == "diffusers":
            assert set(preset.config) <= set(inspect.signature(cls.__init__).parameters)


def test_full_fine_tuning_trains_everything() -> None:
    target = build_target("llama-3.1-8b", lora_rank=0, seq_len=64)
    assert all(p.requires_grad for p in target.model.parameters())
    assert not any("lora_" in n for n, _ in target.model.named_parameters())
    assert target.trainable.startswith("all 8,030,261,248 parameters (full fine-tuning")
    target.loss().backward()


def test_lora_targets_can_be_chosen() -> None:
    few = build_target("sdxl", lora_targets=["to_q"])
    assert few.trainable.startswith("LoRA r16 (alpha 16, fp32) on to_q:")
    names = [n for n, p in few.model.named_parameters() if p.requires_grad]
    assert names and all(".to_q.lora_" in n for n in names)
    with pytest.raises(ConfigError, match="match no module"):
        build_target("sdxl", lora_targets=["no_such_layer"])
    with pytest.raises(ConfigError, match="lora_targets"):
        build_target("sdxl", lora_targets="to_q")


def test_rank_sets_the_adapter_size() -> None:
    def adapters(rank: int) -> int:
        target = build_target("llama-3.1-8b", lora_rank=rank, seq_len=8)
        return sum(p.numel() for p in target.model.parameters() if p.requires_grad)

    assert adapters(32) == 2 * adapters(16) == 2 * 13_631_488


# -- inputs ------------------------------------------------------------------------------------

def test_flux_inputs_follow_resolution_batch_and_text() -> None:
    default = build_target("flux-dev", mode="infer").inputs
    assert default["hidden_states"].shape == (1, 4096, 64)
    assert default["encoder_hidden_states"].shape == (1, 512, 4096)
    assert default["pooled_projections"].shape == (1, 768)
    assert default["img_ids"].shape == (4096, 3) and default["txt_ids"].shape == (512, 3)
    assert default["guidance"].shape == default["timestep"].shape == (1,)
    assert all(t.is_meta for t in default.values())
    target = build_target("flux-dev", mode="infer", resolution=(512, 768), batch=2, seq_len=256)
    inputs = target.inputs
    assert inputs["hidden_states"].shape == (2, 32 * 48, 64)
    assert inputs["encoder_hidden_states"].shape == (2, 256, 4096)
    assert inputs["img_ids"].shape == (32 * 48, 3) and inputs["txt_ids"].shape == (256, 3)
    assert target.shapes == "batch 2, 512x768 px: 1536 image tokens + 256 text tokens"
    assert target.loss().shape == ()


def test_sdxl_inputs() -> None:
    inputs = build_target("sdxl", mode="infer").inputs
    assert inputs["sample"].shape == (1, 4, 128, 128)
    assert inputs["encoder_hidden_states"].shape == (1, 77, 2048)
    assert inputs["added_cond_kwargs"]["text_embeds"].shape == (1, 1280)
    assert inputs["added_cond_kwargs"]["time_ids"].shape == (1, 6)
    inputs = build_target("sdxl", mode="infer", resolution="768x1024", batch=3).inputs
    assert inputs["sample"].shape == (3, 4, 96, 128)
    assert inputs["added_cond_kwargs"]["time_ids"].shape == (3, 6)


def test_sd3_inputs() -> None:
    inputs = build_target("sd3.5-large", mode="infer").inputs
    assert inputs["hidden_states"].shape == (1, 16, 128, 128)
    assert inputs["encoder_hidden_states"].shape == (1, 333, 4096)
    assert inputs["pooled_projections"].shape == (1, 2048)
    inputs = build_target("sd3.5-large", mode="infer", resolution=512, batch=2).inputs
    assert inputs["hidden_states"].shape == (2, 16, 64, 64)
    with pytest.raises(ConfigError, match="3072x3072 px at most"):
        build_target("sd3.5-large", mode="infer", resolution=4096)


def test_qwen_image_inputs() -> None:
    inputs = build_target("qwen-image", mode="infer").inputs
    assert inputs["hidden_states"].shape == (1, 4096, 64)
    assert inputs["encoder_hidden_states"].shape == (1, 512, 3584)
    assert inputs["img_shapes"] == [[(1, 64, 64)]]
    target = build_target("qwen-image", mode="infer", resolution=(1328, 928), batch=2)
    assert target.inputs["hidden_states"].shape == (2, 83 * 58, 64)
    assert target.inputs["img_shapes"] == [[(1, 83, 58)], [(1, 83, 58)]]
    assert target.loss().shape == ()


def test_wan_inputs_follow_frames_and_resolution() -> None:
    target = build_target("wan2.1-14b", mode="infer")
    assert target.inputs["hidden_states"].shape == (1, 16, 21, 60, 104)
    assert target.inputs["encoder_hidden_states"].shape == (1, 512, 4096)
    assert "32760 video tokens" in target.shapes
    inputs = build_target("wan2.1-14b", mode="infer", frames=49, resolution=(720, 1280),
                          batch=2).inputs
    assert inputs["hidden_states"].shape == (2, 16, 13, 90, 160)
    with pytest.raises(ConfigError, match="4k\\+1 frames"):
        build_target("wan2.1-14b", mode="infer", frames=80)


def test_hunyuanvideo_inputs_follow_frames_and_resolution() -> None:
    target = build_target("hunyuanvideo", mode="infer")  # the pipeline's 720x1280, 129 frames
    assert target.inputs["hidden_states"].shape == (1, 16, 33, 90, 160)
    assert target.inputs["encoder_hidden_states"].shape == (1, 256, 4096)
    assert target.inputs["encoder_attention_mask"].shape == (1, 256)
    assert target.inputs["pooled_projections"].shape == (1, 768)
    assert target.inputs["guidance"].shape == (1,)
    assert "118800 video tokens" in target.shapes
    inputs = build_target("hunyuanvideo", mode="infer", frames=33, resolution=(544, 960),
                          batch=2).inputs
    assert inputs["hidden_states"].shape == (2, 16, 9, 68, 120)
    with pytest.raises(ConfigError, match="4k\\+1 frames"):
        build_target("hunyuanvideo", mode="infer", frames=32)
    with pytest.raises(ConfigError, match="multiple"):
        build_target("hunyuanvideo", mode="infer", resolution=(540, 960))


def test_llama_inputs() -> None:
    assert build_target("llama-3.1-8b", mode="infer").inputs["input_ids"].shape == (1, 4096)
    target = build_target("llama-3.1-8b", mode="infer", seq_len=1024, batch=2)
    assert target.inputs["input_ids"].shape == (2, 1024)
    assert target.inputs["input_ids"].dtype == torch.long
    assert target.model.config.use_cache is False


def test_the_mask_patch_is_undone_after_the_step() -> None:
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    target = build_target("llama-3.1-8b", seq_len=16)
    target.loss()
    assert masking_utils.find_packed_sequence_indices is original


@pytest.mark.parametrize(("alias", "name"), [
    ("FLUX.1-dev", "flux-dev"), ("flux", "flux-dev"), ("black-forest-labs/FLUX.1-dev", "flux-dev"),
    ("SDXL", "sdxl"), ("stabilityai/stable-diffusion-3.5-large", "sd3.5-large"),
    ("Qwen-Image", "qwen-image"), ("Wan-AI/Wan2.1-T2V-14B-Diffusers", "wan2.1-14b"),
    ("hunyuanvideo-community/HunyuanVideo", "hunyuanvideo"), ("HunyuanVideo", "hunyuanvideo"),
    ("Llama-3.1-8B", "llama-3.1-8b"), ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
])
def test_preset_aliases(alias: str, name: str) -> None:
    assert build_target(alias, mode="infer").name == name


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"mode": "eval"}, "mode"),
    ({"batch": 0}, "batch"),
    ({"lora_rank": -1}, "lora_rank"),
    ({"resolution": 1000}, "multiples of 16"),
    ({"resolution": "big"}, "resolution"),
    ({"frames": 81}, "frames does not apply"),
    ({"dtype": torch.int8}, "dtype"),
])
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_target("flux-dev", **kwargs)  # type: ignore[arg-type]


def test_a_language_model_takes_no_resolution() -> None:
    with pytest.raises(ConfigError, match="language model"):
        build_target("llama-3.1-8b", resolution=512)


def test_unknown_name_lists_the_presets() -> None:
    with pytest.raises(ConfigError) as info:
        build_target("stable-cascade")
    assert all(name in str(info.value) for name in list_presets())
    with pytest.raises(ConfigError, match="no such folder"):
        build_target("./no/such/folder")


# -- local folders -----------------------------------------------------------------------------

def _tiny_flux(folder: Path) -> int:
    with torch.device("meta"):
        model = diffusers.FluxTransformer2DModel(
            num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, pooled_projection_dim=16, in_channels=16,
            axes_dims_rope=(4, 6, 6), guidance_embeds=True)
    model.save_config(folder)
    return sum(p.numel() for p in model.parameters())


def test_a_diffusers_component_folder(tmp_path: Path) -> None:
    folder = tmp_path / "my-flux" / "transformer"
    params = _tiny_flux(folder)
    target = build_target(str(folder), resolution=256, seq_len=8)
    assert target.name == "my-flux/transformer" and target.family == "flux"
    assert _base_params(target) == params
    assert target.inputs["hidden_states"].shape == (1, 256, 16)
    assert target.inputs["encoder_hidden_states"].shape == (1, 8, 32)
    target.loss().backward()
    # The config.json file itself names the folder too.
    assert build_target(folder / "config.json", mode="infer").family == "flux"


def test_a_pipeline_root_picks_the_transformer(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    _tiny_flux(tmp_path / "transformer")
    target = build_target(str(tmp_path), mode="infer", resolution=128)
    assert target.name == f"{tmp_path.name} (transformer/)" and target.family == "flux"
    assert target.loss().shape == ()


def test_a_pipeline_root_with_a_unet(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "SDPipeline"}))
    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel(
            sample_size=8, block_out_channels=(32, 64), layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
            attention_head_dim=8, norm_num_groups=8)
    unet.save_config(tmp_path / "unet")
    target = build_target(tmp_path)
    assert target.name == f"{tmp_path.name} (unet/)" and target.family == "unet"
    assert target.inputs["sample"].shape == (1, 4, 8, 8)  # sample_size 8 -> 64 px
    assert "to_q" in target.trainable
    target.loss().backward()


def test_a_transformers_folder(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=1000,
                                      architectures=["LlamaForCausalLM"])
    config.save_pretrained(tmp_path)
    target = build_target(str(tmp_path), seq_len=32, batch=2)
    assert target.family == "causal-lm" and target.name == tmp_path.name
    assert target.inputs["input_ids"].shape == (2, 32)
    assert "q_proj" in target.trainable
    target.loss().backward()


def test_a_transformers_folder_that_is_no_causal_lm(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]}))
    with pytest.raises(ConfigError, match="causal language models"):
        build_target(tmp_path)


def test_an_unsupported_diffusers_class(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    with pytest.raises(ConfigError, match="AutoencoderKL"):
        build_target(tmp_path)


def test_a_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json") as info:
        build_target(str(tmp_path))
    assert "config.json" in info.value.hint and "model_index.json" in info.value.hint
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"neither transformer/config\.json"):
        build_target(str(tmp_path))


def test_missing_diffusers_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "diffusers", None)  # import diffusers -> ImportError
    with pytest.raises(ConfigError) as info:
        build_target("flux-dev")
    assert "vramkit[integration]" in info.value.hint


def test_options_and_their_values_are_checked_before_the_model_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Building FLUX on meta takes seconds: a wrong option must not wait for it.
    from vramkit.recipes import targets

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("built before its options were checked")

    monkeypatch.setattr(targets, "_build", no_build)
    for model, kwargs, match in (("flux-dev", {"frames": 9}, "image model: frames"),
                                 ("llama-3.1-8b", {"resolution": 512}, "language model"),
                                 ("flux-dev", {"resolution": 1000}, "multiples of 16"),
                                 ("wan2.1-14b", {"frames": 80}, "4k\\+1")):
        with pytest.raises(ConfigError, match=match):
            build_target(model, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=match):
            targets.check_inputs(model, **kwargs)  # type: ignore[arg-type]
    targets.check_inputs("wan2.1-14b", frames=81, resolution="480x832")  # what it takes


def test_every_family_declares_its_options() -> None:
    from vramkit.recipes.target_kinds import INPUT_OPTIONS
    from vramkit.recipes.targets import _DIFFUSERS_FAMILIES, TARGET_KINDS, target_options

    assert set(TARGET_KINDS) == {*_DIFFUSERS_FAMILIES.values(), "causal-lm"}
    assert all(set(kind.options) <= set(INPUT_OPTIONS) for kind in TARGET_KINDS.values())
    for preset in MODEL_PRESETS:
        found = target_options(preset)
        assert found.name == preset and found.kind is TARGET_KINDS[found.family]
    assert "frames" in target_options("wan2.1-14b").kind.options
    assert "frames" not in target_options("flux-dev").kind.options
