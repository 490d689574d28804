"""Conformance: refpar against PyTorch's own parallelism, step by step, on the same MPI ranks.

    mpiexec -n 2 python -m refpar.conformance ddp fsdp2 tp tp-sp pp-1F1B tp@float32
    mpiexec -n 2 python -m refpar.conformance.dump OUT_DIR   # dumps for `refpar check`

`torch_model.py` is refpar's GPT-2 in torch.nn (loaded from refpar's GPT-2 state dict),
`dist.py` starts torch.distributed (gloo) from refpar's Communicator, `cases.py` (DDP, FSDP2,
DTensor TP and SP) and `pipeline.py` (every torch.distributed.pipelining schedule) run each
PyTorch strategy next to refpar's run of the same mesh and compare (`compare.py`), per optimizer
step, the losses, every rank's gradient shard and the updated parameters. `dump.py` writes
per-rank dumps of a torch step, correct and with common bugs planted.
"""
