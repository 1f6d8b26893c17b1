"""``vramkit profile``: run a script under the memory profiler and write its report.

``vramkit profile [--out DIR] [--interval S] [--json] -- python train.py ARGS`` writes
``report.json``, ``report.html`` and ``report.png`` into DIR and prints the summary.

Python targets (``python script.py ...``, ``python -m module ...``, ``python -c CODE ...`` or a
bare ``script.py ...``) run **in this process** through :mod:`runpy`: the profiler then reads
PyTorch's CUDA allocator directly (exact allocated/reserved figures and between-sample peaks)
and, through PyTorch's global module hooks, names the modules that hold the most activation
memory. Anything else (``torchrun ...``, a shell script), or any target with ``--subprocess``,
runs as a child process sampled from outside (host RSS of the child and its descendants, NVML
process memory); torch figures are then 0, and ``--device`` only labels the report (the child's
allocator cannot be read from here).

In-process caveats: the script runs as ``__main__`` of a runpy namespace, so code that pickles
classes defined in the script for ``multiprocessing`` spawn workers should use ``--subprocess``.
The exit code is the script's.
"""

from __future__ import annotations

import argparse
import builtins
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramkit._validate import check_number
from vramkit.errors import ConfigError

__all__ = ["PythonTarget", "parse_target", "register", "run_profile"]

# Interpreter flags that take no value and do not change what runs: accepted and ignored.
_HARMLESS_FLAGS = frozenset({"-u", "-B", "-O", "-OO", "-s", "-E", "-q"})


@dataclass(frozen=True)
class PythonTarget:
    """What a ``python ...`` command line runs.

    Attributes:
        kind: ``"script"``, ``"module"`` or ``"code"``.
        target: the script path, module name or code string.
        args: the arguments after it (``sys.argv[1:]`` for the target).
    """

    kind: str
    target: str
    args: tuple[str, ...]


def _is_python(word: str) -> bool:
    name = os.path.basename(word)
    return word == sys.executable or name == "python" or (
        name.startswith("python") and name[6:].replace(".", "").isdigit())


def parse_target(command: list[str]) -> PythonTarget | None:
    """The Python target of ``command``, or ``None`` when it must run as a child process.

    Args:
        command: the words after ``--``.

    Returns:
        A :class:`PythonTarget` for ``python [-u ...] script.py|-m mod|-c code ...`` and for
        ``script.py ...``; ``None`` otherwise (other interpreters, unknown Python flags).
    """
    if not command:
        return None
    words = list(command)
    if words[0].endswith(".py"):
        return PythonTarget("script", words[0], tuple(words[1:]))
    if not _is_python(words[0]):
        return None
    rest = words[1:]
    while rest and rest[0] in _HARMLESS_FLAGS:
        rest = rest[1:]
    if not rest:
        return None
    head = rest[0]
    if head in ("-m", "-c"):
        if len(rest) < 2:
            return None
        return PythonTarget("module" if head == "-m" else "code", rest[1], tuple(rest[2:]))
    if head.startswith("-"):
        return None
    return PythonTarget("script", head, tuple(rest[1:]))


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message") prints the message and exits 1
    return 1


def run_in_process(target: PythonTarget) -> int:
    """Run ``target`` as ``__main__`` in this process; returns its exit code.

    Raises:
        ConfigError: when the script file does not exist.
    """
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        if target.kind == "script":
            script = Path(target.target)
            if not script.is_file():
                raise ConfigError(f"script not found: {target.target}",
                                  "Give the path of a Python file after '--'.")
            sys.argv = [str(script), *target.args]
            sys.path.insert(0, str(script.resolve().parent))
            import runpy

            runpy.run_path(str(script), run_name="__main__")
        elif target.kind == "module":
            import runpy

            sys.argv = [target.target, *target.args]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target.target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *target.args]
            sys.path.insert(0, "")
            exec(compile(target.target, "<string>", "exec"),
                 {"__name__": "__main__", "__builtins__": builtins})
        return 0
    except SystemExit as stop:
        return _exit_code(stop.code)
    except (ConfigError, KeyboardInterrupt):
        raise
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def _wait_for_child(proc: subprocess.Popen[bytes]) -> int:
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # the child got the same SIGINT; wait for it to finish
            continue


