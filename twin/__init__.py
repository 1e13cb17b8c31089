"""The live twin harness: the task's torch source as an executable specification, run beside a JAX candidate on
fresh inputs through matched probes (`python -m twin task=T candidate=PATH seed=N`). The trusted side
(twin/torch_side/, twin/harness.py) imports the torch sources; the candidate side (twin/candidate_side/,
twin/child.py) runs sealed and torch-free. Neither reads references/, reports/, the check catalog or the grader's
probes (tests/twin/test_boundary.py)."""
