"""Turn grading reports (grader.app.grade's dicts) into a summary a person reads.

`write_report(reports, out_dir)` writes into out_dir:
  summary.md     one row per task (reward, earned levels, mean score of each level L0..L6), then a
                 per-task section with every check, its 1 - score and the reason for any score below 1
  summary.html   the same on one self-contained page (inline CSS, PNGs embedded as data URIs),
                 cells coloured green >= 0.999, amber >= 0.99, red below
  summary.json   the rows, the mean reward and the full reports
  levels.png     mean score per level across tasks (levels x tasks)
  loss_<task>.png  for a task with a training loss trajectory: torch reference vs candidate, and
                 |candidate - reference| on a log scale (the curves themselves overlap to the eye)

An error row is a dict with "task" and "error" (grading raised; see grader.grade_all): it counts
as reward 0 in the mean, so a crash never flatters the summary.

Scores are shown truncated, never rounded: 0.98999 reads 0.989990, not 0.990000, so a number on
the page never looks like it clears a bar that its colour says it misses.

`python -m grader.scoring.report DIR` re-renders DIR's summary from the <task>.json files in it, without
grading again.
"""
from __future__ import annotations

import base64
import html
import json
import math
import sys
from pathlib import Path

from grader.scoring.lattice import LEVELS

__all__ = ["AMBER", "GREEN", "LOSS_SERIES", "markdown_table", "mean_reward", "score_class",
           "summary_rows", "write_report"]

# Colour bars: green >= GREEN (the strict bar without measured noise), amber >= AMBER, red below. A check's
# own strict verdict uses its bar (grader.scoring.lattice.strict_bar), shown beside its score.
GREEN, AMBER = 0.999, 0.99
LOSS_SERIES = {  # series key -> plot panel title
    "L5/e2e_step_losses/step_losses": "L5 end-to-end SFT: loss per step",
    "L4/fixed_steps_loss/losses": "L4 fixed steps: loss per step",
    "L5/dpo_e2e_step_losses/step_losses": "L5 end-to-end DPO: loss per step",
    "L4/dpo_fixed_steps_loss/losses": "L4 fixed DPO steps: loss per step",
}


# ---------------------------------------------------------------- numbers


def score_class(score: float | None) -> str:
    """CSS class of a score: green, amber, red, or na when there is none."""
    if score is None or (isinstance(score, float) and math.isnan(score)):
        return "na"
    return "green" if score >= GREEN else "amber" if score >= AMBER else "red"


def _fmt(score: float | None, places: int = 6) -> str:
    if score is None:
        return "-"
    return f"{math.floor(score * 10**places) / 10**places:.{places}f}"  # truncated: see module doc


def _deficit(score: float) -> str:
    return "0" if score >= 1.0 else f"{1.0 - score:.1e}"


def _seconds(wall_s: float | None) -> str:
    return "-" if wall_s is None else f"{wall_s:.0f}"


def _earned(levels: int | None) -> str:
    return "none" if levels is None or levels < 0 else f"L0..L{levels}"


def _figure(c: dict, key: str) -> str:
    x = c.get(key)
    return "-" if x is None else f"{x:.1f}" if key.endswith("digits") else f"{x:.2e}"


def _bar(c: dict) -> float:
    return float(c.get("bar") or (1.0 if c.get("aspect") == "spec" else GREEN))


def mean_reward(reports: list[dict]) -> float:
    """Plain mean reward over tasks; an error row counts as 0."""
    return sum(float(r.get("reward") or 0.0) for r in reports) / len(reports) if reports else 0.0


def summary_rows(reports: list[dict]) -> list[dict]:
    """One flat row per task: what the summary table shows."""
    rows = []
    for r in reports:
        checks = r.get("checks") or []
        by_level: dict[str, list[float]] = {}
        for c in checks:
            by_level.setdefault(c["level"], []).append(float(c["score"]))
        notes = []
        if r.get("error"):
            notes.append("error: " + r["error"].strip().splitlines()[-1][:160])
        if r.get("gated"):
            notes.append("gated: " + r["gated"][:160])
        if r.get("stale_reference"):
            notes.append("stale reference")
        if p := r.get("reference_pressure"):
            notes.append(f"pressure run: {p['num_preemptions']} preemptions, {p['num_evictions']} evictions")
        failing = [f"{c['level']}/{c['name']}" for c in checks if c["score"] < _bar(c)]  # strict verdicts
        rows.append({
            "task": r["task"],
            "error": r.get("error"),
            "reward": None if r.get("error") else float(r.get("reward", 0.0)),
            "earned_levels": None if r.get("error") else int(r.get("earned_levels", -1)),
            "levels": {lv: (sum(s) / len(s) if (s := by_level.get(lv)) else None) for lv in LEVELS},
            "checks": len(checks),
            "mean_digits": r.get("mean_digits"),
            "failing": failing,
            "wall_s": r.get("wall_s"),
            "timed": _slowest_timed(r),
            "notes": notes,
        })
    return rows


