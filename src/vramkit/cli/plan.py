"""``vramkit plan MODEL --budget SIZE``: what to turn on for a model on a card, and how fast.

MODEL is a shipped preset name (``flux-dev``, ``sdxl``, ``sd3.5-large``, ``qwen-image``,
``wan2.1-14b``, ``llama-3.1-8b``: published configs only, no weights) or a local diffusers /
transformers folder (only its ``config.json`` is read). The model is built on the meta device
(nothing allocated, no weight read), one step is traced there, and :func:`vramkit.plan` chooses
the swapped blocks, ring slots, checkpointed blocks, storage formats and activation offload with
the best predicted step time under the budget. The command prints the plan, its predicted peak
and step time per phase, and the reasons (``--json``: one object), then the ``vramkit.fit`` call
that applies it in code; ``--save PATH`` writes the plan (:meth:`Plan.save
<vramkit.planning.record.Plan.save>`) for that call's ``plan=PATH``.

Hardware. ``--hardware NAME`` plans offline for a GPU of :data:`vramkit.planning.PROFILES`
(``--list`` shows them). Without it, the GPU of this machine is measured when PyTorch sees one;
on a machine without a GPU the plan is made for :data:`DEFAULT_OFFLINE_HARDWARE` and says so.

Errors. A budget nothing fits in exits with code 1 and names the smallest budget that works
(and ``--allow`` formats that would lower it); bad flag values exit with code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
from collections.abc import Iterator
from typing import Any

__all__ = ["DEFAULT_OFFLINE_HARDWARE", "FLAG_NAMES", "fit_call", "make_plan", "register", "run"]

#: The GPU planned for when no ``--hardware`` is given and PyTorch sees no GPU: the Python
#: API's default too (``vramkit.planning.api.DEFAULT_OFFLINE_HARDWARE``; a test keeps them one),
#: written out here so that building the parser imports no torch.
DEFAULT_OFFLINE_HARDWARE = "rtx4090"

#: Python names of the settings the flags feed (errors speak of the flags).
FLAG_NAMES = {"budget": "--budget", "mode": "--mode", "lora_rank": "--lora-rank",
              "resolution": "--resolution", "batch": "--batch", "seq_len": "--seq-len",
              "frames": "--frames", "hardware": "--hardware", "allow_formats": "--allow",
              "host_budget": "--host-budget", "headroom": "--headroom",
              "disk_bytes_per_s": "--disk-speed", "checkpointing": "--checkpointing",
              "host_memory": "--host-memory", "staging_pool": "--staging-pool",
              "compress": "--compress", "subblock_checkpoint": "--subblock",
              "trainable": "--trainable", "optimizer_state_bytes": "--optimizer-state-bytes"}

#: ``--subblock`` -> ``plan(subblock_checkpoint=)``.
_SUBBLOCK = {"auto": "auto", "on": True, "off": False}


def _positive(flag: str, text: str, unit: str, hint: str, suffix: str = "") -> float:
    """A flag's finite number > 0, ``suffix`` (its unit, optional in the text) stripped;
    ``unit`` names it in the errors."""
    from vramkit.errors import ConfigError

    try:
        value = float(text.removesuffix(suffix).strip() if suffix else text)
    except ValueError:
        raise ConfigError(f"{flag} must be a number of {unit}, got {text!r}",
                          hint=hint) from None
    if not 0 < value < float("inf"):
        raise ConfigError(f"{flag} must be > 0 {unit}, got {text!r}", hint=hint)
    return value


def _disk_speed(text: str | None) -> float | None:
    """``--disk-speed``: GB/s (decimal, as disks are rated) -> bytes per second."""
    if text is None:
        return None
    return _positive("--disk-speed", text, "GB/s",
                     "Give the disk's read speed in GB/s, e.g. --disk-speed 2.5.",
                     suffix="GB/s") * 1e9


def register(subparsers: Any) -> None:
    """Add the ``plan`` sub-command to the ``vramkit`` parser."""
    parser = subparsers.add_parser(
        "plan", help="plan swapping, checkpointing and storage for a model and a memory budget",
        description="Build a model from its config on the meta device (no weights, nothing "
                    "allocated), trace one step, and choose which blocks to swap, how many "
                    "slots, which blocks to checkpoint, storage formats and activation offload "
                    "for the best predicted step time under a memory budget.")
    parser.add_argument("model", metavar="MODEL", nargs="?", default=None,
                        help="a preset (flux-dev, sdxl, sd3.5-large, qwen-image, wan2.1-14b, "
                             "llama-3.1-8b) or a local diffusers/transformers folder")
    parser.add_argument("--budget", metavar="SIZE", default=None,
                        help="device memory for the step, e.g. 12GiB (a card's size or a cap)")
    parser.add_argument("--mode", choices=("train", "infer"), default="train",
                        help="a LoRA (or full) training step, or inference (default train)")
    parser.add_argument("--lora-rank", metavar="N", default="16",
                        help="LoRA rank when training; 0 trains every parameter (default 16)")
    parser.add_argument("--resolution", metavar="PX|HxW", default=None,
                        help="image size, e.g. 1024 or 480x832 (default: the model's own)")
    parser.add_argument("--batch", metavar="N", default="1", help="rows per step (default 1)")
    parser.add_argument("--seq-len", metavar="N", default=None,
                        help="a language model's tokens per row (default 4096); a diffusion "
                             "model's text tokens (default: the model's own)")
    parser.add_argument("--frames", metavar="N", default=None,
                        help="a video model's frames, 4k+1 (default: Wan 81, HunyuanVideo 129)")
    parser.add_argument("--hardware", metavar="GPU", default=None,
                        help="plan offline for a named GPU (see --list); default: measure "
                             f"this machine's GPU, or {DEFAULT_OFFLINE_HARDWARE} without one")
    parser.add_argument("--allow", metavar="FORMATS", default="",
                        help="packed storage the plan may use for frozen weights, e.g. "
                             "fp8,int8 (fp8, int8, int4, nf4; fp8-w8a8 and int8-w8a8 also "
                             "run the frozen layers' matmuls in 8 bits; default none)")
    parser.add_argument("--host-budget", metavar="SIZE", default=None,
                        help="pinned host memory the plan may use (default: no limit); "
                             "swapped blocks that do not fit stay on disk")
    parser.add_argument("--host-memory", choices=("auto", "pinned", "pageable"), default="auto",
                        help="where the swapped masters live: pinned, pageable (copied "
                             "through a pinned staging pool; for Windows/WSL and hosts that "
                             "cannot pin the model), or auto (default: pageable on "
                             "Windows/WSL, and on a measured machine where the masters would "
                             "take most of the pinning cap)")
    parser.add_argument("--staging-pool", metavar="SIZE", default="2GiB",
                        help="pinned staging pool of pageable masters (default 2GiB)")
    parser.add_argument("--compress", choices=("auto", "off"), default="auto",
                        help="losslessly compressed swapped masters: auto (default: where the "
                             "plan predicts a faster step) or off")
    parser.add_argument("--ddp", action="store_true",
                        help="plan one rank of a data-parallel job (torchrun + DDP): the "
                             "budget is each GPU's, DDP's gradient buckets are kept free")
    parser.add_argument("--disk-speed", metavar="GB/s", default=None,
                        help="read speed of the disk a disk tier reads from, in GB/s "
                             "(default 1.0; vramkit info --disk PATH measures it)")
    parser.add_argument("--checkpointing", choices=("auto", "all", "none"), default="auto",
                        help="blocks to checkpoint when training: the planner's choice "
                             "(default auto), every block, or none")
    parser.add_argument("--subblock", choices=tuple(_SUBBLOCK), default="auto",
                        help="checkpoint each block's attentions and feed-forward on their "
                             "own as well, so a block's backward rebuilds one part at a time "
                             "(long sequences: video): auto (default: only where nothing "
                             "fits otherwise), on, off")
    parser.add_argument("--trainable", choices=("resident", "swap"), default="resident",
                        help="where the trained weights live when training: resident "
                             "(default: on the GPU with their gradients and optimizer state) "
                             "or swap (full fine-tuning, with --lora-rank 0: the swapped "
                             "blocks' weights and optimizer state in pinned host memory, "
                             "stepped on the GPU in backward)")
    parser.add_argument("--optimizer-state-bytes", metavar="B", default=None,
                        help="optimizer state per trained parameter, in bytes (default 8: "
                             "AdamW's fp32 moments; vramkit's AdamW8bit about 2)")
    parser.add_argument("--headroom", metavar="SIZE|FRACTION", default=None,
                        help="part of the budget kept free (default 8%% + 256 MiB)")
    parser.add_argument("--save", metavar="PATH", default=None,
                        help="write the plan as JSON to PATH, for vramkit.fit(model, inputs, "
                             "budget, plan=PATH) to apply as it is")
    parser.add_argument("--blocks", action="store_true",
                        help="list every block with its placement, format and checkpointing")
    parser.add_argument("--list", action="store_true",
                        help="list the model presets and hardware names, and exit")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run, flag_names=FLAG_NAMES)


def _int_flag(flag: str, text: str | None, minimum: int, example: int) -> int | None:
    from vramkit._validate import check_int
    from vramkit.errors import ConfigError

    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{flag} must be a whole number, got {text!r}",
                          hint=f"Pass a whole number of {minimum} or more, e.g. {flag} "
                               f"{example}.") from None
    return check_int(flag, value, minimum=minimum)


def _headroom(text: str | None, budget: int, budget_text: str) -> int | float | None:
    """``--headroom``: a fraction (``0.1``) or a size (``2GiB``) that leaves some of the
    budget."""
    from vramkit.errors import ConfigError
    from vramkit.planning.api import resolve_headroom
    from vramkit.units import format_size, parse_size

    if text is None:
        return None
    value: int | float | None = None
    fraction = None
    with contextlib.suppress(ValueError):
        fraction = float(text)
    if fraction is not None and 0 <= fraction < 1:
        value = fraction
    elif fraction is not None and fraction >= 1:  # "2": two bytes? 2 GiB? 2 %?
        raise ConfigError(f"--headroom {text} is ambiguous: a plain number is a fraction of "
                          "the budget, below 1",
                          hint="Pass --headroom 0.1 (a fraction) or --headroom 2GiB (a size "
                               "with its unit).")
    if value is None:
        try:
            value = parse_size(text)
        except ValueError as err:
            raise ConfigError(f"--headroom must be a fraction below 1 or a size, got {text!r}"
                              f" ({str(err).split(': ', 1)[-1]})",
                              hint="Pass --headroom 0.1 or --headroom 2GiB.") from None
    kept = resolve_headroom(budget, value)
    if kept >= budget:
        raise ConfigError(f"--headroom {text} ({format_size(kept)}) leaves nothing of --budget "
                          f"{budget_text} ({format_size(budget)})",
                          hint="Keep less free, e.g. --headroom 0.05 or --headroom 1GiB, or "
                               "raise --budget.")
    return value


def _state_bytes(text: str | None) -> float | None:
    """``--optimizer-state-bytes``: bytes per trained parameter, or None (the default)."""
    if text is None:
        return None
    return _positive("--optimizer-state-bytes", text, "bytes",
                     "Give the optimizer's state per parameter in bytes, e.g. 8 (AdamW) or 2 "
                     "(AdamW8bit).")


def _formats(text: str) -> tuple[str, ...]:
    from vramkit._validate import check_choice
    from vramkit.planning.analysis import FORMATS

    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    for name in names:
        check_choice("--allow", name, tuple(f for f in FORMATS if f != "bf16"))
    return tuple(dict.fromkeys(names))


def _hardware(name: str | None) -> tuple[Any, str | None]:
    """The hardware to plan for, and a note when it was chosen for the user."""
    from vramkit.planning.hardware import hardware_profile

    if name is not None:
        return hardware_profile(name), None
    import torch

    if torch.cuda.is_available():
        return None, None  # measured by the planner
    return (hardware_profile(DEFAULT_OFFLINE_HARDWARE),
            f"PyTorch sees no GPU here: planned offline for {DEFAULT_OFFLINE_HARDWARE} "
            "(--hardware chooses another GPU).")


def make_plan(args: argparse.Namespace,
              status: Any = None) -> tuple[Any, Any, str | None]:
    """Check the flags, build the model on meta and plan it.

    Returns:
        ``(target, plan, note)``: the :class:`~vramkit.recipes.targets.PlanTarget`, the
        :class:`~vramkit.planning.record.Plan` and a note on the hardware (or ``None``).

    Raises:
        FlagError: for a bad flag value (exit code 2).
        PlanError: when no plan fits the budget.
    """
    from vramkit._validate import check_size
    from vramkit.cli._output import flag_values
    from vramkit.errors import ConfigError, PlanError
    from vramkit.planning.api import plan
    from vramkit.recipes.targets import build_target, check_inputs, target_options

    def say(text: str) -> None:
        if status is not None:
            status(text)

    with flag_values():
        if args.model is None:
            raise ConfigError("MODEL is missing",
                              hint="Name a preset (vramkit plan --list) or a model folder: "
                                   "vramkit plan flux-dev --budget 12GiB.")
        if args.budget is None:
            raise ConfigError("--budget is missing",
                              hint="Pass the card's memory or a cap, e.g. --budget 12GiB.")
        budget = check_size("--budget", args.budget, minimum=1)
        host_budget = check_size("--host-budget", args.host_budget, allow_none=True)
        disk_speed = _disk_speed(args.disk_speed)
        lora_rank = _int_flag("--lora-rank", args.lora_rank, 0, 16)
        batch = _int_flag("--batch", args.batch, 1, 1)
        seq_len = _int_flag("--seq-len", args.seq_len, 1, 4096)
        frames = _int_flag("--frames", args.frames, 1, 81)
        allow = _formats(args.allow)
        state_bytes = _state_bytes(getattr(args, "optimizer_state_bytes", None))
        trainable = getattr(args, "trainable", "resident")
        # the options the model takes, from its name or config.json: before any work (after
        # each value's own form, as argparse checks a flag's type first)
        target_options(args.model).check(
            {"resolution": args.resolution, "frames": args.frames, "seq_len": args.seq_len},
            FLAG_NAMES)
        if getattr(args, "save", None) is not None:
            from vramkit.cli._output import check_output_file

            check_output_file("--save", args.save, what="the plan")
        headroom = _headroom(args.headroom, budget, args.budget)
        # the values the model takes (sides a multiple of its patch, Wan's 4k+1 frames)
        check_inputs(args.model, resolution=args.resolution, batch=batch, seq_len=seq_len,
                     frames=frames)
        hardware, note = _hardware(args.hardware)
        if hardware is not None:
            from vramkit.planning.api import check_budget_fits
            from vramkit.planning.machine import machine_for

            check_budget_fits(budget, machine_for(hardware))
        if args.mode == "infer" and getattr(args, "subblock", "auto") == "on":
            raise ConfigError("--subblock on applies to training",
                              hint="Drop --subblock with --mode infer (inference keeps no "
                                   "activations for a backward).")
        if args.mode == "infer" and trainable != "resident":
            raise ConfigError(f"--trainable {trainable} applies to training",
                              hint="Drop --trainable with --mode infer (nothing trains).")
        if args.mode == "infer" and state_bytes is not None:
            raise ConfigError("--optimizer-state-bytes applies to training",
                              hint="Drop --optimizer-state-bytes with --mode infer.")
        if args.mode == "infer" and args.checkpointing != "auto":
            raise ConfigError(f"--checkpointing {args.checkpointing} applies to training",
                              hint="Drop --checkpointing with --mode infer (inference keeps no "
                                   "activations for a backward).")
        say(f"building {args.model} on the meta device")
        target = build_target(args.model, mode=args.mode, lora_rank=lora_rank,
                              resolution=args.resolution, batch=batch, seq_len=seq_len,
                              frames=frames)
    say(f"tracing one {args.mode} step of {target.name} and planning")
    reserved = 0
    if args.ddp:
        from vramkit.distributed.planning import ddp_bucket_bytes

        reserved = ddp_bucket_bytes(target.model)
        from vramkit.units import format_size

        ddp_note = (f"One rank of a DDP job: {format_size(reserved)} of DDP's gradient buckets "
                    "kept free beside the headroom (vramkit.distributed.plan_for_rank).")
        note = f"{note} {ddp_note}" if note else ddp_note
    try:
        result = plan(target.model, target.inputs, budget, mode=args.mode, hardware=hardware,
                      allow_formats=allow, host_budget=host_budget, headroom=headroom,
                      step=target.step, autocast=None, disk_bytes_per_s=disk_speed,
                      reserved_bytes=reserved, checkpointing=args.checkpointing,
                      subblock_checkpoint=_SUBBLOCK[getattr(args, "subblock", "auto")],
                      host_memory=args.host_memory, staging_pool=args.staging_pool,
                      compress=args.compress, trainable=trainable,
                      optimizer_state_bytes=state_bytes)
    except PlanError as err:  # the hint's Python call, as this command's flag
        hint = re.sub(r"allow_formats=\(([^)]*)\)",
                      lambda m: "--allow " + ",".join(re.findall(r"'(\w+)'", m.group(1))),
                      err.hint or "").replace("checkpointing='auto'", "--checkpointing auto")
        if lora_rank == 0 and args.mode == "train" and trainable == "resident":
            hint += (" For full fine-tuning, --trainable swap keeps the swapped blocks' "
                     "weights and optimizer state in host memory (and --optimizer-state-bytes "
                     "2 prices an 8-bit AdamW).")
        raise PlanError(err.message, hint=hint, minimum_budget=err.minimum_budget) from None
    return target, result, note


@contextlib.contextmanager
def _spinner(enabled: bool) -> Iterator[Any]:
    """A transient spinner on stderr whose text :func:`make_plan` updates."""
    if not enabled:
        yield None
        return
    from vramkit.cli._output import console

    with console(stderr=True).status("planning") as status:
        yield lambda text: status.update(text)


def fit_call(args: argparse.Namespace, saved: str | None) -> str:
    """The ``vramkit.fit`` call that applies this plan in code: ``plan=`` the file ``--save``
    wrote (``saved``), else the options that plan the same way on the GPU it runs on. With
    ``--ddp``, ``vramkit.distributed.fit_rank`` (which plans each rank itself)."""
    budget = args.budget.strip()
    arguments = ["model", "inputs", budget if budget.isdigit() else json.dumps(budget)]
    if saved is not None and not args.ddp:
        arguments.append(f"plan={json.dumps(saved)}")
    else:
        if args.mode != "train":
            arguments.append(f"mode={json.dumps(args.mode)}")
        formats = _formats(args.allow)
        if formats:
            arguments.append(f"allow_formats={formats!r}")
        for name, text in (("host_budget", args.host_budget), ("headroom", args.headroom)):
            if text is not None:
                value = text.strip()
                number = value.replace(".", "", 1).isdigit()
                arguments.append(f"{name}={value if number else json.dumps(value)}")
        disk_speed = _disk_speed(args.disk_speed)
        if disk_speed is not None:
            arguments.append(f"disk_bytes_per_s={disk_speed:.4g}")
        if args.checkpointing != "auto":
            arguments.append(f"checkpointing={json.dumps(args.checkpointing)}")
        subblock = getattr(args, "subblock", "auto")
        if subblock != "auto":
            arguments.append(f"subblock_checkpoint={_SUBBLOCK[subblock]}")
        if getattr(args, "trainable", "resident") == "swap":
            arguments.append('trainable="swap"')
    if getattr(args, "trainable", "resident") == "swap" and args.mode == "train":
        # the swapped blocks' optimizers (fit measures their state per parameter itself)
        arguments.append("optimizer=make_optimizer")
    function = "vramkit.distributed.fit_rank" if args.ddp else "vramkit.fit"
    return f"{function}({', '.join(arguments)})"


def run(args: argparse.Namespace) -> int:
    """Plan and print; returns the exit code."""
    from vramkit.cli._output import print_json

    if args.list:
        return _print_lists(args.json)
    with _spinner(not args.json) as status:
        target, result, note = make_plan(args, status)
    saved = str(result.save(args.save)) if args.save is not None else None
    call = fit_call(args, saved)
    if args.json:
        print_json({"model": target.name, "mode": target.mode, "trainable": target.trainable,
                    "shapes": target.shapes, "note": note, "plan": result.to_dict(),
                    "saved": saved, "fit_call": call})
        return 0
    _print_plan(target, result, note, args.blocks)
    _print_fit_call(call, saved)
    return 0


def _print_fit_call(call: str, saved: str | None) -> None:
    from rich.markup import escape

    from vramkit.cli._output import console

    con = console()
    if saved is not None:
        con.print(f"Saved the plan to {escape(saved)}.")
    yours = ("model, inputs and make_optimizer (parameters -> optimizer)"
             if "make_optimizer" in call else "model and inputs")
    con.print(f"In code ({yours}: yours, as planned here): {escape(call)}", soft_wrap=True)
    if saved is None:
        con.print("(--save PATH writes this very plan, for plan=PATH.)")


def _print_lists(as_json: bool) -> int:
    from vramkit.cli._output import console, print_json
    from vramkit.planning.hardware import PROFILES
    from vramkit.recipes.targets import MODEL_PRESETS
    from vramkit.units import format_size

    if as_json:
        print_json({"models": {name: {"library": p.library, "class": p.class_name,
                                      "source": p.source}
                               for name, p in MODEL_PRESETS.items()},
                    "hardware": {name: {"memory_bytes": p.memory_bytes}
                                 for name, p in PROFILES.items()}})
        return 0
    from rich.table import Table

    con = console()
    models = Table(title="Model presets (configs only, no weights)")
    for column in ("preset", "library", "class", "config from"):
        models.add_column(column)
    for name, preset in MODEL_PRESETS.items():
        models.add_row(name, preset.library, preset.class_name, preset.source)
    con.print(models)
    gpus = Table(title="Hardware (--hardware)")
    gpus.add_column("name")
    gpus.add_column("memory", justify="right")
    for name, profile in PROFILES.items():
        gpus.add_row(name, format_size(profile.memory_bytes))
    con.print(gpus)
    return 0


def _print_plan(target: Any, plan: Any, note: str | None, list_blocks: bool) -> None:
    from rich.markup import escape
    from rich.table import Table

    from vramkit.cli._output import console
    from vramkit.units import format_size

    con = console()
    con.print(f"[bold]{escape(target.name)}[/bold], {target.mode}: {escape(target.shapes)}")
    if target.mode == "train":
        con.print(f"Trains: {escape(target.trainable)}")
    if note:
        con.print(f"[yellow]{escape(note)}[/yellow]")
    n = len(plan.swapped) + len(plan.resident)
    table = Table(title=f"Plan for {format_size(plan.budget_bytes)} on {escape(plan.machine)}")
    table.add_column("setting")
    table.add_column("value")
    unit = "units (blocks split)" if plan.split else "blocks"
    swapped = (f"{len(plan.swapped)} of {n} {unit}, {plan.num_slots} slot(s), stored "
               f"{plan.swapped_format}" if plan.swapped else f"none of {n} {unit}")
    table.add_row("swapped", swapped)
    table.add_row("resident", f"{len(plan.resident)} {'units' if plan.split else 'blocks'}, "
                              f"stored {plan.resident_format}")
    if plan.mode == "train":
        parts = ", their parts on their own too" if plan.subblock_checkpoint else ""
        table.add_row("checkpointed", f"{len(plan.checkpointed)} of {n} blocks{parts}")
        table.add_row("activation offload", "on" if plan.activation_offload else "off")
    table.add_row("predicted peak", f"{format_size(plan.predicted_peak_bytes)} "
                                    f"(+ {format_size(plan.headroom_bytes)} kept free)")
    for part, value in plan.peak_breakdown.items():
        table.add_row(f"  {part.replace('_', ' ')}", format_size(value))
    table.add_row("predicted step", f"{plan.predicted_step_seconds * 1e3:.0f} ms")
    phases = [("forward", plan.forward)]
    if plan.mode == "train":
        phases.append(("backward", plan.backward))
    for label, phase in phases:
        bound = ("host-bound" if phase.host_bound else
                 "transfer-bound" if phase.transfer_bound else "compute-bound")
        slowed = (f", {phase.slowed_seconds * 1e3:.1f} ms slower beside the copies"
                  if phase.slowed_seconds >= 5e-5 else "")
        if phase.transfer_bound:  # what bounds it: the compute's wait, not the copies' sum
            slowed += f", {phase.copy_wait_seconds * 1e3:.0f} ms waiting for copies"
        table.add_row(f"  {label}", f"{phase.seconds * 1e3:.0f} ms ({bound}: compute "
                                    f"{phase.compute_seconds * 1e3:.0f} ms{slowed}, copies "
                                    f"{format_size(phase.copy_bytes)} = "
                                    f"{phase.copy_seconds * 1e3:.0f} ms)")
    if plan.swapped:
        table.add_row("pinned host memory", format_size(plan.host_bytes))
    if plan.disk_blocks:
        table.add_row("on disk", f"{len(plan.disk_blocks)} of the swapped blocks, read at "
                                 f"{(plan.disk_bytes_per_s or 0) / 1e9:.2f} GB/s "
                                 f"(SwapConfig(host_budget='{format_size(plan.swap_host_budget or 0)}'))")
    con.print(table)
    if list_blocks:
        blocks = Table(title="Blocks (execution order)")
        for column in ("block", "placement", "format", "checkpointed"):
            blocks.add_column(column)
        swapped_set, checkpointed = set(plan.swapped), set(plan.checkpointed)
        formats = plan.formats
        for name in plan.block_order:
            blocks.add_row(escape(name), "swapped" if name in swapped_set else "resident",
                           formats[name], "yes" if name in checkpointed else "")
        con.print(blocks)
    con.print(escape(plan.explain()))
