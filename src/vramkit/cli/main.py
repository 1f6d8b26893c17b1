"""Entry point of the ``vramkit`` command: one sub-module per sub-command.

Each sub-command module defines ``register(subparsers)``, which adds its parser and sets
``func`` (called with the parsed arguments, returning the exit code) and, optionally,
``flag_names`` (the Python names of the settings its flags feed, each with its flag, see
:func:`vramkit.cli._output.flag_text`), so that errors speak of ``--budget``, not
``DemoConfig.budget``.

How errors end, in every sub-command (no Python traceback for a user error):

- exit code 2, a usage error: argparse's errors and the ``ConfigError``s a command raises while
  it reads its flags (:func:`vramkit.cli._output.flag_values`); they read
  ``vramkit <sub>: error: <message>`` and a hint.
- exit code 1, a runtime failure: any other vramkit error, an ``OSError`` (missing file,
  permission denied, disk full...), a CUDA error vramkit recognises, a missing library.
- exit code 130: interrupted (Ctrl-C).
- a bug in vramkit itself (any other exception): one line saying so and how to report it, exit
  code 1; with ``-v`` the traceback too.

With ``--json`` an error is exactly one JSON object ``{"error": ..., "hint": ...}`` on stdout and
nothing else is printed there (an error that carries a figure adds it as a number: a
``PlanError``'s ``"minimum_budget_bytes"``); without it, errors go to stderr.

``-v``/``--verbose`` and ``--json`` work before and after the sub-command
(``vramkit -v info`` and ``vramkit info -v``).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import json
import logging
import os
import re
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn

from vramkit import __version__
from vramkit.errors import VramkitError

__all__ = ["build_parser", "describe_error", "error_fields", "main"]

# Sub-command modules, in the order `vramkit --help` lists them.
_COMMAND_MODULES = ("info", "select", "plan", "profile", "inspect", "demo")

# Where the sub-command's name goes: a name no sub-command uses for its own arguments
# (`profile` has a positional called `command`).
_COMMAND_DEST = "_vramkit_command"

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

_BUG_HINT = ("This is a bug in vramkit, not in your input: please report it (an issue in the "
             "vramkit repository) with the output of the same command run with -v.")

_ERRNO_HINTS = {
    errno.ENOENT: "Check that the path exists.",
    errno.EACCES: "Check the permissions, or choose a path you can read or write.",
    errno.EPERM: "Check the permissions, or choose a path you can read or write.",
    errno.EISDIR: "Give the path of a file, not of a directory.",
    errno.ENOTDIR: "A part of the path is a file, not a directory: check the path.",
    errno.ENOSPC: "The disk is full: free space, or write somewhere else.",
    errno.EROFS: "The file system is read-only: write somewhere else.",
    errno.EEXIST: "Remove the existing file or choose another path.",
}


class _ArgumentError(Exception):
    """argparse refused the command line (raised instead of printing and exiting)."""

    def __init__(self, prog: str, message: str, usage: str) -> None:
        super().__init__(message)
        self.prog = prog
        self.message = message
        self.usage = usage


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors come back to :func:`main` (sub-parsers are made of
    the same class, so each error carries its own sub-command's ``prog``)."""

    def error(self, message: str) -> NoReturn:
        raise _ArgumentError(self.prog, message, self.format_usage())


def _add_global_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """``-v`` (and ``--json`` on the top parser; every sub-command has its own).

    On sub-parsers the default is SUPPRESS: argparse copies a sub-parser's defaults over what
    the top parser parsed, which would turn ``vramkit -v info`` back to not verbose.
    """
    default: Any = False if top else argparse.SUPPRESS
    parser.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="log at DEBUG level and show tracebacks of internal errors")
    if top:
        parser.add_argument("--json", action="store_true", dest="global_json",
                            help="print JSON (also accepted after the sub-command)")


def build_parser() -> argparse.ArgumentParser:
    """The ``vramkit`` parser with every sub-command registered."""
    parser = _Parser(prog="vramkit",
                     description="Train and run models that are bigger than your GPU.")
    parser.add_argument("--version", action="version", version=f"vramkit {__version__}")
    _add_global_options(parser, top=True)
    subparsers = parser.add_subparsers(dest=_COMMAND_DEST, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(f"vramkit.cli.{name}").register(subparsers)
    for sub in subparsers.choices.values():
        _add_global_options(sub, top=False)
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]  # type: ignore[no-any-return]
    return parser


