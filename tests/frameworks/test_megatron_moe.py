"""Megatron-Core 0.16.1's own MoELayer (router, all-to-all token dispatcher, experts, shared
expert) at expert_model_parallel_size = 2 on two CPU ranks next to refpar's single-device MoE layer
set to Megatron's conventions (refpar/conformance/megatron_moe.py, which lists the CPU patches and
why each is needed): one 2-rank MPI job, one forward and backward, float64. `make conformance` runs
this folder (not `make test`)."""

import json

import numpy as np
import pytest

from tests.mpi import mpiexec
from tests.numerics import CONTRACT, within

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def runs():
    proc = mpiexec(2, "-m", "refpar.conformance.megatron_moe", timeout=600)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_megatrons_moe_layer_under_ep2_is_refpars_to_the_contract(runs):
    """The same experts for every token (and DeepSeek's group score would pick others: the
    convention is what is matched); gates, output, the input's gradient and all 16 parameter
    gradients (router, 8 experts' gate/up/down on the rank that holds them, the shared expert) within
    1e-10 (measured 6e-16), with tokens crossing ranks both ways."""
    for row in runs["float64-sigmoid"]:
        assert row["dtype"] == "torch.float64"
        assert row["sent_away"] > 0, row  # the all-to-all carried tokens to the other rank's experts
        assert row["experts_differ"] == 0 and row["experts_differ_deepseek"] > 0, row
        assert within(max(row["gates"], row["out"], row["dx"]), CONTRACT), row
        assert len(row["grads"]) == 4 * 3 + 3 + 1  # this rank's 4 experts, the shared one, the router
        assert within(max(row["grads"].values()), CONTRACT), row


def test_megatrons_float32_sigmoid_bounds_the_as_shipped_run(runs):
    """As shipped, Megatron computes sigmoid(logits.float()): each logit l rounded to float32
    (relative 2^-24, moved through sigmoid's elasticity (1 - s) l <= |l|) and the score rounded
    again (2^-24): a score's relative error <= (1 + max|l|) 2^-24, and a normalised gate's (a ratio
    of such scores) twice that. Output, dx and the gradients carry the gates' error through sums of
    k = 3 gated expert outputs and the gates' own gradient: within (k + 1) times the gates' bound."""
    from refpar.conformance.megatron_moe import MOE, K, inputs

    params, _, x, _ = inputs()
    logits = x.reshape(-1, x.shape[-1]) @ params[MOE.router_name(0)].T  # (N, E)
    gates = 2 * (1 + float(np.max(np.abs(logits)))) * 2.0**-24  # 4.7e-7 here; measured 5.7e-8
    for row in runs["as-shipped"]:
        assert row["experts_differ"] == 0, row
        assert 1e-10 < row["gates"] <= gates, (row["gates"], gates)  # float32's trace is there
        assert within(max(row["out"], row["dx"], *row["grads"].values()), (K + 1) * gates), row
