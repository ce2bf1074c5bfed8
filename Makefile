# H2O harness. `make help` lists the targets.
SHELL := /bin/bash
PY ?= .venv/bin/python
PIP ?= .venv/bin/pip
EXP ?= default
LAUNCHER ?= basic
DRY ?=
# WANDB=1: sweep, bench and stream mirror their records to wandb (offline unless WANDB_MODE=online)
WANDB ?=

.DEFAULT_GOAL := help

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

.venv/installed: pyproject.toml
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0          # CPU wheel here, CUDA build on a GPU node: same pin
	DISABLE_CUDA=1 $(PIP) install -q -e '.[test]'  # DISABLE_CUDA: hqq's sdist (test extra) would try to build CUDA kernels
	touch $@

install: .venv/installed ## create .venv and install the package with its pinned stack

test: install ## run the test suite (what CI runs) in a shuffled order; TEST_SEED=<n> repeats an order; tests/test_slurm_real.py brings a one-node Slurm up and down itself (root)
	@echo "make test: test order shuffled with seed $(TEST_SEED); this order again: make test TEST_SEED=$(TEST_SEED)"
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile -p randomly --randomly-seed=$(TEST_SEED) --durations=15; \
	status=$$?; echo "make test: seed $(TEST_SEED) (exit $$status); this order again: make test TEST_SEED=$(TEST_SEED)"; \
	exit $$status

slurm-up: ## start the one-node Slurm of the tests (root; installs the Debian packages if missing); then export SLURM_CONF=/tmp/h2o-slurm/slurm.conf
	bash tests/slurm/up.sh

slurm-down: ## stop it
	bash tests/slurm/down.sh

data: install ## the Austen novels and Moby-Dick into the cache, and the bb_* tasks converted (BIG-bench's files: H2O_BIGBENCH=<dir>, docs/protocols.md)
	$(PY) -m h2o.assets.data

sources: install ## one line per external artifact: pinned version and digest, cached here or not, still offered by its index or not, what needs it (exit 0)
	$(PY) -m h2o.assets.sources

model: install ## fetch SmolLM2-135M into the cache
	$(PY) -m h2o.assets.models fetch

runs:  # the records' folder the sweeps write and the analysis reads (made once, empty until a sweep)
	@mkdir -p $@

tables: install | runs ## regenerate the paper's tables from runs/
	$(PY) -m analysis tables --runs runs --out analysis/out

figures: install | runs ## regenerate the figures from runs/
	$(PY) -m analysis figures --runs runs --out analysis/out

report: install | runs ## analysis/out/REPORT.md: every paper number beside ours, with a verdict (any runs/, even empty)
	$(PY) -m analysis report --runs runs --out analysis/out

docs-results: install ## docs/results/*.md and their figures, regenerated from the study records committed under studies/<study>/
	$(PY) -m analysis.results_pages --studies studies --out docs/results

leaderboard: install ## docs/results/leaderboard.md and its figures: every method against the KV it keeps, per task family, from the committed study records (also part of docs-results)
	$(PY) -m analysis.leaderboard --studies studies --out docs/results

# Sweeps: h2o-run -m experiment=$(EXP) (conf/experiment/*.yaml). ARGS: extra Hydra overrides.
ARGS ?=
# An experiment's companions, ALSO_<exp>: experiments that sweep (and DRY=1, LAUNCHER=slurm, status, prefetch) take
# after it, each its own sweep, unless ARGS is given. The default's: its third finding, long generation
# (conf/experiment/default_long_generation.yaml, records under runs/default/ too; full's run first, in its sweep).
ALSO_default = default_long_generation
ALSO = $(if $(ARGS),,$(ALSO_$(EXP)))
# $(call EACH,<X>_ONE): the command X_ONE for EXP, then for each companion (&&: the first failure stops)
EACH = $(call $(1),$(EXP))$(foreach e,$(ALSO), && $(call $(1),$(e)))
DRY_ONE = $(PY) -m h2o.pipeline.run -m experiment=$(1) hydra/launcher=slurm --dry --list $(ARGS)
SLURM_ONE = $(PY) -m h2o.pipeline.run -m experiment=$(1) hydra/launcher=slurm $(ARGS)
RUN_ONE = $(PY) -m h2o.pipeline.run -m experiment=$(1) hydra/launcher=$(LAUNCHER) $(if $(WANDB),logger=wandb) $(ARGS); \
	rc=$$?; [ $$rc = 2 ] && exit 2; [ $$rc = 0 ] || touch runs/.sweep-failed;
