"""The seeded-defect catalog and sweep: every edit applies, the lattice is covered, and a real sweep
of two defects catches both with the checks one expects."""
import json
from pathlib import Path

import pytest

from grader.sweep import baseline, cli, defects as defects_mod, mutant, reports, task as sweep_one
from grader.sweep.defects import Defect, LEVELS, apply_defect, load_catalog, make_mutant

ROOT = Path(__file__).resolve().parents[2]
CATALOG = load_catalog()
DEFECTS = {d.id: d for d in CATALOG.defects}


def test_catalog_has_enough_defects_with_unique_ids():
    assert len(CATALOG.defects) >= 40
    assert len(DEFECTS) == len(CATALOG.defects)  # load_catalog also refuses duplicates
    for cls in defects_mod.CLASSES:
        assert sum(d.task_class == cls for d in CATALOG.defects) >= 15, cls


@pytest.mark.parametrize("did", sorted(DEFECTS))
def test_every_edit_occurs_exactly_once_and_still_compiles(did):
    d = DEFECTS[did]
    text = (ROOT / d.file).read_text()
    assert text.count(d.old) == 1, f"{did}: edit target occurs {text.count(d.old)} times in {d.file}"
    assert d.old != d.new and d.description
    # A defect models a wrong port, not a file that does not parse.
    compile(text.replace(d.old, d.new), d.file, "exec")


@pytest.mark.parametrize("cls", defects_mod.CLASSES)
def test_every_lattice_level_of_both_classes_is_covered(cls):
    covered = {lv for d in CATALOG.defects if d.task_class == cls for lv in d.levels}
    assert covered == set(LEVELS), sorted(set(LEVELS) - covered)


def test_every_defect_applies_to_some_task():
    from catalog.tasks import compose_task, known_tasks
    cfgs = [compose_task(t) for t in known_tasks()]
    dead = [d.id for d in CATALOG.defects if not any(defects_mod.applicable([d], cfg) for cfg in cfgs)]
    assert not dead, dead


def test_applicability_follows_class_family_and_mode():
    d = Defect("x", "serving", ("gemma4",), ("chunked",), ("L5",), "serving_engine/engine.py", "a", "b", "bug")
    assert d.applies_to("serving", "gemma4", "chunked")
    assert not d.applies_to("serving", "gemma4", "core")
    assert not d.applies_to("serving", "llama3", "chunked")
    assert not d.applies_to("training", "gemma4", None)
    assert Defect("y", "training", (), (), ("L1",), "f", "a", "b", "bug").applies_to("training", "llama3", None)
    dpo_only = Defect("z", "training", (), (), ("L4",), "f", "a", "b", "bug", methods=("dpo",))
    assert dpo_only.applies_to("training", "llama3", None, "dpo")
    assert not dpo_only.applies_to("training", "llama3", None, "sft")


def test_method_defects_apply_to_their_method_only():
    from catalog.tasks import compose_task
    sft, dpo = (defects_mod.applicable(CATALOG.defects, compose_task(t)) for t in ("llama3-sft", "llama3-dpo"))
    assert not any(d.id.startswith("dpo-") for d in sft)
    assert {d.id for d in dpo if d.id.startswith("dpo-")} == {d.id for d in CATALOG.defects if d.id.startswith("dpo-")}
    assert "train-ga-mean-per-micro-batch" not in {d.id for d in dpo}  # sft.py's accumulation: SFT's code path


def test_an_ambiguous_or_missing_edit_target_is_refused(tmp_path):
    (tmp_path / "m.py").write_text("x = 1\nx = 1\n")
    with pytest.raises(ValueError, match="2 times"):
        apply_defect(tmp_path, Defect("dup", "training", (), (), ("L1",), "m.py", "x = 1", "x = 2", "bug"))
    with pytest.raises(ValueError, match="0 times"):
        apply_defect(tmp_path, Defect("gone", "training", (), (), ("L1",), "m.py", "y = 1", "y = 2", "bug"))


def test_a_mutant_differs_from_the_oracle_only_in_the_edited_file(tmp_path):
    d = DEFECTS["train-labels-not-shifted"]
    mutant = make_mutant(d, tmp_path / "m")
    assert (mutant / d.file).read_text() == (ROOT / d.file).read_text().replace(d.old, d.new)
    assert (mutant / "jax_oracles/models/llama3.py").read_text() == (ROOT / "jax_oracles/models/llama3.py").read_text()
    assert not list(mutant.rglob("__pycache__"))


