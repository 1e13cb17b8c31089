"""Isolation: what stands between a candidate and the grader. The file inspection (contents.py), the import scan
and the child runner (gate.py), the bubblewrap sandbox (sandbox.py), the in-child guard (_guard.py), the one file
a child writes back (exchange.py), the grader's clock and caps (clock.py), the fork server for the sweep's own
mutants (forkserver.py), and the split of checks whose inputs would hand a sibling its answers (answers.py)."""
