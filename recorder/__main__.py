"""`python -m recorder task=llama3-sft [device=cuda]`; `python -m recorder stale=true`."""
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from recorder.app import run

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")


@hydra.main(version_base=None, config_path=CONFIGS, config_name="recorder")
def main(cfg: DictConfig) -> None:
    code = run(cfg)
    if code:  # a failed job fails the command; success returns normally so multirun workers go on
        sys.exit(code)


if __name__ == "__main__":
    main()