def test_reports_list_untripped_checks_with_their_rationale(tmp_path):
    result = {
        "task": "t", "task_class": "training", "clean_reward": 1.0, "clean_earned_levels": 6, "default_noise": 1e-6,
        "levels": list(LEVELS), "seconds": 1.0,
        "defects": [{"id": "d1", "description": "bug", "file": "f", "expected_levels": ["L1"], "reward": 0.5,
                     "reward_drop": 0.5, "gated": False, "caught": True, "tripped": ["L1/rope"],
                     "levels_tripped": ["L1"], "expected_levels_missed": [], "scores": {}, "reasons": {},
                     "seconds": 1.0}],
        "checks": {"L1/rope": {"clean_score": 1.0, "clean_reason": None, "noise": 1e-6, "tripped_by": ["d1"]},
                   "L1/mlp": {"clean_score": 1.0, "clean_reason": None, "noise": 1e-6, "tripped_by": []}},
        "totals": {"defects_caught": 1, "defects": 1, "strict_caught": 1, "checks_tripped": 1, "checks": 2},
    }
    js, md = reports.write_reports(result, tmp_path, {"L1/mlp": "kept because the MLP is half the FLOPs"})
    text = md.read_text()
    assert "| `d1` |" in text
    assert "**1/1 defects caught, 1/1 strictly (each costs a level), 1/2 checks tripped**" in text
    assert "`L1/mlp`: kept because the MLP is half the FLOPs" in text
    assert json.loads(js.read_text())["untripped"] == {"L1/mlp": "kept because the MLP is half the FLOPs"}


def test_cli_takes_hydra_style_and_dashed_options():
    a = cli._parse(["task=llama3-sft", "defects=a,b", "limit=2", "levels=L1,L4"])
    assert (a.task, a.defects, a.limit, a.levels) == ("llama3-sft", "a,b", 2, "L1,L4")
    assert cli._parse(["--all"]).all == "true" and cli._parse(["all=true"]).all == "true"


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_real_sweep_of_two_defects_catches_both_with_the_expected_checks(tmp_path):
    # Three levels keep it to three short grades (clean + two mutants), about a minute on two cores.
    levels = ("L1", "L3", "L4")
    picked = [DEFECTS["train-rope-theta-default"], DEFECTS["train-labels-not-shifted"]]
    result = sweep_one.sweep_task("llama3-sft", picked, tmp_path, progress=lambda msg: None, levels=levels)
    by_id = {r["id"]: r for r in result["defects"]}
    assert result["totals"]["defects_caught"] == 2

    rope = set(by_id["train-rope-theta-default"]["tripped"])
    assert {"L1/rope", "L3/logits_b1_t7", "L3/logits_b3_t33_pad", "L4/loss_step0"} <= rope
    assert not rope & {"L0/torch_free", "L1/rms_norm", "L1/mlp", "L1/attention_core", "L1/lora_linear",
                       "L1/data_tokens", "L1/data_labels", "L1/collate"}

    labels = by_id["train-labels-not-shifted"]
    # The loss shift touches the loss only: everything below L4 is bit-identical to the oracle.
    assert set(labels["tripped"]) == {"L4/loss_step0", "L4/lora_grads_step0", "L4/fixed_steps_loss",
                                      "L4/fixed_steps_params", "L4/loss_step0_train_on_prompt"}
    assert labels["reward_drop"] > 1e-3 and result["checks"]["L4/loss_step0"]["tripped_by"] == [
        "train-rope-theta-default", "train-labels-not-shifted"]


@pytest.mark.sandbox
@pytest.mark.parametrize("did, only_trace", [
    # slow (~100 s each: a clean and a mutant L5 grading); `make test-full` and the sweep run them
    pytest.param("serve-free-head-first", True, marks=pytest.mark.slow),
    pytest.param("serve-no-null-block", False, marks=pytest.mark.slow),  # also tripped by the greedy checks
])
def test_block_pool_defects_are_caught_by_the_pressure_trace(tmp_path, did, only_trace):
    # Freeing head first keeps every token: only the per-step trace under a preempting, evicting pool sees it.
    # Without a null block, padded block-table entries alias a live request's KV: the tokens change as well.
    result = sweep_one.sweep_task("llama3-chunked", [DEFECTS[did]], tmp_path, progress=lambda msg: None, levels=("L5",))
    (rec,) = result["defects"]
    assert rec["caught"] and "L5/schedule_trace" in rec["tripped"], rec
    assert (rec["tripped"] == ["L5/schedule_trace"]) == only_trace, rec["tripped"]
    assert rec["scores"]["L5/schedule_trace"] < 0.99


