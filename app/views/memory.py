import streamlit as st
from at_scale import show_at_scale
from family import family_picker
from last_run import last_run
from lesson_link import lesson_link

from refpar.config import ConfigError, TrainConfig, model_preset
from refpar.precision import PRECISIONS
from refpar.viz import comm, expected

SHOWN = ("dp", "zero1", "zero2", "zero3", "fsdp", "tp", "sp", "pp")
BATCH = TrainConfig().batch_size


def batch_for(n: int) -> int:
    """The global batch the page prices: refpar's default, or one sequence per rank when the ranks
    outnumber it (every data rank needs a sequence), the same for every strategy shown."""
    return max(BATCH, n)


@st.cache_data(max_entries=32)
def rank0_memory(n: int, microbatches: int, precision: str = "fp64",
                 model: str = "tiny") -> tuple[dict, dict]:
    """Rank 0's closed-form peak bytes by category per strategy for the preset `model` (every
    strategy's closed form counts fp64, fp32 and the 16-bit mixed runs), and why any is left out."""
    columns, skipped = {}, {}
    dtype = PRECISIONS[precision]
    for s in SHOWN:
        try:
            w = expected.workload(s, n, model_preset(model, dtype=dtype),
                                  TrainConfig(steps=1, batch_size=batch_for(n)),
                                  microbatches=microbatches if s == "pp" else 1)
            columns[f"{s} ({n})"] = comm.memory_by_rank(expected.closed_form_rows(w)[1])[0]
        except ConfigError as err:
            skipped[s] = str(err)
    return columns, skipped


st.title("Memory")
st.markdown(
    "Peak bytes on rank 0 of refpar's tiny GPT-2 or tiny Llama, by category, from the closed forms the "
    "memory ledger is tested against. Watch the optimizer state shrink from DP to ZeRO-1, the "
    "gradients at ZeRO-2 and the parameters at ZeRO-3, while TP and SP split activations too and "
    "PP holds only its stages (plus the activations its schedule keeps in flight). In bf16-mixed "
    "the ZeRO paper's own numbers appear: 2 bytes of parameters and 2 of gradients per parameter, "
    "and 4 of fp32 master weights plus 8 of fp32 moments, the 12 that ZeRO-1 shards first."
)
lesson_link(2)
a, b = st.columns(2)
# No limits on the boxes: a typed value reaches the page, which refuses it by the box's label.
n = a.number_input("ranks on the strategy's axis", value=4, key="memory_n", help=f"1 to {expected.MAX_WORLD}")
m = b.number_input("microbatches (pp)", value=4, key="memory_m", help=f"1 to the batch of {BATCH} sequences")
precision = st.radio("precision", ("fp64", "bf16-mixed"), horizontal=True)
model = family_picker()
for label, value, high in (("ranks on the strategy's axis", n, expected.MAX_WORLD),
                           ("microbatches (pp)", m, BATCH)):
    if not 1 <= value <= high:
        st.error(f"{label} = {value:,}: choose 1 to {high}")
        st.stop()
if precision != "fp64":
    lesson_link(13)  # where the 2 + 2 + 4 + 8 bytes come from, measured
if batch_for(int(n)) != BATCH:
    st.caption(f"A batch of {batch_for(int(n))} sequences, one per data rank (refpar's default is {BATCH}).")
columns, skipped = rank0_memory(int(n), int(m), precision, model)
if columns:
    st.plotly_chart(comm.memory_figure(columns, "peak bytes on rank 0, closed form"), width="stretch")
else:
    st.error(f"No strategy runs on {n} ranks of this model; choose fewer ranks on the strategy's axis.")
if skipped:  # one sentence naming what is left out and what to change here; refpar's reasons below it
    st.warning(f"Left out on {n} ranks: {', '.join(skipped)}; choose another number of ranks to see "
               f"{'it' if len(skipped) == 1 else 'them'}.")
    with st.expander("why each is left out (as `refpar train` would say it)"):
        st.markdown("\n".join(f"- **{s}**: {why}" for s, why in skipped.items()))
run = last_run()
if run is not None:
    summary = run["summary"]
    measured = comm.memory_by_rank(summary["memory_peak_bytes"] or [])
    closed = comm.memory_by_rank(summary["expected_memory_peak_bytes"] or [])
    pairs = {}
    for rank in sorted(measured):
        pairs[f"rank {rank} closed form"] = closed.get(rank, {})
        pairs[f"rank {rank} measured"] = measured[rank]
    st.subheader(f"The last real run: {run['label']}")
    st.plotly_chart(comm.memory_figure(pairs, "closed form next to measured, every rank"), width="stretch")
else:
    st.info("Launch a run on the Run for real page to see every rank's measured peaks beside these.")

show_at_scale("memory_scale", "llama3-8b", comm=False)