# A word that argparse would take for an option but is a negative value: "-3GiB", "-1", "-.5".
_NEGATIVE_VALUE = re.compile(r"^-\.?[0-9]")


def _attach_negative_values(parser: argparse.ArgumentParser, words: Sequence[str]) -> list[str]:
    """``--budget -3GiB`` as ``--budget=-3GiB`` (``-n -2`` as ``-n-2``), for every flag that
    takes one value.

    argparse takes a word such as ``-3GiB`` for an unknown option and fails with "expected one
    argument" and its whole usage; attached, the value reaches the flag's own check, whose
    one-line error says what is wrong with it. Words after ``--`` or after the first word of
    a command that a sub-command runs (``profile``'s) are left as they are.
    """
    result: list[str] = []
    current = parser
    rest_is_a_command = False
    index = 0
    while index < len(words):
        word = words[index]
        if word == "--" or rest_is_a_command:
            result.extend(words[index:])
            break
        index += 1
        if current is parser and not word.startswith("-"):
            current = _subparser(parser, word)
            result.append(word)
            continue
        action = current._option_string_actions.get(word)
        takes_value = action is not None and action.nargs is None and not isinstance(
            action, (argparse._StoreConstAction, argparse._StoreTrueAction,
                     argparse._CountAction, argparse._HelpAction, argparse._VersionAction))
        if takes_value and index < len(words):
            value = words[index]
            if _NEGATIVE_VALUE.match(value):
                result.append(f"{word}={value}" if word.startswith("--") else f"{word}{value}")
                index += 1
                continue
            if not value.startswith("-"):
                result.extend((word, value))
                index += 1
                continue
        if not word.startswith("-") and any(a.nargs == argparse.REMAINDER
                                            for a in current._actions):
            rest_is_a_command = True
            index -= 1
            continue
        result.append(word)
    return result


def _json_requested(argv: Sequence[str]) -> bool:
    """``--json`` among the options (before ``--``): known even when parsing fails."""
    for word in argv:
        if word == "--":
            return False
        if word == "--json":
            return True
    return False


class _ErrorPrinter:
    """Prints an error as ``<prog>: error: ...`` with a hint on stderr, or as one JSON object
    on stdout."""

    def __init__(self, prog: str, as_json: bool, flags: Mapping[str, str] | None = None) -> None:
        self.prog = prog
        self.as_json = as_json
        self.flags = flags or {}

    def __call__(self, message: str, hint: str | None, code: int, *,
                 usage: str | None = None, details: str | None = None,
                 fields: Mapping[str, Any] | None = None) -> int:
        from vramkit.cli._output import flag_text

        message = flag_text(message, self.flags)
        hint = flag_text(hint, self.flags) if hint else hint
        if details:
            sys.stderr.write(details)
        if self.as_json:
            with _quiet_broken_pipe():
                sys.stdout.flush()
                json.dump({"error": message, "hint": hint, **(fields or {})}, sys.stdout)
                sys.stdout.write("\n")
                sys.stdout.flush()
            return code
        if usage:
            sys.stderr.write(usage)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        if hint:
            print(f"  hint: {hint}", file=sys.stderr)
        return code


@contextlib.contextmanager
def _quiet_broken_pipe() -> Iterator[None]:
    """Swallow a ``BrokenPipeError`` (the reader of stdout went away: nothing to tell it)."""
    try:
        yield
    except BrokenPipeError:
        _silence_stdout()


