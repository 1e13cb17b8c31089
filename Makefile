# Everything runs from the project's own .venv, bootstrapped on first use.
PY     := .venv/bin/python
STAMP  := .venv/.installed-stamp
# The torch-free verifier environment every sandboxed candidate child runs with (grader/isolation/sandbox.py).
VENV_V := .venv-verifier
VPY    := $(VENV_V)/bin/python
VSTAMP := $(VENV_V)/.installed-stamp
# LLaMA-Factory itself, for the parity harness only (tools/lf_parity): never used by the tests, the recorder or the grader.
VENV_LF := .venv-lf
LFPY    := $(VENV_LF)/bin/python
LFSTAMP := $(VENV_LF)/.installed-stamp
TASK   ?= llama3-sft
SCALE  ?= tiny
JOBS   ?= 2
# The Hydra launcher of record-all (and, given on the command line, of make sweep's multirun form):
# local (joblib on this machine, configs/hydra/launcher/local.yaml), local_submitit (submitit's local executor: the
# Slurm path's job pickling, per-job logs and result collection on this machine) or cluster (Slurm; README, Re-recording)
LAUNCHER ?= local
# make test's pytest-xdist workers, one test file each at a time (module fixtures are built once per file)
TEST_JOBS ?= 2
PYTEST := $(PY) -m pytest -q -p no:randomly


.PHONY: twin gpu-check export export-check locks lf-env lf-parity venv verifier sandbox record record-all grade grade-all calibrate stability coverage-torch sweep test test-full bench assets stale clean-venv harbor-env

venv: $(STAMP)

# torch==2.13.0 first: that CPU build lies on this machine's disk, any other version downloads gigabytes.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[torch,dev]'
	touch $(STAMP)

# Versions follow .venv's (its pip freeze as constraints); torch & co. are never installed here.
$(VSTAMP): requirements-verifier.txt tools/check_verifier.py $(STAMP)
	test -x $(VPY) || python3 -m venv $(VENV_V)
	$(PY) -m pip freeze --exclude-editable > $(VENV_V)/constraints.txt
	$(VPY) -m pip install -q -r requirements-verifier.txt -c $(VENV_V)/constraints.txt
	$(VPY) -I tools/check_verifier.py
	touch $(VSTAMP)

verifier: $(VSTAMP)

sandbox: verifier     ## what grading needs: the verifier env and bubblewrap (apt-get install where root)
	tools/ensure_bwrap.sh

record: venv          ## make record TASK=llama3-sft
	$(PY) -m recorder task=$(TASK)

record-all: venv      ## every task, one Hydra multirun in parallel [LAUNCHER=local (joblib)|local_submitit|cluster]
	$(PY) -m recorder -m 'task=glob(*)' hydra/launcher=$(LAUNCHER)

twin: venv sandbox    ## the live twin: make twin TASK=llama3-sft [CANDIDATE=path] [SEED=0]: matched probes on fresh inputs, torch source vs candidate (README, The live twin)
	$(PY) -m twin task=$(TASK) $(if $(CANDIDATE),candidate=$(CANDIDATE),) $(if $(SEED),seed=$(SEED),)

gpu-check: venv       ## on a GPU: record a training and a serving task with device=cuda, grade the serving one with the Pallas kernel compiled, the decode kernel's bandwidth; without one: says so, exit 0
	$(PY) tools/gpu_check.py

grade: venv sandbox   ## make grade TASK=llama3-sft [CANDIDATE=path] [TRUSTED=true: no sandbox, oracles only]
	$(PY) -m grader task=$(TASK) $(if $(CANDIDATE),candidate=$(CANDIDATE),) $(if $(TRUSTED),trusted=$(TRUSTED),)

grade-all: venv sandbox   ## every recorded task graded, one report in reports/all (md, html, png) [CANDIDATE=path]; coverage of the graded code in reports/coverage
	$(PY) -m grader.grade_all $(if $(CANDIDATE),candidate=$(CANDIDATE),)
	$(PY) -m grader.coverage

