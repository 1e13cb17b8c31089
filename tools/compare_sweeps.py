"""Compare two sweep report directories defect by defect (issue 14's identical-results check):

    python tools/compare_sweeps.py OLD_DIR NEW_DIR llama3-sft llama3-chunked

For each task: the same defects, and per defect the same caught, strict_caught, gated, earned level, tripped
checks, failed-strict checks and levels tripped; per check the same tripped_by. Rewards are compared and
shown (they may part in the last digits where the clean code itself differs, never past the noise floor).
Prints each difference, then minutes and mutants per minute per side; last line IDENTICAL or N DIFFERENCES."""
import json
import sys
from pathlib import Path

FIELDS = ("caught", "strict_caught", "gated", "earned_levels", "tripped", "failed_strict", "levels_tripped")


def compare(old_dir: Path, new_dir: Path, tasks: list[str]) -> int:
    bad = 0
    n = {"old": 0, "new": 0}
    secs = {"old": 0.0, "new": 0.0}
    for task in tasks:
        old, new = (json.loads((d / f"{task}.json").read_text()) for d in (old_dir, new_dir))
        o, m = ({r["id"]: r for r in x["defects"]} for x in (old, new))
        if set(o) != set(m):
            print(f"{task}: defect sets differ: {sorted(set(o) ^ set(m))}")
            bad += 1
        rewards = 0
        for did in sorted(set(o) & set(m)):
            for f in FIELDS:
                if o[did][f] != m[did][f]:
                    print(f"{task} {did}: {f} old={o[did][f]} new={m[did][f]}")
                    bad += 1
            rewards += o[did]["reward"] != m[did]["reward"]
        for key in old["checks"]:
            if old["checks"][key]["tripped_by"] != new["checks"].get(key, {}).get("tripped_by"):
                print(f"{task} {key}: tripped_by old={old['checks'][key]['tripped_by']} "
                      f"new={new['checks'].get(key, {}).get('tripped_by')}")
                bad += 1
        for side, r in (("old", old), ("new", new)):
            t = r["totals"]
            n[side] += t["defects"]
            secs[side] += r["seconds"]
            print(f"{task} {side}: clean {r['clean_reward']:.6f}/{r['clean_rerun_reward']:.6f}, "
                  f"defects_caught={t['defects_caught']}/{t['defects']} strict_caught={t['strict_caught']} "
                  f"checks_tripped={t['checks_tripped']}/{t['checks']} in {r['seconds'] / 60:.1f} min"
                  + (f", level groups graded {t['groups_graded']}/{t['groups_total']}" if "groups_graded" in t else ""))
        print(f"{task}: {rewards} of {len(set(o) & set(m))} rewards differ in some digit")
    for side in ("old", "new"):
        print(f"{side}: {n[side]} mutants in {secs[side] / 60:.1f} min = {n[side] / (secs[side] / 60):.2f} mutants/min")
    print("IDENTICAL" if not bad else f"{bad} DIFFERENCES")
    return bad


if __name__ == "__main__":
    sys.exit(1 if compare(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]) else 0)
