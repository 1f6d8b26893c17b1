"""The presets' memory settings as plans: what :func:`vramkit.planning.planner.search` chooses
for one LoRA training step of SDXL / FLUX.1-dev on a card of each tier.

One rule answers "what fits this card, and how fast": the planner's. A preset's model is built on
the meta device from its published config the way ``vramkit plan sdxl|flux-dev`` builds it
(:func:`vramkit.recipes.targets.build_target`, LoRA rank 16 on ``to_q, to_k, to_v, to_out.0`` as
the presets train), analyzed once (:func:`vramkit.planning.analysis.analyze`) and searched for the
tier's card on :data:`PRESET_HARDWARE` (an offline profile: the choice between swapping and
recomputing is priced at a consumer card's copy bandwidth and throughput), the budget being the
card less the CUDA context (:data:`CONTEXT_BYTES`) and the planner's default headroom.

The search is held to what the presets' fields can say (``search(swap_sets="spread")``: the
swapper's own schedule for a count of swapped blocks; the swapper's default ring of
``SwapConfig.num_slots`` slots; checkpointing of every block or none, the faster plan of the
two; no activation offload) and run with the presets' own choices applied, which the search does
not make: the frozen base stored in the preset's format (quantized on meta before the analysis,
so its bytes and its dequantization are what the plan counts), the optimizer's state per
trainable parameter (``search(optimizer_state_bytes=)``: 8-bit AdamW), VAE tiling (no part of
a training step on cached latents). Flux's base format is the preset's decision too: int8, and
nf4 (then a host optimizer) only where int8 has no plan: nf4 costs precision, which no step time
prices.

Analyzing a model takes seconds (FLUX.1-dev: ~10 s on one core), so the tiers' results are
stored in :data:`TIER_PLANS`; ``python -m vramkit.recipes._preset_plans`` prints the table the
planner gives now, and tests/recipes/test_preset_plans.py fails when the stored one differs.
Costs and plans are cached per process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vramkit._validate import check_size
from vramkit.errors import ConfigError, PlanError
from vramkit.offload.swap import SwapConfig
from vramkit.recipes._preset_memory import (
    CONTEXT_BYTES,
    IMAGE_SIZE,
    PROFILE_LORA_RANK,
    PROFILE_LORA_TARGETS,
    card_text,
)
from vramkit.units import format_size

#: The offline GPU profile the tiers are planned on (:data:`vramkit.planning.PROFILES`): the
#: planner's offline default. The hardware profiles hold no 8 GB card, and a tier's budget is a
#: cap on it (as benchmarks/presets.py caps its GPU).
PRESET_HARDWARE = "rtx4090"
TIERS_GB = (24, 16, 12, 8)
#: Optimizer state on the device per trainable parameter: AdamW's two fp32 moments, 8-bit
#: AdamW's two uint8 moments and a fp32 scale per 256 values, nothing when stepped on the host.
OPTIMIZER_STATE_BYTES = {"adamw": 8.0, "adamw8bit": 2 + 8 / 256, "host": 0.0}
#: Flux's (base format, optimizer) in order of preference: the first one with a plan is taken.
FLUX_CHOICES = (("int8", "adamw8bit"), ("nf4", "adamw8bit"), ("nf4", "host"))
_TARGETS = {"sdxl": "sdxl", "flux": "flux-dev"}


@dataclass(frozen=True)
class Setting:
    """A preset's memory settings, in the terms both models share.

    Attributes:
        model: ``"sdxl"`` or ``"flux"``.
        base_format: the frozen base's storage (``"bf16"``: as built).
        optimizer: ``"adamw"``, ``"adamw8bit"`` or ``"host"``.
        checkpointing: every block checkpointed (else none).
        swapped: blocks swapped (the swapper's schedule picks which).
        batch: rows per step.
        min_param_bytes: ``SwapConfig.min_param_bytes`` of the swapper.
    """

    model: str
    base_format: str = "bf16"
    optimizer: str = "adamw"
    checkpointing: bool = True
    swapped: int = 0
    batch: int = 1
    min_param_bytes: int = SwapConfig.min_param_bytes


@dataclass(frozen=True)
class TierPlan:
    """What the planner chose for one model on one tier.

    Attributes:
        setting: the memory settings (:class:`Setting`).
        gigabytes: the tier (the card's size in GB).
        predicted_peak_bytes: the plan's predicted peak.
        predicted_step_seconds: the plan's predicted step on :data:`PRESET_HARDWARE`.
    """

    setting: Setting
    gigabytes: int
    predicted_peak_bytes: int
    predicted_step_seconds: float


def headroom(vram: int) -> int:
    """Bytes of a card of ``vram`` the step may not use: the CUDA context and the planner's
    default headroom (:func:`vramkit.planning.api.resolve_headroom`)."""
    from vramkit.planning.api import resolve_headroom

    return CONTEXT_BYTES + resolve_headroom(vram, None)


def room(vram: int) -> int:
    """What a card of ``vram`` bytes leaves for the step (its plan's peak must fit)."""
    return max(0, vram - headroom(vram))


def minimum_vram(peak: int) -> int:
    """The smallest card whose :func:`room` holds ``peak`` bytes."""
    low, high = peak, 2 * peak + (4 << 30)
    while low < high:
        mid = (low + high) // 2
        if room(mid) >= peak:
            high = mid
        else:
            low = mid + 1
    return low


def tier_vram(gigabytes: int) -> int:
    # The decimal reading ("8GB" = 8e9 bytes, 7.45 GiB) is the smaller one: a preset that fits
    # it fits an "8 GiB" card too.
    return gigabytes * 10**9


# -- planning ---------------------------------------------------------------------------------

@functools.cache
def _machine() -> Any:
    from vramkit.planning.machine import machine_for

    return machine_for(PRESET_HARDWARE)


@functools.cache
def preset_cost(model: str, base_format: str = "bf16", batch: int = 1,
                min_param_bytes: int = SwapConfig.min_param_bytes) -> Any:
    """The :class:`~vramkit.planning.analysis.ModelCost` of one LoRA training step of ``model``
    at :data:`IMAGE_SIZE`, its frozen base stored in ``base_format`` (needs diffusers and peft;
    seconds; cached)."""
    from vramkit.planning._meta import quantize_on_meta
    from vramkit.planning.analysis import analyze
    from vramkit.recipes.targets import build_target

    target = build_target(_TARGETS[model], lora_rank=PROFILE_LORA_RANK, batch=batch,
                          resolution=IMAGE_SIZE, lora_targets=PROFILE_LORA_TARGETS)
    if base_format != "bf16":
        quantize_on_meta(target.model, base_format)
    return analyze(target.model, target.inputs, step=target.step, autocast=None,
                   swap_config=SwapConfig(min_param_bytes=min_param_bytes))


def _search(setting: Setting, vram: int, checkpointing: str, *, price: bool = False) -> Any:
    from vramkit.planning.planner import Choice, search

    cost = preset_cost(setting.model, setting.base_format, setting.batch,
                       setting.min_param_bytes)
    only = None
    slots = SwapConfig.num_slots
    if price:  # this setting's own plan, fitting or not
        from vramkit.offload.blocks import spread_evenly

        k = min(setting.swapped, len(cost.blocks))
        chosen = tuple(spread_evenly([b.swapped["bf16"] for b in cost.blocks], k))
        slots = min(slots, k) if k else slots
        only = Choice(chosen=chosen, num_slots=slots,
                      checkpoints=len(cost.blocks) if setting.checkpointing else 0)
    return search(cost, _machine(), vram, headroom(vram), num_slots=(slots,),
                  activation_offload=False, checkpointing=checkpointing,
                  optimizer_state_bytes=OPTIMIZER_STATE_BYTES[setting.optimizer],
                  swap_sets="spread", only=only)


def price(setting: Setting, vram: int) -> Any:
    """The planner's :class:`~vramkit.planning.record.Plan` of exactly ``setting`` for a card
    of ``vram`` bytes (its ``predicted_peak_bytes`` says whether it fits :func:`room`)."""
    return _search(setting, vram, "all" if setting.checkpointing else "none", price=True)


def plan_for(model: str, vram: int, *, base_format: str = "bf16",
             optimizer: str = "adamw") -> tuple[Setting, Any]:
    """The planner's choice for ``model`` on a card of ``vram`` bytes with the preset's base
    format and optimizer: the faster of the best plan with every block checkpointed and the
    best with none (ties: no recomputation).

    Raises:
        PlanError: when neither fits (the message names the smallest budget).
    """
    plans, refused = [], None
    for checkpointing in ("none", "all"):
        setting = Setting(model, base_format, optimizer, checkpointing == "all")
        try:
            plans.append((setting, _search(setting, vram, checkpointing)))
        except PlanError as err:
            refused = err
    if not plans:
        assert refused is not None
        raise refused
    setting, best = min(plans, key=lambda p: (p[1].predicted_step_seconds, p[0].checkpointing))
    return Setting(model, base_format, optimizer, setting.checkpointing,
                   len(best.swapped)), best


@functools.cache
def plan_tier(model: str, gigabytes: int) -> tuple[TierPlan, Any]:
    """What the planner chooses now for ``model`` on the ``gigabytes`` tier: the
    :class:`TierPlan` and its :class:`~vramkit.planning.record.Plan` (cached)."""
    vram = tier_vram(gigabytes)
    choices = FLUX_CHOICES if model == "flux" else (("bf16", "adamw"),)
    refused: PlanError | None = None
    for base_format, optimizer in choices:
        try:
            setting, plan = plan_for(model, vram, base_format=base_format, optimizer=optimizer)
        except PlanError as err:
            refused = err
            continue
        return TierPlan(setting, gigabytes, plan.predicted_peak_bytes,
                        round(plan.predicted_step_seconds, 4)), plan
    assert refused is not None
    raise refused


# -- the stored table -------------------------------------------------------------------------

def tier(model: str, gigabytes: int) -> TierPlan:
    """The stored :class:`TierPlan` (:data:`TIER_PLANS`)."""
    try:
        return TIER_PLANS[model, gigabytes]
    except KeyError:
        raise ConfigError(f"no {model} preset for a {gigabytes} GB card",
                          hint=f"The tiers are {', '.join(map(str, TIERS_GB))} GB.") from None


def stored_peak(setting: Setting) -> int | None:
    """The stored predicted peak of ``setting`` where it is a tier's (the same at any card:
    the peak of a priced setting does not depend on the budget), else ``None``."""
    for plan in TIER_PLANS.values():
        if plan.setting == setting:
            return plan.predicted_peak_bytes
    return None


def check_fits(what: str, setting: Setting, vram: int, hint: Callable[[], str]) -> None:
    """Raise when the planner's peak of ``setting`` does not fit a card of ``vram`` bytes."""
    peak = stored_peak(setting)
    breakdown = ""
    if peak is None:
        plan = price(setting, vram)
        peak = plan.predicted_peak_bytes
        breakdown = " (" + ", ".join(f"{k.replace('_', ' ')} {format_size(v)}"
                                     for k, v in plan.peak_breakdown.items()) + ")"
    if peak <= room(vram):
        return
    raise ConfigError(
        f"{what} LoRA training at {IMAGE_SIZE}x{IMAGE_SIZE} with these settings is planned to "
        f"peak at {format_size(peak)} on the GPU{breakdown}, more than the "
        f"{format_size(room(vram))} a card of {card_text(vram)} leaves "
        f"({format_size(CONTEXT_BYTES)} CUDA context and the planner's headroom); it needs "
        f"{format_size(minimum_vram(peak))} or more", hint=hint())


def for_vram(cls: Any, vram: int | str, what: str) -> Any:
    """The largest tier preset of ``cls`` whose planned peak fits a card of ``vram``; where
    smaller tiers have the same settings, the largest of them that the card's size reaches
    (a 16 GB card gets ``preset_16gb`` when it plans as ``preset_24gb`` does)."""
    nbytes = check_size("vram", vram)
    model = "sdxl" if what == "SDXL" else "flux"
    for gigabytes in TIERS_GB:
        if tier(model, gigabytes).predicted_peak_bytes <= room(nbytes):
            same = [g for g in TIERS_GB if g <= gigabytes and tier_vram(g) <= nbytes
                    and tier(model, g).setting == tier(model, gigabytes).setting]
            return getattr(cls, f"preset_{max(same, default=gigabytes)}gb")()
    smallest = minimum_vram(tier(model, TIERS_GB[-1]).predicted_peak_bytes)
    raise ConfigError(
        f"no {what} preset fits a card of {card_text(nbytes)}: the smallest (preset_8gb) is "
        f"planned to peak at {format_size(tier(model, TIERS_GB[-1]).predicted_peak_bytes)} and "
        f"needs a card of {format_size(smallest)} or more ({format_size(CONTEXT_BYTES)} CUDA "
        "context and the planner's headroom)",
        hint=f"Use a card of {format_size(smallest)} or more, or train below "
             f"{IMAGE_SIZE}x{IMAGE_SIZE} (the presets are planned for {IMAGE_SIZE}x"
             f"{IMAGE_SIZE}, batch 1).")


def table_source() -> str:
    """:data:`TIER_PLANS` as the planner gives it now, as Python source."""
    lines = ["TIER_PLANS: dict[tuple[str, int], TierPlan] = {"]
    for model in _TARGETS:
        for gigabytes in TIERS_GB:
            plan = plan_tier(model, gigabytes)[0]
            s = plan.setting
            lines.append(f"    ({model!r}, {gigabytes}): TierPlan(Setting({model!r}, "
                         f"{s.base_format!r}, {s.optimizer!r}, {s.checkpointing}, "
                         f"{s.swapped}), {gigabytes}, {plan.predicted_peak_bytes}, "
                         f"{plan.predicted_step_seconds!r}),")
    lines.append("}")
    return "\n".join(lines)


#: The tiers' plans (``python -m vramkit.recipes._preset_plans`` prints them again; a test
#: compares): model, base format, optimizer, checkpointing, swapped blocks; predicted peak
#: (bytes) and step (seconds, on :data:`PRESET_HARDWARE`).
TIER_PLANS: dict[tuple[str, int], TierPlan] = {
    ('sdxl', 24): TierPlan(Setting('sdxl', 'bf16', 'adamw', False, 0), 24, 13295334152, 0.6086),
    ('sdxl', 16): TierPlan(Setting('sdxl', 'bf16', 'adamw', False, 0), 16, 13295334152, 0.6086),
    ('sdxl', 12): TierPlan(Setting('sdxl', 'bf16', 'adamw', False, 13), 12, 10076082952, 0.6502),
    ('sdxl', 8): TierPlan(Setting('sdxl', 'bf16', 'adamw', True, 0), 8, 6546772876, 0.8623),
    ('flux', 24): TierPlan(Setting('flux', 'int8', 'adamw8bit', True, 0), 24, 15321961856, 4.9404),
    ('flux', 16): TierPlan(Setting('flux', 'int8', 'adamw8bit', True, 9), 16, 13686527360, 4.9451),
    ('flux', 12): TierPlan(Setting('flux', 'int8', 'adamw8bit', True, 23), 12, 10211136896, 4.9541),
    ('flux', 8): TierPlan(Setting('flux', 'int8', 'adamw8bit', True, 39), 8, 6443783552, 4.9638),
}


if __name__ == "__main__":
    print(table_source())
