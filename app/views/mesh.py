import math

import streamlit as st
from at_scale import show_at_scale
from family import family_picker
from last_run import last_run
from page_words import mesh_in_page_words

from refpar.analysis.closed_forms import MOMENTS
from refpar.config import MESH_AXES, ConfigError, Plan, TrainConfig
from refpar.viz import mesh_grid
from refpar.viz.expected import DP_STRATEGIES

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "dualpipev")
MAX_AXIS, MAX_M, MAX_BATCH = mesh_grid.MAX_RANKS, 16, 256


BALANCED = ("MoE routing priced as balanced (an assumption): in each microbatch of T tokens every expert "
            "receives its share T k / E of the T k assignments, from each data rank in proportion to its "
            "tokens, and keeps up to the capacity the run computes; each kept assignment is its own "
            "(token, ep rank) pair, exact for top-1 and an upper bound on the all-to-all rows otherwise.")


def routing_of(moe: dict | None):
    """The kept and pair counts a MoE mesh is priced with: a run's (its summary's "moe" field), else
    balanced."""
    return mesh_grid.run_routing(moe, "the run") if moe else None


@st.cache_data(max_entries=32)
def step_of_every_rank(model, cfg, sizes: dict, plan, moe: dict | None) -> dict:
    """Rank -> its moments of the step: computed once per mesh, whichever moment or rank is shown."""
    return {r: mesh_grid.step_moments(model, cfg, sizes, plan, r, routing_of(moe))
            for r in range(math.prod(sizes.values()))}


@st.cache_data(max_entries=32)
def checked(model, cfg, sizes: dict, plan) -> dict:
    return mesh_grid.check_mesh(model, cfg, sizes, plan)


@st.cache_data(max_entries=64)
def facts_of(model, cfg, sizes: dict, plan, rank: int, moe: dict | None):
    return mesh_grid.rank_facts(model, cfg, sizes, plan, rank, routing_of(moe))


def last_run_of(sizes: dict, plan, preset: str, cfg: TrainConfig) -> dict | None:
    """The last Run for real result if it ran this very mesh, plan and model (its command's arguments
    are this page's) and kept its routing counts, else None."""
    last = last_run()
    if not last or not (last["summary"].get("moe") or {}).get("microbatch_pair_counts"):
        return None
    args = mesh_grid.train_args(sizes, plan, preset, last["summary"]["steps"], moe=True, cfg=cfg)
    return last if last.get("key") == ("mesh", *args) else None


def pick_rank(key: str) -> None:
    """A click on a rank of the grid selects it (the rank is each point's customdata)."""
    points = st.session_state[key].selection.points
    if points:
        st.session_state["mesh_rank"] = int(points[0]["customdata"])


st.title("Whole mesh")
st.markdown(
    "Every rank of a run over pp, dp (ZeRO 0-3 or FSDP), ep, cp and tp (with sp), laid out as "
    "refpar/mesh.py lays them (tp fastest). Click a rank, or pick it below, to see what it holds: "
    "read off the functions the engine places data with (its stage's blocks, its heads and vocabulary "
    "rows, its samples, its sequence positions, its experts, its ZeRO shard) and the bytes a run's "
    "ledger measures. Then step through a training step: what each rank gathers, frees and sends.")

def within(label: str, value: int, high: int) -> int:
    """`value` if the page can use it, else one sentence naming its box: the boxes have no limits, so
    that a typed value reaches the page and is refused here, not left in a box the page ignores."""
    if not 1 <= value <= high:
        st.error(f"{label} = {value:,}: choose 1 to {high}")
        st.stop()
    return int(value)


cols = st.columns(5)
sizes = {a: c.number_input(a, value=v, key=f"mesh_{a}", help=f"1 to {MAX_AXIS}, all five multiplying to at "
                           f"most {mesh_grid.MAX_RANKS}")
         for a, c, v in zip(MESH_AXES, cols, (2, 2, 1, 1, 2), strict=True)}
a, b, c, d, e, f = st.columns(6)
strategy = a.selectbox("data parallelism", DP_STRATEGIES, index=3, key="mesh_strategy",
                       help="over each unit's replicas: dp x cp (and ep, in a MoE model)")
schedule = b.selectbox("schedule", SCHEDULES, disabled=sizes["pp"] == 1, key="mesh_schedule")
m = c.number_input("microbatches", value=2, key="mesh_m", help=f"1 to {MAX_M}")
batch = d.number_input("batch size", value=TrainConfig().batch_size, key="mesh_batch",
                       help=f"sequences in a step, 1 to {MAX_BATCH}")
seq = e.number_input("sequence length", value=TrainConfig().seq_len, key="mesh_seq",
                     help="tokens in a sequence, up to the model's positions")
