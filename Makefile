# Every target bootstraps its own virtual environment (.venv) when it is missing or older than
# pyproject.toml, so `make demo` and `make test` work on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-kernels conformance lint bench app clean

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
# Two pytest workers (pytest-xdist), a test file each at a time (--dist loadfile: a file's module
# fixtures, MPI runs among them, are made once): the single-process tests then use both cores, as
# the MPI jobs already did. Under a load of 8-20 on 2 cores the whole suite took 34 minutes so and 83
# one file after another.
test: $(STAMP) lint
	OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile

# The single-process numeric tests under four OpenBLAS kernel families (SkylakeX, Haswell,
# Sandybridge, Prescott; those this CPU can run, at least three): each sums in its own order, so a
# bound that holds on one machine only is caught here (tests/numerics.py). The files: the layers and
# the whole model against finite differences (test_model_gradients), the MoE layer and MoE model
# (test_moe, test_moe_model), mixed precision (test_precision), the model on other array namespaces
# and against PyTorch (test_model_backends, test_model_torch), Llama's layers and model against finite
# differences, torch and Hugging Face (test_llama_layers, test_llama_hf), the MoE single-device reference's
# microbatches and the Markov corpus. The lessons' printed numbers are left out: their commands run
# MPI jobs, ~6 minutes per family on 2 cores (they passed under Haswell when the bounds were set).
KERNEL_TESTS := tests/test_model_gradients.py tests/test_moe.py tests/test_moe_model.py \
	tests/test_precision.py tests/test_model_backends.py tests/test_model_torch.py \
	tests/test_llama_layers.py tests/test_llama_hf.py tests/test_fp8.py \
	tests/test_moe_pipeline.py::test_one_microbatch_is_the_global_batch_and_dropless_unweighted_microbatches_only_accumulate \
	tests/test_train.py::test_markov_floor_is_the_empirical_mean_negative_log_likelihood_of_the_chain
test-kernels: $(STAMP)
	$(PY) benchmarks/bound_ratios.py $(KERNEL_TESTS)

# Megatron-Core's GPTModel and DeepSpeed's ZeRO against refpar (tests/frameworks/, refpar/conformance/
# megatron_cases.py and deepspeed_cases.py), torchao's FP8 casts against refpar/fp8/: their extras
# installed once (DS_BUILD_OPS=0: no compiled DeepSpeed ops, the cases use torch's AdamW), then the
# 2-rank jobs and the single-process torchao tests. Kept out of `make test`, which
# must stay within 15 minutes on 2 cores.
CONFORMANCE_STAMP := $(VENV)/.conformance-installed
$(CONFORMANCE_STAMP): $(STAMP)
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet -e '.[all,megatron,deepspeed,torchao]'
	touch $(CONFORMANCE_STAMP)

conformance: $(CONFORMANCE_STAMP)
	OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 $(PY) -m pytest -q tests/frameworks

app: $(STAMP)
	$(PY) -m refpar app

bench: $(STAMP)
	$(PY) benchmarks/model_step.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