calibrate: venv sandbox   ## the oracle's CPU seconds per task and timed level + the speed probe -> grader/timing/budgets.yaml (L5/L6 budgets)
	$(PY) -m grader.timing.calibrate

# The oracle of a training and a serving task, and the catalog's too-slow defects, graded idle, beside two CPU-bound
# processes, two gradings at once, and pinned to one core (grader/timing/stability.py); last line stable=true|false
stability: venv sandbox   ## verdicts that hold on a loaded or slower machine: reports/stability/stability.md
	$(PY) -m grader.timing.stability

coverage-torch: venv   ## branch coverage of torch_sources/ while recording every task (references untouched)
	for t in $$($(PY) -c "from recorder.app import known_tasks; print(' '.join(known_tasks()))"); do \
	  $(PY) -m recorder task=$$t coverage=true out_dir=$$(mktemp -d) || exit 1; done
	$(PY) -m grader.coverage

# Each mutant is graded only at the level groups whose clean child executes its edit (grader/sweep/impact.py; the clean
# baseline is cached in reports/sweep/.cache), its L0-L4 in one child, children forked from a server that imported
# jax once (grader/isolation/forkserver.py). The same as a Hydra multirun: python -m grader.sweep -m 'task=glob(*)' 'defect=glob(*)'
# hydra/launcher=local (or cluster), then python -m grader.sweep aggregate=true (docs/SWEEP.md, issue 14).
# make sweep LAUNCHER=... (on the command line or in the environment) runs that form through the launcher: one job per
# (task, defect) pair, every task by every defect of the catalog; with local_submitit each is a process of its own
# (seconds even where the defect does not apply), so it is the cluster's form, tried here on a few pairs first.
sweep: venv sandbox   ## seeded-defect sweep of every recorded task (hours on 2 cores) [LAUNCHER=...: the multirun]; last line defects_caught=N/M strict_caught=S/M checks_tripped=K/L
ifeq ($(origin LAUNCHER),file)
	$(PY) -m grader.sweep --all --jobs $(JOBS)
else
	$(PY) -m grader.sweep -m 'task=glob(*)' 'defect=glob(*)' hydra/launcher=$(LAUNCHER)
	$(PY) -m grader.sweep aggregate=true
endif

# torch==2.13.0 first (the CPU build on this disk), then the lock with --no-deps: pip's own resolution of llamafactory
# would pull torchvision 0.28 / torchaudio 2.11, which do not load against torch 2.13 (tools/lf_parity/README.md).
# LF's PPO trainer needs TRL <= 0.9.6 while the package pins 0.24: TRL 0.9.6 goes to an overlay only the PPO run sees.
$(LFSTAMP): tools/lf_parity/requirements.lock tools/lf_parity/requirements-ppo-overlay.lock tools/lf_parity/requirements-pillow-overlay.lock
	test -x $(LFPY) || python3 -m venv $(VENV_LF)
	$(LFPY) -m pip install -q --upgrade pip
	$(LFPY) -m pip install -q torch==2.13.0
	$(LFPY) -m pip install -q --no-deps -r tools/lf_parity/requirements.lock
	rm -rf $(VENV_LF)/overlays/trl-0.9.6
	$(LFPY) -m pip install -q --no-deps --target $(VENV_LF)/overlays/trl-0.9.6 -r tools/lf_parity/requirements-ppo-overlay.lock
	rm -rf $(VENV_LF)/overlays/trl-0.9.6/tests $(VENV_LF)/overlays/trl-0.9.6/bin
	rm -rf $(VENV_LF)/overlays/pillow-13.0.0
	$(LFPY) -m pip install -q --no-deps --target $(VENV_LF)/overlays/pillow-13.0.0 -r tools/lf_parity/requirements-pillow-overlay.lock
	rm -rf $(VENV_LF)/overlays/pillow-13.0.0/bin
	$(LFPY) -I tools/lf_parity/check_env.py $(VENV_LF)/overlays/trl-0.9.6 $(VENV_LF)/overlays/pillow-13.0.0
	touch $(LFSTAMP)

