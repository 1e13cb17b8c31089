"""Timing: the L5/L6 budgets relative to the grading machine (budget.py, budgets.yaml), the speed probe
(speed.py), the calibration that measures the oracle (calibrate.py), and verdict stability under load
(stability.py)."""
