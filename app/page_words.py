"""refpar's sentences said with a page's own controls: the command line's checks (refpar.engine.validate,
refpar.schedules.builders, refpar.analysis.planner, ...) name flags, which no page has. Each page gives
its flags' labels (and, for what it has no control for, the words to say instead); a sentence keeps
its numbers and its reason, and names the box or choice to change."""

import re

from refpar.config import ConfigError
from refpar.viz.expected import AXIS


def within(label: str, value: int, low: int, high: int | None = None) -> int:
    """`value` if the page can use it, else a ConfigError naming the box: the boxes have no limits, so
    that a typed value reaches the page and is refused by its label rather than left in a box the page
    ignores."""
    if value < low or (high is not None and value > high):
        raise ConfigError(f"{label} = {value:,}: choose {low:,} to {high:,}" if high is not None
                          else f"{label} = {value:,}: choose {low:,} or more")
    return int(value)


def in_page_words(sentence: str, controls: dict[str, str], instead: dict[str, str] | None = None) -> str:
    """`sentence` with each `--flag` of `controls` (flag without its dashes -> the page's label) said as
    that control ("use --microbatches 8 or more" -> "set m (microbatches) to 8 or more"), after each
    pattern of `instead` (a regular expression -> its replacement) is replaced."""
    for pattern, replacement in (instead or {}).items():
        sentence = re.sub(pattern, replacement, sentence)
    for flag, label in controls.items():
        sentence = re.sub(rf"\b(?:use|give) --{flag} (\S+)", lambda m, label=label: f"set {label} to {m[1]}",
                          sentence)
        sentence = re.sub(rf"--{flag}\b", lambda m, label=label: label, sentence)
    return sentence


# The Whole mesh and Run for real (any mesh) pages: refpar.engine.validate's flags as their controls.
MESH_CONTROLS = {"batch-size": "batch size", "seq-len": "sequence length", "microbatches": "microbatches"}


def mesh_in_page_words(sentence: str, strategy: str) -> str:
    """refpar train's sentence for a mesh, said with the controls of a page of pp, dp, ep, cp and tp
    boxes, a "data parallelism" choice (`strategy`), microbatches, batch size and sequence length (the
    model, and its 4 experts when ep > 1, are the page's own: no control changes them)."""
    instead = {
        r"^(--fsdp|--zero \d) shards": f"data parallelism {strategy} shards",
        r"give the mesh dp=2, ep=2 or cp=2 or more": "set dp, ep or cp to 2 or more, or choose data "
                                                     "parallelism dp",
        r"give the mesh dp=2 or more": "set dp to 2 or more, or choose data parallelism dp",
        r"moe_experts=(\d+) is fewer than ep=(\d+); use at least \d+ experts":
            r"ep=\2 is more than the \1 experts of the page's MoE model; choose ep from 1 to \1",
        r"; use fewer stages \(or chunks\) or more layers":
            "; choose a smaller pp (interleaved-1f1b puts 2 stages on each rank)",
        r"\(m=(\d+), p=(\d+)\); use m in": r"(microbatches \1, pp \2); choose microbatches in",
        r"\bbatch_size=": "batch size ",
        r"\bseq_len=": "sequence length ",
        r"drop (\w+) from --mesh": r"set \1 to 1",
    }
    return in_page_words(sentence, MESH_CONTROLS, instead)


# The Communication and Run for real (one axis) pages: a strategy, "ranks on its axis", "dp replicas" and
# "microbatches"; refpar's default batch and sequence, which no control changes.
AXIS_CONTROLS = {"microbatches": "microbatches"}


def axis_in_page_words(sentence: str, strategy: str, n: int, seq: int) -> str:
    """refpar train's sentence for a one-axis mesh, said with those pages' controls (`seq`: the tokens
    of their sequences)."""
    if n == 1 and ("or more to --mesh" in sentence or "give the mesh" in sentence):
        return f"{strategy} splits the work over its axis; choose 2 or more ranks on its axis"
    instead = {
        r"; use --seq-len \d+ or more$": f"; this page's sequences are {seq} tokens, so choose fewer ranks "
                                         "on its axis",
        r"^--batch-size (\d+)": r"a batch of \1 sequences",
        r"\bbatch_size=(\d+)": r"a batch of \1 sequences",
        r"use --batch-size \d+ or more, or fewer microbatches": "choose fewer microbatches",
        r"use --batch-size \d+ or more so every rank has a sequence":
            "choose fewer ranks on its axis or fewer dp replicas",
        rf"^{AXIS.get(strategy, strategy)}=(\d+)": r"\1 ranks on its axis",
        rf"choose {AXIS.get(strategy, strategy)} in": "choose ranks on its axis in",
    }
    return in_page_words(sentence, AXIS_CONTROLS, instead)


# The planner's flags (refpar.analysis.planner) as the controls of the pages that price a published model
# (Plan, and the at-scale sections of app/at_scale.py), and what to say for what they have no control for.
PLANNER_CONTROLS = {"gpus": "GPUs", "schedule": "schedule", "chunks": "chunks (interleaved)",
                    "zero": "ZeRO stage", "micro-batch": "micro-batch", "recompute": "recompute",
                    "sp": "sequence parallelism"}
PLANNER_INSTEAD = {r"use more GPUs, a smaller global batch or a shorter sequence":
                   "choose more GPUs or a smaller model",
                   r"use a global batch that is a multiple of (\d+)": r"choose GPUs that divide it",
                   r"recompute \(--recompute selective or full\)": "set recompute to selective or full"}


def planner_in_page_words(sentence: str) -> str:
    return in_page_words(sentence, PLANNER_CONTROLS, PLANNER_INSTEAD)
