# Two commands do all the set-up on a fresh machine:
#   make demo    CP attention on 4 local CPU ranks, checked against unsplit attention
#   make test    the test suite
# Both create .venv and install ctxpar into it first, with the versions constraints.txt
# pins (torch 2.13.0, whose CPU wheel CI's wheelhouse serves; the transformers the tests
# enumerate); pyproject.toml itself accepts any torch>=2.6 for users elsewhere.

VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS  ?=

.PHONY: demo test bench gpu-check

$(STAMP): pyproject.toml constraints.txt
	@python3 -c 'import sys; sys.exit(sys.version_info < (3, 11) and "make demo / make test need Python 3.11 or newer (transformers 5.24 does); python3 is " + sys.version.split()[0])'
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt torch -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ctxpar demo $(ARGS)

# compileall: ctxpar's and the tests' bytecode, written once here, where the environment may forbid Python to
# write it as it imports (PYTHONDONTWRITEBYTECODE): every command, rank server and rank the suite starts compiled
# the modules it imports from source again (0.4 s of CPU for the command's alone)
test: $(STAMP)
	$(PY) -m compileall -q src tests
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/overhead.py $(ARGS)

# On a machine with a GPU and its own CUDA build of PyTorch; installs nothing. The CUDA
# tests, exactness per strategy, kernel efficiency: a table and gpu_check.json (about 5 min
# on one H200). GPU_PY=.venv/bin/python ARGS=--dry-run runs the same steps on the CPU.
GPU_PY ?= python3
gpu-check:
	PYTHONPATH=src $(GPU_PY) benchmarks/gpu_check.py $(ARGS)
