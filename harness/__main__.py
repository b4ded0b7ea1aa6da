"""``python -m harness`` is the same as ``aftershock``."""

from harness.cli import main

main()
