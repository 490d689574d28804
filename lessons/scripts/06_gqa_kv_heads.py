"""Lesson 6: which kv head each tp rank of llama-tiny holds, and who sums its gradient with whom.

    mpiexec -n 4 python -m refpar train --model llama-tiny --mesh tp=4 --steps 1 \
        --trace /tmp/refpar-lesson04-gqa.json --overwrite
    python lessons/scripts/06_gqa_kv_heads.py /tmp/refpar-lesson04-gqa.json.jsonl

The layout comes from refpar/holdings.py (the table in refpar/parallel/llama_pieces.py);
the sums come from the run's trace (JSON lines, one collective per line): block 0's all-reduce of
its k_proj and v_proj gradients, tagged "model.layers.0.self_attn.kv_proj:replica-grad".
"""

import json
import sys

from refpar.config import model_preset
from refpar.holdings import kv_heads, tp_param_slices
from refpar.sharding import shard_range

REPLICA_GRAD = "model.layers.0.self_attn.kv_proj:replica-grad"  # block 0's k and v gradients, summed
config = model_preset("llama-tiny")
events = [json.loads(line) for line in open(sys.argv[1])]
t = len({e["rank"] for e in events})
g = config.n_head // config.n_kv_head
print(f"llama-tiny on tp={t}: {config.n_head} query heads over {config.n_kv_head} kv heads "
      f"({g} query heads read each), head size {config.head_size}")
print(f"  {'rank':<5} {'query heads':<12} {'kv head':<8} {'k_proj/v_proj rows':<19} "
      f"{'block 0 sums dK, dV with':<25} {'bytes sent':>10}")
for rank in range(t):
    h0, h1 = shard_range(config.n_head, t, rank)
    k0, k1 = kv_heads(config, t, rank)
    rows = tp_param_slices(config, t, rank)["model.layers.0.self_attn.k_proj.weight"][1]
    sums = [e for e in events if e["rank"] == rank and e["tag"] == REPLICA_GRAD]
    group = ", ".join(map(str, sums[0]["group"])) if sums else "nobody (its own)"
    sent = sum(e["bytes_sent"] for e in sums)
    heads = ", ".join(map(str, range(h0, h1)))
    kv = ", ".join(map(str, range(k0, k1)))
    print(f"  {rank:<5} {heads:<12} {kv:<8} {f'{rows[0]}-{rows[-1]}':<19} {'ranks ' + group:<25} {sent:>10,}")
