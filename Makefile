# The few commands a learner or a maintainer types. Everything runs inside .venv, made on demand.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: help install test test-fast lab site browser-check student notebooks bench lint clean python-matrix

# silence mkdocs-material's banner about MkDocs 2 (pyproject pins mkdocs<2)
export NO_MKDOCS_2_WARNING := 1

help:
	@echo "make lab        JupyterLab on the repository: your copies in student/, the solved chapters in notebooks/"
	@echo "make test       everything CI runs: library, oracles, notebooks (nbval), website build"
	@echo "make test-fast  the tests that start no rank (kinds unit and chapters): under a minute;"
	@echo "                .venv/bin/python -m pytest -m KIND tests runs one kind (tests/conftest.py)"
	@echo "make site       build the website into site/"
	@echo "make student    learner copies of the notebooks (no solutions) and the final project's template"
	@echo "                (student/project.py; minitp grade grades it) into student/; keeps copies you changed"
	@echo "                (make student FRESH=1 overwrites them)"
	@echo "make notebooks  re-execute every notebook in place (stored outputs)"
	@echo "make browser-check  build the site, open every chapter in headless Chromium, then learner copies"
	@echo "                    of 03 and 05 in JupyterLab; screenshots in build/screenshots"
	@echo "make bench      minitp against PyTorch's own implementations (not in CI)"
	@echo "make python-matrix  a fresh environment per Python (3.11, 3.12, 3.13): the tests and notebooks in each"

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else \
	  "minitp needs Python 3.11 or newer; $(PYTHON) is " + sys.version.split()[0] + ": make PYTHON=python3.11 ...")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[course,dev]"
	touch $(STAMP)

install: $(STAMP)

NBVAL := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

# Two pytest runs: the library and oracle tests and the website (strict build, pages in Chromium);
# then every chapter re-run by nbval against its stored outputs under PyTorch's plain kernels
# (ATEN_CPU_CAPABILITY=default: no AVX2, no AVX-512). They add in another order than this CPU's, as
# another learner's CPU does, so a stored output that prints float noise fails here, not on a laptop.
# Both run; the target fails if either did. Each runs in two pytest workers, a file per worker at a
# time (pytest-xdist): alone, a run keeps one of two cores busy, its ranks mostly starting or
# waiting (2-core machine: tests 14:56 -> 9:44, notebooks 4:41 -> 3:19). `make test XDIST=` runs one.
# nbval runs each chapter as a learner's kernel does (MINITP_LIVE=1): a live control runs the setting
# it shows and does not rebuild its static twin, whose output nbval ignores anyway; the stored twins
# are the website's, checked by the chapters' tests (13 chapters: notebooks 6:09 -> 4:44).
XDIST ?= -n 2 --dist loadfile
test: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) tests; tests=$$?; \
	MINITP_LIVE=1 ATEN_CPU_CAPABILITY=default $(BIN)/python -m pytest -q $(XDIST) notebooks $(NBVAL); \
	notebooks=$$?; test $$tests -eq 0 -a $$notebooks -eq 0

# The kinds of tests/conftest.py's KINDS that start no rank (a test of them that does fails): unit
# and chapters. Not the oracles, the exercises (their checkers run answers on 2-4 ranks and wait out the
# hangs they name: 2.5-3 minutes alone), the website or the notebooks; `make test` runs them all.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests -m "unit or chapters"

# JupyterLab opens at the repository root, its file browser in student/ (the learner's copies, made
# here when missing; a copy you changed is kept). MINITP_PROGRESS=1: runs of several seconds show a
# live progress line (never stored: make notebooks and nbval run without it). MINITP_LIVE=1: a live
# control runs only the setting it shows (no website grid, which make notebooks stores). Root (Docker, cloud
# notebooks) needs --allow-root. No news: JupyterLab 4 asks on first start whether to fetch Jupyter's news
# feed unless its notification setting fetchNews has a value; an overrides.d file in .venv gives it "false"
# (tools/lab-overrides.json, a default: Settings > Notifications can still turn it on), and news_url=None keeps the server from fetching.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.d

lab: $(STAMP)
	$(BIN)/python -m minitp.exercises.student notebooks student --keep-changed
	mkdir -p $(LAB_OVERRIDES)
	cp tools/lab-overrides.json $(LAB_OVERRIDES)/minitp.json
	MINITP_PROGRESS=1 MINITP_LIVE=1 $(BIN)/jupyter lab --ServerApp.root_dir=. --LabApp.default_url=/lab/tree/student \
	  --LabApp.news_url=None $(ALLOW_ROOT)

site: $(STAMP)
	$(BIN)/mkdocs build --strict

browser-check: site
	$(BIN)/python tools/browser_check.py site --screenshots build/screenshots --notebooks notebooks
	$(BIN)/python tools/lab_check.py --screenshots build/screenshots

student: $(STAMP)
	$(BIN)/python -m minitp.exercises.student notebooks student $(if $(FRESH),,--keep-changed)

notebooks: $(STAMP)
	for nb in notebooks/[0-9][0-9]_*.ipynb; do \
	  $(BIN)/jupyter nbconvert --to notebook --execute --inplace "$$nb" || exit 1; \
	done

# Every comparison (ring, DDP, FSDP, TP, PP; tiny and small models), alternating in one run:
# one JSON line each; build/bench.json and the table build/bench.md rewritten after each. About 10 minutes
# on 2 quiet cores; a row waits (--wait 30 s) while other processes use over a quarter of the machine
# (--max-foreign 0.25), and the rows left after 1200 s (--budget-s) are recorded as skipped.
bench: $(STAMP)
	$(BIN)/python benchmarks/harness.py --out build/bench.json

# Not in CI: each Python's environment, install and run take 10-20 minutes on 2 cores.
python-matrix:
	tools/python_matrix.sh $(VERSIONS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf site build/screenshots .pytest_cache  # never student/: it holds the learner's work
