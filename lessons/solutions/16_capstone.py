"""Lesson 16, reference solution: the capstone."""

# units (refpar/analysis/memory.py unit_sizes): wte 3,072, wpe 1,024 (+ ln_f 64: "root"), 12,704 per block
STAGE_0 = 3072 + 1024 + 2 * 12704  # pp=2: rank 0 holds the embeddings and blocks 0-1: 29,504


def plan() -> dict:
    return {"mesh": {"pp": 2, "dp": 2, "tp": 1}, "zero": 1, "microbatches": 4}


def estimate() -> dict:
    psi = STAGE_0
    # float64: params 8, grads 8, and ZeRO-1 halves AdamW's 16 over dp = 2
    model_states = 8 * psi + 8 * psi + 16 * psi // 2
    # 1F1B on 2 stages keeps 2 microbatches of 1 row (8 rows / dp 2 / m 4) on rank 0: per microbatch two
    # blocks (lesson 2's 919,552 bytes for 8 rows, so 114,944 per row) and the embedding (token ids and
    # its dropout mask: 16 x 8 + 16 x 32 x 8 = 4,224)
    activations = 2 * (2 * 919_552 // 8 + 4_224)
    # pp: 4 activations of (1, 16, 32) float64 forward, plus the tied wte's gradient all-reduced between
    # the two stages (3,072 x 8 / 2) and the loss (8); dp: ZeRO-1's reduce-scatter and all-gather of the
    # stage's 29,504 float64 (half of it each) and the loss (8)
    sent = {"pp": 4 * 16 * 32 * 8 + 3072 * 8 // 2 + 8, "dp": 2 * psi * 8 // 2 + 8, "tp": 0}
    return {"model_states": model_states, "activations": activations, "sent": sent}


WHY = """Plain DP on 4 ranks holds everything four times (3,270,144 bytes at its peak sum) and ZeRO-3 on
dp=4 still 1,772,864: most of it is a quarter of the batch's activations, which no ZeRO stage divides.
A pipeline of 2 stages halves the parameters and their optimizer state per rank, and 4 microbatches keep
1F1B's in-flight activations small; data parallelism over the other factor of 2 with ZeRO-1 shards the
optimizer state and sends no more than plain DP. pp=4 would send fewer bytes still, but its first rank's
peaks add up to 1,592,576: over the budget. The price is the pipeline's bubble, (p - 1) / (m + p - 1) =
1/5 of the step."""
