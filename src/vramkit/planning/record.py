"""A plan: what to turn on (swapped blocks, slots, checkpointing, storage formats, activation
offload) and what it is predicted to cost, with what it shows (:meth:`Plan.explain`,
:meth:`Plan.to_dict`) and how it is kept: :meth:`Plan.save` writes it as JSON,
:meth:`Plan.load` / :meth:`Plan.from_dict` read it back, and :func:`vramkit.fit` applies a loaded
plan (``plan=`` a :class:`Plan` or the path of a saved one) without searching again.

The search that makes a plan is :func:`vramkit.planning.planner.search`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from vramkit._files import atomic_open
from vramkit.errors import ConfigError
from vramkit.units import format_size

__all__ = ["CHECKPOINTING", "PhaseTime", "Plan"]

#: Optimizer state bytes per trainable parameter (AdamW: two fp32 moments): what a plan prices
#: unless it is told its optimizer's (``plan(optimizer_state_bytes=)``).
ADAMW_STATE_BYTES = 8

#: What a plan may be asked to checkpoint: ``"auto"`` (the fewest blocks that fit, chosen per
#: candidate), ``"all"`` (every block: what trainers run at these sizes, the planner choosing
#: everything else) or ``"none"``.
CHECKPOINTING = ("auto", "all", "none")


@dataclass(frozen=True)
class PhaseTime:
    """One phase's prediction.

    Attributes:
        seconds: the phase's time, from a simulation of the host, the compute stream and the
            copy engine (a block's kernels wait for the host to enqueue them and for its copy, a
            copy for a free slot and for the engine).
        compute_seconds: the kernels alone (recomputation included in backward).
        copy_seconds: the copy engine's busy time (swapped blocks, restored activations).
        copy_bytes: the bytes those copies move.
        host_seconds: the host's time to enqueue the phase (Python, the dispatcher, the
            swapper's bookkeeping); it runs ahead of the device unless the blocks are small.
        slowed_seconds: what the compute loses to the copies running beside it (the memory
            system is shared: :meth:`~vramkit.planning.calibration.BlockTimes.copy_slowdown`),
            part of ``seconds``.
    """

    seconds: float
    compute_seconds: float
    copy_seconds: float
    copy_bytes: int
    host_seconds: float = 0.0
    slowed_seconds: float = 0.0

    @property
    def host_bound(self) -> bool:
        """Whether the host's enqueueing paces the phase (it takes 99 % of it or more, and the
        kernels less)."""
        return (self.host_seconds >= 0.99 * self.seconds
                and self.host_seconds > 1.01 * self.compute_seconds)

    @property
    def copy_wait_seconds(self) -> float:
        """What the compute waits for copies: the phase less its compute (slowed beside the
        copies included); 0 for a host-bound phase, whose gaps are the host's."""
        if self.host_bound:
            return 0.0
        return max(0.0, self.seconds - self.compute_seconds - self.slowed_seconds)

    @property
    def transfer_bound(self) -> bool:
        """Whether compute waits for copies for more than 1 % of the phase (and not for the
        host); compute slowed beside the copies is still compute."""
        return (not self.host_bound
                and self.seconds > 1.01 * (self.compute_seconds + self.slowed_seconds))


