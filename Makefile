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

demo: $(STAMP)
	$(PY) -m refpar train --model tiny --steps 200

lint: $(STAMP)
	$(PY) -m ruff check .

test: $(STAMP) lint
	$(PY) -m pytest -q

app: $(STAMP)
	$(PY) -m refpar app

bench: $(STAMP)
	$(PY) benchmarks/model_step.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