@pytest.mark.sandbox
@pytest.mark.parametrize("task, did, check", [
    pytest.param("llama3-core", "serve-min-p-before-temperature", "L1/sampler_pipeline",
                 marks=pytest.mark.slow),  # CI time (~42 s): make test-full
    pytest.param("llama3-sft", "train-template-eos-not-replaced", "L1/collate",
                 marks=pytest.mark.slow),  # CI time (~29 s): make test-full; the executed-edit test stays in CI
])
def test_order_and_eos_defects_are_caught_at_l1(tmp_path, task, did, check):
    # Both were blind spots once: the per-transform sampler checks compose the stages in the probe's
    # order, and an Instruct tokenizer (eos already <|eot_id|>) made replace_eos a no-op.
    result = sweep_one.sweep_task(task, [DEFECTS[did]], tmp_path, progress=lambda msg: None, levels=("L1",))
    (rec,) = result["defects"]
    assert rec["caught"] and check in rec["tripped"], rec
    assert rec["scores"][check] < 0.99


# ---- impact analysis and the multirun (issue 14) -------------------------------------------------

from grader.sweep import impact as impact_mod  # noqa: E402


def _fake_base(coverage: dict, groups=("L0", "L1", "L2"), ok=None) -> dict:
    """A clean baseline as task_baseline writes it, without grading anything: every check scores 1."""
    def check(level, name, aspect="numeric"):
        return {"level": level, "name": name, "aspect": aspect, "measure": "pass" if aspect == "spec" else "max_ulp",
                "score": 1.0, "reason": None, "seconds": 0.0, "bar": None, "max_abs_diff": None, "rel_l2": None,
                "digits": None}
    clean = [check("L0", "torch_free", "spec"), check("L0", "param_tree", "spec")] + [
        check(g, f"c{i}") for g in groups if g != "L0" for i in range(2)]
    return {"key": "k", "groups": {g: [g] for g in groups}, "depends": {}, "coverage": coverage,
            "coverage_ok": ok or {g: True for g in groups}, "clean": clean, "rerun": clean,
            "clean_reward": 1.0, "clean_rerun_reward": 1.0, "clean_earned_levels": len(groups) - 1, "impact": "line"}


def _graded_at(monkeypatch, defect, base, workdir):
    """grade_mutant with the grading faked: -> (the levels it asked to grade, the record)."""
    asked = []

    def fake_grade(cfg, candidate, report_dir, levels, compile_cache=None, **kw):
        asked.append(tuple(levels))
        checks = [dict(c, score=0.5 if c["level"] in levels else c["score"]) for c in base["clean"]
                  if c["level"] in levels or c["name"] == "torch_free"]
        return {"checks": checks, "reward": 0.0, "earned_levels": 0, "gated": None}

    monkeypatch.setattr(mutant, "_grade", fake_grade)
    graded = mutant.grade_mutant(defect, None, base, workdir, impact="line")
    noise = {f'{c["level"]}/{c["name"]}': 1e-6 for c in base["clean"]}
    return asked[0], mutant.defect_record(defect, graded, base, noise, lambda k: k)


def test_impact_skips_a_file_no_group_executes_with_a_reason(monkeypatch, tmp_path):
    d = DEFECTS["train-labels-not-shifted"]
    cov = {"L0": {"conversion/llama3.py": {"lines": [1, 2]}}, "L1": {}, "L2": {"jax_oracles/models/llama3.py":
                                                                                {"lines": [1]}}}
    imp = baseline.impact_of(d, _fake_base(cov))
    assert not any(imp.graded.values())
    assert all(f"never imports {d.file}" in why for why in imp.why.values())
    levels, rec = _graded_at(monkeypatch, d, _fake_base(cov), tmp_path)
    assert levels == ()  # only the gate runs
    assert not rec["caught"] and rec["graded_groups"] == [] and "no level group" in rec["not_executed"]


