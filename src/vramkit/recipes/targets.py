"""The models ``vramkit plan`` and the benchmarks plan for, built on the meta device: no weight
read, nothing allocated.

:func:`build_target` turns a preset name (:data:`MODEL_PRESETS`: published configs only) or a
local diffusers / transformers folder (only its ``config.json`` is read) into a
:class:`PlanTarget`: the model on the meta device in bf16, the keyword inputs of one forward at
the asked resolution, batch and sequence length (meta tensors), and a step that turns them into
a scalar loss. For training, peft LoRA adapters (fp32, as trainers keep them) go on the attention
projections the LoRA trainers target (:data:`LORA_TARGETS_BY_FAMILY`) and the base is
frozen;
``lora_rank=0`` leaves every parameter trainable (full fine-tuning).

Everything a step does runs on meta tensors: forward, and for training ``loss.backward()``, cost
shapes, not memory. One spot of the libraries asks a meta tensor for a value and is patched for
the step's duration: transformers' causal-mask code checks whether ``position_ids`` hold several
packed sequences (``Tensor.all()`` -> ``.item()``); the step answers "one sequence per row"
(:func:`_meta_safe_masks`). The diffusers models run as they are.

diffusers, transformers and peft are imported only when a model is built (``pip install
'vramkit[integration]'``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vramkit._validate import check_choice, check_int
from vramkit.errors import ConfigError
from vramkit.planning._meta import MetaAutocast
from vramkit.recipes.target_kinds import TargetKind, TargetOptions

__all__ = ["LORA_TARGETS_BY_FAMILY", "MODEL_PRESETS", "TARGET_KINDS", "ModelPreset",
           "PlanTarget", "build_target", "check_inputs", "list_presets", "target_options"]

_INSTALL_HINT = "pip install 'vramkit[integration]'"
_MODES = ("train", "infer")


@dataclass(frozen=True)
class ModelPreset:
    """A published model the planner knows by name (its config only; no weights).

    Attributes:
        name: the preset's name (``"flux-dev"``).
        library: ``"diffusers"`` or ``"transformers"``.
        class_name: the library class that builds it (``"FluxTransformer2DModel"``).
        config: the published ``config.json`` fields the class takes (fields it does not take
            are dropped, each with a comment in the source).
        source: where the config comes from (Hugging Face repo and file).
        parameters: parameters of the meta build (checked by the tests).
        published: the size the model's publishers give.
        aliases: other names that select it (compared without case and punctuation).
    """

    name: str
    library: str
    class_name: str
    config: Mapping[str, Any]
    source: str
    parameters: int
    published: str
    aliases: tuple[str, ...] = ()


#: The published models, by name. ``parameters`` is what the meta build counts (diffusers 0.42,
#: transformers 5.24); the tests build each one and compare, and compare with ``published``.
MODEL_PRESETS: dict[str, ModelPreset] = {
    # 11,901,408,320 parameters (published: 12 B, "11.9 B").
    "flux-dev": ModelPreset(
        name="flux-dev", library="diffusers", class_name="FluxTransformer2DModel",
        config={
            "attention_head_dim": 128, "guidance_embeds": True, "in_channels": 64,
            "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 19,
            "num_single_layers": 38, "patch_size": 1, "pooled_projection_dim": 768,
            "axes_dims_rope": (16, 56, 56),
        },
        source="black-forest-labs/FLUX.1-dev, transformer/config.json",
        parameters=11_901_408_320, published="11.9 B",
        aliases=("flux", "flux.1", "flux.1-dev", "flux1-dev", "black-forest-labs/FLUX.1-dev")),
    # 2,567,463,684 parameters (published: 2.6 B UNet). The fields left out are diffusers'
    # defaults (SDXL base 1.0's config lists them with the default values).
    "sdxl": ModelPreset(
        name="sdxl", library="diffusers", class_name="UNet2DConditionModel",
        config={
            "sample_size": 128, "in_channels": 4, "out_channels": 4,
            "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            "block_out_channels": (320, 640, 1280), "layers_per_block": 2,
            "transformer_layers_per_block": (1, 2, 10), "attention_head_dim": (5, 10, 20),
            "cross_attention_dim": 2048, "use_linear_projection": True,
            "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
            "projection_class_embeddings_input_dim": 2816,
        },
        source="stabilityai/stable-diffusion-xl-base-1.0, unet/config.json",
        parameters=2_567_463_684, published="2.57 B",
        aliases=("sdxl-base", "sdxl-base-1.0", "stable-diffusion-xl-base-1.0",
                 "stabilityai/stable-diffusion-xl-base-1.0")),
    # 8,056,627,520 parameters, plus the 89,653,248-element positional-embedding buffer
    # (pos_embed.pos_embed, 192 x 192 x 2432): 8,146,280,768 in the checkpoint (published:
    # "8.1 B").
    "sd3.5-large": ModelPreset(
        name="sd3.5-large", library="diffusers", class_name="SD3Transformer2DModel",
        config={
            "attention_head_dim": 64, "caption_projection_dim": 2432, "in_channels": 16,
            "joint_attention_dim": 4096, "num_attention_heads": 38, "num_layers": 38,
            "out_channels": 16, "patch_size": 2, "pooled_projection_dim": 2048,
            "pos_embed_max_size": 192, "qk_norm": "rms_norm", "sample_size": 128,
            # Not in the published config (large has no dual-attention layers: that is
            # 3.5-medium's MMDiT-X); the class's default, spelled out.
            "dual_attention_layers": (),
        },
        source="stabilityai/stable-diffusion-3.5-large, transformer/config.json",
        parameters=8_056_627_520, published="8.1 B",
        aliases=("sd35-large", "sd3.5large", "stable-diffusion-3.5-large",
                 "stabilityai/stable-diffusion-3.5-large")),
    # 20,430,401,088 parameters (published: 20 B, "20.4 B"). The published config also has
    # "pooled_projection_dim": 768, which QwenImageTransformer2DModel does not take (Qwen-Image
    # has no pooled text embedding): dropped.
    "qwen-image": ModelPreset(
        name="qwen-image", library="diffusers", class_name="QwenImageTransformer2DModel",
        config={
            "attention_head_dim": 128, "axes_dims_rope": (16, 56, 56), "guidance_embeds": False,
            "in_channels": 64, "joint_attention_dim": 3584, "num_attention_heads": 24,
            "num_layers": 60, "out_channels": 16, "patch_size": 2,
        },
        source="Qwen/Qwen-Image, transformer/config.json",
        parameters=20_430_401_088, published="20.4 B",
        aliases=("qwenimage", "qwen/qwen-image")),
    # 14,288,491,584 parameters (published: 14 B, "14.3 B").
    "wan2.1-14b": ModelPreset(
        name="wan2.1-14b", library="diffusers", class_name="WanTransformer3DModel",
        config={
            "added_kv_proj_dim": None, "attention_head_dim": 128, "cross_attn_norm": True,
            "eps": 1e-6, "ffn_dim": 13824, "freq_dim": 256, "image_dim": None,
            "in_channels": 16, "num_attention_heads": 40, "num_layers": 40, "out_channels": 16,
            "patch_size": (1, 2, 2), "qk_norm": "rms_norm_across_heads",
            "rope_max_seq_len": 1024, "text_dim": 4096,
        },
        source="Wan-AI/Wan2.1-T2V-14B-Diffusers, transformer/config.json",
        parameters=14_288_491_584, published="14.3 B",
        aliases=("wan2.1-t2v-14b", "Wan-AI/Wan2.1-T2V-14B-Diffusers")),
    # 12,821,012,544 parameters (published: 13 B).
    "hunyuanvideo": ModelPreset(
        name="hunyuanvideo", library="diffusers", class_name="HunyuanVideoTransformer3DModel",
        config={
            "attention_head_dim": 128, "guidance_embeds": True, "in_channels": 16,
            "mlp_ratio": 4.0, "num_attention_heads": 24, "num_layers": 20,
            "num_refiner_layers": 2, "num_single_layers": 40, "out_channels": 16,
            "patch_size": 2, "patch_size_t": 1, "pooled_projection_dim": 768,
            "qk_norm": "rms_norm", "rope_axes_dim": (16, 56, 56), "rope_theta": 256.0,
            "text_embed_dim": 4096,
        },
        source="hunyuanvideo-community/HunyuanVideo, transformer/config.json",
        parameters=12_821_012_544, published="13 B",
        aliases=("hunyuan-video", "hunyuanvideo-community/HunyuanVideo", "tencent/HunyuanVideo")),
    # 8,030,261,248 parameters (published: 8.03 B). transformers 5 reads rope_theta and
    # rope_scaling into rope_parameters; "torch_dtype" is the published spelling of "dtype".
    "llama-3.1-8b": ModelPreset(
        name="llama-3.1-8b", library="transformers", class_name="LlamaForCausalLM",
        config={
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
            "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
            "initializer_range": 0.02, "intermediate_size": 14336,
            "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32,
            "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
            "rms_norm_eps": 1e-5,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "use_cache": True, "vocab_size": 128256,
        },
        source="meta-llama/Llama-3.1-8B, config.json",
        parameters=8_030_261_248, published="8.03 B",
        aliases=("llama3.1-8b", "meta-llama-3.1-8b", "meta-llama/Llama-3.1-8B",
                 "meta-llama/Meta-Llama-3.1-8B", "llama-3.1-8b-instruct",
                 "meta-llama/Llama-3.1-8B-Instruct")),
}

#: LoRA target modules by model family (peft ``target_modules``: a module matches when its
#: qualified name ends with one of them). UNet and Wan: the attention projections of every
#: attention (diffusers' SDXL LoRA script; Wan's self- and cross-attention). Flux, SD3 and
#: Qwen-Image: the image stream's projections and the text stream's of the joint attention
#: (``add_*_proj``, ``to_add_out``), as diffusers' SD3 LoRA script targets by default and the
#: Flux/Qwen-Image trainers (ai-toolkit, SimpleTuner, diffusers with ``--lora_layers``) do; the
#: feed-forward layers some of them add are left out. Llama: the attention projections (peft's
#: own default for Llama).
LORA_TARGETS_BY_FAMILY: dict[str, tuple[str, ...]] = {
    "flux": ("to_q", "to_k", "to_v", "to_out.0",
             "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
    "sd3": ("to_q", "to_k", "to_v", "to_out.0",
            "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
    "qwen-image": ("to_q", "to_k", "to_v", "to_out.0",
                   "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
    "unet": ("to_q", "to_k", "to_v", "to_out.0"),
    "wan": ("to_q", "to_k", "to_v", "to_out.0"),
    "hunyuan-video": ("to_q", "to_k", "to_v", "to_out.0"),
    "causal-lm": ("q_proj", "k_proj", "v_proj", "o_proj"),
}

#: Each family's options, declared once: :func:`build_target` and ``vramkit plan`` refuse the
#: others before anything is built. A new family (a video model with frames) declares its own.
TARGET_KINDS: dict[str, TargetKind] = {
    "flux": TargetKind("an image model", ("resolution", "seq_len")),
    "unet": TargetKind("an image model", ("resolution", "seq_len")),
    "sd3": TargetKind("an image model", ("resolution", "seq_len")),
    "qwen-image": TargetKind("an image model", ("resolution", "seq_len")),
    "wan": TargetKind("a video model", ("resolution", "frames", "seq_len")),
    "hunyuan-video": TargetKind("a video model", ("resolution", "frames", "seq_len")),
    "causal-lm": TargetKind("a language model", ("seq_len",)),
}

#: diffusers class -> family (which inputs its forward takes).
_DIFFUSERS_FAMILIES = {
    "FluxTransformer2DModel": "flux",
    "UNet2DConditionModel": "unet",
    "SD3Transformer2DModel": "sd3",
    "QwenImageTransformer2DModel": "qwen-image",
    "WanTransformer3DModel": "wan",
    "HunyuanVideoTransformer3DModel": "hunyuan-video",
}
_VAE_SCALE = 8  # spatial down-scaling of every VAE here (SD, SDXL, SD3, Flux, Qwen-Image, Wan 2.1)
_WAN_TEMPORAL_SCALE = 4  # Wan 2.1's and HunyuanVideo's VAEs: 4 frames per latent frame, after
                         # the first
_WAN_DEFAULT = (81, (480, 832))  # frames, (height, width): Wan 2.1 T2V's 480p default
_HUNYUAN_DEFAULT = (129, (720, 1280))  # HunyuanVideo's pipeline defaults
_IMAGE_DEFAULT = 1024
_LM_DEFAULT_TOKENS = 4096
_CLIP_IMAGE_TOKENS = 257  # Wan I2V's CLIP ViT-H/14 image tokens


@dataclass(frozen=True, eq=False)
class PlanTarget:
    """A model ready for the planner: built on the meta device, with one step's inputs.

    Attributes:
        name: what was built (``"flux-dev"``, ``"FLUX.1-dev (transformer/)"``).
        model: the model on the meta device, frozen base in the asked dtype (bf16), LoRA
            adapters (fp32) when training with ``lora_rank > 0``.
        inputs: the keyword arguments of the model's forward: meta tensors, plus the plain
            values a forward needs (SDXL's ``added_cond_kwargs`` dict, Qwen-Image's
            ``img_shapes``).
        step: ``step(model, inputs) -> loss``: the forward (under bf16 autocast when training)
            and a scalar loss: the sum of the float outputs, or a causal LM's mean logit. For
            ``mode="infer"`` the same forward, without autocast.
        mode: ``"train"`` or ``"infer"``.
        trainable: what trains, in words (``"LoRA r16 (alpha 16, fp32) on to_q, ...: 26,148,864
            parameters"``).
        family: ``"flux"``, ``"unet"``, ``"sd3"``, ``"qwen-image"``, ``"wan"``,
            ``"hunyuan-video"`` or ``"causal-lm"``.
        shapes: the inputs in words (``"batch 1, 1024x1024 px: 4096 image tokens + 512 text
            tokens"``).
    """

    name: str
    model: nn.Module
    inputs: dict[str, Any]
    step: Callable[[nn.Module, dict[str, Any]], torch.Tensor]
    mode: str
    trainable: str
    family: str = ""
    shapes: str = ""

    def loss(self) -> torch.Tensor:
        """``step(model, inputs)``."""
        return self.step(self.model, self.inputs)


def list_presets() -> list[str]:
    """The names of :data:`MODEL_PRESETS`."""
    return list(MODEL_PRESETS)


# -- names and folders ------------------------------------------------------------------------

def _normal(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower().strip().removesuffix("-diffusers"))


@functools.cache
def _alias_table() -> dict[str, str]:
    table: dict[str, str] = {}
    for preset in MODEL_PRESETS.values():
        for alias in (preset.name, *preset.aliases):
            for form in {alias, alias.rpartition("/")[2]}:
                key = _normal(form)
                if table.get(key, preset.name) != preset.name:  # an alias must be unambiguous
                    raise AssertionError(f"alias {alias!r} names two presets")
                table[key] = preset.name
    return table


def _preset_named(name: str) -> ModelPreset | None:
    found = _alias_table().get(_normal(name))
    if found is None and "/" in name:  # an org/repo id: try the repo part alone
        found = _alias_table().get(_normal(name.rpartition("/")[2]))
    return MODEL_PRESETS[found] if found is not None else None


@dataclass(frozen=True)
class _Spec:
    """What to build: a library class and its config."""

    name: str
    library: str
    class_name: str
    config: Mapping[str, Any]


_NO_CONFIG_HINT = ("Point at a diffusers component folder (transformer/ or unet/, with "
                   "config.json), a diffusers pipeline root (model_index.json and transformer/ "
                   "or unet/), or a transformers model folder; only config.json is read, no "
                   "weights are needed.")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read {path}: {err}", hint=_NO_CONFIG_HINT) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object", hint=_NO_CONFIG_HINT)
    return data


def _spec_from_directory(path: Path) -> _Spec:
    if path.is_file():
        if path.name != "config.json":
            raise ConfigError(f"{path} is a file, not a model folder", hint=_NO_CONFIG_HINT)
        path = path.parent
    config_file, name = path / "config.json", path.name
    if path.name in ("transformer", "unet") and path.parent.name:
        name = f"{path.parent.name}/{path.name}"
    if not config_file.is_file():
        for component in ("transformer", "unet"):  # a pipeline root: its denoiser
            if (path / component / "config.json").is_file():
                config_file, name = path / component / "config.json", f"{path.name} ({component}/)"
                break
        else:
            what = ("a pipeline root (model_index.json) with neither transformer/config.json "
                    "nor unet/config.json" if (path / "model_index.json").is_file()
                    else "no config.json")
            raise ConfigError(f"{path} has {what}", hint=_NO_CONFIG_HINT)
    config = _read_json(config_file)
    if "_class_name" in config:
        return _Spec(name, "diffusers", str(config["_class_name"]), config)
    if "architectures" in config or "model_type" in config:
        architectures = config.get("architectures") or [""]
        return _Spec(name, "transformers", str(architectures[0]), config)
    raise ConfigError(f"{config_file} names no model class (no _class_name, architectures or "
                      "model_type)", hint=_NO_CONFIG_HINT)


def _resolve(model: str | Path) -> _Spec:
    if not isinstance(model, (str, Path)) or not str(model).strip():
        raise ConfigError(f"model must be a preset name or a folder, got {model!r}",
                          hint=f"Presets: {', '.join(MODEL_PRESETS)}.")
    path = Path(model).expanduser()
    if path.exists():
        return _spec_from_directory(path)
    preset = _preset_named(str(model))
    if preset is not None:
        return _Spec(preset.name, preset.library, preset.class_name, preset.config)
    looks_like_path = str(model).startswith((".", "~", "/")) or "\\" in str(model)
    raise ConfigError(
        f"unknown model {str(model)!r}: " + ("no such folder" if looks_like_path
                                              else "not a preset nor a local folder")
        + f"; presets: {', '.join(MODEL_PRESETS)}",
        hint="Pass a preset name or a local diffusers/transformers folder with its config.json "
             "(no weights needed).")


def _family(spec: _Spec) -> str:
    if spec.library != "diffusers":
        return "causal-lm"
    family = _DIFFUSERS_FAMILIES.get(spec.class_name)
    if family is None:
        raise ConfigError(
            f"{spec.name}: vramkit plans {', '.join(_DIFFUSERS_FAMILIES)} models, not "
            f"{spec.class_name!r}",
            hint="Point at the pipeline's denoiser (transformer/ or unet/) of a supported "
                 "model, or use a preset.")
    return family


def target_options(model: str | Path) -> TargetOptions:
    """The family of ``model`` (a preset name or a folder, as for :func:`build_target`) and the
    options it takes, from its name or ``config.json`` alone: nothing is built or imported.

    Raises:
        ConfigError: for an unknown name, a folder without config.json or an unsupported class.
    """
    spec = _resolve(model)
    family = _family(spec)
    return TargetOptions(spec.name, family, TARGET_KINDS[family])


# -- building on meta ---------------------------------------------------------------------------

def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ConfigError(f"planning a model needs diffusers, transformers and peft ({err})",
                          hint=_INSTALL_HINT) from err


def _accepted_kwargs(cls: type, config: Mapping[str, Any]) -> dict[str, Any]:
    """The config fields ``cls.__init__`` takes (diffusers' ``_class_name``-style bookkeeping
    and fields of other versions of the class are dropped, as ``from_config`` drops them)."""
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return {k: v for k, v in config.items() if not k.startswith("_")}
    return {k: v for k, v in config.items() if k in parameters and k != "self"}


def _build(spec: _Spec, dtype: torch.dtype) -> tuple[nn.Module, str]:
    """The model on meta in ``dtype`` and its family."""
    if spec.library == "diffusers":
        diffusers = _import("diffusers")
        family = _DIFFUSERS_FAMILIES.get(spec.class_name)
        cls = getattr(diffusers, spec.class_name, None)
        if family is None or cls is None:
            raise ConfigError(
                f"{spec.name}: vramkit plans {', '.join(_DIFFUSERS_FAMILIES)} models, not "
                f"{spec.class_name!r}" + ("" if cls is not None
                                          else f" (not a class of diffusers "
                                               f"{diffusers.__version__})"),
                hint="Point at the pipeline's denoiser (transformer/ or unet/) of a supported "
                     "model, or use a preset.")
        with torch.device("meta"):
            module: nn.Module = cls(**_accepted_kwargs(cls, spec.config))
        for tensor in (*module.parameters(), *module.buffers()):  # as from_pretrained(dtype)
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)
        return module, family
    transformers = _import("transformers")
    fields = {k: v for k, v in spec.config.items() if k != "model_type"}
    model_type = spec.config.get("model_type")
    if not model_type:
        raise ConfigError(f"{spec.name}: its config.json has no model_type",
                          hint="Use a transformers config.json as saved by save_pretrained.")
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as err:
        raise ConfigError(f"{spec.name}: transformers {transformers.__version__} does not know "
                          f"model_type {model_type!r} ({err})",
                          hint="Models with remote code are not supported; upgrade "
                               "transformers for newer architectures.") from None
    config.use_cache = False  # no KV cache: a training step, or one forward
    cls = getattr(transformers, spec.class_name, None) if spec.class_name else None
    if spec.class_name and not (cls is not None and spec.class_name.endswith("ForCausalLM")):
        raise ConfigError(f"{spec.name}: vramkit plans causal language models "
                          f"(...ForCausalLM), not {spec.class_name!r}",
                          hint="Use a causal LM's folder, or a preset.")
    with torch.device("meta"):
        module = (cls(config) if cls is not None
                  else transformers.AutoModelForCausalLM.from_config(config))
    # Parameters in dtype; buffers stay as built (the rotary inv_freq is float32 in a loaded
    # model too).
    for p in module.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return module, "causal-lm"


def _n_params(module: nn.Module, trainable: bool | None = None) -> int:
    return sum(p.numel() for p in module.parameters()
               if trainable is None or p.requires_grad == trainable)


def _make_trainable(module: nn.Module, family: str, mode: str, rank: int,
                    targets: Sequence[str] | None) -> str:
    module.requires_grad_(False)
    if mode == "infer":
        module.eval()
        return "nothing (inference)"
    module.train()
    if rank == 0:
        for p in module.parameters():
            p.requires_grad_(p.is_floating_point())
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters()})
        return (f"all {_n_params(module):,} parameters (full fine-tuning, "
                f"{'/'.join(dtypes)})")
    try:
        import peft
    except ImportError as err:
        raise ConfigError(f"planning LoRA training needs peft ({err})",
                          hint=_INSTALL_HINT) from err
    chosen = tuple(targets) if targets is not None else LORA_TARGETS_BY_FAMILY[family]
    config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=list(chosen))
    try:
        with torch.device("meta"):
            peft.inject_adapter_in_model(config, module)
    except ValueError as err:  # no module matched
        raise ConfigError(f"LoRA targets {list(chosen)} match no module of the model ({err})",
                          hint="Pass lora_targets naming the model's linear layers.") from None
    for name, p in module.named_parameters():
        if "lora_" in name:
            p.requires_grad_(True)
            p.data = p.data.to(torch.float32)  # trainers keep adapters in fp32
        else:
            p.requires_grad_(False)
    return (f"LoRA r{rank} (alpha {rank}, fp32) on {', '.join(chosen)}: "
            f"{_n_params(module, True):,} parameters")


# -- inputs -----------------------------------------------------------------------------------

def _resolution(value: object, default: tuple[int, int]) -> tuple[int, int]:
    if value is None:
        return default
    hint = "Give resolution as pixels: 1024, (height, width) or '480x832'."
    if isinstance(value, str):
        found = re.fullmatch(r"\s*(\d+)\s*(?:[x×,*]\s*(\d+))?\s*", value)
        if found is None:
            raise ConfigError(f"resolution must be pixels, got {value!r}", hint=hint)
        value = (int(found[1]), int(found[2] or found[1]))
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    if (isinstance(value, (tuple, list)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        return int(value[0]), int(value[1])
    raise ConfigError(f"resolution must be a positive int or (height, width), got {value!r}",
                      hint=hint)


def _check_multiple(size: tuple[int, int], factor: int, what: str) -> None:
    if size[0] % factor or size[1] % factor:
        lower = tuple(max(factor, s // factor * factor) for s in size)
        raise ConfigError(f"{what} takes images whose sides are multiples of {factor} px, got "
                          f"{size[0]}x{size[1]}",
                          hint=f"Use {lower[0]}x{lower[1]}.")


def _config_int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ConfigError(f"{key}={value!r}: the planner needs one value",
                              hint="Use a model whose config gives a single value.")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"the config's {key} is {value!r}, not an int",
                          hint="Check the model's config.json.")
    return value


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _inputs(family: str, config: Mapping[str, Any], *, resolution: object, frames: int | None,
            seq_len: int | None, batch: int, dtype: torch.dtype,
            name: str) -> tuple[dict[str, Any], str]:
    # options the family does not take were refused by TargetOptions.check
    if family == "causal-lm":
        tokens = seq_len or _LM_DEFAULT_TOKENS
        return ({"input_ids": torch.zeros(batch, tokens, dtype=torch.long, device="meta")},
                f"batch {batch}, {tokens} tokens")
    b = batch
    if family == "flux":
        size = _resolution(resolution, (_IMAGE_DEFAULT, _IMAGE_DEFAULT))
        _check_multiple(size, 2 * _VAE_SCALE, name)
        # FLUX.1-dev's pipeline pads T5 prompts to 512 tokens, schnell's (no guidance) to 256.
        text = seq_len or (512 if config.get("guidance_embeds") else 256)
        tokens = (size[0] // 16) * (size[1] // 16)  # VAE /8, 2x2 latent patches packed
        inputs: dict[str, Any] = {
            "hidden_states": _meta(b, tokens, _config_int(config, "in_channels", 64), dtype=dtype),
            "encoder_hidden_states": _meta(b, text, _config_int(config, "joint_attention_dim",
                                                                4096), dtype=dtype),
            "pooled_projections": _meta(b, _config_int(config, "pooled_projection_dim", 768),
                                        dtype=dtype),
            "timestep": _meta(b, dtype=dtype),
            "img_ids": _meta(tokens, 3, dtype=dtype),
            "txt_ids": _meta(text, 3, dtype=dtype),
        }
        if config.get("guidance_embeds"):
            inputs["guidance"] = _meta(b, dtype=dtype)
        return inputs, (f"batch {b}, {size[0]}x{size[1]} px: {tokens} image tokens + {text} "
                        "text tokens")
    if family == "unet":
        sample = config.get("sample_size") or 64
        sample = sample[0] if isinstance(sample, (list, tuple)) else sample
        size = _resolution(resolution, (sample * _VAE_SCALE, sample * _VAE_SCALE))
        _check_multiple(size, _VAE_SCALE, name)
        if config.get("class_embed_type") or config.get("encoder_hid_dim_type"):
            raise ConfigError(f"{name}: UNets with class_embed_type / encoder_hid_dim_type "
                              "are not supported", hint="Use an SD 1.x/2.x or SDXL UNet.")
        text = seq_len or 77  # CLIP's context
        latent = (size[0] // _VAE_SCALE, size[1] // _VAE_SCALE)
        inputs = {
            "sample": _meta(b, _config_int(config, "in_channels", 4), *latent, dtype=dtype),
            "timestep": _meta(b, dtype=dtype),
            "encoder_hidden_states": _meta(b, text, _config_int(config, "cross_attention_dim",
                                                                1280), dtype=dtype),
        }
        added = config.get("addition_embed_type")
        if added == "text_time":  # SDXL: pooled text embedding + 6 size/crop ids
            pooled = (_config_int(config, "projection_class_embeddings_input_dim")
                      - 6 * _config_int(config, "addition_time_embed_dim"))
            inputs["added_cond_kwargs"] = {"text_embeds": _meta(b, pooled, dtype=dtype),
                                           "time_ids": _meta(b, 6, dtype=dtype)}
        elif added:
            raise ConfigError(f"{name}: addition_embed_type={added!r} is not supported",
                              hint="Use an SD 1.x/2.x or SDXL UNet.")
        return inputs, (f"batch {b}, {size[0]}x{size[1]} px: {latent[0]}x{latent[1]} latents + "
                        f"{text} text tokens")
    if family == "sd3":
        size = _resolution(resolution, (_IMAGE_DEFAULT, _IMAGE_DEFAULT))
        patch = _config_int(config, "patch_size", 2)
        _check_multiple(size, patch * _VAE_SCALE, name)
        largest = config.get("pos_embed_max_size")
        if largest and max(size) // (patch * _VAE_SCALE) > largest:
            edge = largest * patch * _VAE_SCALE
            raise ConfigError(f"{name} has positional embeddings for {edge}x{edge} px at most, "
                              f"got {size[0]}x{size[1]}", hint=f"Use sides of {edge} px or less.")
        # CLIP-L and -G (77 tokens, concatenated along channels) + T5 (256 tokens).
        text = seq_len or 77 + 256
        latent = (size[0] // _VAE_SCALE, size[1] // _VAE_SCALE)
        return {
            "hidden_states": _meta(b, _config_int(config, "in_channels", 16), *latent,
                                   dtype=dtype),
            "encoder_hidden_states": _meta(b, text, _config_int(config, "joint_attention_dim",
                                                                4096), dtype=dtype),
            "pooled_projections": _meta(b, _config_int(config, "pooled_projection_dim", 2048),
                                        dtype=dtype),
            "timestep": _meta(b, dtype=dtype),
        }, (f"batch {b}, {size[0]}x{size[1]} px: {latent[0] // patch * (latent[1] // patch)} "
            f"image tokens + {text} text tokens")
    if family == "qwen-image":
        size = _resolution(resolution, (_IMAGE_DEFAULT, _IMAGE_DEFAULT))
        patch = _config_int(config, "patch_size", 2)
        _check_multiple(size, patch * _VAE_SCALE, name)
        if config.get("use_additional_t_cond") or config.get("zero_cond_t"):
            raise ConfigError(f"{name}: Qwen-Image variants with extra conditioning "
                              "(use_additional_t_cond, zero_cond_t) are not supported",
                              hint="Use Qwen-Image's text-to-image transformer.")
        # Qwen2.5-VL prompt embeddings, padded up to the pipeline's max_sequence_length (512).
        text = seq_len or 512
        grid = (size[0] // (patch * _VAE_SCALE), size[1] // (patch * _VAE_SCALE))
        tokens = grid[0] * grid[1]
        inputs = {
            "hidden_states": _meta(b, tokens, _config_int(config, "in_channels", 64), dtype=dtype),
            "encoder_hidden_states": _meta(b, text, _config_int(config, "joint_attention_dim",
                                                                3584), dtype=dtype),
            "timestep": _meta(b, dtype=dtype),
            # (frames, height, width) in patches, per row; the text length comes from
            # encoder_hidden_states (diffusers 0.42 takes no txt_seq_lens). No text mask: the
            # prompts fill the 512 tokens.
            "img_shapes": [[(1, *grid)] for _ in range(b)],
        }
        if config.get("guidance_embeds"):
            inputs["guidance"] = _meta(b, dtype=dtype)
        return inputs, (f"batch {b}, {size[0]}x{size[1]} px: {tokens} image tokens + {text} "
                        "text tokens")
    if family == "hunyuan-video":
        frames = _video_frames(frames, _HUNYUAN_DEFAULT[0], name)
        spatial, temporal = _config_int(config, "patch_size", 2), _config_int(
            config, "patch_size_t", 1)
        size = _resolution(resolution, _HUNYUAN_DEFAULT[1])
        _check_multiple(size, spatial * _VAE_SCALE, name)
        latent = ((frames - 1) // _WAN_TEMPORAL_SCALE + 1, size[0] // _VAE_SCALE,
                  size[1] // _VAE_SCALE)
        text = seq_len or 256  # Llama prompt tokens: the pipeline's max_sequence_length
        inputs = {
            "hidden_states": _meta(b, _config_int(config, "in_channels", 16), *latent,
                                   dtype=dtype),
            "timestep": _meta(b, dtype=dtype),
            "encoder_hidden_states": _meta(b, text, _config_int(config, "text_embed_dim", 4096),
                                           dtype=dtype),
            # every prompt token counts (the mask only shortens the text; a plan is for the
            # longest prompt)
            "encoder_attention_mask": torch.empty(b, text, dtype=torch.long, device="meta"),
            "pooled_projections": _meta(b, _config_int(config, "pooled_projection_dim", 768),
                                        dtype=dtype),
        }
        if config.get("guidance_embeds"):
            inputs["guidance"] = _meta(b, dtype=dtype)
        tokens = (latent[0] // temporal) * (latent[1] // spatial) * (latent[2] // spatial)
        return inputs, (f"batch {b}, {frames} frames at {size[0]}x{size[1]} px: latents "
                        f"{latent[0]}x{latent[1]}x{latent[2]}, {tokens} video tokens + {text} "
                        "text tokens")
    # wan
    frames = _video_frames(frames, _WAN_DEFAULT[0], name)
    patch = config.get("patch_size") or (1, 2, 2)
    size = _resolution(resolution, _WAN_DEFAULT[1])
    _check_multiple(size, patch[1] * _VAE_SCALE, name)
    latent = ((frames - 1) // _WAN_TEMPORAL_SCALE + 1, size[0] // _VAE_SCALE,
              size[1] // _VAE_SCALE)
    text = seq_len or 512  # umT5 tokens, padded to the pipeline's max_sequence_length
    inputs = {
        "hidden_states": _meta(b, _config_int(config, "in_channels", 16), *latent, dtype=dtype),
        "timestep": _meta(b, dtype=dtype),
        "encoder_hidden_states": _meta(b, text, _config_int(config, "text_dim", 4096),
                                       dtype=dtype),
    }
    if config.get("image_dim"):  # image-to-video: CLIP image tokens
        inputs["encoder_hidden_states_image"] = _meta(b, _CLIP_IMAGE_TOKENS,
                                                      _config_int(config, "image_dim"),
                                                      dtype=dtype)
    tokens = math.prod(n // p for n, p in zip(latent, patch, strict=True))
    return inputs, (f"batch {b}, {frames} frames at {size[0]}x{size[1]} px: latents "
                    f"{latent[0]}x{latent[1]}x{latent[2]}, {tokens} video tokens + {text} text "
                    "tokens")


def _video_frames(frames: int | None, default: int, name: str) -> int:
    """``frames`` (or ``default``), which a video VAE packing 4 frames per latent frame after
    the first takes only as 4k+1."""
    frames = default if frames is None else check_int("frames", frames, minimum=1)
    if (frames - 1) % _WAN_TEMPORAL_SCALE:
        lower = (frames - 1) // _WAN_TEMPORAL_SCALE * _WAN_TEMPORAL_SCALE + 1
        raise ConfigError(f"{name} takes 4k+1 frames (its VAE packs 4 frames per latent frame "
                          f"after the first), got {frames}", hint=f"Use {lower} frames.")
    return frames


# -- the step ---------------------------------------------------------------------------------

@contextlib.contextmanager
def _meta_safe_masks() -> Iterator[None]:
    """transformers' causal-mask code asks whether ``position_ids`` pack several sequences
    (``find_packed_sequence_indices``: ``(...).all()``, a ``.item()``), which a meta tensor
    cannot answer. The plan is one sequence per row: answer ``None`` (not packed) for meta
    ``position_ids`` while the step runs; real tensors get the original."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:  # another transformers version: nothing to patch
        yield
        return

    @functools.wraps(original)
    def one_sequence_per_row(position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if position_ids.is_meta:
            return None
        return original(position_ids, *args, **kwargs)

    masking_utils.find_packed_sequence_indices = one_sequence_per_row
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _float_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _float_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _float_tensors(item)


def _autocast(dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    return MetaAutocast(dtype) if dtype is not None else contextlib.nullcontext()


def _diffusers_step(model: nn.Module, inputs: dict[str, Any], *,
                    autocast: torch.dtype | None = None) -> torch.Tensor:
    """The denoiser's forward; the loss is the sum of its float outputs."""
    with _autocast(autocast):
        out = model(**inputs, return_dict=False)
    parts = [t.float().sum() for t in _float_tensors(out)]
    if not parts:
        raise ConfigError(f"{type(model).__name__} returned no float tensor",
                          hint="Check the inputs of the plan target.")
    return torch.stack(parts).sum() if len(parts) > 1 else parts[0]


def _causal_lm_step(model: nn.Module, inputs: dict[str, Any], *,
                    autocast: torch.dtype | None = None) -> torch.Tensor:
    """The LM's forward; the loss is the mean of its logits (float)."""
    with _autocast(autocast), _meta_safe_masks():
        logits = model(**inputs).logits
    return logits.float().mean()


# -- the target -------------------------------------------------------------------------------

def _checked_inputs(model: str | Path, *, resolution: object, batch: int, seq_len: int | None,
                    frames: int | None, dtype: torch.dtype
                    ) -> tuple[_Spec, str, dict[str, Any], str]:
    """The options the family takes, then their values: the inputs depend on the config, not
    on the built module, so all of it is known before building."""
    spec = _resolve(model)
    family = _family(spec)
    TargetOptions(spec.name, family, TARGET_KINDS[family]).check(
        {"resolution": resolution, "frames": frames, "seq_len": seq_len})
    inputs, shapes = _inputs(family, spec.config, resolution=resolution, frames=frames,
                             seq_len=seq_len, batch=batch, dtype=dtype, name=spec.name)
    return spec, family, inputs, shapes


def check_inputs(model: str | Path, *, resolution: int | tuple[int, int] | str | None = None,
                 batch: int = 1, seq_len: int | None = None, frames: int | None = None) -> None:
    """Check :func:`build_target`'s input options for ``model`` without building it: the
    options its family takes (:data:`TARGET_KINDS`) and their values (a resolution its patches
    divide, Wan's 4k+1 frames). What ``vramkit plan`` runs before any work.

    Raises:
        ConfigError: as :func:`build_target` would, for these options.
    """
    batch = check_int("batch", batch, minimum=1)
    seq_len = check_int("seq_len", seq_len, minimum=1, allow_none=True)
    frames = check_int("frames", frames, minimum=1, allow_none=True)
    _checked_inputs(model, resolution=resolution, batch=batch, seq_len=seq_len, frames=frames,
                    dtype=torch.bfloat16)


def build_target(model: str | Path, *, mode: str = "train", lora_rank: int = 16,
                 resolution: int | tuple[int, int] | str | None = None, batch: int = 1,
                 seq_len: int | None = None, frames: int | None = None,
                 dtype: torch.dtype = torch.bfloat16,
                 lora_targets: Sequence[str] | None = None) -> PlanTarget:
    """Build a model on the meta device, with one step's inputs, for the planner.

    Args:
        model: a preset name (:func:`list_presets`; case and punctuation do not matter, and
            unambiguous aliases such as ``"FLUX.1-dev"`` or ``"flux"`` work) or a local folder:
            a diffusers component folder (``transformer/``, ``unet/``), a diffusers pipeline
            root (its ``transformer/``, else its ``unet/``, is built: the target's name says
            which), or a transformers causal-LM folder. Only ``config.json`` is read.
        mode: ``"train"`` (LoRA or full fine-tuning, forward under bf16 autocast) or
            ``"infer"`` (frozen, no adapters).
        lora_rank: the LoRA rank (alpha = rank, fp32 adapters, frozen base); ``0`` trains
            every parameter. Ignored for ``"infer"``.
        resolution: pixels, ``1024``, ``(height, width)`` or ``"480x832"``; default 1024x1024
            for image models (a UNet: its ``sample_size`` x 8) and 480x832 for Wan. Not for
            language models.
        batch: rows per step.
        seq_len: a language model's tokens per row (default 4096); for a diffusion model, the
            text tokens (default: Flux-dev 512, SDXL 77, SD3.5 333, Qwen-Image 512, Wan 512).
        frames: a video model's frames, 4k+1 (default: Wan 81, HunyuanVideo 129). Not for
            image models.
        dtype: the frozen weights' dtype (default bf16; LoRA adapters are fp32).
        lora_targets: module names for the adapters, instead of :data:`LORA_TARGETS_BY_FAMILY`.

    Returns:
        A :class:`PlanTarget`; ``target.step(target.model, target.inputs)`` runs on meta.

    Raises:
        ConfigError: for an unknown name (the presets are listed), a folder without
            config.json, an unsupported model class, inputs the model cannot take, or without
            diffusers / transformers / peft.
    """
    mode = check_choice("mode", mode, _MODES)
    lora_rank = check_int("lora_rank", lora_rank, minimum=0)
    batch = check_int("batch", batch, minimum=1)
    seq_len = check_int("seq_len", seq_len, minimum=1, allow_none=True)
    frames = check_int("frames", frames, minimum=1, allow_none=True)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch.dtype, got {dtype!r}",
                          hint="Pass torch.bfloat16 (the default), torch.float16 or "
                               "torch.float32.")
    if lora_targets is not None and (isinstance(lora_targets, str) or not lora_targets):
        raise ConfigError(f"lora_targets must be a non-empty list of module names, got "
                          f"{lora_targets!r}", hint="Pass e.g. ['to_q', 'to_k', 'to_v'].")
    # Every check of the inputs comes before the build (seconds for a 12 B model).
    spec, family, inputs, shapes = _checked_inputs(model, resolution=resolution, batch=batch,
                                                   seq_len=seq_len, frames=frames, dtype=dtype)
    module, _ = _build(spec, dtype)
    trainable = _make_trainable(module, family, mode, lora_rank, lora_targets)
    low_precision = dtype in (torch.bfloat16, torch.float16)
    autocast = dtype if mode == "train" and low_precision else None
    run = _causal_lm_step if family == "causal-lm" else _diffusers_step
    return PlanTarget(name=spec.name, model=module, inputs=inputs,
                      step=functools.partial(run, autocast=autocast), mode=mode,
                      trainable=trainable, family=family, shapes=shapes)
