# H2O harness. `make help` lists the targets.
SHELL := /bin/bash
PY ?= .venv/bin/python
PIP ?= .venv/bin/pip
EXP ?= default
LAUNCHER ?= basic
DRY ?=

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
	$(PY) -m h2o.data

model: install ## fetch SmolLM2-135M into the cache
	$(PY) -m h2o.models fetch

tables: install ## regenerate the paper's tables from runs/
	$(PY) -m analysis tables --runs runs --out analysis/out

figures: install ## regenerate the figures from runs/
	$(PY) -m analysis figures --runs runs --out analysis/out

.PHONY: help install test tables figures data model
