"""Reference systems under test for Aftershock: a fault-tolerant trainer (and later a server).

They are ordinary users of the harness: they report through ``aftershock.harness.probe`` and can be
replaced by a user's own code. Importing this package is cheap; torch is imported only by
the submodules (``aftershock.reference_impl.model``, ``aftershock.reference_impl.checkpoint``,
``aftershock.reference_impl.trainer``).
"""
