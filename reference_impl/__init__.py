"""Reference systems under test for Aftershock: a fault-tolerant trainer (and later a server).

They are ordinary users of the harness: they report through ``harness.probe`` and can be
replaced by a user's own code. Importing this package is cheap; torch is imported only by
the submodules (``reference_impl.model``, ``reference_impl.checkpoint``,
``reference_impl.trainer``).
"""
