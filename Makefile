# Every target bootstraps its own virtual environment (.venv) when it is missing or older than
# pyproject.toml, so `make demo` and `make test` work on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# MPICH busy-polls; with more ranks than cores this halves the run time (ENVIRONMENT.md).
export MPIR_CVAR_ENABLE_HEAVY_YIELD := 1

.PHONY: demo test lint bench app clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[all]'
	touch $(STAMP)

# The 8-rank 3D example: 2 pipelines of 2 stages, each stage tensor-parallel over 2 ranks.
# One BLAS thread per rank: 8 ranks already oversubscribe 2 cores, and BLAS threads on top made
# tiny steps several times slower.
demo: $(STAMP)
	OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 $(VENV)/bin/mpiexec -n 8 $(PY) -m refpar train --mesh dp=2,tp=2,pp=2 --microbatches 4 --steps 10 --check

lint: $(STAMP)
	$(PY) -m ruff check .

# The suite includes `refpar verify --quick` (tests/test_engine.py): every strategy combination.
# One BLAS thread: the tiny test models gain nothing from more, and the MPI jobs already use every
# core (with two OpenBLAS threads a tiny training run took 10x longer on a busy 2-core machine).
test: $(STAMP) lint
	OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 $(PY) -m pytest -q

app: $(STAMP)
	$(PY) -m refpar app

bench: $(STAMP)
	$(PY) benchmarks/model_step.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