def _slowest_timed(report: dict) -> dict | None:
    """The timed level (L5, L6) whose child came closest to its budget, on the grader's clock."""
    levels = [(lv, b) for lv, b in (report.get("budgets") or {}).items()
              if b.get("used_cpu_s") is not None and b.get("budget_cpu_s")]
    if not levels:
        return None
    lv, b = max(levels, key=lambda x: x[1]["used_cpu_s"] / x[1]["budget_cpu_s"])
    return {"level": lv, "used_cpu_s": b["used_cpu_s"], "budget_cpu_s": b["budget_cpu_s"],
            "fraction": b["used_cpu_s"] / b["budget_cpu_s"]}


def _timed_cell(t: dict | None) -> str:
    return "" if not t else f"{t['level']} {t['used_cpu_s']:.1f}/{t['budget_cpu_s']:.1f} ({t['fraction']:.2f})"


# ---------------------------------------------------------------- markdown

READING = ("1 - score says how far below 1 each score is; the reason is the grader's own (a crash, timeout, "
           "missing output, NaN or spec mismatch), so a score below 1 with no reason is plain numeric distance.")


def _md_cell(score: float | None) -> str:
    cls = score_class(score)  # markdown has no colour: red is bold, amber italic
    return f"**{_fmt(score)}**" if cls == "red" else f"_{_fmt(score)}_" if cls == "amber" else _fmt(score)