sweep: install | runs ## run experiment EXP (and its companions, ALSO_<exp>) on LAUNCHER (basic|submitit_local: then tables, figures and the report, unless the sweep was refused (exit 2); slurm: submit only the work left and return); DRY=1 lists the jobs and the Slurm arrays with resources and GPU-hours
ifneq ($(DRY),)
	$(call EACH,DRY_ONE)
else ifeq ($(LAUNCHER),slurm)
	$(call EACH,SLURM_ONE)
else
	@rm -f runs/.sweep-failed
	$(foreach e,$(EXP) $(ALSO),$(call RUN_ONE,$(e)))
	$(MAKE) --no-print-directory tables figures report
	@if [ -e runs/.sweep-failed ]; then rm -f runs/.sweep-failed; echo "sweep: some jobs failed (listed above)"; exit 1; fi
endif

STATUS_ONE = $(PY) -m h2o.pipeline.status experiment=$(1) $(ARGS)
status: install ## done / running / queued / failed / left of experiment EXP and its companions (runs/ and the Slurm scheduler)
	$(call EACH,STATUS_ONE)

PREFETCH_ONE = $(PY) -m h2o.pipeline.prefetch experiment=$(1) $(ARGS)
prefetch: install ## download every model and data set of experiment EXP and its companions into the caches (login node, before a Slurm sweep)
	$(call EACH,PREFETCH_ONE)

# Benchmarks: the decode, memory and simulated-forward targets as one run of experiment=bench (h2o/bench/targets.py), recorded under
# runs/bench/ like every run (a finished record is not measured again: move it away or set ARGS=experiment_name=...).
# Sizes: prompt,batch pairs. Measured 7 min 53 s - 8 min 31 s on 2 idle cores at these defaults (and 33 min with
# BENCH_THREADS=1 beside four other jobs on 2 cores). On shared cores use BENCH_THREADS=1: two threads per process
# then wait on each other at every small op (decoding measured 5-10x slower).
TEST_WORKERS ?= 2  # make test: pytest-xdist processes, each test file on one (tests/slurm and the model cache are shared)
# make test: torch/OpenMP threads per worker (and per process a test starts). 2 workers x 2 threads on 2 cores spin
# against each other at every small op: test_sliding_window + test_paths measured 397 s at the default, 36 s at 1.
TEST_THREADS ?= 1
# make test: the shuffle's seed (pytest-randomly), drawn once per make (:=) unless given
TEST_SEED ?= $(shell python3 -c 'import random; print(random.randrange(1, 10**6))')
TEST_SEED := $(strip $(TEST_SEED))
BENCH_THREADS ?= 2
BENCH_LONG ?= 4096,8
BENCH_SHORT ?= 2048,1
BENCH_E2E ?= 512,2
BENCH_SIM ?= 1024
BENCH_MEMORY ?= 1024,8
BENCH_GEN ?= 8
BENCH_SHORT_GEN ?= 64
BENCH_REPEATS ?= 3
BENCH_METHODS ?= 512,1
# the long-generation section (h2o/bench/long_generation.py): generated tokens,batch (the field's 2048,8 on a GPU;
# smaller on a CPU); empty: left out
BENCH_LONG_GEN ?= 128,2
# the prefill section (python -m h2o.bench prefill): prompt lengths, comma-separated; empty: left out. About 2 min
# at 1024 tokens on idle cores (15 processes: each policy, transformers' sdpa and eager)
BENCH_PREFILL ?= 1024
bench: install ## the benchmark targets: decode throughput, KV bytes, largest batch (memory cap on CUDA, estimate on the CPU), simulated forward vs full and transformers' caches, then each policy's prefill beside sdpa and eager (BENCH_* sizes)
	$(PY) -m h2o.pipeline.run experiment=bench threads=$(BENCH_THREADS) 'task.long=[$(BENCH_LONG)]' \
		'task.short=[$(BENCH_SHORT)]' 'task.e2e=[$(BENCH_E2E)]' task.sim=$(BENCH_SIM) 'task.memory=[$(BENCH_MEMORY)]' \
		task.gen_len=$(BENCH_GEN) task.short_gen=$(BENCH_SHORT_GEN) task.repeats=$(BENCH_REPEATS) \
		'task.methods=[$(BENCH_METHODS)]' $(if $(BENCH_LONG_GEN),'task.long_gen=[$(BENCH_LONG_GEN)]',task.long_gen=null) \
		$(if $(WANDB),logger=wandb) $(ARGS)
	$(if $(BENCH_PREFILL),$(PY) -m h2o.bench prefill --lengths $(BENCH_PREFILL) --threads $(BENCH_THREADS))

