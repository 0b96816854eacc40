"""Reference answers: thin modules with the exercises' function names, built from minizero's own
code. Graded with `pytest exercises --solutions` or `python -m minizero.grade --solutions`."""
