"""``vramkit demo``: fine-tune a diffusion transformer larger than a memory budget.

``vramkit demo [--budget SIZE] [--model-size PRESET|SIZE] [--steps N] [--batch-size N] [--json]
[--report PATH] [--no-baseline] [--device cpu|cuda]`` plans block swapping and checkpointing for
the budget, trains LoRA adapters of a DiT under it with a progress bar, then prints what was
swapped and checkpointed, the peak memory against the budget, the step time against the same
model fully resident, the loss, and where the profile report went. The work is done by
:func:`vramkit.recipes.demo.run_demo`; this module parses arguments and prints.

Every flag, the report path included (its directory must take files; ``.png`` needs
matplotlib), is checked before the model is built: a bad one exits with code 2 and trains
nothing. The progress bar and the summary show the same step-time statistic, the median step
time with the first step left out (``DemoResult.median_step_seconds``), under the same label.
"""

from __future__ import annotations

import argparse
from typing import Any

from vramkit.errors import ConfigError

__all__ = ["FLAG_NAMES", "STEP_TIME_LABEL", "register", "run"]

#: The DemoConfig fields the flags set, each with its flag (errors name the flag).
FLAG_NAMES = {"budget": "--budget", "model_size": "--model-size", "steps": "--steps",
              "batch_size": "--batch-size", "device": "--device", "report": "--report",
              "baseline": "--no-baseline"}

#: How the progress bar and the summary name the step time they show (the same statistic).
STEP_TIME_LABEL = "median step time (first step excluded)"


def register(subparsers: Any) -> None:
    """Add the ``demo`` sub-command to the ``vramkit`` parser."""
    parser = subparsers.add_parser(
        "demo", help="train a model larger than a memory budget (block swapping)",
        description="Fine-tune LoRA adapters of a diffusion transformer (Flux-style DiT) that is "
                    "larger than a memory budget, on synthetic data: vramkit swaps blocks "
                    "between pinned host memory and the GPU and checkpoints when activations "
                    "would not fit. Without a GPU it runs a small CPU configuration with a "
                    "simulated budget.")
    parser.add_argument("--budget", metavar="SIZE", default=None,
                        help="device memory to train in, e.g. 4GiB (default: 4 GiB on a GPU; "
                             "simulated on a CPU: 85%% of the weights or what the plan needs)")
    parser.add_argument("--model-size", metavar="PRESET|SIZE", default=None,
                        help="a DiT preset (tiny, small, base, large, xl) or a weight size such "
                             "as 6GiB (default: 1.5x the budget on a GPU, 'small' on a CPU)")
    parser.add_argument("--steps", metavar="N", default=None,
                        help="training steps (default: 20 on a GPU, 10 on a CPU)")
    parser.add_argument("--batch-size", metavar="N", default=None,
                        help="samples per step (default: 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where to train (default: cuda when a GPU is visible)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object instead of tables (no progress bar)")
    parser.add_argument("--report", metavar="PATH", default=None,
                        help="profile report to write (.html, .json or .png; default "
                             "vramkit-demo-report.html; '' writes none)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="do not time the model fully resident")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each block beneath checkpointing and swapping "
                             "(planned with the blocks timed compiled); the resident baseline "
                             "stays eager")
    parser.set_defaults(func=run, flag_names=FLAG_NAMES)


# -- argparse-level conversion ------------------------------------------------------------------
# DemoConfig checks its fields (vramkit._validate). These only turn an option's text into the
# value DemoConfig takes, and word a bad one in terms of the option typed on the command line.

_SIZE_HINT = "Give a size such as 4GiB, 1500MB or 2G."


def _whole_number(option: str, text: str | None) -> int | None:
    """``--steps`` / ``--batch-size``: a whole number >= 1 (``None`` when not given)."""
    if text is None:
        return None
    hint = f"Give {option} a whole number such as 10."
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{option} must be a whole number >= 1, got {text!r}",
                          hint=hint) from None
    if value < 1:
        raise ConfigError(f"{option} must be >= 1, got {value}", hint=hint)
    return value


