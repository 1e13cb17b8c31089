"""`python -m grader task=llama3-sft [candidate=PATH] [trusted=true]`: last line is `reward=<4 decimals>`."""
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from catalog.h5schema import ReferenceError
from catalog.scale import ensure_scale_checkpoints
from catalog.tasks import known_tasks
from grader.app import ROOT, GradeOptions, grade, print_checks, save_report
from grader.fresh import FreshUnavailable, fresh_pass
from grader.isolation.sandbox import SandboxUnavailable
from grader.timing.budget import BudgetPolicy

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")


@hydra.main(version_base=None, config_path=CONFIGS, config_name="grader")
def main(cfg: DictConfig) -> None:
    if "task_name" not in cfg:
        print(f"no task given: pass task=NAME; valid tasks: {', '.join(known_tasks())}", file=sys.stderr)
        sys.exit(2)
    candidate = Path(cfg.candidate).resolve() if cfg.candidate else ROOT
    if not candidate.is_dir():
        print(f"candidate {candidate} is not a directory", file=sys.stderr)
        sys.exit(2)
    ensure_scale_checkpoints(cfg)  # scale=small: its checkpoints, written on first use (configs/scale/)
    try:
        options = GradeOptions(budget=BudgetPolicy.from_cfg(cfg.budget), spec_timeout=cfg.timeouts.spec,
                               numeric_timeout=cfg.timeouts.numeric, check_timeout_s=cfg.timeouts.check,
                               trusted=bool(cfg.trusted), jax_platforms=str(cfg.jax_platforms))
        report = grade(cfg, candidate, ROOT / cfg.references, ROOT / cfg.report_dir, options)
        if cfg.get("fresh") is not None:
            report["fresh"] = fresh_pass(cfg, candidate, int(cfg.fresh), options)
            save_report(report, ROOT / cfg.report_dir)
    except ReferenceError as e:
        print(f"cannot grade {cfg.task_name}: {e}", file=sys.stderr)
        sys.exit(1)
    except FreshUnavailable as e:
        print(f"cannot run the fresh pass of {cfg.task_name}: {e}", file=sys.stderr)
        sys.exit(1)
    except SandboxUnavailable as e:
        print(f"refusing to grade {cfg.task_name}: no sandbox can be made here: {e}", file=sys.stderr)
        sys.exit(2)
    fresh = report.get("fresh")
    if fresh is not None:
        print_checks(f"{cfg.task_name}, fresh inputs (seed {fresh['seed']}, levels {fresh['levels'][0]}-"
                     f"{fresh['levels'][-1]})", fresh["checks"])
        print(f"fresh_seed={fresh['seed']} fresh_strict_level="
              f"{'L' + str(fresh['earned_levels']) if fresh['earned_levels'] >= 0 else 'none'} "
              f"fresh_reward={fresh['reward']:.4f}")
    print(f"strict_level=L{report['earned_levels']} mean_digits={report['mean_digits']:.2f}"
          if report["earned_levels"] >= 0 and report["mean_digits"] is not None
          else f"strict_level=none mean_digits={report['mean_digits']}")
    print(f"reward={report['reward']:.4f}")


if __name__ == "__main__":
    main()
