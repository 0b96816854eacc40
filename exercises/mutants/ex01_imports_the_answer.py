"""Mutant: borrows minizero's own ring all-reduce instead of building it."""

from minizero.ring import ring_all_reduce  # noqa: F401
