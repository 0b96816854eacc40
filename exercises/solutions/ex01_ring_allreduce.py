"""Exercise 1, answer: minizero's own ring all-reduce (read it in minizero/comm.py)."""

from minizero.comm import ring_all_reduce

__all__ = ["ring_all_reduce"]
