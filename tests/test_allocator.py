"""refpar/allocator.py: with `keep_freed_memory`, arrays freed and allocated again reuse their pages.

Measured in fresh processes (the setting is process-wide), as a step uses memory: 64 arrays of
1 MiB (activations; below NumPy's 4 MiB, where it asks for huge pages) allocated, written and all
freed, three times; the third pass's page faults (getrusage's minor faults) are counted. glibc
alone gives the freed top of its heap back to the system (more than twice its mmap threshold is
free there), so each of the 16,384 pages faults in again; kept, the heap hands back the same pages.
"""

import subprocess
import sys

import pytest

from refpar.allocator import keep_freed_memory

PAGES = (64 << 20) // 4096

SCRIPT = """
import resource, sys
import numpy as np
from refpar.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def step():
    arrays = [np.empty(1 << 20, dtype=np.uint8) for _ in range(64)]  # (1 MiB,) each
    for a in arrays:
        a[...] = 1
    del arrays, a
step()
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def second_pass_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not keep_freed_memory(), reason="the C library is not glibc")
def test_a_steps_freed_arrays_are_allocated_again_without_faulting_their_pages_in():
    kept, default = second_pass_faults("keep"), second_pass_faults("default")
    assert kept < PAGES // 100  # the same pages: a few faults of the interpreter's own
    assert default > PAGES // 2  # glibc's own thresholds: a new mapping, every page again


def test_keep_freed_memory_is_set_once_and_answers_the_same():
    assert keep_freed_memory() == keep_freed_memory()