def _run_child(command: list[str], interval: float, device: str | None) -> tuple[int, Any]:
    from vramkit.memory.profiler import MemoryProfiler

    # Settings are checked before the child exists: a bad --device must not leave it running.
    # (The pid is known only after the start, so the sampling profiler is made afterwards.)
    MemoryProfiler(device=device, sample_interval=interval)
    try:
        proc = subprocess.Popen(command)
    except OSError as err:
        raise ConfigError(f"cannot start {command[0]!r}: {err}",
                          "Check the command after '--'.") from err
    try:
        profiler = MemoryProfiler(device=device, sample_interval=interval, pid=proc.pid)
        profiler.start()
        try:
            code = _wait_for_child(proc)
        finally:
            report = profiler.stop()
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        raise
    return (128 - code if code < 0 else code), report


def _print_summary(report: Any, out_dir: Path, written: list[Path], as_json: bool) -> None:
    from vramkit.cli._output import console, print_json
    from vramkit.units import format_size

    if as_json:
        data = report.to_dict()
        data.pop("history", None)
        data.pop("history_fields", None)
        data["files"] = [str(p) for p in written]
        print_json(data)
        return
    from rich.table import Table

    con = console()
    table = Table(title="vramkit memory profile", show_header=True)
    table.add_column("figure")
    table.add_column("value")
    for label, value in report.summary_rows():
        table.add_row(label, value)
    con.print(table)
    if report.phase_peaks:
        phases = Table(title="phases")
        for column in ("phase", "peak allocated", "peak reserved", "peak host RSS"):
            phases.add_column(column)
        for name, peak in report.phase_peaks.items():
            phases.add_row(name, format_size(peak.allocated), format_size(peak.reserved),
                           format_size(peak.host_rss) if peak.host_rss is not None else "n/a")
        con.print(phases)
    if report.top_modules:
        modules = Table(title="top modules by activation memory")
        for column in ("module", "type", "calls", "activation / call", "peak hits"):
            modules.add_column(column)
        for m in report.top_modules:
            modules.add_row(m.name, m.type, str(m.calls), format_size(m.activation_bytes),
                            str(m.peak_hits))
        con.print(modules)
    con.print(f"reports written to {out_dir}: " + ", ".join(p.name for p in written))


def run_profile(args: argparse.Namespace) -> int:
    """Run the command in ``args.command`` under the profiler; returns its exit code."""
    from vramkit.memory.profiler import MemoryProfiler

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("no command to profile",
                          "Usage: vramkit profile [--out DIR] -- python train.py ARGS")
    interval = check_number("--interval", args.interval, minimum=0, low_open=True,
                            hint="Give the seconds between samples, e.g. --interval 0.01.")
    target = None if args.subprocess else parse_target(command)
    if target is None:
        code, report = _run_child(command, interval, args.device)
    else:
        profiler = MemoryProfiler(device=args.device, sample_interval=interval)
        if not args.no_modules:
            # forward hooks only: backward hooks break scripts that modify outputs in place
            profiler.attach(None, backward=False)
        profiler.start()
        try:
            code = run_in_process(target)
        finally:
            profiler.detach()
            report = profiler.stop()
    out_dir = Path(args.out)
    written = [report.save(out_dir / "report.json"), report.save(out_dir / "report.html")]
    try:
        written.append(report.save(out_dir / "report.png"))
    except ImportError as err:  # matplotlib is optional; the other two files still stand
        print(f"vramkit profile: skipped report.png: {err}", file=sys.stderr)
    _print_summary(report, out_dir, written, args.json)
    return code


def register(subparsers: Any) -> None:
    """Add the ``profile`` sub-command to the ``vramkit`` parser."""
    parser = subparsers.add_parser(
        "profile", help="run a Python script under the memory profiler",
        description="Run a command under the vramkit memory profiler and write report.json, "
                    "report.html and report.png. Python scripts run in-process (allocator "
                    "figures and module attribution); other commands run as a child process "
                    "sampled through NVML and psutil.")
    parser.add_argument("--out", default="vramkit-profile", metavar="DIR",
                        help="directory for the reports (default: ./vramkit-profile)")
    parser.add_argument("--interval", type=float, default=0.01, metavar="S",
                        help="seconds between samples (default: 0.01)")
    parser.add_argument("--json", action="store_true",
                        help="print the summary as JSON instead of tables")
    parser.add_argument("--device", default=None,
                        help="CUDA device to read (default: the current one, else CPU); with "
                             "--subprocess or a non-Python command it only labels the report")
    parser.add_argument("--subprocess", action="store_true",
                        help="run even Python scripts as a child process (no module hooks)")
    parser.add_argument("--no-modules", action="store_true",
                        help="do not hook modules (in-process runs only)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command, after '--' (e.g. -- python train.py --lr 1e-4)")
    parser.set_defaults(func=run_profile)
