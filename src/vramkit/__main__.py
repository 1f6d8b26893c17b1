"""``python -m vramkit`` runs the CLI."""

from vramkit.cli.main import main

raise SystemExit(main())
