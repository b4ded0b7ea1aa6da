"""Deliberately broken: a package whose modules import each other at import (a → b → a),
as harness/run/runner.py, baseline.py and golden.py did. tests/test_layering.py shows its cycle
check names the cycle; the import inside c's function is no edge, nor is one under
``if TYPE_CHECKING:``."""
