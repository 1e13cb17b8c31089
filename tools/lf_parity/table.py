"""The parity tables (docs/LF_PARITY.md) from the per-task records of parity.task_parity.

Two tables: parity (LF with the project's documented choices aligned, every cell judged at 1e-5) and effects (LF as
it is, one default at a time: measured, not judged). A cell is the max abs difference over everything it merges.
"""

from __future__ import annotations

import re
from pathlib import Path

from tools.lf_parity.compare import TOLERANCE, merge, within

PARITY = (("tokens", ("tokens",)), ("template", ("template",)), ("collated batches", ("batches",)),
          ("step losses", ("losses",)), ("final adapter", ("adapter",)),
          ("eval", ("eval",)), ("metrics", ("metrics",)), ("PPOConfig", ("config",)),
          ("train_on_prompt run", ("train_on_prompt.losses", "train_on_prompt.adapter", "train_on_prompt.eval")),
          ("hf_loss_kwargs run", tuple(f"hf_loss_kwargs.{v}{c}" for v in ("", "train_on_prompt.")
                                       for c in ("losses", "adapter", "eval", "batches"))),
          ("source vs reference", ("reference",)))
EFFECTS = ("sdpa", "autocast", "clip_once", "no_decay_wd", "last_step_sync", "pillow")


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
    tolerance = cells[0].get("tolerance", TOLERANCE) if len(cells) == 1 else TOLERANCE
    cell = merge(cells)
    findings = "".join(notes.mark(f) for f in dict.fromkeys(c["finding"] for c in cells if c.get("finding")))
    if cell.get("error"):
        return "**differs**: " + cell["error"].replace("|", "/")[:200] + (" " + findings if findings else "")
    value = cell["max_abs"]
    if value is None:
        return "-"
    judged = names != ("reference",)
    text = "0" if value == 0 else f"{value:.1e}"
    if cells[0].get("batches") is not None and len(cells) == 1:
        text += f" ({cells[0]['batches']} batches)"
    text += f" **> {f'{tolerance:g}'.replace('e-0', 'e-')}**" if judged and not within(cell, tolerance) else ""
    return text + (" " + findings if findings else "")


def _effect_cell(record: dict, effect: str, notes: _Notes) -> str:
    # an effect run's collated batches are LF's collator's whatever the effect (judged in the parity table's
    # "collated batches"; e.g. Qwen2.5-Omni's audio padding): the effect is what its run moves besides them
    cells = [c for n, c in record["cells"].items() if n.startswith(effect + ".") and not n.endswith(".batches")]
    if not cells:
        return "-"
    cell = merge(cells)
    mark = notes.mark(cells[0]["reason"]) if cells[0].get("reason") else ""
    if cell.get("error"):
        return "**failed** " + mark
    return (f"{cell['max_abs']:.1e} " if cell["max_abs"] is not None else "- ") + mark


_MARK = re.compile(r"\[(\d+)\]")
BEGIN, END = "<!-- parity-table:begin -->", "<!-- parity-table:end -->"


def _table_rows(lines: list[str]) -> tuple[list[str], list[list[str]]]:
    """A markdown table's header cells and its rows' cells (the separator dropped)."""
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    return cells[0], [row for row in cells[2:]]


def carried_rows(block: str) -> dict[str, dict]:
    """The rows of a table block render() wrote, by task: {task: {"parity": {header: cell}, "effects": {effect:
    cell}}}, each cell's note marks [k] replaced by the note's text (`[[text]]`), so that a task the run did not
    redo keeps its row under the new numbering (and a column added since reads "-")."""
    lines = block.splitlines()
    notes = {}
    for line in lines:
        m = re.match(r"^\[(\d+)\] (.*?)\s*$", line)
        if m:
            notes[m.group(1)] = m.group(2)
    tables, current = [], []
    for line in lines + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    out: dict[str, dict] = {}
    for kind, table in zip(("parity", "effects"), tables):
        header, rows = _table_rows(table)
        for row in rows:
            cells = {h: _MARK.sub(lambda m: f"[[{notes.get(m.group(1), m.group(0))}]]", c)
                     for h, c in zip(header[1:], row[1:])}
            out.setdefault(row[0], {})[kind] = cells
    return out


def _carried_cell(text: str, notes: _Notes) -> str:
    return re.sub(r"\[\[(.*?)\]\]", lambda m: notes.mark(m.group(1)), text)


def render(records: list[dict], carried: dict[str, dict] | None = None) -> str:
    """The two tables of records, with carried rows (carried_rows of the previous block) for tasks that have no
    record; rows sorted by task."""
    notes = _Notes()
    carried = {t: v for t, v in (carried or {}).items() if t not in {r["task"] for r in records}}
    tasks = sorted([*(r["task"] for r in records), *carried])
    by_task = {r["task"]: r for r in records}
    rows = ["| task | " + " | ".join(h for h, _ in PARITY) + " |", "|---" * (len(PARITY) + 1) + "|"]
    for task in tasks:
        if task in carried:
            if "parity" in carried[task]:
                old = carried[task]["parity"]
                rows.append(f"| {task} | " + " | ".join(_carried_cell(old.get(h, "-"), notes) for h, _ in PARITY)
                            + " |")
            continue
        record = by_task[task]
        if "run" in record["cells"]:
            rows.append(f"| {record['task']} | **the run failed**: "
                        + record["cells"]["run"]["error"].splitlines()[0][:200] + " |" + " |" * (len(PARITY) - 1))
            continue
        rows.append(f"| {record['task']} | " + " | ".join(_parity_cell(record, names, notes) for _, names in PARITY)
                    + " |")
    effects = ["| task | " + " | ".join(EFFECTS) + " |", "|---" * (len(EFFECTS) + 1) + "|"]
    for task in tasks:
        if task in carried:
            if "effects" in carried[task]:
                old = carried[task]["effects"]
                effects.append(f"| {task} | " + " | ".join(_carried_cell(old.get(e, "-"), notes) for e in EFFECTS)
                               + " |")
            continue
        record = by_task[task]
        if any(n.split(".")[0] in EFFECTS for n in record["cells"]):
            effects.append(f"| {record['task']} | " + " | ".join(_effect_cell(record, e, notes) for e in EFFECTS)
                           + " |")
    return "\n".join(["Parity (LF with the project's documented choices aligned): each cell the max abs difference, "
                      "judged at 1e-5 absolute up to magnitude 1 and relative beyond (collated batches: every "
                      "integer tensor exact, pixel values at 1e-6; a judged failure reads **> 1e-5**):", "", *rows,
                      "",
                      "Effects of LF's own defaults where the project departs from them (max abs over the "
                      "run's compared cells; measured, not judged):", "", *effects, "",
                      *[f"[{i}] {reason}  " for i, reason in enumerate(notes.reasons, 1)]])


def write_table(records: list[dict], path: Path) -> None:
    """Replace the block between the parity-table markers of path (appended when absent). A task with no record
    keeps the row the block had (carried_rows): a run of some tasks updates their rows and loses no other."""
    text = path.read_text() if path.exists() else ""
    carried = {}
    if BEGIN in text and END in text:
        carried = carried_rows(text[text.index(BEGIN) + len(BEGIN):text.index(END)])
    block = f"{BEGIN}\n{render(records, carried)}\n{END}"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = (text + "\n" if text else "") + block + "\n"
    path.write_text(text)
