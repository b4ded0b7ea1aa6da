"""Aftershock's recovery benchmark: our strategies against plain DDP, torchrun and torchft.

Run it with ``python -m bench`` (or ``make bench``); see ``bench/README.md``.
"""