def _silence_stdout() -> None:
    # Python flushes stdout again at exit; pointing it at /dev/null keeps that flush quiet.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def _os_error_text(err: OSError) -> tuple[str, str]:
    reason = err.strerror or str(err) or type(err).__name__
    where = " -> ".join(str(f) for f in (err.filename, err.filename2) if f is not None)
    message = f"{reason}: {where}" if where else reason
    hint = _ERRNO_HINTS.get(err.errno or -1, "Check the paths and the machine's resources, "
                                            "then run the command again.")
    return message, hint


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``vramkit`` command line ``argv`` (default ``sys.argv[1:]``); returns the exit
    code (see the module docstring)."""
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(_attach_negative_values(parser, words))
        if extras:
            # The top parser collects what no parser knew; the sub-command's own parser names it.
            _subparser(parser, getattr(args, _COMMAND_DEST, None)).error(
                "unrecognized arguments: " + " ".join(extras))
    except _ArgumentError as err:
        printer = _ErrorPrinter(err.prog, _json_requested(words))
        # An error about one flag's value ("argument --top: invalid int value: 'x'") names the
        # flag: one line and the hint. The usage is shown for a command line of the wrong shape
        # (unknown or missing arguments).
        usage = None if err.message.startswith("argument ") else err.usage
        return printer(err.message, f"Run `{err.prog} --help` to see the options.", EXIT_USAGE,
                       usage=usage)
    except SystemExit as stop:  # --help, --version
        return stop.code if isinstance(stop.code, int) else EXIT_OK

    verbose = bool(getattr(args, "verbose", False))
    if verbose:
        logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "global_json", False) and hasattr(args, "json"):
        args.json = True
    name = getattr(args, _COMMAND_DEST, None)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return EXIT_USAGE
    prog = _subparser(parser, name).prog
    as_json = bool(getattr(args, "json", False) or getattr(args, "global_json", False))
    fail = _ErrorPrinter(prog, as_json, getattr(args, "flag_names", None))
    return _run(args, fail, verbose)


def _run(args: argparse.Namespace, fail: _ErrorPrinter, verbose: bool) -> int:
    """Run the sub-command; an exception ends as one error (with its traceback under -v)."""
    try:
        with _quiet_broken_pipe():
            return int(args.func(args) or 0)
        return EXIT_FAILURE  # stdout's reader went away
    except KeyboardInterrupt as interrupt:
        error: BaseException = interrupt
        message, hint, code = ("interrupted", "The command was stopped (Ctrl-C); run it again "
                               "to finish.", EXIT_INTERRUPTED)
    except Exception as err:
        error = err
        message, hint, code = describe_error(err)
    details = "".join(traceback.format_exception(error)) if verbose else None
    return fail(message, hint, code, details=details, fields=error_fields(error))


def error_fields(err: BaseException) -> dict[str, Any]:
    """The figures an error carries, for ``--json`` beside its text: what a script needs as a
    number rather than read out of a sentence."""
    from vramkit.errors import PlanError

    if isinstance(err, PlanError) and err.minimum_budget is not None:
        return {"minimum_budget_bytes": int(err.minimum_budget)}
    return {}


def describe_error(err: Exception) -> tuple[str, str, int]:
    """``(message, hint, exit code)`` of an exception a sub-command raised.

    Usage errors (:class:`~vramkit.cli._output.FlagError`) exit 2; vramkit errors, ``OSError``,
    recognised CUDA errors and missing libraries exit 1; anything else is a bug in vramkit
    (exit 1, a hint on reporting it).
    """
    from vramkit.cli._output import FlagError

    if isinstance(err, FlagError):
        return err.message, err.hint, EXIT_USAGE
    if isinstance(err, VramkitError):
        return err.message, err.hint, EXIT_FAILURE
    if isinstance(err, OSError):
        return (*_os_error_text(err), EXIT_FAILURE)
    if isinstance(err, ModuleNotFoundError) and err.name and not err.name.startswith("vramkit"):
        package = err.name.split(".")[0]
        return (f"this command needs the Python package {package!r}, which is not installed",
                f"pip install {package}", EXIT_FAILURE)
    if isinstance(err, (MemoryError, RuntimeError)):
        # CUDA failures (out of memory, a bad launch, an illegal address) get a short
        # explanation and what to try; anything unrecognised is a vramkit bug.
        from vramkit.devices.cuda_errors import CudaErrorKind, explain_cuda_error

        explanation = explain_cuda_error(err)
        if explanation.kind is not CudaErrorKind.UNKNOWN:
            lines = str(err).strip().splitlines()
            return (lines[0] if lines else type(err).__name__), str(explanation), EXIT_FAILURE
    lines = str(err).strip().splitlines()
    message = f"internal error: {type(err).__name__}" + (f": {lines[0]}" if lines else "")
    return message, _BUG_HINT, EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