def _size(option: str, what: str, text: str | None, hint: str = _SIZE_HINT) -> int | None:
    """``--budget`` / ``--model-size``: a size > 0 bytes (``None`` when not given)."""
    from vramkit.units import parse_size

    if text is None:
        return None
    try:
        nbytes = parse_size(text)
    except ValueError as exc:
        reason = str(exc).removeprefix(f"invalid size {text!r}: ")
        raise ConfigError(f"invalid {what} {text!r} ({option}): {reason}", hint=hint) from None
    if nbytes <= 0:
        raise ConfigError(f"{option} must be > 0 bytes, got {text!r}", hint=hint)
    return nbytes


def _model_size(text: str | None) -> str | int | None:
    """``--model-size``: a DiT preset name, else a weight size."""
    from vramkit.recipes.dit import DiTConfig

    presets = DiTConfig.preset_names()
    if text is None or text in presets:
        return text
    return _size("--model-size", "model size", text,
                 hint=f"Use a preset ({', '.join(presets)}) or a weight size such as 6GiB.")


def config_from_args(args: argparse.Namespace, *, distributed: bool = False) -> Any:
    """The :class:`vramkit.recipes.demo.DemoConfig` of parsed arguments (``distributed``: for
    one rank of a torchrun job, which writes no report and runs no resident baseline).

    Raises:
        ConfigError: for a bad --budget, --model-size, --steps, --batch-size or --report.
    """
    from vramkit.recipes.demo import DemoConfig

    return DemoConfig(
        budget=_size("--budget", "budget", args.budget),
        model_size=_model_size(args.model_size),
        steps=_whole_number("--steps", args.steps),
        batch_size=_whole_number("--batch-size", args.batch_size),
        device=args.device, baseline=not args.no_baseline and not distributed,
        report="" if distributed else _report_path(args),
        compile=getattr(args, "compile", False))


def _report_path(args: argparse.Namespace) -> str:
    """``--report`` (the default when not given; ``''``: none), checked for writing."""
    from vramkit.cli._output import REPORT_FORMATS, check_output_file
    from vramkit.recipes.demo import DEFAULT_REPORT

    report = DEFAULT_REPORT if args.report is None else args.report
    if report != "":
        check_output_file("--report", report, formats=REPORT_FORMATS,
                          what="a profile report", extra_hint=", or --report '' for none")
    return report


def run(args: argparse.Namespace) -> int:
    """Plan, train, and print the results; returns the exit code."""
    from vramkit.cli._output import flag_values, print_json
    from vramkit.recipes.demo import plan_demo, run_demo

    if _world_size() > 1:
        return _run_distributed(args)
    with flag_values():  # every flag, the report path and the plan: before any work
        config = config_from_args(args)
        plan = plan_demo(config)
    if args.json:
        print_json(run_demo(config, plan=plan).to_dict())
        return 0
    from vramkit.cli._output import console

    con = console()
    _print_plan(con, plan)
    with _ProgressBar(con) as bar:
        result = run_demo(config, plan=plan, progress=bar.update)
    _print_result(con, result)
    return 0


class _ProgressBar:
    """A transient rich progress bar fed by :class:`vramkit.recipes.demo.DemoProgress` reports.

    It shows the statistic the summary shows, under the same label: the running median step
    time the runner reports (``DemoProgress.median_step_seconds``, the first step left out
    once there are two), never the last step's time.
    """

    def __init__(self, con: Any) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.progress = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn(STEP_TIME_LABEL + " {task.fields[step_time]}"),
            TimeElapsedColumn(), console=con, transient=True)
        self.tasks: dict[str, Any] = {}
        self.building = self.progress.add_task("building the model", total=None, loss="-",
                                               step_time="-")

    def __enter__(self) -> _ProgressBar:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def update(self, event: Any) -> None:
        if event.stage == "build":  # built; pinning host masters and placing the rest next
            self.progress.update(self.building, description="setting up block swapping")
            return
        self.progress.update(self.building, visible=False)
        labels = {"train": "training (swapped)", "baseline": "baseline (fully resident)"}
        task = self.tasks.get(event.stage)
        if task is None:
            task = self.tasks[event.stage] = self.progress.add_task(
                labels.get(event.stage, event.stage), total=event.total, loss="-",
                step_time="-")
        if event.loss is not None and event.median_step_seconds is not None:
            self.progress.update(task, completed=event.step, loss=f"{event.loss:.4f}",
                                 step_time=_ms(event.median_step_seconds))