def test_a_mutant_is_graded_only_where_its_edit_runs_and_reuses_clean_scores_elsewhere(monkeypatch, tmp_path):
    d = DEFECTS["train-labels-not-shifted"]
    old = (ROOT / d.file).read_text()
    (span,) = impact_mod.edited_spans(old, old.replace(d.old, d.new)).spans
    cov = {"L0": {}, "L1": {d.file: {"lines": [1, 2, 3]}},  # imports the file, never runs the edited lines
           "L2": {d.file: {"lines": [1, span[0]]}}}
    imp = baseline.impact_of(d, _fake_base(cov))
    assert imp.graded == {"L0": False, "L1": False, "L2": True}
    assert "never executes lines" in imp.why["L1"] and "executes the edited lines" in imp.why["L2"]
    levels, rec = _graded_at(monkeypatch, d, _fake_base(cov), tmp_path)
    assert levels == ("L2",)
    assert rec["graded_groups"] == ["L2"] and rec["reused_checks"] == 3  # L0/param_tree, L1/c0, L1/c1
    assert rec["tripped"] == ["L2/c0", "L2/c1"] and rec["caught"]
    # a group without trustworthy coverage is graded; so is a group that consumes a graded one's outputs
    base = _fake_base(cov, ok={"L0": False, "L1": True, "L2": True})
    base["depends"] = {"L1": ["L2"]}
    imp = baseline.impact_of(d, base)
    assert imp.graded == {"L0": True, "L1": True, "L2": True}
    assert baseline.impact_of(d, _fake_base(cov), impact="file").graded == {"L0": False, "L1": True, "L2": True}


def test_line_level_impact_falls_back_to_the_file_where_it_cannot_be_shown_sound():
    src = ("X = 1\n\ndef f(a, b=2):\n    \"\"\"doc\"\"\"\n    if a:\n        y = a + 1\n    else:\n        y = X\n"
           "    return y\n")
    spans = lambda old, new: impact_mod.edited_spans(src, src.replace(old, new, 1))  # noqa: E731
    assert spans("y = a + 1", "y = a + 2").spans == ((6, 6),)   # a body line: runs when f runs that branch
    assert spans("b=2", "b=3").spans == ((3, 9),)               # the def statement: runs at import
    assert "binding of X" in spans("y = X", "y = X\n        X = 0").file_level  # X becomes local in all of f
    assert "co_flags" in spans("return y", "yield y").file_level            # f becomes a generator
    assert "no bytecode" in spans('"""doc"""', '"""dox"""').file_level      # a docstring leaves no line event


def test_every_catalog_edit_has_an_impact_anchor_or_a_file_level_reason():
    for d in CATALOG.defects:
        old = (ROOT / d.file).read_text()
        a = impact_mod.edited_spans(old, old.replace(d.old, d.new))
        assert bool(a.spans) != bool(a.file_level), d.id
        assert all(1 <= x <= y <= old.count("\n") + 1 for x, y in a.spans), d.id


def test_no_candidate_module_is_imported_before_the_child_starts_coverage():
    # Coverage starts in run_probes; a candidate module imported before it would run its top level untraced.
    import ast as ast_
    for path in [*(ROOT / "grader" / "probes").glob("*.py"), *(ROOT / "grader").glob("*.py")]:
        tree = ast_.parse(path.read_text())
        for node in tree.body:
            names = ([a.name for a in node.names] if isinstance(node, ast_.Import) else
                     [node.module or ""] if isinstance(node, ast_.ImportFrom) else [])
            assert not any(n.split(".")[0] in impact_mod.CANDIDATE_ROOTS for n in names), (path, names)


def test_no_candidate_code_runs_where_the_coverage_tracer_cannot_see_it():
    # coverage.py traces the child's Python threads; a JAX host callback or a thread started by candidate code
    # could run oracle lines it never records, and the impact analysis would skip a group that runs an edit.
    import re
    pattern = re.compile(r"pure_callback|io_callback|debug\.callback|host_callback|threading|concurrent\.futures|"
                         r"multiprocessing|os\.fork")
    files = [p for tree in impact_mod.CANDIDATE_ROOTS for p in sorted((ROOT / tree).rglob("*.py"))]
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits


