# The few commands a learner or a maintainer types. Everything runs inside .venv, made on demand.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: help install test test-fast lab site student notebooks bench lint clean

help:
	@echo "make lab        JupyterLab on the course notebooks (learn)"
	@echo "make test       everything CI runs: library, oracles, notebooks (nbval), website build"
	@echo "make site       build the website into site/"
	@echo "make student    learner copies of the notebooks (no solutions) into student/"
	@echo "make notebooks  re-execute every notebook in place (stored outputs)"
	@echo "make bench      minitp against PyTorch's own implementations (not in CI)"

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[course,dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests -m "not notebooks and not site"

lab: $(STAMP)
	$(BIN)/jupyter lab notebooks

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_ddp.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf site student .pytest_cache
