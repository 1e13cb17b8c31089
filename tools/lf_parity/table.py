"""The parity tables (docs/LF_PARITY.md) from the per-task records of parity.task_parity.

Two tables: parity (LF with the project's documented choices aligned, every cell judged at 1e-5) and effects (LF as
it is, one default at a time: measured, not judged). A cell is the max abs difference over everything it merges.
"""

from __future__ import annotations

from pathlib import Path

from tools.lf_parity.compare import TOLERANCE, merge, within

PARITY = (("tokens", ("tokens",)), ("template", ("template",)), ("step losses", ("losses",)), ("final adapter", ("adapter",)),
          ("eval", ("eval",)), ("metrics", ("metrics",)), ("PPOConfig", ("config",)),
          ("train_on_prompt run", ("train_on_prompt.losses", "train_on_prompt.adapter", "train_on_prompt.eval")),
          ("source vs reference", ("reference",)))
EFFECTS = ("sdpa", "autocast", "clip_once", "no_decay_wd", "last_step_sync")


def failing_cells(record: dict) -> list[str]:
    """Cells off by more than TOLERANCE, or not compared without a documented reason."""
    bad = []
    for name, cell in record["cells"].items():
        if name == "tokens":
            if cell.get("error"):
                bad.append(name)
        elif name == "reference":
            continue  # the stale check owns it; shown, not judged (a reference may be absent)
        elif not cell.get("reason") and not within(cell):
            bad.append(name)
    return bad


class _Notes:
    def __init__(self):
        self.reasons: list[str] = []

    def mark(self, reason: str) -> str:
        if reason not in self.reasons:
            self.reasons.append(reason)
        return f"[{self.reasons.index(reason) + 1}]"


def _parity_cell(record: dict, names: tuple[str, ...], notes: _Notes) -> str:
    cells = [record["cells"][n] for n in names if n in record["cells"]]
    if not cells:
        return "-"
    if names == ("tokens",):
        cell = cells[0]
        if cell.get("error"):
            return "**differs**: " + cell["error"].replace("|", "/")[:200]
        refused = f", {', '.join(cell['refused'])} refused by both" if cell.get("refused") else ""
        return f"identical ({cell['rows']} rows{refused})"
    reasons = [c["reason"] for c in cells if c.get("reason")]
    if reasons and len(reasons) == len(cells):
        return "n/a " + notes.mark(reasons[0])
    cell = merge(cells)
    if cell.get("error"):
        return "**differs**: " + cell["error"].replace("|", "/")[:200]
    value = cell["max_abs"]
    if value is None:
        return "-"
    judged = names != ("reference",)
    text = "0" if value == 0 else f"{value:.1e}"
    return text + (" **> 1e-5**" if judged and not within(cell, TOLERANCE) else "")


def _effect_cell(record: dict, effect: str, notes: _Notes) -> str:
    cells = [c for n, c in record["cells"].items() if n.startswith(effect + ".")]
    if not cells:
        return "-"
    cell = merge(cells)
    mark = notes.mark(cells[0]["reason"]) if cells[0].get("reason") else ""
    if cell.get("error"):
        return "**failed** " + mark
    return (f"{cell['max_abs']:.1e} " if cell["max_abs"] is not None else "- ") + mark


def render(records: list[dict]) -> str:
    notes = _Notes()
    rows = ["| task | " + " | ".join(h for h, _ in PARITY) + " |", "|---" * (len(PARITY) + 1) + "|"]
    for record in records:
        if "run" in record["cells"]:
            rows.append(f"| {record['task']} | **the run failed**: "
                        + record["cells"]["run"]["error"].splitlines()[0][:200] + " |" + " |" * (len(PARITY) - 1))
            continue
        rows.append(f"| {record['task']} | " + " | ".join(_parity_cell(record, names, notes) for _, names in PARITY)
                    + " |")
    effects = ["| task | " + " | ".join(EFFECTS) + " |", "|---" * (len(EFFECTS) + 1) + "|"]
    for record in records:
        if any(n.split(".")[0] in EFFECTS for n in record["cells"]):
            effects.append(f"| {record['task']} | " + " | ".join(_effect_cell(record, e, notes) for e in EFFECTS)
                           + " |")
    return "\n".join(["Parity (LF with the project's documented choices aligned): each cell the max abs difference, "
                      "judged at 1e-5 absolute up to magnitude 1 and relative beyond (a judged failure reads "
                      "**> 1e-5**):", "", *rows, "",
                      "Effects of LF's own defaults where the project departs from them (max abs over the "
                      "run's compared cells; measured, not judged):", "", *effects, "",
                      *[f"[{i}] {reason}  " for i, reason in enumerate(notes.reasons, 1)]])


def write_table(records: list[dict], path: Path) -> None:
    """Replace the block between the parity-table markers of path (appended when absent)."""
    text = path.read_text() if path.exists() else ""
    begin, end = "<!-- parity-table:begin -->", "<!-- parity-table:end -->"
    block = f"{begin}\n{render(records)}\n{end}"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = (text + "\n" if text else "") + block + "\n"
    path.write_text(text)
