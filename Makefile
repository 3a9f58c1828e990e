# Two commands: `make lab` and `make test`. Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PORT   ?= 8888

.PHONY: lab test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Stamps re-run the install whenever pyproject.toml changes.
$(VENV)/.lab-installed: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[lab]"
	touch $@

$(VENV)/.test-installed: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

# Containers often run as root, which JupyterLab refuses without --allow-root.
ROOT_ARGS := $(if $(filter 0,$(shell id -u)),--allow-root)

lab: $(VENV)/.lab-installed
	$(VENV)/bin/jupyter lab --notebook-dir=lessons --port=$(PORT) $(ROOT_ARGS) $(LAB_ARGS)

lint: $(VENV)/.test-installed
	$(VENV)/bin/ruff check parlearn tests

# Unit tests and every lesson (nbval, FAST mode) in one pytest run.
test: lint
	PARLEARN_FAST=1 $(PY) -m pytest $(PYTEST_ARGS)

bench: $(VENV)/.test-installed
	$(PY) -m parlearn.bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
