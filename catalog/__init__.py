"""What both apps stand on: the check catalog, the HDF5 schema, layouts, workloads, traces, the held-out scorers,
task composition and provenance. The recorder (torch side) and the grader (torch-free) import this package and
never each other; a sandboxed child gets a copy of it beside the grader's. Torch-free, and it imports neither app
(pyproject.toml's import-linter contracts)."""
