"""What torchrun runs in each rank it forks from the warm launcher
(``aftershock.reference_impl.launch``, ``--run-path``): the reference trainer, with what a
forked rank must do first and last (``aftershock.reference_impl._forked``)."""

import os
import sys

from aftershock.reference_impl import _forked, trainer

_forked.begin([sys.executable, "-u", "-m", "aftershock.reference_impl.trainer", *sys.argv[1:]])
try:
    code = trainer.main(sys.argv[1:])
except _forked.Exit as done:
    code = done.code
if code:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
# 0: return through torchrun's worker, which reports it and exits without shutdown.