# Streaming: one run per policy x budget x chunk of experiment=streaming (conf/experiment/streaming.yaml), recorded
# under runs/streaming/ like every run (a finished record is not run again; a failed job leaves the others). Then
# python -m analysis.streaming_study prints the window table and each policy's chunked run beside its token-by-token
# one (perplexity change, speed-up). STREAM_COMPARE_CHUNK=0: no chunked runs. Policy options: STREAM_POLICIES=h2o ARGS=policy.score=mean.
STREAM_TOKENS ?= 20000
STREAM_BUDGETS ?= 96,192,384
STREAM_POLICIES ?= h2o,streaming_llm,local
STREAM_CHUNK ?= 1
STREAM_COMPARE_CHUNK ?= 32
STREAM_OUT ?= analysis/out/streaming
comma := ,
STREAM_CHUNKS = $(STREAM_CHUNK)$(if $(filter-out 0 $(STREAM_CHUNK),$(STREAM_COMPARE_CHUNK)),$(comma)$(STREAM_COMPARE_CHUNK))
stream: install ## streaming perplexity on Austen = h2o-run -m experiment=streaming, one record per policy x budget x chunk (token by token, the authors' protocol, and chunks of 32), then the window table and chunk comparison (STREAM_* sizes)
	$(PY) -m h2o.pipeline.run -m experiment=streaming threads=$(BENCH_THREADS) task.tokens=$(STREAM_TOKENS) \
		policy=$(STREAM_POLICIES) policy.budget=$(STREAM_BUDGETS) task.chunk=$(STREAM_CHUNKS) \
		$(if $(WANDB),logger=wandb) $(ARGS); rc=$$?; [ $$rc = 2 ] && exit 2; \
	$(PY) -m analysis.streaming_study $${H2O_RUNS:-runs}/streaming --out $(STREAM_OUT) || exit $$?; \
	[ $$rc = 0 ] || { echo "stream: some jobs failed (listed above)"; exit 1; }

GPU_CHECK_OUT ?= runs/gpu_check.json
gpu-check: install ## on one GPU (<= 10 min): equivalence in fp32/fp16/bf16, launches and syncs, decode and simulated ratios -> one JSON
	$(PY) -m h2o.bench.gpu_check --json $(GPU_CHECK_OUT)

wandb: install ## mirror EXP's records in runs/ to wandb (offline unless WANDB_MODE=online; idempotent) and log its summary run
	$(PY) -m h2o.pipeline.wandb_sync runs --experiment $(EXP) --summary

# Parity with kvpress (outside CI): kvpress 0.5.5 in its own virtualenv .parity-venv (torch 2.13.0 first, then
# kvpress with its transformers pin), each of its presses beside the harness's method on the same SmolLM2 prompts;
# records under runs/parity/ (resumable), table in docs/results/parity.md. PARITY_ARGS: python -m h2o.parity
# options (--contexts, --needles, --context-len, --cont-len, --ratios, --methods, --decode, --out). Measured with
# --contexts 2 --needles 1 --context-len 1024 --cont-len 128 --ratios 0.8 --decode: 41 min (kvpress side) beside
# 31 min (ours) on 2 shared cores at load ~12; the defaults (2 x 2,048-token contexts, 2 needles, 3 ratios) are
# several times that. PARITY_ARGS=--golden instead records CI's golden numbers (kvpress on the committed tiny model,
# tests/data/parity_golden/kvpress.json; about a minute) and checks ours against them.
PARITY_ARGS ?= --decode
parity: install ## kvpress 0.5.5 beside the harness, same prompts (own venv .parity-venv; PARITY_ARGS) -> docs/results/parity.md
	tools/parity/setup_venv.sh .parity-venv
	$(PY) -m h2o.parity.driver $(PARITY_ARGS)

.PHONY: help install test slurm-up slurm-down tables figures report docs-results leaderboard data sources model bench stream sweep wandb status prefetch gpu-check parity