def markdown_table(rows: list[dict]) -> str:
    head = ["task", "reward", "strict", "digits", *LEVELS, "failing", "seconds", "slowest timed CPU-s/budget", "notes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for row in rows:
        cells = [row["task"], "ERROR" if row["error"] else _md_cell(row["reward"]), _earned(row["earned_levels"]),
                 _figure(row, "mean_digits"),
                 *(_md_cell(row["levels"][lv]) for lv in LEVELS), str(len(row["failing"])),
                 _seconds(row["wall_s"]), _timed_cell(row.get("timed")),
                 "; ".join(row["notes"]).replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _markdown(reports, rows, plots) -> str:
    out = ["# Grading summary", "",
           f"mean reward **{mean_reward(reports):.4f}** over {len(reports)} tasks "
           f"(an error counts as 0). Scores truncated to 6 places; **bold** < {AMBER} (red), "
           f"_italic_ < {GREEN} (amber). A level column is the plain mean of its checks.", "",
           markdown_table(rows), "", f"![per-level scores]({plots['levels']})", "", "## Checks per task", "", READING]
    for r, row in zip(reports, rows):
        out += ["", f"### {row['task']}", ""]
        if row["error"]:
            out += ["Grading raised:", "", "```", (r.get("traceback") or r["error"]).rstrip(), "```"]
            continue
        out.append(f"reward {_fmt(row['reward'])}, strict lattice {_earned(row['earned_levels'])}, "
                   f"mean digits {_figure(row, 'mean_digits')}, "
                   f"candidate `{r.get('candidate', '?')}`" + (f"; {'; '.join(row['notes'])}" if row["notes"] else ""))
        if row["task"] in plots:
            out += ["", f"![{row['task']} losses]({plots[row['task']]})"]
        out += ["", "| level | check | measure | score | bar | pass | max abs diff | rel L2 | digits | seconds | "
                "reason |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in r.get("checks") or []:
            reason = (c.get("reason") or "").replace("|", "/")
            out.append(f"| {c['level']} | {c['name']} | {c['measure']} | {_md_cell(c['score'])} | {_bar(c):.4f} | "
                       f"{'yes' if c['score'] >= _bar(c) else '**no**'} | {_figure(c, 'max_abs_diff')} | "
                       f"{_figure(c, 'rel_l2')} | {_figure(c, 'digits')} | {c.get('seconds', 0.0):.2f} | {reason} |")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- html

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; }
td.num { font-family: ui-monospace, monospace; text-align: right; }
th { background: #f0f0f0; }
.green { background: #c8ecc8; } .amber { background: #ffe0a0; } .red { background: #f6b4b4; }
.na { background: #eee; color: #888; } .error { background: #f6b4b4; font-weight: bold; }
details { margin: 0.6em 0; } summary { cursor: pointer; font-weight: 600; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; }
img { max-width: 100%; }
"""


def _td(score: float | None) -> str:
    return f'<td class="num {score_class(score)}">{_fmt(score)}</td>'


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _html(reports, rows, plots, out_dir: Path) -> str:
    e = html.escape
    head = "".join(f"<th>{h}</th>" for h in ("task", "reward", "strict", "digits", *LEVELS, "failing", "seconds",
                                              "notes"))
    body = []
    for row in rows:
        reward = '<td class="error">ERROR</td>' if row["error"] else _td(row["reward"])
        body.append(f"<tr><td><a href=\"#{e(row['task'])}\">{e(row['task'])}</a></td>{reward}"
                    f"<td>{_earned(row['earned_levels'])}</td><td class=\"num\">{_figure(row, 'mean_digits')}</td>"
                    + "".join(_td(row["levels"][lv]) for lv in LEVELS)
                    + f"<td class=\"num\">{len(row['failing'])}</td>"
                    + f"<td class=\"num\">{_seconds(row['wall_s'])}</td>"
                    + f"<td>{e('; '.join(row['notes']))}</td></tr>")
    parts = [f"<!doctype html><html><head><meta charset=\"utf-8\"><title>Grading summary</title>"
             f"<style>{CSS}</style></head><body><h1>Grading summary</h1>",
             f"<p>mean reward <b>{mean_reward(reports):.4f}</b> over {len(reports)} tasks (an error counts as 0). "
             f"Scores truncated to 6 places; green &ge; {GREEN}, amber &ge; {AMBER}, red below. "
             f"A level cell is the plain mean of its checks.</p>",
             f"<table><tr>{head}</tr>{''.join(body)}</table>", _img(out_dir / plots["levels"], "per-level scores"),
             f"<h2>Checks per task</h2><p>{html.escape(READING)}</p>"]
    for r, row in zip(reports, rows):
        task = e(row["task"])
        if row["error"]:
            parts.append(f'<details open id="{task}"><summary>{task}: <span class="error">grading raised</span>'
                         f"</summary><pre>{e(r.get('traceback') or r['error'])}</pre></details>")
            continue
        opened = " open" if row["failing"] or row["notes"] else ""
        parts.append(f'<details{opened} id="{task}"><summary>{task}: reward {_fmt(row["reward"])}, strict lattice '
                     f"{_earned(row['earned_levels'])}, mean digits {_figure(row, 'mean_digits')}, "
                     f"{len(row['failing'])} failing</summary>"
                     f"<p>candidate <code>{e(str(r.get('candidate', '?')))}</code>"
                     + (f"; {e('; '.join(row['notes']))}" if row["notes"] else "") + "</p>")
        if row["task"] in plots:
            parts.append(_img(out_dir / plots[row["task"]], f"{row['task']} losses"))
        parts.append("<table><tr><th>level</th><th>check</th><th>measure</th><th>score</th><th>1 - score</th>"
                     "<th>bar</th><th>max abs diff</th><th>rel L2</th><th>digits</th><th>seconds</th>"
                     "<th>reason</th></tr>")
        for c in r.get("checks") or []:
            reason = c.get("reason") or ""
            num = '<td class="num">'
            parts.append(f"<tr><td>{c['level']}</td><td>{e(c['name'])}</td><td>{c['measure']}</td>{_td(c['score'])}"
                         f"{num}{_deficit(c['score'])}</td>{num}{_bar(c):.4f}</td>{num}{_figure(c, 'max_abs_diff')}"
                         f"</td>{num}{_figure(c, 'rel_l2')}</td>{num}{_figure(c, 'digits')}</td>"
                         f"{num}{c.get('seconds', 0.0):.2f}</td><td>{e(reason)}</td></tr>")
        parts.append("</table></details>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


# ---------------------------------------------------------------- plots


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt
    return plt


def _plot_losses(report: dict, path: Path) -> bool:
    """Reference vs candidate loss per step, and their gap; False when the task has no loss series."""
    import numpy as np
    from matplotlib.ticker import MaxNLocator
    series = {k: v for k, v in (report.get("series") or {}).items() if k in LOSS_SERIES}
    if not series:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(2, len(series), figsize=(6.5 * len(series), 6.5), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2]}, sharex="col")
    for col, key in enumerate(k for k in LOSS_SERIES if k in series):
        ref = np.asarray(series[key]["reference"], np.float64)  # f64[S]
        cand = series[key]["candidate"]
        steps = np.arange(len(ref))
        top, bottom = axes[0, col], axes[1, col]
        top.plot(steps, ref, "o-", color="#1f5fa8", lw=2.5, ms=5, label="torch reference")
        if cand is not None and len(cand) == len(ref):
            cand = np.asarray(cand, np.float64)
            top.plot(steps, cand, "x--", color="#e0701a", lw=1.5, ms=6, label="candidate (JAX)")
            gap = np.abs(cand - ref)
            bottom.semilogy(steps, np.where(gap > 0, gap, np.nan), "s-", color="#8a2be2", ms=4)
            if 0 < np.count_nonzero(gap == 0) < len(gap):  # log axis drops them: say why a point is missing
                n = int(np.count_nonzero(gap == 0))
                bottom.set_title(f"{n} step{'s' * (n > 1)} bit-identical (no point on a log axis)", fontsize=9,
                                 loc="right", color="#555")
            if not np.any(gap > 0):  # nothing to put on a log axis: say so and drop its meaningless ticks
                bottom.text(0.5, 0.5, "identical at every step", ha="center", va="center", transform=bottom.transAxes)
                bottom.set_yticks([], minor=True)
                bottom.set_yticks([])
        else:
            why = "no candidate output" if cand is None else f"candidate has {len(cand)} steps, reference {len(ref)}"
            bottom.text(0.5, 0.5, why, ha="center", va="center", color="red", transform=bottom.transAxes)
        top.set_title(LOSS_SERIES[key])
        top.set_ylabel("loss")
        top.legend()
        top.grid(alpha=0.3)
        bottom.set_ylabel("|candidate - reference|")
        bottom.set_xlabel("step")
        bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
        bottom.grid(alpha=0.3, which="both")
    fig.suptitle(f"{report['task']}: training loss, torch reference vs candidate", fontsize=13)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_levels(rows: list[dict], path: Path) -> None:
    """Levels x tasks grid coloured by the same bars as the tables, each cell annotated with its score."""
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    plt = _pyplot()
    colours = {"na": "#dddddd", "red": "#e06666", "amber": "#f6b26b", "green": "#7bc67b"}
    index = {k: i for i, k in enumerate(colours)}
    grid = np.array([[index["na" if row["error"] else score_class(row["levels"][lv])] for row in rows]
                     for lv in LEVELS])  # i32[L, tasks]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(rows) + 1.5), 5.2))
    ax.imshow(grid, cmap=ListedColormap(list(colours.values())), vmin=0, vmax=len(colours) - 1, aspect="auto")
    for j, row in enumerate(rows):
        for i, lv in enumerate(LEVELS):
            text = ("error" if i == 0 else "") if row["error"] else _fmt(row["levels"][lv])
            ax.text(j, i, text, ha="center", va="center", fontsize=9, family="monospace")
    ax.set_xticks(range(len(rows)), [r["task"] for r in rows], rotation=25, ha="right")
    ax.set_yticks(range(len(LEVELS)), LEVELS)
    ax.set_xticks(np.arange(len(rows) + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(len(LEVELS) + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", lw=2)
    ax.tick_params(which="minor", length=0)
    ax.legend(handles=[Patch(color=colours["green"], label=f">= {GREEN}"),
                       Patch(color=colours["amber"], label=f">= {AMBER}"),
                       Patch(color=colours["red"], label=f"< {AMBER}"),
                       Patch(color=colours["na"], label="not run / error")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title("mean check score per level (truncated to 6 places)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- entry


def write_report(reports: list[dict], out_dir: Path) -> dict:
    """Write summary.{md,html,json} and the PNGs into out_dir; return the summary.json dict."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(reports)
    plots = {"levels": "levels.png"}
    _plot_levels(rows, out_dir / plots["levels"])
    for r in reports:
        name = f"loss_{r['task']}.png"
        if not r.get("error") and _plot_losses(r, out_dir / name):
            plots[r["task"]] = name
    (out_dir / "summary.md").write_text(_markdown(reports, rows, plots))
    (out_dir / "summary.html").write_text(_html(reports, rows, plots, out_dir))
    summary = {"mean_reward": mean_reward(reports), "tasks": len(reports), "rows": rows, "plots": plots,
               "reports": reports}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m grader.scoring.report DIR   (re-renders DIR/summary.* from DIR/<task>.json)", file=sys.stderr)
        return 2
    out_dir = Path(argv[0])
    reports = [json.loads(p.read_text()) for p in sorted(out_dir.glob("*.json")) if p.name != "summary.json"]
    summary = write_report(reports, out_dir)
    print(markdown_table(summary["rows"]))
    print(f"mean_reward={summary['mean_reward']:.4f} tasks={summary['tasks']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
