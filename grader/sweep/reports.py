"""A task's sweep as reports/sweep/<task>.json and .md."""
from __future__ import annotations

import json
from pathlib import Path

from grader.sweep.defects import LEVELS
from grader.sweep.mutant import _check_order


# ---- reports -------------------------------------------------------------------------------------

def write_reports(result: dict, out_dir: Path, rationale: dict[str, str] | None = None) -> tuple[Path, Path]:
    """reports/sweep/<task>.json and .md from a sweep_task result."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    task, rationale = result["task"], rationale or {}
    untripped = {k: rationale.get(k, "(no rationale in grader/sweep/defects/common.yaml)")
                 for k, c in result["checks"].items() if not c["tripped_by"]}
    result = {**result, "untripped": untripped}
    js = out_dir / f"{task}.json"
    js.write_text(json.dumps(result, indent=2, default=float))
    md = out_dir / f"{task}.md"
    md.write_text(_markdown(result))
    return js, md


def _fmt_checks(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", +{len(keys) - limit} more" if len(keys) > limit else "")


def _markdown(r: dict) -> str:
    t = r["totals"]
    lines = [
        f"# Seeded-defect sweep: {r['task']} ({r['task_class']})", "",
        f"Clean oracle reward {r['clean_reward']:.6f} (earned L{r['clean_earned_levels']}). "
        f"**{t['defects_caught']}/{t['defects']} defects caught, {t['strict_caught']}/{t['defects']} strictly "
        f"(each costs a level), {t['checks_tripped']}/{t['checks']} checks tripped** "
        f"({r['seconds'] / 60:.1f} min).", "",
        "A check is tripped when its score falls below the clean oracle's by more than its run-to-run noise "
        f"(measured: the larger of {r['default_noise']:g} and the score gap between two clean gradings, or the "
        "reference's `noise` attribute where one was recorded). A defect is caught when it trips a check, and "
        "strictly caught when a check the clean oracle passes strictly falls below its strict bar. Catalog: "
        "`grader/sweep/defects/common.yaml`." + ("" if r["levels"] == list(LEVELS) else f" Levels graded: {', '.join(r['levels'])}."),
    ]
    if r.get("impact", "off") != "off" and "groups_graded" in t:
        lines += ["", f"Impact analysis (`grader/sweep/impact.py`, {r['impact']} level): {t['groups_graded']} of "
                      f"{t['groups_total']} level-group gradings ran; a group whose clean child never executes a "
                      "defect's edit keeps the clean scores (the independence gate runs for every mutant)."]
    lines += [
        "", "## Defects", "",
        "| defect | reward | drop | caught | strict (level) | levels tripped | checks tripped | expected level missed "
        "| graded at | bug |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in r["defects"]:
        gated = " (gated)" if d["gated"] else ""
        graded = ",".join(d["graded_groups"]) or "gate only" if "graded_groups" in d else "all"
        lines.append(f"| `{d['id']}` | {d['reward']:.6f} | {d['reward_drop']:.2e} | "
                     f"{'yes' if d['caught'] else '**NO**'}{gated} | "
                     f"{'yes' if d.get('strict_caught') else '**NO**'} (L{d.get('earned_levels', '?')}) | "
                     f"{','.join(d['levels_tripped']) or '-'} | "
                     f"{_fmt_checks(d['tripped'])} | {','.join(d['expected_levels_missed']) or '-'} | {graded} | "
                     f"{d['description']} |")
    unexecuted = [d for d in r["defects"] if d.get("not_executed")]
    if unexecuted:
        lines += ["", "## Defects whose edit no level group executes (not caught)", ""]
        lines += [f"- `{d['id']}`: {d['not_executed']}" for d in unexecuted]
    lines += ["", "## Checks", "", "| check | clean score | noise | tripped by |", "|---|---|---|---|"]
    for key in sorted(r["checks"], key=_check_order(r["task_class"])):
        c = r["checks"][key]
        by = c["tripped_by"]
        note = f" ({c['clean_reason']})" if c.get("clean_reason") else ""
        lines.append(f"| `{key}` | {c['clean_score']:.9f}{note} | {c['noise']:g} | "
                     f"{f'{len(by)}: ' + ', '.join(by) if by else '**none**'} |")
    if r["untripped"]:
        lines += ["", "## Checks no defect tripped", ""]
        lines += [f"- `{k}`: {why}" for k, why in r["untripped"].items()]
    return "\n".join(lines) + "\n"
