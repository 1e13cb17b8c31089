"""The twin's information boundary: its process never opens references/, reports/, the check catalog and what
the graded inputs are built from (catalog/checks, workloads, trace, heldout, scorers, ppo_eval, layout), nor the
grader's probes, scoring, sweep or timing; an audit hook on every open and directory listing of a real twin run
proves it, and the same hook is shown to fire on a process that does read one of them."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from grader.app import ROOT

# run in a fresh interpreter with the hook installed before any import: module loads are opens too
HOOKED = textwrap.dedent("""
    import json, os, re, sys
    ROOT = {root!r}
    OFF_LIMITS = re.compile(r"^(references|reports)(/|$)"
                            r"|^catalog/(__pycache__/)?(checks|workloads|trace|heldout|scorers|ppo_eval|layout)\\."
                            r"|^grader/(probes|scoring|sweep|timing)(/|$)")
    seen = []
    def hook(event, args):
        if event in ("open", "os.listdir", "os.scandir", "glob.glob") and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(args[0]))
            if path.startswith(ROOT + os.sep):
                rel = os.path.relpath(path, ROOT)
                if OFF_LIMITS.search(rel):
                    seen.append(rel)
    sys.addaudithook(hook)
    sys.path.insert(0, ROOT)
    try:
        {body}
    finally:
        print("OPENED=" + json.dumps(sorted(set(seen))))
""")


def _run_hooked(body: str, timeout: int = 900) -> tuple[subprocess.CompletedProcess, list[str]]:
    code = HOOKED.format(root=str(ROOT), body=textwrap.indent(textwrap.dedent(body), "    ").strip())
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("OPENED=")]
    assert line, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, json.loads(line[-1][len("OPENED="):])


def test_the_hook_sees_a_process_that_reads_the_catalog_or_a_reference():
    _, opened = _run_hooked("""
        import catalog.checks
        open(os.path.join(ROOT, "references", "llama3-sft.h5"), "rb").close()
        os.listdir(os.path.join(ROOT, "grader", "probes"))
    """)
    assert "references/llama3-sft.h5" in opened and "grader/probes" in opened
    assert any(p.startswith("catalog/") and "checks" in p for p in opened), opened


@pytest.mark.sandbox
@pytest.mark.parametrize("task", ["llama3-sft", "llama3-core"])
def test_a_twin_run_never_opens_references_reports_or_the_checks(task, tmp_path):
    proc, opened = _run_hooked(f"""
        from twin.__main__ import main
        rc = main(["task={task}", "seed=3", "out={tmp_path}"])
        print("RC=" + str(rc))
    """)
    assert "RC=0" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert opened == [], opened
