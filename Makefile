# Two commands do all the set-up on a fresh machine:
#   make demo    CP attention on 4 local CPU ranks, checked against unsplit attention
#   make test    the test suite
# Both create .venv and install ctxpar into it first. torch is pinned to the CPU wheel
# here; pyproject.toml itself accepts any torch>=2.6 for users elsewhere.

VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS  ?=

.PHONY: demo test bench

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0 -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ctxpar demo $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/overhead.py $(ARGS)
