"""Scoring: the continuous measures (measures.py), the L0-L6 lattice and its strict bars (lattice.py), the
spec-gated reward (reward.py), and the report a grading writes (report.py). Pure functions of recorded and
produced arrays: nothing here runs a candidate."""
