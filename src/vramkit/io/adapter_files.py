"""LoRA adapters saved and loaded in the layouts trainers and UIs read.

One adapter is three things per adapted layer: ``down`` (rank x in), ``up`` (out x rank) and
``alpha``, the update being ``up @ down * alpha / rank`` (:class:`LoRAFactors`). They come from
a model with peft LoRA layers or with a kohya/musubi-style network hooked in (the layer's
``forward`` replaced by the adapter's, which has ``lora_down``/``lora_up``/``alpha``), or from a
state dict in any layout below, and go out in any of them (``layout=``):

* ``"peft"``: ``{path}.lora_A.weight`` / ``{path}.lora_B.weight``, what peft's
  ``get_peft_model_state_dict`` gives and ``set_peft_model_state_dict`` reads (for a model with
  ``add_adapter``; a ``get_peft_model`` wrapper's keys start ``base_model.model.``: pass that as
  ``prefix``); ``alpha`` goes
  into the file's metadata (``lora_alpha``, ``r``, and per-layer patterns where they differ:
  the ``LoraConfig`` to make).
* ``"diffusers"``: the same keys under ``transformer.`` (``prefix=``), with diffusers'
  ``lora_adapter_metadata`` (``transformer.r``, ``transformer.lora_alpha``, ...): what a
  pipeline's ``load_lora_weights`` / ``lora_state_dict`` read.
* ``"kohya"``: ``lora_unet_{path with _ for .}.lora_down.weight`` / ``.lora_up.weight`` /
  ``.alpha`` (``prefix=``; ``lora_transformer`` for a diffusers transformer: the names diffusers'
  FLUX loader and ComfyUI map from diffusers' module names).
* ``"comfyui"``: ``diffusion_model.{path}.lora_down.weight`` / ``.lora_up.weight`` /
  ``.alpha`` (``prefix=``; ``"transformer."`` for diffusers' module names): the keys ComfyUI
  maps onto its model's own.

Files are safetensors with the layout in their metadata (``vramkit.lora_layout``), written
atomically (a temporary file in the same folder, then renamed). Reading a ``kohya`` name back
into a module path needs the module names (``model=``): ``_`` stands for ``.`` and for ``_``
alike.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from vramkit._validate import check_choice
from vramkit.errors import ConfigError

__all__ = ["LORA_LAYOUTS", "LoRAFactors", "adapter_state_dict", "load_adapters",
           "lora_factors", "save_adapters"]

#: The layouts :func:`save_adapters` writes and :func:`load_adapters` reads.
LORA_LAYOUTS = ("peft", "diffusers", "kohya", "comfyui")
_PREFIX = {"peft": "", "diffusers": "transformer.", "kohya": "lora_unet",
           "comfyui": "diffusion_model."}
_LAYOUT_KEY = "vramkit.lora_layout"
_DIFFUSERS_METADATA = "lora_adapter_metadata"


class LoRAFactors(NamedTuple):
    """One adapted layer: ``up @ down * alpha / rank`` is added to its weight."""

    down: torch.Tensor  # rank x in
    up: torch.Tensor  # out x rank
    alpha: float

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    def delta(self) -> torch.Tensor:
        """The weight update the factors make, in float32."""
        return (self.up.float() @ self.down.float()) * (self.alpha / self.rank)


def _peft_layers(model: nn.Module) -> list[tuple[str, Any]]:
    peft = sys.modules.get("peft.tuners.lora.layer") or sys.modules.get("peft.tuners.lora")
    layer_type = getattr(peft, "LoraLayer", None) if peft is not None else None
    if layer_type is None:
        return []
    return [(name, m) for name, m in model.named_modules() if isinstance(m, layer_type)]


def _strip(name: str) -> str:
    """A module path relative to the adapted model (peft's wrapper prefix taken off)."""
    for lead in ("base_model.model.",):
        if name.startswith(lead):
            return name[len(lead):]
    return name


def _alpha_of(module: nn.Module) -> float:
    alpha = getattr(module, "alpha", None)
    if isinstance(alpha, torch.Tensor):
        return float(alpha)
    if isinstance(alpha, (int, float)):
        return float(alpha)
    return float(module.lora_down.weight.shape[0])  # kohya's default: alpha = rank


def lora_factors(model: nn.Module, adapter: str = "default") -> dict[str, LoRAFactors]:
    """The LoRA factors of ``model``'s adapted layers, by module path (relative to the base
    model: peft's ``base_model.model.`` taken off).

    Found: peft LoRA layers (adapter ``adapter``; alpha as its scaling makes it, so rsLoRA
    comes out as the equivalent plain alpha) and layers whose ``forward`` an adapter with
    ``lora_down`` / ``lora_up`` replaced (kohya, musubi-tuner, LyCORIS' LoRA).

    Raises:
        ConfigError: when ``model`` holds no LoRA layer.
    """
    out: dict[str, LoRAFactors] = {}
    for name, layer in _peft_layers(model):
        if adapter not in getattr(layer, "lora_A", {}):
            continue
        down = layer.lora_A[adapter].weight.detach()
        up = layer.lora_B[adapter].weight.detach()
        if down.dim() != 2:
            raise ConfigError(f"{name}: only linear LoRA layers are saved in these layouts, "
                              f"not {type(layer.lora_A[adapter]).__name__}",
                              hint="Save convolution adapters with peft's own save_pretrained.")
        out[_strip(name)] = LoRAFactors(down, up, float(layer.scaling[adapter]) * down.shape[0])
    other: list[str] = []  # adapters hooked in that are not LoRA factors (LoHa, LoKr, ...)
    for name, module in model.named_modules():
        bound = getattr(module.__dict__.get("forward"), "__self__", None)
        if not isinstance(bound, nn.Module) or bound is module:
            continue
        if (isinstance(getattr(bound, "lora_down", None), nn.Module)
                and isinstance(getattr(bound, "lora_up", None), nn.Module)):
            out[_strip(name)] = LoRAFactors(bound.lora_down.weight.detach().flatten(1),
                                            bound.lora_up.weight.detach().flatten(1),
                                            _alpha_of(bound))
        elif any(p.requires_grad for p in bound.parameters()):
            other.append(f"{name} ({type(bound).__name__})")
    if other:
        raise ConfigError(f"{len(other)} adapted layer(s) hold adapters that are not LoRA "
                          f"factors (down/up): {', '.join(other[:3])}",
                          hint="Save LoHa/LoKr and other LyCORIS algorithms with the network's "
                               "own save_weights(); these layouts hold LoRA.")
    if not out:
        raise ConfigError(f"{type(model).__name__} holds no LoRA layer",
                          hint="Add adapters with peft (get_peft_model, add_adapter) or apply a "
                               "kohya-style network first.")
    return out


def _prefix(layout: str, prefix: str | None) -> str:
    return _PREFIX[layout] if prefix is None else prefix


def _kohya_name(prefix: str, path: str) -> str:
    return f"{prefix}_{path}".replace(".", "_") if prefix else path.replace(".", "_")


def adapter_state_dict(source: nn.Module | Mapping[str, LoRAFactors], layout: str, *,
                       prefix: str | None = None, dtype: torch.dtype | None = None
                       ) -> dict[str, torch.Tensor]:
    """The adapters of ``source`` (a model, see :func:`lora_factors`, or factors by module path)
    as a state dict in ``layout`` (:data:`LORA_LAYOUTS`; ``prefix`` replaces the layout's
    default), tensors contiguous on the CPU, in ``dtype`` if given.

    peft and diffusers keep ``alpha`` outside the weights (:func:`save_adapters` writes it into
    the file's metadata)."""
    check_choice("layout", layout, LORA_LAYOUTS)
    factors = lora_factors(source) if isinstance(source, nn.Module) else dict(source)
    lead = _prefix(layout, prefix)

    def out(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to("cpu", dtype=dtype or t.dtype)
        return t.contiguous()

    state: dict[str, torch.Tensor] = {}
    for path, f in factors.items():
        if layout in ("peft", "diffusers"):
            state[f"{lead}{path}.lora_A.weight"] = out(f.down)
            state[f"{lead}{path}.lora_B.weight"] = out(f.up)
            continue
        name = _kohya_name(lead, path) if layout == "kohya" else f"{lead}{path}"
        state[f"{name}.lora_down.weight"] = out(f.down)
        state[f"{name}.lora_up.weight"] = out(f.up)
        state[f"{name}.alpha"] = torch.tensor(f.alpha, dtype=dtype or f.down.dtype)
    return state


def _config_metadata(factors: Mapping[str, LoRAFactors]) -> dict[str, Any]:
    """peft's ``LoraConfig`` fields that give each layer its rank and alpha."""
    ranks = {p: f.rank for p, f in factors.items()}
    alphas = {p: f.alpha for p, f in factors.items()}
    r = max(set(ranks.values()), key=list(ranks.values()).count)
    alpha = max(set(alphas.values()), key=list(alphas.values()).count)
    config: dict[str, Any] = {"r": r, "lora_alpha": alpha,
                              "target_modules": sorted(factors)}
    rank_pattern = {p: v for p, v in ranks.items() if v != r}
    alpha_pattern = {p: v for p, v in alphas.items() if v != alpha}
    if rank_pattern:
        config["rank_pattern"] = rank_pattern
    if alpha_pattern:
        config["alpha_pattern"] = alpha_pattern
    return config


def save_adapters(source: nn.Module | Mapping[str, LoRAFactors], path: str | os.PathLike[str],
                  *, layout: str = "peft", prefix: str | None = None,
                  dtype: torch.dtype | None = None, metadata: Mapping[str, str] | None = None
                  ) -> Path:
    """Write the adapters of ``source`` to a safetensors file in ``layout``, atomically.

    Args:
        source: a model with LoRA layers (:func:`lora_factors`) or factors by module path.
        path: the file to write (replaced if it exists).
        layout: ``"peft"``, ``"diffusers"``, ``"kohya"`` or ``"comfyui"`` (module docstring).
        prefix: the key prefix instead of the layout's (``"lora_transformer"`` for a diffusers
            transformer in the kohya layout, ``"transformer."`` for the comfyui one).
        dtype: the tensors' dtype in the file (default: as trained).
        metadata: more string metadata to store.

    Returns:
        The path written.
    """
    from safetensors.torch import save_file

    check_choice("layout", layout, LORA_LAYOUTS)
    factors = lora_factors(source) if isinstance(source, nn.Module) else dict(source)
    state = adapter_state_dict(factors, layout, prefix=prefix, dtype=dtype)
    info = {str(k): str(v) for k, v in (metadata or {}).items()}
    info[_LAYOUT_KEY] = layout
    config = _config_metadata(factors)
    if layout == "peft":
        info["lora_config"] = json.dumps(config, sort_keys=True)
    elif layout == "diffusers":
        lead = _prefix(layout, prefix).rstrip(".")
        info["format"] = "pt"
        info[_DIFFUSERS_METADATA] = json.dumps(
            {f"{lead}.{k}" if lead else k: v for k, v in config.items()}, sort_keys=True)
    target = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                                         dir=target.parent)
    os.close(handle)
    try:
        save_file(state, temporary, metadata=info)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target


def _detect(keys: list[str]) -> str:
    if any(k.endswith(".lora_down.weight") for k in keys):
        return "kohya" if all("." not in k.rsplit(".lora_down.weight", 1)[0]
                              for k in keys if k.endswith(".lora_down.weight")) else "comfyui"
    if any(k.endswith(".lora_A.weight") for k in keys):
        return "diffusers" if all(k.startswith("transformer.") for k in keys) else "peft"
    raise ConfigError("no LoRA keys found (.lora_A/.lora_B or .lora_down/.lora_up weights)",
                      hint="Pass a LoRA adapter file or state dict.")


def load_adapters(source: str | os.PathLike[str] | Mapping[str, torch.Tensor], *,
                  layout: str = "auto", prefix: str | None = None,
                  model: nn.Module | None = None) -> dict[str, LoRAFactors]:
    """Read LoRA factors by module path from a safetensors file or a state dict.

    Args:
        source: a file :func:`save_adapters` (or a trainer) wrote, or a state dict.
        layout: one of :data:`LORA_LAYOUTS`, or ``"auto"``: the file's metadata, else told by
            its keys.
        prefix: the key prefix instead of the layout's default.
        model: the model the adapters are for: its module names turn kohya names (``_`` for
            ``.``) back into paths (without it, a kohya name stays as it is, prefix taken off).

    Raises:
        ConfigError: keys of no LoRA layout, or a layer missing half of its factors.
    """
    metadata: dict[str, str] = {}
    if isinstance(source, Mapping):
        state = dict(source)
    else:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(os.fspath(source), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
        state = load_file(os.fspath(source))
    if layout == "auto":
        layout = metadata.get(_LAYOUT_KEY) or _detect(list(state))
    check_choice("layout", layout, LORA_LAYOUTS)
    lead = _prefix(layout, prefix)
    out: dict[str, LoRAFactors] = {}
    if layout in ("peft", "diffusers"):
        config = json.loads(metadata.get("lora_config", "{}"))
        if layout == "diffusers" and _DIFFUSERS_METADATA in metadata:
            packed = json.loads(metadata[_DIFFUSERS_METADATA])
            head = lead.rstrip(".") + "."
            config = {k[len(head):] if k.startswith(head) else k: v for k, v in packed.items()}
        for key, down in state.items():
            if not key.endswith(".lora_A.weight"):
                continue
            path = _strip(key[len(lead):] if key.startswith(lead) else key)
            path = path[:-len(".lora_A.weight")]
            up = state.get(key[:-len(".lora_A.weight")] + ".lora_B.weight")
            if up is None:
                raise ConfigError(f"{key} has no lora_B beside it",
                                  hint="The file is incomplete; save the adapter again.")
            alpha = config.get("alpha_pattern", {}).get(path, config.get("lora_alpha"))
            out[path] = LoRAFactors(down, up, float(alpha if alpha is not None
                                                    else down.shape[0]))
        return out
    paths = {}
    if layout == "kohya" and model is not None:
        paths = {_kohya_name(lead, _strip(n)): _strip(n) for n, _ in model.named_modules() if n}
    for key, down in state.items():
        if not key.endswith(".lora_down.weight"):
            continue
        name = key[:-len(".lora_down.weight")]
        up = state.get(f"{name}.lora_up.weight")
        if up is None:
            raise ConfigError(f"{key} has no lora_up beside it",
                              hint="The file is incomplete; save the adapter again.")
        alpha = state.get(f"{name}.alpha")
        if layout == "kohya":
            path = paths.get(name) or (name[len(lead) + 1:] if lead and name.startswith(
                lead + "_") else name)
        else:
            path = name[len(lead):] if name.startswith(lead) else name
        out[path] = LoRAFactors(down, up, float(alpha) if alpha is not None
                                else float(down.shape[0]))
    return out
