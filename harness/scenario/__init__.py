"""Scenarios: the typed scenario format and its loader, its building blocks, durations, presets
and the search space."""
