"""Fold kernels: element types, reductions and their codes (reduction.py, in numpy, and the
one code table; _fold.h holds the same arithmetic in C for the C helpers in samehost/ and
transport/, its codes copied from that table and checked against it by
tests/test_fold_codes.py), and the records of one fold step (fold.py)."""
