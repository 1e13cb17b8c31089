"""The grader: similarity measures, level lattice, spec-gated reward and the independence gate.

Kept import-free on purpose: the sandboxed candidate process puts a copy of this package on its
path, and importing it must not pull in anything heavy.
"""
