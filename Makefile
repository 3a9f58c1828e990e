# Two commands: `make lab` and `make test`. Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PORT   ?= 8888

.PHONY: lab test lint bench browser-test gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Notebooks are committed without outputs: in a git checkout, nbstripout runs as a git
# clean filter (.gitattributes names it), so working through a lesson in JupyterLab, which
# autosaves outputs, leaves `git status` clean. The filter lives in .git/config, so every
# install step (re)writes it.
define output_filter
	if git rev-parse --git-dir >/dev/null 2>&1; then \
	  git config filter.nbstripout.clean "'$(abspath $(VENV))/bin/nbstripout' --keep-id" && \
	  git config filter.nbstripout.smudge cat && \
	  git config diff.ipynb.textconv "'$(abspath $(VENV))/bin/nbstripout' -t"; \
	fi
endef

# Stamps re-run the install whenever pyproject.toml changes.
$(VENV)/.lab-installed: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[lab]"
	@$(output_filter)
	touch $@

$(VENV)/.test-installed: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[test]"
	@$(output_filter)
	touch $@

$(VENV)/.browser-installed: pyproject.toml $(VENV)/.test-installed
	$(PY) -m pip install --quiet -e ".[test,lab,browser]"
	touch $@

# Containers often run as root, which JupyterLab refuses without --allow-root.
ROOT_ARGS := $(if $(filter 0,$(shell id -u)),--allow-root)

# `PARLEARN_FAST=1 make lab` opens the lessons at FAST sizes; LAB_ARGS goes to jupyter lab.
lab: $(VENV)/.lab-installed
	$(VENV)/bin/jupyter lab --notebook-dir=lessons --port=$(PORT) $(ROOT_ARGS) $(LAB_ARGS)

lint: $(VENV)/.test-installed
	$(VENV)/bin/ruff check parlearn tests tests_browser

# Unit tests and every lesson (nbval, FAST mode) in one pytest run.
test: lint
	PARLEARN_FAST=1 $(PY) -m pytest $(PYTEST_ARGS)

bench: $(VENV)/.test-installed
	$(PY) -m parlearn.bench $(BENCH_ARGS)

# Every lesson in JupyterLab in headless Chromium (Debian's `chromium` package; or set
# PARLEARN_CHROMIUM): Run All, no errors, every dashboard redraws when a control moves.
browser-test: $(VENV)/.browser-installed
	PARLEARN_FAST=1 $(PY) -m pytest tests_browser -v $(PYTEST_ARGS)

# On a CUDA machine: every exactness test's cuda case, then the bench on the GPU, whose rows
# are stored (with device, date, command) as the GPU figures the lessons show beside their own.
gpu-check: $(VENV)/.test-installed
	@$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else \
	  'gpu-check: torch sees no CUDA device (install a CUDA build of torch)')"
	PARLEARN_FAST=1 $(PY) -m pytest tests -k cuda -q $(PYTEST_ARGS)
	$(PY) -m parlearn.bench --device cuda --json gpu-bench.json --record

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