def test_the_multirun_entry_parses_and_registers_every_defect(tmp_path):
    from hydra.core.config_store import ConfigStore
    assert cli._hydra_mode(["-m", "task=llama3-sft", "defect=glob(*)"]) and cli._hydra_mode(["aggregate=true"])
    assert not cli._hydra_mode(["task=llama3-sft", "defects=a,b"]) and not cli._hydra_mode(["--all"])
    assert not cli._hydra_mode(["task=llama3-sft", "impact=file", "merge=false"])  # the --task path's options
    cli._register_defects()
    options = {n[:-len(".yaml")] for n in ConfigStore.instance().list("defect")}
    assert options == set(DEFECTS)
    # a pair whose defect does not apply is recorded as such, without grading anything
    rec = cli.run_job("llama3-sft", "serve-free-head-first", tmp_path, tmp_path / "cache")
    assert rec is None
    path = tmp_path / "cache" / "llama3-sft" / "not-applicable" / "serve-free-head-first.json"
    assert json.loads(path.read_text()) == {"id": "serve-free-head-first", "applicable": False}
    with pytest.raises(SystemExit, match="no baseline"):
        cli.aggregate(["llama3-sft"], tmp_path, tmp_path / "cache")


@pytest.mark.sandbox
def test_an_executed_edit_is_graded_and_caught_and_an_unexecuted_one_reuses_the_clean_scores(tmp_path):
    # L1 only: three clean L1 gradings (two for the noise, one under coverage), then each mutant's L1 child
    # only where L1 runs its edit. The template's eos edit runs at L1 (collate); the loss shift never does.
    picked = [DEFECTS["train-template-eos-not-replaced"], DEFECTS["train-labels-not-shifted"]]
    result = sweep_one.sweep_task("llama3-sft", picked, tmp_path, progress=lambda msg: None, levels=("L1",))
    eos, labels = result["defects"]
    assert eos["graded_groups"] == ["L1"] and eos["caught"] and "L1/collate" in eos["tripped"], eos
    assert labels["graded_groups"] == [] and not labels["caught"] and labels["reused_checks"] > 0, labels
    assert "never executes lines" in labels["impact"]["L1"] or "never imports" in labels["impact"]["L1"]
    assert "not_executed" in labels


def _toy_candidate(tmp_path, name, source):
    import textwrap
    cand = tmp_path / name
    (cand / "jax_oracles").mkdir(parents=True)
    (cand / "jax_oracles" / "__init__.py").write_text("")
    (cand / "jax_oracles" / "entry.py").write_text(textwrap.dedent(source))
    inputs, out = tmp_path / f"{name}-in", tmp_path / f"{name}-out"
    inputs.mkdir()
    out.mkdir()
    (inputs / "in.json").write_text("{}")
    return cand, inputs, out


def test_the_fork_server_runs_trusted_children_behind_the_guard_with_timeouts(tmp_path):
    from grader.isolation import gate
    from grader.isolation.forkserver import ForkServer
    ok = """
    import json, os, sys
    def main(inp, out):
        json.dump({"pid": os.getpid(), "cwd": os.getcwd(), "jax_loaded": "jax" in sys.modules,
                   "env": os.environ.get("T2J_GATE_FORBIDDEN", "")}, open(out, "w"))
    """
    torch = "def main(inp, out):\n    import torch\n"
    hang = "import time\ndef main(inp, out):\n    time.sleep(60)\n"
    with ForkServer(gate.fork_server_env()) as server:
        for i in range(2):  # two children of one server: each its own process, cwd and environment
            cand, inputs, out = _toy_candidate(tmp_path, f"ok{i}", ok)
            res = gate.run_sandboxed(cand, "jax_oracles.entry:main", inputs, out, 30.0, inputs_name="in.json",
                                     outputs_name="out.json", trusted=True, forkserver=server)
            assert res.ok, (res.reason, res.stderr_tail)
            got = json.loads((out / "out.json").read_text())
            assert got["pid"] != server._proc.pid and got["jax_loaded"] and "torch" in got["env"]
            assert Path(got["cwd"]).name == "candidate"
        cand, inputs, out = _toy_candidate(tmp_path, "torch", torch)
        res = gate.run_sandboxed(cand, "jax_oracles.entry:main", inputs, out, 30.0, inputs_name="in.json",
                                 outputs_name="out.json", trusted=True, forkserver=server)
        assert not res.ok and res.reason == "torch import"
        cand, inputs, out = _toy_candidate(tmp_path, "hang", hang)
        res = gate.run_sandboxed(cand, "jax_oracles.entry:main", inputs, out, 2.0, inputs_name="in.json",
                                 outputs_name="out.json", trusted=True, forkserver=server)
        assert not res.ok and res.reason == "timeout" and res.seconds < 20
        with pytest.raises(ValueError, match="trusted code only"):
            gate.run_sandboxed(cand, "jax_oracles.entry:main", inputs, tmp_path / "none", 2.0, forkserver=server)


