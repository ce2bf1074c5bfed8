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
	$(PIP) install -q -e '.[test]'
	touch $@

install: .venv/installed ## create .venv and install the package with its pinned stack

test: install ## run the test suite (what CI runs)
	$(PY) -m pytest -q

data: install ## fetch bigbench files and Austen novels into the cache
	$(PY) -m h2o.assets.data

model: install ## fetch SmolLM2-135M into the cache
	$(PY) -m h2o.assets.models fetch

tables: install ## regenerate the paper's tables from runs/
	$(PY) -m analysis tables --runs runs --out analysis/out

figures: install ## regenerate the figures from runs/
	$(PY) -m analysis figures --runs runs --out analysis/out

report: install ## analysis/out/REPORT.md: every paper number beside ours, with a verdict (any runs/, even empty)
	$(PY) -m analysis report --runs runs --out analysis/out

# Sweeps: h2o-run -m experiment=$(EXP) (conf/experiment/*.yaml). ARGS: extra Hydra overrides.
ARGS ?=
sweep: install ## run experiment EXP on LAUNCHER (basic|submitit_local: then tables, figures and the report; slurm: submit only the work left and return); DRY=1 lists the jobs and the Slurm arrays with resources and GPU-hours
ifneq ($(DRY),)
	$(PY) -m h2o.pipeline.launch experiment=$(EXP) --dry --list $(ARGS)
else ifeq ($(LAUNCHER),slurm)
	$(PY) -m h2o.pipeline.launch experiment=$(EXP) $(ARGS)
else
	@mkdir -p runs && rm -f runs/.sweep-failed
	$(PY) -m h2o.pipeline.run -m experiment=$(EXP) hydra/launcher=$(LAUNCHER) $(if $(WANDB),logger=wandb) $(ARGS) || touch runs/.sweep-failed
	$(MAKE) --no-print-directory tables figures report
	@if [ -e runs/.sweep-failed ]; then rm -f runs/.sweep-failed; echo "sweep: some jobs failed (listed above)"; exit 1; fi
endif

status: install ## done / running / queued / failed / left of experiment EXP (runs/ and the Slurm scheduler)
	$(PY) -m h2o.pipeline.status experiment=$(EXP) $(ARGS)

prefetch: install ## download every model and data set of experiment EXP into the caches (login node, before a Slurm sweep)
	$(PY) -m h2o.pipeline.prefetch experiment=$(EXP) $(ARGS)

# Benchmarks (issue targets). Sizes: prompt,batch pairs. Estimated 10-15 min on 2 idle cores at these defaults
# (measured: 33 min with BENCH_THREADS=1 beside four other jobs on 2 cores). On shared cores use BENCH_THREADS=1:
# two threads per process then wait on each other at every small op (decoding measured 5-10x slower).
BENCH_THREADS ?= 2
BENCH_LONG ?= 4096,8
BENCH_SHORT ?= 2048,1
BENCH_E2E ?= 512,2
BENCH_SIM ?= 1024
BENCH_GEN ?= 8
BENCH_REPEATS ?= 3
BENCH_OUT ?= runs/bench.jsonl
bench: install ## throughput, latency and KV memory vs full and transformers' caches (BENCH_* sizes)
	@mkdir -p $(dir $(BENCH_OUT))
	$(PY) -m h2o.bench --suite targets --model smollm2-135m --threads $(BENCH_THREADS) \
		--long $(BENCH_LONG) --short $(BENCH_SHORT) --e2e $(BENCH_E2E) --sim $(BENCH_SIM) \
		--gen $(BENCH_GEN) --repeats $(BENCH_REPEATS) --json $(BENCH_OUT) $(if $(WANDB),--runs runs)
	$(if $(WANDB),$(PY) -m h2o.pipeline.wandb_sync runs --experiment benchmark)

STREAM_TOKENS ?= 20000
STREAM_BUDGETS ?= 64,128,256
STREAM_CHUNK ?= 32
stream: install ## streaming perplexity on Austen: h2o vs streaming_llm vs local (STREAM_* sizes)
	$(PY) -m h2o.bench.streaming --text austen --tokens $(STREAM_TOKENS) --budgets $(STREAM_BUDGETS) \
		--chunk $(STREAM_CHUNK) --threads $(BENCH_THREADS) --runs runs --progress 100
	$(if $(WANDB),$(PY) -m h2o.pipeline.wandb_sync runs --experiment streaming --summary)

wandb: install ## mirror EXP's records in runs/ to wandb (offline unless WANDB_MODE=online; idempotent) and log its summary run
	$(PY) -m h2o.pipeline.wandb_sync runs --experiment $(EXP) --summary

.PHONY: help install test tables figures report data model bench stream sweep wandb status prefetch
