"""Array backends for accelerators: CuPy and torch (CUDA, or CPU for CI), and a device transport.

Chosen through `refpar.backend.use(name, device)` or `refpar train --backend torch|cupy`; each
module imports its library only when that backend is asked for, so refpar runs without either.
"""
