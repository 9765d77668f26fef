"""``python -m kvtier``: the ``kvtier`` command, for environments without its script."""

from kvtier.cli.app import main

main()
