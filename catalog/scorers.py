"""The L6 held-out scorers: per check key, what the grader computes from the child's logits (catalog/heldout.py for
the SFT loss and the DPO preference metrics, catalog/ppo_eval.py for the PPO reward of the child's samples)."""
from __future__ import annotations

from pathlib import Path

from catalog import heldout
from catalog.ppo_eval import RewardModel, heldout_reward

ROOT = Path(__file__).resolve().parents[1]


def _heldout_loss_values(recorded: dict, produced: dict) -> tuple[dict[str, float], list[tuple[int, ...]]]:
    loss, shapes = heldout.heldout_loss(recorded, produced)
    return {"loss": loss}, shapes


def _heldout_reward_values(recorded: dict, produced: dict) -> tuple[dict[str, float], list[tuple[int, ...]]]:
    # the reward checkpoint is the grader's own asset (assets/, named by the reference)
    return heldout_reward(recorded, produced, RewardModel(ROOT / str(recorded["gen.reward_model"])))


# L6 check key -> what the grader computes from the child's logits: ({metric: value}, logits shapes). Each
# metric is banded by the check's recorded `band_<metric>` attribute (the reference's /L6/band for "loss").
SCORERS = {heldout.HELDOUT_KEY: _heldout_loss_values, heldout.PREFERENCE_KEY: heldout.heldout_preference,
           heldout.REWARD_KEY: _heldout_reward_values}
