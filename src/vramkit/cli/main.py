"""Entry point of the ``vramkit`` command: one sub-module per sub-command.

Each sub-command module defines ``register(subparsers)``, which adds its parser and sets
``func`` (called with the parsed arguments, returning the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from vramkit import __version__
from vramkit.errors import VramkitError

# Sub-command modules, in the order `vramkit --help` lists them.
_COMMAND_MODULES = ("info", "select", "profile", "inspect", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vramkit",
        description="Train and run models that are bigger than your GPU.",
    )
    parser.add_argument("--version", action="version", version=f"vramkit {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(f"vramkit.cli.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except VramkitError as err:
        print(f"vramkit {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except (MemoryError, RuntimeError) as err:
        # CUDA failures (out of memory, a bad launch, an illegal address) get a short
        # explanation and what to try; anything unrecognised propagates with its traceback.
        from vramkit.devices.cuda_errors import CudaErrorKind, explain_cuda_error

        explanation = explain_cuda_error(err)
        if explanation.kind is CudaErrorKind.UNKNOWN:
            raise
        print(f"vramkit {args.command}: error: {err}\n{explanation}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
