"""``python -m aftershock`` is the same as the ``aftershock`` command."""

from aftershock.harness.cli import main

main()
