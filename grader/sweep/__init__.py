"""Seeded-defect sweep (DESIGN section 10): grade mutants of the oracles, report what the checks catch.

    python -m grader.sweep task=llama3-sft [defects=id1,id2] [limit=N] [levels=L1,L3] [jobs=2] [out=reports/sweep]
    python -m grader.sweep all=true [defects=...] [limit=N] [jobs=2]    # every task with a reference
    (`--task NAME`, `--all`, `--defects a,b`, `--limit N`, `--levels ...`, `--jobs N`, `--out DIR`, `--impact
    line|file|off`, `--cache DIR`, `--refresh` are the same options; defects, limit and levels are for quick
    runs: a full sweep grades every applicable defect; jobs grades that many mutants at once)

    # the same as a Hydra multirun over (task, defect), one job per mutant (configs/sweep.yaml):
    python -m grader.sweep -m task=llama3-sft,llama3-chunked 'defect=glob(*)' hydra/launcher=local
    python -m grader.sweep aggregate=true [task=llama3-sft]   # then the reports and the last line

The catalog is grader/sweep/defects/*.yaml (data, not code; grader/sweep/defects.py reads it): each defect is one exact text edit to a copy
of jax_oracles/, serving_engine/ and conversion/. Per task the clean oracle is graded twice (its noise)
and once under branch coverage (which lines each level group's sandboxed child executes): the task's
*baseline*, kept on disk in <out>/.cache/<task>/<key>/ where the key is a sha256 of everything it depends
on (baseline_key: the solution trees, references/<task>.h5, the grader package with its catalog, the
composed task config, the assets the child reads, the verifier environment's distributions, the levels and
the impact mode), so a change of any of them recomputes it. Then every defect that applies to the task's
class, family and mode is graded on its own mutant, `jobs` at a time, at the level groups that can execute
its edit only (grader/sweep/impact.py: the edited statements, or the whole file where a line-level answer could
be unsound); a group that cannot keeps the clean oracle's scores, marked reused in the record (same code
executed on the same inputs on a deterministic CPU: same result). The independence gate (L0/torch_free)
runs for every mutant. A defect whose edit no group executes is reported, not caught, with the reason.
All grades of a run share one JAX persistent compilation cache, so a mutant recompiles only the programs
its edit changed (the multirun keeps it in <out>/.cache/xla).

In the multirun each job grades one mutant and writes its record to <out>/.cache/<task>/<key>/records/;
a (task, defect) pair whose defect does not apply is recorded as such and skipped. The first job of a task
computes the baseline under a file lock (the others wait for it) and with the machine to itself (an
exclusive lock that mutant gradings take shared: a baseline's timed levels are the bar); the aggregation
step writes the same reports as the --task/--all path.

A check is *tripped* by a defect when its score falls below the clean oracle's score on that check by
more than the check's run-to-run noise. The noise is measured: the clean oracle is graded twice and
the noise is the larger of the two runs' score gap and a floor of 1e-6 (or the reference check
group's "noise" attribute, where a recording on a nondeterministic device sets one). On this CPU
both runs are bit-identical, so any drop above rounding is the defect's.
A defect is *caught* when it trips at least one check. A defect that trips the independence gate
zeroes every check; the per-check tally credits it to L0/torch_free only, so a torch import cannot
make every other check look sharp.

Writes reports/sweep/<task>.json and reports/sweep/<task>.md. `all` (and `aggregate`) prints as its last
line `defects_caught=N/M strict_caught=S/M checks_tripped=K/L` (over both classes; a defect counts
once per task it applies to; a check is one (class, level/name) pair, tripped when any defect on any
task of that class trips it).
"""
