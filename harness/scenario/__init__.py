"""Scenarios: the typed scenario format, its building blocks, durations, presets and the search
space."""