def test_a_forked_child_is_charged_the_imports_its_server_did_for_it(tmp_path):
    """A cold child pays its interpreter start and imports inside its budget; a fork of the sweep's server does
    not, so it is charged the server's startup CPU (grader/isolation/forkserver.py): a mutant faces the budget a
    real grading sets, not one looser by the imports."""
    from grader.isolation import gate
    from grader.isolation.forkserver import CHARGED_ENV, ForkServer
    spin = """
    import json, os, time
    def main(inp, out):
        start = time.process_time()
        while time.process_time() - start < 0.3:
            pass
        json.dump({"charged": os.environ.get("%s")}, open(out, "w"))
    """ % CHARGED_ENV
    with ForkServer(gate.fork_server_env()) as server:
        assert server.startup_cpu_s > 0.5  # jax, numpy and h5py imported once
        cand, inputs, out = _toy_candidate(tmp_path, "roomy", spin)
        res = gate.run_sandboxed(cand, "jax_oracles.entry:main", inputs, out, 60.0, inputs_name="in.json",
                                 outputs_name="out.json", trusted=True, forkserver=server,
                                 cpu_limit_s=server.startup_cpu_s + 10.0)
        assert res.ok, (res.reason, res.stderr_tail)
        assert float(json.loads((out / "out.json").read_text())["charged"]) == server.startup_cpu_s
        assert res.usage.cpu_s >= server.startup_cpu_s + 0.2  # the spin, as the meter saw it (it polls)
        cand, inputs, out = _toy_candidate(tmp_path, "tight", spin)  # room for the spin, none for the imports
        res = gate.run_sandboxed(cand, "jax_oracles.entry:main", inputs, out, 60.0, inputs_name="in.json",
                                 outputs_name="out.json", trusted=True, forkserver=server, cpu_limit_s=1.0)
        assert not res.ok and res.reason == "timeout" and res.usage.exceeded == "cpu", (res.reason, res.usage)


def test_a_clean_baseline_below_its_ceiling_is_refused_regraded_and_never_cached(monkeypatch, tmp_path):
    """A clean grading with a check under its strict bar (a timeout on a loaded machine) is graded again;
    one that reaches its ceiling is cached; one that never does raises BaselineError and caches nothing."""
    from catalog.h5schema import read_reference
    from catalog.tasks import compose_task
    cfg, ref = compose_task("llama3-sft"), read_reference(ROOT / "references" / "llama3-sft.h5")
    good = _fake_base({})["clean"]
    good = [dict(c, bar=1.0 if c["aspect"] == "spec" else 0.999) for c in good]
    slow = [dict(c, score=0.0, reason="timeout: the child's process tree used 9.9 CPU-s > 9.0 CPU-s")
            if c["name"] == "c0" and c["level"] == "L2" else c for c in good]
    gradings = []

    def fake_grade(cfg, candidate, report_dir, levels, compile_cache=None, **kw):
        gradings.append(report_dir.name)
        checks = slow if len(gradings) <= 2 or plan == "never" else good
        return {"checks": checks, "reward": 0.9, "earned_levels": 1, "gated": None}

    monkeypatch.setattr(baseline, "_grade", fake_grade)
    assert baseline.below_ceiling({"checks": good}) == [] and "L2/c0 0.000000 (timeout" in \
        baseline.below_ceiling({"checks": slow})[0]
    plan = "once"
    base = baseline.task_baseline("llama3-sft", cfg, ref, ("L2",), tmp_path / "cache", tmp_path, None, impact="off",
                               progress=lambda m: None)
    assert len(gradings) == 4 and base["clean"] == good  # the first pair refused, the second kept
    assert list((tmp_path / "cache").rglob("baseline.json"))
    plan, gradings[:] = "never", []
    with pytest.raises(baseline.BaselineError, match="below its ceiling"):
        baseline.task_baseline("llama3-sft", cfg, ref, ("L2",), tmp_path / "cache2", tmp_path, None, impact="off",
                            progress=lambda m: None)
    assert len(gradings) == 2 * baseline.BASELINE_ATTEMPTS and not list((tmp_path / "cache2").rglob("baseline.json"))
