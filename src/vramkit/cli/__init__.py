"""The ``vramkit`` command line."""
