"""``vramkit profile``: run a script under the memory profiler and write its report.

``vramkit profile [--out DIR] [--interval S] [--json] [--trace FILE] -- python train.py ARGS``
writes ``report.json``, ``report.html`` and ``report.png`` into DIR and prints the summary.

Python targets (``python script.py ...``, ``python -m module ...``, ``python -c CODE ...`` or a
bare ``script.py ...``) run **in this process** through :mod:`runpy`: the profiler then reads
PyTorch's CUDA allocator directly (exact allocated/reserved figures and between-sample peaks)
and, through PyTorch's global module hooks, names the modules that hold the most activation
memory. A bare ``python``/``python3``/``python3.N`` means the interpreter vramkit runs in; an
interpreter given as a *path* is used as given: when it is another interpreter than this one
(another virtual environment, another version) the command runs as a child process with it.

Anything else (``torchrun ...``, a shell script, another interpreter), or any target with
``--subprocess``, runs as a child process sampled from outside (host RSS of the child and its
descendants, NVML process memory). What cannot be seen from outside shows as ``n/a`` (``null``
in JSON): the allocator figures, per-module attribution, steps and the leak check. ``--device``
then only labels the report. On a CPU (no CUDA allocator) the allocator figures are ``n/a`` too.

Steps are counted without help from the script: in-process, the profiler counts a step at each
training iteration's ``torch.optim.Optimizer.step`` (``MemoryProfiler(count_optimizer_steps=
True)``, a global optimizer hook), so the leak check runs on ordinary training scripts.

``--json`` prints only the JSON summary on stdout: the profiled command's own stdout goes to
stderr (in-process at the file-descriptor level too, so C extensions and child processes of the
script follow). Without ``--json`` its output stays on stdout, before the tables.

``--trace FILE`` records PyTorch's allocation history with stacks and writes it as the
``.pickle`` snapshot that https://pytorch.org/memory_viz reads. It needs CUDA in this process
(in-process runs only): without it the command stops with exit code 2 before the script runs.

Every flag and output path is checked before the command starts (exit code 2; ``report.png``
is skipped with a note, before the run, when matplotlib is missing). In-process caveats: the
script runs as ``__main__`` of a runpy namespace, so code that pickles classes defined in the
script for ``multiprocessing`` spawn workers should use ``--subprocess``. The exit code is the
script's.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import os
import shutil
import subprocess
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramkit._validate import check_number
from vramkit.errors import ConfigError

__all__ = ["FLAG_NAMES", "PythonTarget", "parse_target", "register", "run_profile",
           "runs_this_interpreter"]

#: The MemoryProfiler arguments the flags set, each with its flag (errors name the flag).
FLAG_NAMES = {"sample_interval": "--interval", "device": "--device", "trace": "--trace"}

REPORT_FILES = ("report.json", "report.html", "report.png")

# Summary rows read from PyTorch's CUDA allocator: n/a when it was not read.
_ALLOCATOR_ROWS = frozenset({"peak allocated", "peak reserved", "mean allocated",
                             "allocations"})
_ALLOCATOR_FIELDS = ("peak_allocated", "peak_reserved", "mean_allocated", "mean_reserved",
                     "num_allocations", "alloc_retries", "ooms", "fragmentation",
                     "inactive_split_ratio")

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


def runs_this_interpreter(word: str) -> bool:
    """Whether the first word of a Python command line means the interpreter vramkit runs in.

    A bare name (``python``, ``python3``, ``python3.12``) or a bare ``script.py`` does; a path
    does when it is ``sys.executable`` or the same file in the same directory (a virtual
    environment's ``bin/python`` is a link to its base interpreter, yet another environment).
    """
    if word.endswith(".py") or os.path.basename(word) == word:
        return True
    given, mine = os.path.abspath(word), os.path.abspath(sys.executable)
    if given == mine:
        return True
    try:
        same = os.path.samefile(given, mine)
    except OSError:
        return False
    return same and os.path.dirname(given) == os.path.dirname(mine)


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
    if target.kind == "script" and not Path(target.target).is_file():
        raise ConfigError(f"script not found: {target.target}",
                          "Give the path of a Python file after '--'.")
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        if target.kind == "script":
            script = Path(target.target)
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
    except KeyboardInterrupt:  # Ctrl-C: the report keeps what was collected, exit 130
        print("vramkit profile: interrupted; the report covers what ran until then",
              file=sys.stderr)
        return 130
    except Exception:  # the script's own error (vramkit's included): its traceback, exit 1
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


def _run_child(command: list[str], interval: float, device: str | None,
               stdout_to_stderr: bool) -> tuple[int, Any]:
    from vramkit.observe.profiler import MemoryProfiler

    try:
        proc = subprocess.Popen(command, stdout=2 if stdout_to_stderr else None)
    except OSError as err:
        raise ConfigError(f"cannot start {command[0]!r}: {err.strerror or err}",
                          "Check the command after '--'.") from None
    try:
        # The pid is known only after the start: the profiler's settings were checked before.
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


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send what is written to stdout (``sys.stdout`` and file descriptor 1) to stderr."""
    sys.stdout.flush()
    try:
        saved: int | None = os.dup(1)
    except OSError:  # no descriptor 1 (a closed stdout): only sys.stdout to redirect
        saved = None
    if saved is not None:
        os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _command(args: argparse.Namespace) -> list[str]:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("no command to profile",
                          "Usage: vramkit profile [--out DIR] -- python train.py ARGS")
    return command


def _check_command(command: list[str], target: PythonTarget | None) -> None:
    """The program (or the script of an in-process run) must exist before anything starts."""
    if target is not None:
        if target.kind == "script" and not Path(target.target).is_file():
            raise ConfigError(f"script not found: {target.target}",
                              "Give the path of a Python file after '--'.")
        if target.kind == "module" and not _module_found(target.target):
            raise ConfigError(f"module not found: {target.target}",
                              "Check the module name after '-m' (it is looked up in the "
                              "current directory and the installed packages).")
        return
    program = command[0]
    found = (os.path.isfile(program) and os.access(program, os.X_OK)
             if os.path.basename(program) != program else shutil.which(program) is not None)
    if not found:
        raise ConfigError(f"command not found: {program}",
                          "Check the command after '--' (a program on PATH, or the path of "
                          "an executable file).")


def _module_found(name: str) -> bool:
    """Whether ``python -m name`` would find ``name`` (from the current directory, as
    :func:`run_in_process` runs it). A parent package that fails to import counts as found:
    its error is the script's, shown when it runs."""
    import importlib.util

    saved = sys.path[:]
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
    except Exception:
        return True
    finally:
        sys.path[:] = saved


def _check_trace(args: argparse.Namespace, target: PythonTarget | None) -> None:
    """``--trace`` needs an in-process run with CUDA, and a writable file."""
    from vramkit.cli._output import check_output_file
    from vramkit.observe.profiler import trace_unsupported_reason

    if target is None:
        raise ConfigError("--trace records the CUDA allocator of this process; it cannot trace "
                          "a command run as a child process",
                          "Run a Python script in-process (no --subprocess; `python script.py` "
                          "or this interpreter's path) to use --trace.")
    reason = trace_unsupported_reason(args.device)
    if reason is not None:
        raise ConfigError(f"--trace needs CUDA, and cannot work here: {reason}",
                          "Drop --trace (the sampled report works on the CPU too), or run on a "
                          "machine with an NVIDIA GPU.")
    check_output_file("--trace", args.trace, what="the allocation trace")


def _allocator_read(report: Any) -> bool:
    return report.metric != "host_rss"


def summary_rows(report: Any, child: bool) -> list[tuple[str, str]]:
    """The report's summary rows, with ``n/a`` for what this run could not measure."""
    if child:
        why = "n/a (another process's allocator cannot be read)"
    else:
        why = "n/a (no CUDA allocator: PyTorch keeps no CPU allocator statistics)"
    rows = []
    for label, value in report.summary_rows():
        if label in _ALLOCATOR_ROWS and not _allocator_read(report):
            value = why
        elif label == "leak" and child:
            value = "n/a (the steps of a child process are not seen)"
        elif label == "peak pinned pools" and child:
            value = "n/a (another process's pinned pools cannot be read)"
        rows.append((label, value))
    if child:
        rows.append(("per-module attribution", "n/a (the command ran as a child process)"))
    return rows


def summary_dict(report: Any, child: bool, written: list[Path]) -> dict[str, Any]:
    """The JSON summary: the report without its history, ``None`` for what was not measured."""
    data = report.to_dict()
    data.pop("history", None)
    data.pop("history_fields", None)
    if not _allocator_read(report):
        for key in _ALLOCATOR_FIELDS:
            data[key] = None
        for peak in data.get("phase_peaks", {}).values():
            peak["allocated"] = peak["reserved"] = None
    if child:  # seen only from inside the process
        for key in ("top_modules", "leak", "leak_by_workload", "peak_pinned", "steps"):
            if key in data:
                data[key] = None
    data["mode"] = "child process" if child else "in-process"
    data["files"] = [str(p) for p in written]
    return data


def _size_or_na(value: int | None, measured: bool) -> str:
    from vramkit.units import format_size

    return format_size(value) if measured and value is not None else "n/a"


def _print_summary(report: Any, out_dir: Path, written: list[Path], as_json: bool,
                   child: bool = False) -> None:
    from vramkit.cli._output import console, print_json

    if as_json:
        print_json(summary_dict(report, child, written))
        return
    from rich.table import Table

    con = console()
    table = Table(title="vramkit memory profile", show_header=True)
    table.add_column("figure")
    table.add_column("value")
    for label, value in summary_rows(report, child):
        table.add_row(label, value)
    con.print(table)
    allocator = _allocator_read(report)
    if report.phase_peaks:
        phases = Table(title="phases")
        for column in ("phase", "peak allocated", "peak reserved", "peak host RSS"):
            phases.add_column(column)
        for name, peak in report.phase_peaks.items():
            phases.add_row(name, _size_or_na(peak.allocated, allocator),
                           _size_or_na(peak.reserved, allocator),
                           _size_or_na(peak.host_rss, True))
        con.print(phases)
    if report.top_modules:
        from vramkit.units import format_size

        modules = Table(title="top modules by activation memory")
        for column in ("module", "type", "calls", "activation / call", "peak hits"):
            modules.add_column(column)
        for m in report.top_modules:
            modules.add_row(m.name, m.type, str(m.calls), format_size(m.activation_bytes),
                            str(m.peak_hits))
        con.print(modules)
    con.print(f"reports written to {out_dir}: " + ", ".join(p.name for p in written))


def _note(text: str) -> None:
    print(f"vramkit profile: {text}", file=sys.stderr)


def run_profile(args: argparse.Namespace) -> int:
    """Run the command in ``args.command`` under the profiler; returns its exit code."""
    from vramkit.cli._output import check_output_dir, flag_values, module_available
    from vramkit.observe.profiler import MemoryProfiler

    with flag_values():  # every flag and path, before the command starts
        command = _command(args)
        interval = check_number("--interval", args.interval, minimum=0, low_open=True,
                                hint="Give the seconds between samples, e.g. --interval 0.01.")
        target = None if args.subprocess else parse_target(command)
        if target is not None and not runs_this_interpreter(command[0]):
            _note(f"{command[0]} is not the interpreter vramkit runs in ({sys.executable}): "
                  "running it as a child process (allocator figures and module attribution "
                  "are n/a)")
            target = None
        _check_command(command, target)
        out_dir = check_output_dir("--out", args.out, REPORT_FILES)
        if args.trace is not None:
            _check_trace(args, target)
        # made now so that a bad --device starts nothing (a child's profiler needs its pid,
        # so this one only checks the settings then)
        profiler = MemoryProfiler(device=args.device, sample_interval=interval,
                                  trace=target is not None and args.trace is not None,
                                  count_optimizer_steps=True)
    files = list(REPORT_FILES)
    if not module_available("matplotlib"):
        files.remove("report.png")
        _note("report.png will be skipped: it needs matplotlib (pip install matplotlib)")
    with contextlib.ExitStack() as stack:
        if args.json:
            stack.enter_context(_stdout_to_stderr())
        if target is None:
            code, report = _run_child(command, interval, args.device, args.json)
        else:
            if not args.no_modules:
                # forward hooks only: backward hooks break scripts that modify outputs in place
                profiler.attach(None, backward=False)
            profiler.start()  # counts optimizer steps: the script needs no profiler.step()
            try:
                code = run_in_process(target)
            finally:
                profiler.detach()
                report = profiler.stop()
    written = [report.save(out_dir / name) for name in files]
    if target is not None and args.trace is not None:
        written.append(profiler.save_trace(args.trace))
    _print_summary(report, out_dir, written, args.json, child=target is None)
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
                        help="print only the summary, as JSON, on stdout (the command's own "
                             "stdout goes to stderr)")
    parser.add_argument("--device", default=None,
                        help="CUDA device to read (default: the current one, else CPU); with "
                             "--subprocess or a non-Python command it only labels the report")
    parser.add_argument("--subprocess", action="store_true",
                        help="run even Python scripts as a child process (no module hooks)")
    parser.add_argument("--no-modules", action="store_true",
                        help="do not hook modules (in-process runs only)")
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="also record PyTorch's allocation history and write it as a "
                             "memory_viz snapshot (e.g. trace.pickle; open it at "
                             "pytorch.org/memory_viz). Needs CUDA; in-process runs only")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command, after '--' (e.g. -- python train.py --lr 1e-4)")
    parser.set_defaults(func=run_profile, flag_names=FLAG_NAMES)
