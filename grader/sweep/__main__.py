"""`python -m grader.sweep ...` (grader/sweep/cli.py; the package docstring says what it does)."""
from grader.sweep.cli import main

if __name__ == "__main__":
    # main is cli.main, so the multirun's workers find hydra_job (and the defect group) in grader.sweep.cli
    main()