sp = f.checkbox("sequence parallel (sp)", value=False, key="mesh_sp", disabled=sizes["tp"] == 1)
preset = family_picker()
sizes = {a: within(a, n, MAX_AXIS) for a, n in sizes.items()}
m, batch = within("microbatches", m, MAX_M), within("batch size", batch, MAX_BATCH)
model = mesh_grid.mesh_model(preset, sizes["ep"])
seq = within("sequence length", seq, model.n_positions)
cfg = TrainConfig(steps=1, batch_size=batch, seq_len=seq)
plan = Plan(schedule=schedule if sizes["pp"] > 1 else None, microbatches=m, sp=sp and sizes["tp"] > 1,
            zero=int(strategy[-1]) if strategy.startswith("zero") else 0, fsdp=strategy == "fsdp",
            chunks=2 if schedule == "interleaved-1f1b" and sizes["pp"] > 1 else None)
try:
    sizes = checked(model, cfg, sizes, plan)
except ConfigError as err:
    st.error(mesh_in_page_words(str(err), strategy))
    st.stop()
world = math.prod(sizes[a] for a in MESH_AXES)
moe = None  # the run's routing counts the page prices a MoE mesh with (None: balanced)
if sizes["ep"] > 1:
    st.caption(f"ep > 1: every block is a Mixture-of-Experts layer of {model.moe_experts} experts, "
               f"top-{model.moe_top_k}")
    run = last_run_of(sizes, plan, preset, cfg)
    choices = ["balanced (assumed)"] + ([f"the last run's counts ({run['label']})"] if run else [])
    if st.radio("routing", choices, index=len(choices) - 1, horizontal=True, key="mesh_routing",
                help="what the all-to-alls move and a MoE block keeps follows from the routing counts"
                ).startswith("balanced"):
        st.caption(BALANCED + ("" if run else " Run this mesh on Run for real (any mesh) to price its own "
                               "counts here."))
    else:
        moe, cfg = run["summary"]["moe"], TrainConfig(steps=run["summary"]["steps"], batch_size=batch,
                                                      seq_len=seq)
        st.caption("MoE routing priced with the run's own kept and pair counts (its --json summary's "
                   "microbatch_kept_counts and microbatch_pair_counts): the step below is its last, the "
                   "peaks its highest over every step.")
command = mesh_grid.train_args(sizes, plan, preset, 3, model.moe_experts > 0, cfg=cfg)
st.code(f"mpiexec -n {world} refpar train " + " ".join(command), language="bash", wrap_lines=True)
if st.session_state.get("mesh_rank", 0) >= world:
    st.session_state["mesh_rank"] = 0
rank = st.selectbox("rank", list(range(world)), key="mesh_rank")
labels = {r: f"rank {r}" for r in range(world)}
left, right = st.columns([3, 2])
left.plotly_chart(mesh_grid.mesh_figure(sizes, labels, rank, "the ranks, coloured by pipeline rank"),
                  key="mesh_grid", on_select=lambda: pick_rank("mesh_grid"), selection_mode="points")
st.caption(mesh_grid.LEGEND)
facts = facts_of(model, cfg, sizes, plan, rank, moe)
right.markdown(f"**What rank {rank} holds**")
right.table(mesh_grid.holdings_rows(facts), hide_index=True)

st.subheader("Through one training step")
# Each label numbered, the number of moments said: a select slider shows only the current label.
moment = st.select_slider(f"moment of the step ({len(MOMENTS)} in all)", MOMENTS, key="mesh_moment",
                          format_func=lambda x: f"{MOMENTS.index(x) + 1}. {x}")
st.caption(" → ".join(f"{k}. {x}" for k, x in enumerate(MOMENTS, 1)))
every = step_of_every_rank(model, cfg, sizes, plan, moe)
at = {r: next(x for x in every[r] if x.label == moment) for r in range(world)}
sent = {r: sum(mesh_grid.sent_by_axis(at[r]).values()) for r in range(world)}
left, right = st.columns([3, 2])
left.plotly_chart(mesh_grid.mesh_figure(sizes, {r: f"rank {r}<br>{sent[r]:,} B" for r in range(world)}, rank,
                                        f"{moment}: bytes each rank sends"), key="mesh_step")
mine = at[rank]
right.markdown(f"**Rank {rank}, {moment}**\n\n- computes: {mine.computes}\n"
               f"- gathers: {', '.join(mine.gathers) or 'nothing'}\n- frees: {mine.frees}\n"
               f"- sends: {sent[rank]:,} bytes"
               + "".join(f"\n  - {axis}: {n:,} B" for axis, n in mesh_grid.sent_by_axis(mine).items()))
if mine.calls:
    st.dataframe(mine.calls, hide_index=True, width="stretch")

show_at_scale("mesh_scale", "deepseek-v3")
