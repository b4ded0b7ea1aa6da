"""Deliberately broken: one function with 16 ways through it (cyclomatic complexity 16),
one past the limit. tests/test_complexity.py shows its check names it."""

from __future__ import annotations


def tangled(a: int) -> str:
    if a == 1:
        return "one"
    if a == 2:
        return "two"
    if a == 3:
        return "three"
    if a == 4:
        return "four"
    if a == 5:
        return "five"
    if a == 6:
        return "six"
    if a == 7:
        return "seven"
    if a == 8:
        return "eight"
    if a == 9:
        return "nine"
    if a == 10:
        return "ten"
    if a == 11:
        return "eleven"
    if a == 12:
        return "twelve"
    if a == 13:
        return "thirteen"
    if a == 14:
        return "fourteen"
    if a == 15:
        return "fifteen"
    return "many"


def plain(a: int) -> str:
    return "one" if a == 1 else "other"
