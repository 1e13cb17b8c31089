"""What the twin checks: a property is one matched probe, run on the torch source (trusted process) and on the
candidate (sealed child), its outputs compared tensor by tensor in the order the probe returns them.

Standard library only: the sealed child imports this module from its copy of the twin.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CONVERSION_RULES", "LEVELS", "Property", "ESTABLISHED", "VIOLATED", "NOT_ESTABLISHED"]

LEVELS = ("L0", "L1", "L2", "L3", "L4", "L5")
ESTABLISHED, VIOLATED, NOT_ESTABLISHED = "established", "violated", "not established"
# the rules every family's converter table runs on (conversion/<family>.py is a table of them): a layout property
# points at both
CONVERSION_RULES = "conversion/rules.py"


@dataclass(frozen=True)
class Property:
    """One matched probe. `key` is "<level>/<name>" (L0 spec, L1 operators, L2 one layer, L3 the whole forward,
    L4 loss and gradients / a decode step, L5 one optimizer step / one engine step). `modules` are the candidate
    files the probe exercises first-hand (relative to the candidate root), so a violation points at them.
    `rtol`: a float tensor agrees when max|candidate - torch| <= rtol * max(max|torch|, 1); integer, bool and
    string tensors must be equal. `what`: one line, for the table."""
    key: str
    what: str
    modules: tuple[str, ...]
    rtol: float = 1e-4

    @property
    def level(self) -> str:
        return self.key.split("/", 1)[0]

    @property
    def name(self) -> str:
        return self.key.split("/", 1)[1]
