#!/bin/bash
# The verifier of $task: the sealed grader on the agent's tree; the reward (and the strict level reached) to
# reward.json, the per-level report beside it. Overridable for a run outside Harbor's container:
#   T2J_PYTHON (the verifier's python), T2J_VERIFIER (its venv, the sandbox's interpreter),
#   T2J_CANDIDATE (the graded tree), T2J_LOGS (where the reward goes)
set -uo pipefail
HERE="$$(cd "$$(dirname "$$0")" && pwd)"
PY="$${T2J_PYTHON:-/opt/verifier/bin/python}"
export T2J_VERIFIER="$${T2J_VERIFIER:-/opt/verifier}"
CANDIDATE="$${T2J_CANDIDATE:-$candidate}"
LOGS="$${T2J_LOGS:-/logs/verifier}"
mkdir -p "$$LOGS"
cd "$$HERE/runtime"
"$$PY" -E -s -m grader task=$task candidate="$$CANDIDATE" report_dir="$$LOGS/report" hydra.run.dir="$$LOGS/hydra" \
    > "$$LOGS/grader.log" 2>&1
status=$$?
"$$PY" -I - "$$LOGS" "$$status" <<'PYEOF'
import json, sys
from pathlib import Path

logs, status = Path(sys.argv[1]), int(sys.argv[2])
reports = sorted((logs / "report").glob("*.json"))
if status != 0 or not reports:
    tail = (logs / "grader.log").read_text(errors="replace").splitlines()[-15:] if (logs / "grader.log").exists() else []
    reason = f"the grader stopped (exit {status}) before a report: " + " | ".join(tail)
    (logs / "report.json").write_text(json.dumps({"reward": 0.0, "reason": reason}, indent=1))
    (logs / "reward.json").write_text(json.dumps({"reward": 0.0}))
    print(reason)
    sys.exit(0)
report = json.loads(reports[0].read_text())
(logs / "report.json").write_text(json.dumps(report, indent=1, default=str))
reward = {"reward": float(report["reward"])}
(logs / "reward.json").write_text(json.dumps(reward))
print(f"reward={reward['reward']:.4f}", report.get("gated") or "")
PYEOF