lf-env: $(LFSTAMP)   ## LLaMA-Factory 0.9.5 in its own venv (.venv-lf; .venv and .venv-verifier untouched)

lf-parity: venv lf-env   ## every training task through LLaMA-Factory and the torch source: docs/LF_PARITY.md (~40 min)
	$(PY) -m tools.lf_parity task=all table=docs/LF_PARITY.md

stale: venv
	$(PY) -m recorder stale=true

test: venv sandbox    ## the CI suite: fast tests + the static independence contract
	-$(MAKE) harbor-env   # best effort: Harbor's own validation of the exports runs where Python 3.12 is (else skipped, saying why)
	$(PY) -m recorder stale=true
	.venv/bin/lint-imports --config pyproject.toml
	$(PYTEST) -n $(TEST_JOBS) --dist loadfile -m "not slow and not gpu"

test-full: venv sandbox   ## everything, slow tests included (every recorded task graded)
	$(PYTEST) -m "not gpu"

# SCALE=small: ~100M-parameter llama3 (tools/checkpoints_small.py, written on first use), every workload in its own
# process: step times, TTFT, decode tokens/s and peak memory per side (bench/bench_scale.py, docs/PERFORMANCE.md)
bench: venv           ## torch vs JAX, side by side: SFT, DPO and PPO step time; serving decode tokens/s (llama3, gemma4, gpt_oss) [SCALE=small]
ifeq ($(SCALE),small)
	$(PY) bench/bench_scale.py --scale small
else
	$(PY) bench/bench_sft.py
	$(PY) bench/bench_dpo.py
	$(PY) bench/bench_ppo.py
	$(PY) bench/bench_serving.py --family llama3
	$(PY) bench/bench_serving.py --family gemma4
	$(PY) bench/bench_serving.py --family gpt_oss
endif

assets: venv          ## regenerate the tiny checkpoints, tokenizer, datasets and images (byte-identical)
	$(PY) tools/make_tokenizer.py
	$(PY) tools/make_datasets.py
	$(PY) tools/make_checkpoints.py
	$(PY) tools/make_images.py
	$(PY) tools/make_vl_datasets.py
	$(PY) tools/make_vl_checkpoints.py

clean-venv:
	rm -rf .venv $(VENV_V)

# Harbor (PyPI harbor, Python >= 3.12) in its own venv, only to validate exported task directories (tools/harbor).
VENV_H := .venv-harbor
HSTAMP := $(VENV_H)/.installed-stamp
# Recursive (=): looked up only when the recipe runs.
HARBOR_PY312 = $(firstword $(wildcard /root/.pyenv/versions/3.12.1/bin/python3.12) $(shell command -v python3.12 2>/dev/null))

$(HSTAMP): tools/harbor/requirements.txt
	@test -n "$(HARBOR_PY312)" || { echo "harbor-env: needs Python 3.12: neither /root/.pyenv/versions/3.12.1/bin/python3.12 nor python3.12 on PATH" >&2; exit 1; }
	test -x $(VENV_H)/bin/python || $(HARBOR_PY312) -m venv $(VENV_H)
	$(VENV_H)/bin/python -m pip install -q --upgrade pip
	$(VENV_H)/bin/python -m pip install -q -r tools/harbor/requirements.txt
	touch $(HSTAMP)

harbor-env: $(HSTAMP)   ## Harbor (PyPI harbor, pinned in tools/harbor/requirements.txt) in its own venv (.venv-harbor) for tools/harbor/check_tasks.py

export: venv   ## every recorded task as a Harbor task bundle under exports/ (recorder/export.py) [TASKS=a,b]
	$(PY) -m recorder.export task=$(or $(TASKS),all) out=exports

locks: venv verifier   ## the agent's and the verifier's lock files, pinned by date (tools/make_locks.py) [DATE=YYYY-MM-DD]
	$(PY) -m tools.make_locks $(DATE)

export-check: venv sandbox   ## every task exported, its verifier run from the exported directory alone on the exported solution (tools/check_exports.py) [TASKS=a,b]
	$(PY) -m tools.check_exports task=$(or $(TASKS),all)
