"""Properties the closed forms must have for any shape, checked on random models (hypothesis)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from refpar.analysis.presets import ModelSpec
from refpar.analysis.scale import layer_activation_bytes, stage_params

shapes = st.builds(
    lambda heads, head_size, kv_div, layers, swiglu, dropout, vocab: ModelSpec(
        "random", layers, heads * head_size, heads, vocab_size=vocab, seq_len=4096,
        global_batch=64, n_kv_head=heads // kv_div, mlp="swiglu" if swiglu else "gelu",
        dropout=dropout),
    heads=st.sampled_from([8, 16, 32]), head_size=st.sampled_from([64, 128]),
    kv_div=st.sampled_from([1, 2, 8]), layers=st.sampled_from([8, 16, 24]),
    swiglu=st.booleans(), dropout=st.booleans(), vocab=st.integers(1000, 200_000),
)


@settings(max_examples=60, deadline=None)
@given(spec=shapes, t=st.sampled_from([1, 2, 4, 8]), b=st.sampled_from([1, 2, 4]),
       s=st.sampled_from([512, 2048, 4096]))
def test_recomputing_more_or_splitting_more_never_keeps_more(spec, t, b, s):
    # Korthikanti et al. 2022, Section 5: full <= selective <= none; sequence parallelism only
    # divides what tensor parallelism left whole (Section 4.2.2).
    def act(**kw):
        return layer_activation_bytes(spec, b, s, tp=t, **kw)

    for sp in (False, True):
        assert act(sp=sp, recompute="full") <= act(sp=sp, recompute="selective") <= act(sp=sp)
    assert act(sp=True) <= act(sp=False)


@settings(max_examples=40, deadline=None)
@given(spec=shapes, t=st.sampled_from([1, 2, 4, 8]))
def test_more_pipeline_stages_never_put_more_weights_on_any_stage(spec, t):
    # The weights of the fullest stage (first: embedding + its blocks; last: its blocks + head).
    # memory_per_rank reports the stage with the most bytes in total, activations included, which
    # can switch from the last stage to the first as p grows; the weights per stage cannot grow.
    def fullest(p):
        (fs, fe), (ls, le) = stage_params(spec, t, p, 1)
        return max(fs + fe, ls + le)

    weights = [fullest(p) for p in (1, 2, 4, 8)]
    assert all(a >= b for a, b in zip(weights, weights[1:], strict=False)), weights
