"""Fold kernels: element types, reductions and their codes (reduction.py, in numpy; _fold.h
holds the same arithmetic in C for the native helpers, its codes checked against these by
tests/test_packaging.py), and the records of one fold step (fold.py)."""
