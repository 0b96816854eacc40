"""Plausible wrong answers that the graders must reject: tests/test_grading.py runs each grader on
them. Each one imports the correct answer and breaks one thing, named in its docstring. (Solve
first, then read.)"""