@dataclass(frozen=True)
class Plan:
    """What to turn on, and what it is predicted to cost (:func:`vramkit.plan`).

    Attributes:
        mode: ``"train"`` or ``"infer"``.
        machine: the machine's name (a hardware profile, or ``"measured: ..."``).
        budget_bytes / headroom_bytes: the budget and the part of it kept free.
        swapped / resident: block names in execution order.
        checkpointed: blocks recomputed in backward.
        num_slots: R, the swapper's GPU slots.
        swapped_format / resident_format: storage of the swapped / resident blocks' frozen
            weights (``"bf16"`` = as built).
        activation_offload: whether saved activations go to pinned host memory.
        predicted_peak_bytes: the predicted peak of allocated memory.
        peak_breakdown: its parts, in bytes.
        forward / backward: per-phase predictions (``backward`` is zero for inference).
        optimizer_seconds: the optimizer step.
        overhead_seconds: time outside both phases and the optimizer (0 from the search, whose
            phases include the swapper's host time; a caller may add its own, e.g. a
            data-parallel step's).
        host_bytes: pinned host memory for the swapped blocks' masters and offloaded
            activations.
        notes: remarks on the prediction (an offline machine's figures, ...).
        block_order: every block, swapped or resident, in execution order.
        disk_blocks: swapped blocks kept on disk because their masters would not fit
            ``host_budget`` (the swapper's disk tier, ``SwapConfig(host_budget=...)``), read
            ahead of use at ``disk_bytes_per_s`` through pinned staging buffers.
        swap_host_budget: the ``SwapConfig.host_budget`` that keeps exactly ``disk_blocks`` on
            disk (the host budget less the offloaded activations' pinned bytes); ``None``
            without a disk tier.
        disk_bytes_per_s: the disk read bandwidth the prediction assumed (``None`` without a
            disk tier).
        dequantize_together: whether each packed block's first call dequantizes all of its
            layers into one shared buffer (:mod:`vramkit.quant.dense`; counted in
            ``peak_breakdown["dequantized_weights"]``) instead of each layer at its own call.
        checkpointing: what the plan was asked to checkpoint: ``"auto"`` (the planner's
            choice), ``"all"`` or ``"none"`` (:data:`CHECKPOINTING`).
        host_breakdown: ``host_bytes`` by part: ``"masters"`` (the swapped blocks' pinned
            weights), ``"offloaded_activations"`` (what activation offload keeps on the host).
        host_budget_bytes: the host budget the plan was made under (``None``: none given);
            :meth:`explain` says whether ``host_bytes`` fits it.
        trainable: ``"swap"`` when the swapped blocks' trainable weights swap with them and
            their optimizer state lives in pinned host memory (full fine-tuning,
            ``SwapConfig(trainable="swap")``; ``num_slots`` state slots beside the weight
            slots), else ``"resident"``.
        optimizer_state_bytes: the optimizer's state per trainable parameter the plan priced
            (8: AdamW's two fp32 moments; :func:`vramkit.fit` measures its ``optimizer=``
            factory's for ``trainable="swap"``).
        ffn_chunks: each block's feed-forward layer runs over this many slices of its tokens,
            recomputed slice by slice in backward (:mod:`vramkit.offload.chunked`); 1: as
            built.
        subblock_checkpoint: each block's parts (attentions, feed-forward) run under their own
            checkpoint (:mod:`vramkit.offload.subblock`), so a checkpointed block's backward
            rebuilds one part at a time.
        split: the blocks were split into their children (attention, feed-forward, norms;
            :func:`vramkit.offload.blocks.split_blocks`): ``swapped``, ``resident`` and
            ``block_order`` name those units, and the ring's slots are as large as the largest
            unit (inference at budgets where whole blocks leave no room).
        compress_masters: the swapped masters are kept losslessly compressed and decoded on
            the device after each copy (``SwapConfig(compress="on")``; the decode scratch is
            ``peak_breakdown["compress_scratch"]``): fewer bytes over a transfer-bound link.
            ``compressed_blocks``: the swapped blocks compressed where only some are (the
            others' copies hide anyway, and each decode costs compute); empty: all of them.
        host_memory / host_memory_reason: where the swapped masters live, ``"pinned"`` or
            ``"pageable"`` (``SwapConfig.host_memory``, resolved by :func:`vramkit.plan`), and
            why; with pageable masters the copies were priced at ``copy_bytes_per_s``
            through a pinned staging pool of ``staging_pool_bytes``.
    """

    mode: str
    machine: str
    budget_bytes: int
    headroom_bytes: int
    swapped: tuple[str, ...]
    resident: tuple[str, ...]
    checkpointed: tuple[str, ...]
    num_slots: int
    swapped_format: str
    resident_format: str
    activation_offload: bool
    predicted_peak_bytes: int
    peak_breakdown: dict[str, int]
    forward: PhaseTime
    backward: PhaseTime
    optimizer_seconds: float
    overhead_seconds: float
    host_bytes: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    block_order: tuple[str, ...] = field(default_factory=tuple)
    disk_blocks: tuple[str, ...] = field(default_factory=tuple)
    swap_host_budget: int | None = None
    disk_bytes_per_s: float | None = None
    dequantize_together: bool = False
    checkpointing: str = "auto"
    split: bool = False
    compress_masters: bool = False
    compressed_blocks: tuple[str, ...] = ()
    host_memory: str = "pinned"
    host_memory_reason: str = ""
    copy_bytes_per_s: float | None = None
    staging_pool_bytes: int | None = None
    host_breakdown: dict[str, int] = field(default_factory=dict)
    host_budget_bytes: int | None = None
    trainable: str = "resident"
    optimizer_state_bytes: float = ADAMW_STATE_BYTES
    ffn_chunks: int = 1
    subblock_checkpoint: bool = False

    @property
    def predicted_step_seconds(self) -> float:
        """Forward + backward + optimizer + overhead."""
        return (self.forward.seconds + self.backward.seconds + self.optimizer_seconds
                + self.overhead_seconds)

    @property
    def host_bound_phases(self) -> tuple[str, ...]:
        """The phases predicted host-bound (``"forward"``, ``"backward"``): the host's pace
        decides their time."""
        return tuple(name for name in ("forward", "backward") if getattr(self, name).host_bound)

    @property
    def formats(self) -> dict[str, str]:
        """Block name -> storage format of its frozen weights."""
        out = dict.fromkeys(self.resident, self.resident_format)
        out.update(dict.fromkeys(self.swapped, self.swapped_format))
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data, with the derived figures."""
        data = asdict(self)
        data["predicted_step_seconds"] = self.predicted_step_seconds
        for phase in ("forward", "backward"):
            data[phase]["transfer_bound"] = getattr(self, phase).transfer_bound
            data[phase]["host_bound"] = getattr(self, phase).host_bound
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """The plan :meth:`to_dict` gave ``data`` for (after a JSON round trip too: lists back
        to tuples). The derived figures ``to_dict`` adds are recomputed, not read.

        Raises:
            ConfigError: for a field missing or unknown (a plan from another version).
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"a plan is a mapping of its fields, got {type(data).__name__}",
                              hint="Pass what Plan.to_dict() returned, or Plan.load(path).")
        known = {f.name: f for f in fields(cls)}
        unknown = set(data) - set(known) - _DERIVED
        if unknown:
            raise ConfigError(f"a plan has no field(s) {sorted(unknown)}",
                              hint="Plan again with this version of vramkit, or drop them.")
        missing = [name for name, f in known.items() if name not in data
                   and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise ConfigError(f"the plan lacks field(s) {missing}",
                              hint="Pass what Plan.to_dict() returned, or Plan.load(path).")
        values: dict[str, Any] = {}
        for name in known:
            if name not in data:
                continue
            value = data[name]
            if name in ("forward", "backward"):
                value = PhaseTime(**{f.name: value[f.name] for f in fields(PhaseTime)
                                     if f.name in value})
            elif name in ("peak_breakdown", "host_breakdown"):
                value = {str(k): int(v) for k, v in value.items()}
            elif name in _NAME_TUPLES:
                value = tuple(value)
            values[name] = value
        return cls(**values)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan as JSON (:meth:`to_dict`) to ``path``, atomically: a temporary file
        in the same folder, then renamed over ``path``, so a reader never finds half a plan.

        Returns:
            The path written.
        """
        target = Path(path)
        with atomic_open(target, "w") as file:
            file.write(self.to_json())
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """The plan :meth:`save` wrote to ``path``.

        Raises:
            ConfigError: when the file is not a saved plan.
        """
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not a saved plan: {err}",
                              hint="Write plans with Plan.save(path).") from err
        return cls.from_dict(data)

    def host_verdict(self) -> str:
        """The host memory the plan pins, by part, against its host budget, in words (empty
        when it pins nothing)."""
        if not self.host_bytes:
            return ""
        parts = ", ".join(f"{k.replace('_', ' ')} {format_size(v)}"
                          for k, v in self.host_breakdown.items() if v)
        # pageable masters are held, not pinned: only the staging pool and the rest are
        held = "held" if self.host_memory == "pageable" else "pinned"
        line = f"Host memory: {format_size(self.host_bytes)} {held}" + (
            f" ({parts})" if parts else "")
        if self.host_memory == "pageable" and self.staging_pool_bytes:
            line += (f", the masters in pageable memory; pinned: the "
                     f"{format_size(self.staging_pool_bytes)} staging pool"
                     + (" and the offloaded activations"
                        if self.host_breakdown.get("offloaded_activations") else ""))
        budget = self.host_budget_bytes
        if budget is None:
            return (line + "; no host budget was given: it must fit this host's RAM beside "
                    "the model's own copy (vramkit info; host_budget= bounds it).")
        if self.host_bytes <= budget:
            return (line + f": within the host budget of {format_size(budget)} "
                    f"({format_size(budget - self.host_bytes)} to spare).")
        return (line + f": OVER the host budget of {format_size(budget)} by "
                f"{format_size(self.host_bytes - budget)}.")

    def explain(self) -> str:
        """The plan and its reasons, in plain words."""
        lines = []
        n = len(self.swapped) + len(self.resident)
        budget = (f"{format_size(self.budget_bytes)} budget "
                  f"({format_size(self.headroom_bytes)} kept free)")
        parts = ", ".join(f"{k.replace('_', ' ')} {format_size(v)}"
                          for k, v in self.peak_breakdown.items() if v)
        lines.append(f"Predicted peak {format_size(self.predicted_peak_bytes)} of a {budget}: "
                     f"{parts}.")
        if self.swapped:
            what = "units (blocks split into their children)" if self.split else "blocks"
            if self.host_memory == "pageable":
                host = (f"{format_size(self.host_bytes)} of pageable host memory, copied "
                        f"through a {format_size(self.staging_pool_bytes or 0)} pinned staging "
                        "pool")
            else:
                host = f"{format_size(self.host_bytes)} of pinned host memory"
            lines.append(f"Swap {len(self.swapped)} of {n} {what} through {self.num_slots} "
                         f"slot{'s' if self.num_slots > 1 else ''}; {host}.")
            if self.host_memory_reason:
                lines.append(f"Masters {self.host_memory}, because {self.host_memory_reason}.")
            stacks = _by_stack(self.block_order or (*self.swapped, *self.resident),
                               set(self.swapped))
            if len(stacks) > 1:
                lines.append("Swapped per stack: " + ", ".join(
                    f"{stack} {k} of {total}" for stack, (k, total) in stacks.items()) + ".")
        else:
            lines.append(f"Every one of the {n} blocks stays on the GPU: no swapping.")
        if self.disk_blocks:
            rate = (f"{self.disk_bytes_per_s / 1e9:.2f} GB/s" if self.disk_bytes_per_s
                    else "the disk's speed")
            lines.append(f"Keep {len(self.disk_blocks)} of the swapped blocks on disk (the host "
                         "budget holds the others' masters and the staging buffers), read "
                         f"ahead of use at {rate}: SwapConfig(host_budget="
                         f"{format_size(self.swap_host_budget or 0)}).")
        if self.mode == "train":
            if self.checkpointing == "all":
                lines.append(f"Checkpoint all {n} blocks (recomputed in backward), as asked "
                             "(checkpointing='all').")
            elif self.checkpointing == "none":
                lines.append("No checkpointing, as asked (checkpointing='none').")
            elif self.checkpointed:
                lines.append(f"Checkpoint {len(self.checkpointed)} of {n} blocks (recomputed "
                             "in backward) so their activations fit.")
            else:
                lines.append("No checkpointing: the activations fit.")
        formats = {self.swapped_format if self.swapped else None,
                   self.resident_format if self.resident else None} - {None}
        if formats != {"bf16"}:
            lines.append(f"Store frozen weights as {self.swapped_format} (swapped) / "
                         f"{self.resident_format} (resident).")
            if self.dequantize_together:
                scratch = self.peak_breakdown.get("dequantized_weights", 0)
                lines.append("Dequantize each packed block's layers together at its first "
                             f"call, into one buffer of {format_size(scratch)} (less host "
                             "time per layer).")
        if self.compress_masters:
            scratch = self.peak_breakdown.get("compress_scratch", 0)
            which = (f"{len(self.compressed_blocks)} of the {len(self.swapped)} swapped "
                     "masters" if self.compressed_blocks else "the swapped masters")
            lines.append(f"Keep {which} compressed and decode them on the device "
                         f"after each copy (fewer bytes copied; {format_size(scratch)} of "
                         "decode scratch; each decode is priced in the time of the compute "
                         "it runs beside, or waited for by its block).")
        if self.activation_offload:
            lines.append("Offload saved activations to pinned host memory.")
        if self.ffn_chunks > 1:
            lines.append(f"Run each block's feed-forward layer over {self.ffn_chunks} slices "
                         "of its tokens, each recomputed in backward: its wide temporaries "
                         "exist for one slice at a time.")
        if self.subblock_checkpoint:
            lines.append("Checkpoint each block's parts (attention, feed-forward) on their own "
                         "as well (sub-block checkpointing): a block's backward rebuilds one "
                         "part at a time, for one more forward of each part in backward.")
        if self.trainable == "swap":
            state = self.host_breakdown.get("optimizer_state", 0)
            lines.append(f"Full fine-tuning with swapped optimizer state: each swapped block's "
                         f"optimizer state ({format_size(state)} in all, in pinned host memory) "
                         f"comes to one of {self.num_slots} state slots in backward, where "
                         "the block's optimizer steps, and goes back with its weights "
                         "(SwapConfig(trainable='swap'), optimizer=a factory).")
        host = self.host_verdict()
        if host:
            lines.append(host)
        for label, phase in (("forward", self.forward), ("backward", self.backward)):
            if self.mode != "train" and label == "backward":
                continue
            compute = f"{phase.compute_seconds * 1e3:.0f} ms of compute"
            if phase.host_bound:
                copies = (f", {format_size(phase.copy_bytes)} of copies "
                          f"({phase.copy_seconds * 1e3:.0f} ms)" if phase.copy_bytes else "")
                lines.append(f"{label.capitalize()} {phase.seconds * 1e3:.0f} ms, host-bound: "
                             f"the host needs {phase.host_seconds * 1e3:.0f} ms to enqueue "
                             f"{compute}{copies}.")
            elif phase.copy_bytes:
                # Which side bounds the phase, said as what waits for what: copies that take
                # less time than the compute can still bound it (the first block's copy, and
                # copies a full ring cannot start early, overlap nothing).
                copies = (f"{format_size(phase.copy_bytes)} of copies "
                          f"({phase.copy_seconds * 1e3:.0f} ms on the copy engine)")
                slowed = (f"; beside the copies the compute runs "
                          f"{phase.slowed_seconds * 1e3:.1f} ms slower"
                          if phase.slowed_seconds >= 5e-5 else "")
                if phase.transfer_bound:
                    said = (f"transfer-bound: {copies} do not all overlap the "
                            f"{phase.compute_seconds * 1e3:.0f} ms of compute, which waits "
                            f"{phase.copy_wait_seconds * 1e3:.0f} ms for them{slowed}")
                else:
                    said = f"compute-bound: {copies} hide behind {compute}{slowed}"
                lines.append(f"{label.capitalize()} {phase.seconds * 1e3:.0f} ms, {said}.")
            else:
                lines.append(f"{label.capitalize()} {phase.seconds * 1e3:.0f} ms: {compute}, "
                             "no copies.")
        lines.append(f"Predicted step: {self.predicted_step_seconds * 1e3:.0f} ms on "
                     f"{self.machine}.")
        lines.extend(self.notes)
        return "\n".join(lines)

def _by_stack(names: Sequence[str], swapped: set[str]) -> dict[str, tuple[int, int]]:
    """Per stack of blocks (a name up to its last index: ``transformer_blocks`` for
    ``transformer_blocks.3`` and for a split block's ``transformer_blocks.3.attn``), how many of
    its blocks are swapped and how many it has, in the order the stacks first run."""
    out: dict[str, tuple[int, int]] = {}
    for name in names:
        parts = name.split(".")
        index = max((i for i, part in enumerate(parts) if part.isdigit() and i), default=0)
        stack = ".".join(parts[:index]) if index else name  # a split block's unit: its stack
        k, total = out.get(stack, (0, 0))
        out[stack] = (k + (name in swapped), total + 1)
    return out


#: What :meth:`Plan.to_dict` adds beside the fields: figures derived from them.
_DERIVED = frozenset({"predicted_step_seconds"})
#: The fields of names (and notes) that JSON turns into lists.
_NAME_TUPLES = frozenset({"swapped", "resident", "checkpointed", "notes", "block_order",
                          "disk_blocks", "compressed_blocks"})