def _print_plan(con: Any, plan: Any) -> None:
    from vramkit.units import format_size

    cfg = plan.dit_config
    if plan.simulated and not plan.gpu_found:
        con.print("[bold]No GPU found: running the small CPU configuration[/bold] "
                  "(the budget is simulated: planned, not enforced).")
    elif plan.simulated:
        con.print("Running on the CPU (--device cpu): the budget is simulated.")
    else:
        con.print(f"GPU: {plan.device_name} ({plan.device}); the budget is enforced with "
                  "torch.cuda.set_per_process_memory_fraction.")
    ratio = plan.model_bytes / plan.budget_bytes
    name = plan.model_name
    if name.startswith("for_bytes("):
        name = f"sized for {name[len('for_bytes('):-1]}"
    con.print(f"Model: DiT {name} (hidden {cfg.hidden_size}, {cfg.num_double_blocks} double + "
              f"{cfg.num_single_blocks} single-stream blocks), "
              f"{cfg.num_parameters() / 1e6:,.1f} M parameters ({format_size(plan.model_bytes)} "
              f"{cfg.dtype}, {cfg.num_tokens} tokens/sample); LoRA rank {plan.lora_rank}: "
              f"{plan.trainable_params:,} trainable parameters.")
    predicted = (f", predicted step {_ms(plan.predicted_step_seconds)}"
                 if plan.predicted_step_seconds is not None else "")
    con.print(f"Budget: {format_size(plan.budget_bytes)} (the weights are {ratio:.2f}x the "
              f"budget). Plan (vramkit.plan): swap {plan.planned_swapped_blocks} of "
              f"{plan.num_blocks} blocks through {plan.num_slots} slots; checkpointing "
              f"{'on' if plan.checkpointing else 'off'}: {plan.checkpointing_reason}; "
              f"{'blocks compiled; ' if plan.compile else ''}"
              f"predicted peak {format_size(plan.predicted_peak_bytes)}{predicted}.")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _print_result(con: Any, result: Any) -> None:
    from rich.table import Table

    from vramkit.planning.fitting import host_bound_remark
    from vramkit.units import format_size

    plan = result.plan
    table = Table(title="vramkit demo", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    host = "host memory" if plan.simulated else "pinned host memory"
    table.add_row("swapped", f"{result.swapped_blocks} of {result.total_blocks} blocks, "
                             f"{format_size(result.swapped_bytes)} in {host}; "
                             f"{plan.num_slots} device slots, {format_size(result.slot_bytes)}")
    table.add_row("checkpointed", f"{len(result.checkpointed_blocks)} of {result.total_blocks} "
                                  "blocks" + ("" if result.checkpointed_blocks else
                                              " (activations fit without it)"))
    verdict = "under" if result.under_budget else "OVER"
    source = ("measured, torch.cuda.max_memory_allocated" if result.peak_source == "measured"
              else "planned: weights on the device + slots + optimizer + estimated activations; "
                   "simulated on the CPU")
    table.add_row("peak memory", f"{format_size(result.peak_bytes)} of "
                                 f"{format_size(plan.budget_bytes)} budget: {verdict} budget "
                                 f"({source})")
    speed = _ms(result.median_step_seconds)
    if result.baseline_median_step_seconds is not None:
        speed += (f"; fully resident {_ms(result.baseline_median_step_seconds)}: "
                  f"{result.slowdown:.2f}x")
        if result.slowdown_spread is not None:  # paired rounds: how far apart they read
            speed += f"; {result.slowdown_spread.describe()}"
    else:
        speed += f"; no baseline: {result.baseline_skipped}"
    table.add_row(STEP_TIME_LABEL, speed)
    report = result.prediction  # the planner's prediction next to the run (CUDA only)
    if (report is not None and report.measured_peak_bytes is not None
            and report.measured_step_seconds is not None):
        said = (f"peak {format_size(report.predicted_peak_bytes)} (measured "
                f"{format_size(report.measured_peak_bytes)}), step "
                f"{_ms(report.predicted_step_seconds)} (measured "
                f"{_ms(report.measured_step_seconds)})")
        if not report.same_machine:  # a time for another GPU: no test of the prediction
            said += (f"; the step time was predicted for {report.planned_for}, not for "
                     f"{report.runs_on}")
        remark = host_bound_remark(report.host_bound, report.step_error)
        if remark:
            said += f"; the {remark}"
        table.add_row("planner's prediction", said)
    loss = f"{result.loss_first:.4f} -> {result.loss_last:.4f} over {len(result.losses)} steps"
    if result.baseline_max_loss_diff is not None:
        loss += f" (fully resident run: max difference {result.baseline_max_loss_diff:.3g})"
    table.add_row("loss", loss)
    t = result.transfers
    table.add_row("transfers", f"{t['loads']} block loads ({t['prefetched']} prefetched, "
                               f"{t['on_demand']} on demand), {format_size(t['h2d_bytes'])} "
                               "host -> device")
    table.add_row("report", result.report_path or f"none ({result.report_skipped})")
    con.print(table)


# -- under torchrun -------------------------------------------------------------------------------


def _world_size() -> int:
    import os

    try:
        return int(os.environ.get("WORLD_SIZE", "1") or "1")
    except ValueError:
        return 1  # init_from_env words the error when a job really starts


def _run_distributed(args: argparse.Namespace) -> int:
    """``torchrun --nproc_per_node N -m vramkit demo``: every rank trains its share, rank 0
    prints (:mod:`vramkit.recipes.demo_ddp`)."""
    import contextlib

    from vramkit.cli._output import flag_values, print_json
    from vramkit.distributed import init_from_env, shutdown
    from vramkit.recipes.demo_ddp import run_distributed_demo

    with flag_values():
        if args.report is not None and args.report != "":
            raise ConfigError(
                "--report is not available under torchrun: each rank would profile its own "
                "process",
                hint="Drop --report (or run the one-process demo, which writes it).")
        config = config_from_args(args, distributed=True)
        info = init_from_env(backend="gloo" if args.device == "cpu" else None)
    try:
        if args.json:
            result = run_distributed_demo(config, info)
            if info.is_main:
                print_json(result.to_dict())
            return 0
        from vramkit.cli._output import console

        con = console()
        if info.is_main:
            con.print(f"Data-parallel job: {info.world_size} ranks ({info.backend}); rank 0 "
                      "reports.")
        bar = _ProgressBar(con) if info.is_main else None
        with bar if bar is not None else contextlib.nullcontext():
            result = run_distributed_demo(config, info,
                                          progress=bar.update if bar is not None else None)
        if info.is_main:
            _print_plan(con, result.plan)
            _print_distributed(con, result)
        return 0
    finally:
        shutdown()  # before interpreter exit: gloo's threads must not outlive it


def _print_distributed(con: Any, result: Any) -> None:
    from rich.table import Table

    from vramkit.units import format_size

    plan = result.plan
    table = Table(title=f"vramkit demo, {result.world_size} ranks", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("swapped", f"{result.swapped_blocks} of {result.total_blocks} blocks per rank, "
                             f"{format_size(result.swapped_bytes)}"
                             + ("" if result.plans_agree else " (ranks planned differently)"))
    shared = (f"{format_size(result.shared_bytes)} of masters shared by the node's ranks (one "
              "copy)" if result.shared_bytes else "not shared: each rank pins its own")
    if result.uploads == "sharded":
        shared += (f"; each GPU copied its share of every block from the host "
                   f"({format_size(sum(result.h2d_bytes))} in all) and received the rest over "
                   f"NVLink ({format_size(sum(result.gathered_bytes))})")
    pss = [p for p in result.pss_bytes if p is not None]
    table.add_row("host memory", shared + (f"; ranks' proportional set size "
                                           f"{format_size(sum(pss))} together" if pss else ""))
    verdict = "under" if result.under_budget else "OVER"
    table.add_row("peak memory", ", ".join(format_size(p) for p in result.peak_bytes)
                  + f" of {format_size(plan.budget_bytes)} per rank: {verdict} budget "
                    f"({result.peak_source})")
    table.add_row(STEP_TIME_LABEL, f"{_ms(result.median_step_seconds)} (slowest rank); "
                                   f"{result.samples_per_second:.2f} samples/s over the job")
    table.add_row("loss", f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f} over "
                          f"{len(result.losses)} steps (mean over ranks)")
    table.add_row("replicas", "equal on every rank" if result.replicas_max_diff == 0 else
                  f"differ by up to {result.replicas_max_diff:.3g}")
    table.add_row("baseline", "not run under torchrun (each rank would hold a second copy); "
                              "run the one-process demo for it")
    con.print(table)
