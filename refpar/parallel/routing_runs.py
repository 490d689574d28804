"""Routing under context parallelism: where a rank's tokens lie in the global (micro)batch, as
runs of consecutive global token indices, and their order over the routing exchange group.

    mpiexec -n 4 python -m refpar train --mesh ep=2,cp=2 --moe-experts 4 --moe-topk 2 --check

With context parallelism each data rank's rows are split over c cp ranks by position, so the
exchange group of expert parallelism (refpar/parallel/expert_parallel.py) is the dp x ep x cp ranks
(group rank d * c + cp rank, cp innermost) and a rank's tokens are no longer one contiguous block
of the global order: of each of its rows it holds runs of positions (two zig-zag chunks under ring
attention, one chunk under Ulysses). Routing then works on runs (`token_runs`, maximal runs of
consecutive global token indices b*T + t): each rank all-gathers one (k, E) count per run, and
each run's queue offset comes from the runs before it in global order (routing.Parts). The global
order of the runs is computed by every rank from the microbatch's rows and the cp layout, without
communication (`routing_runs`): the all-gather carries only counts, and without cp a data rank's
rows are one run, one (k, E) count per data rank. The closed form of the count of runs is
refpar/analysis/moe.py's routing_runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from refpar.model.routing import Parts


def token_runs(sample_ids, positions, seq_len: int) -> list[tuple[int, int]]:
    """The maximal runs (first global token index, length) of consecutive global token indices
    s * T + t among rows `sample_ids` (ascending) at `positions` (ascending), in that order: the
    order of the tokens of a (rows, positions) batch flattened."""
    runs: list[tuple[int, int]] = []
    for s in sample_ids:
        for t in positions:
            g = int(s) * seq_len + int(t)
            if runs and sum(runs[-1]) == g:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((g, 1))
    return runs


@dataclass(frozen=True)
class RoutingRuns:
    """The runs of one global microbatch over the exchange group: `parts`, this rank's runs for
    routing.route; `per_rank`, how many runs each group rank holds (the all-gather's counts); `order`,
    the runs as gathered (group rank by group rank) in global order."""

    parts: Parts
    per_rank: tuple[int, ...]
    order: tuple[int, ...]


def routing_runs(runs_by_rank: list[list[tuple[int, int]]], rank: int) -> RoutingRuns:
    """`runs_by_rank[g]`: group rank g's `token_runs`; the RoutingRuns of group rank `rank`."""
    gathered = [(start, g, n) for g, runs in enumerate(runs_by_rank) for start, n in runs]
    order = sorted(range(len(gathered)), key=lambda i: gathered[i][0])  # global order
    place = {i: p for p, i in enumerate(order)}
    first = sum(len(r) for r in runs_by_rank[:rank])
    mine = range(first, first + len(runs_by_rank[rank]))
    parts = Parts(tuple(gathered[i][2] for i in mine), tuple(place[i] for i in mine),
                  tuple(gathered[i][1] for i in order))
    return RoutingRuns(parts, tuple(len(r) for r in runs_by_rank), tuple(order))
