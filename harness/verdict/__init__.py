"""Verdicts: the check registry, the checks, the metrics, re-checking a recorded run."""
