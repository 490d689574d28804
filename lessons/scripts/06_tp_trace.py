"""Lesson 6: rank 0's collectives of one tensor-parallel step, in the order they ran.

    mpiexec -n 2 python -m refpar train --mesh tp=2 --steps 1 --trace /tmp/refpar-lesson04.json --overwrite
    python lessons/scripts/06_tp_trace.py /tmp/refpar-lesson04.json

Reads the Chrome/Perfetto trace that `--trace` writes (open it in https://ui.perfetto.dev too).
"""

import json
import sys

events = json.load(open(sys.argv[1]))
events = events["traceEvents"] if isinstance(events, dict) else events
calls = [dict(e["args"], op=e["name"].split()[0]) for e in events
         if e.get("pid") == 0 and "tag" in e.get("args", {})]
print(f"rank 0's {len(calls)} collectives, in order:")
print(f"  {'op':<11} {'tag':<24} {'axis':<5} {'shape':<10} {'bytes sent':>10}")
for c in calls:
    shape = "x".join(map(str, c["shape"]))
    print(f"  {c['op']:<11} {c['tag']:<24} {c['axis']:<5} {shape:<10} {c['bytes_sent']:>10,}")
block0 = [c["tag"] for c in calls if c["tag"].startswith("h.0.")]
print(f"block h.0: {len(block0)} collectives: {', '.join(block0)}")
