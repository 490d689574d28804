"""Conformance: refpar against PyTorch's own parallelism, step by step, on the same MPI ranks.

    mpiexec -n 2 python -m refpar.conformance ddp fsdp2 tp

`torch_model.py` is refpar's GPT-2 in torch.nn (loaded from refpar's GPT-2 state dict),
`dist.py` starts torch.distributed (gloo) from refpar's Communicator, `cases.py` runs each
PyTorch strategy next to refpar's run of the same mesh and compares, per optimizer step, the
losses, every rank's gradient shard and the updated parameters.
"""
