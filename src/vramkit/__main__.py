"""``python -m vramkit`` runs the CLI (the same as the ``vramkit`` command)."""

from vramkit.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
