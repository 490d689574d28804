"""Lesson 9's checker: exposed and hidden communication from a trace's spans, against an independent
count (the timeline cut at every span's ends, each piece judged on its own) on cases built like the
traces of lessons/scripts/09_overlap.py: a blocking bucket, ring rounds with their waits, a blocking
call during an isend, nested and touching spans."""

from __future__ import annotations

import math

import numpy as np

from lessons.checkers.common import Wrong

REL = 1e-12  # sums of a few dozen float64 differences


def _reference(messages, waits) -> tuple[float, float, float]:
    """Cut the time axis at every end point; a piece is in flight when a message covers it, exposed
    when a blocking message or a wait does."""
    cuts = sorted({t for s, e, _ in messages for t in (s, e)} | {t for s, e in waits for t in (s, e)})
    flight = exposed = 0.0
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        mid = (a + b) / 2
        if any(s <= mid < e for s, e, _ in messages):
            flight += b - a
        blocked = [(s, e) for s, e, blocking in messages if blocking] + list(waits)
        if any(s <= mid < e for s, e in blocked):
            exposed += b - a
    return flight, exposed, flight - exposed


def _cases() -> dict[str, tuple[list, list]]:
    rng = np.random.default_rng(9)
    rounds, waits = [], []
    t = 0.0
    for _ in range(6):  # ring rounds: isend and irecv posted together, completed at the next wait
        post, done = t, t + rng.uniform(2, 4)
        wait_from = done - rng.uniform(0.2, 1.5)
        rounds += [(post, done, False), (post + 0.01, done, False)]
        waits.append((wait_from, done))
        t = done + rng.uniform(0, 0.5)
    return {
        "one blocking all-reduce after the backward": ([(10.0, 14.0, True)], []),
        "the isend and irecv of one ring round, posted together, one wait": (
            [(0.0, 3.0, False), (0.1, 3.0, False)], [(2.0, 3.0)]),
        "an isend still in flight while a blocking all-reduce runs": (
            [(0.0, 5.0, False), (1.0, 2.0, True)], [(4.5, 5.0)]),
        "two blocking calls back to back (touching spans)": ([(0.0, 1.0, True), (1.0, 2.5, True)], []),
        "a message nested in another, waited on twice": (
            [(0.0, 10.0, False), (2.0, 3.0, False)], [(2.5, 3.0), (9.0, 10.0)]),
        "six ring rounds of a bucket with --overlap": (rounds, waits),
    }


def _unsorted(messages, waits):
    return list(reversed(messages)), list(reversed(waits))


def check_09(mod, comm) -> str:
    for name, (messages, waits) in _cases().items():
        for order, given in (("", (messages, waits)),
                             (" (the same spans, listed in another order)", _unsorted(messages, waits))):
            want = _reference(*given)
            got = mod.exposed_and_hidden(*given)
            if not (isinstance(got, tuple) and len(got) == 3):
                raise Wrong("exposed_and_hidden must return (in_flight, exposed, hidden); it returned "
                            f"{got!r}")
            for what, g, w in zip(("in_flight", "exposed", "hidden"), got, want, strict=True):
                if math.isclose(g, w, rel_tol=REL, abs_tol=1e-12):
                    continue
                spans = sum(e - s for s, e, _ in given[0])
                hint = {
                    "in_flight": f"the spans' lengths add up to {spans:g} s, but two messages in flight at "
                                 "the same moment are one moment of communication" if math.isclose(g, spans)
                                 else "is every moment that some message covers counted, once?",
                    "exposed": "a blocking call blocks the rank for its whole span, a non-blocking message "
                               "only while the rank waits for it",
                    "hidden": "hidden is what was in flight while the rank was not blocked",
                }[what]
                raise Wrong(f"{what} = {g:g} s for '{name}'{order}; the spans give {w:g} s: {hint}")
    return "exposed_and_hidden splits communication into exposed and hidden time as the trace's spans say"
