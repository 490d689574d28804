"""Running real MPI jobs from tests: `mpiexec` from the virtual environment, as a subprocess with a
timeout, so a failing or hanging rank fails the test instead of hanging the suite (ENVIRONMENT.md,
"Testing under MPI")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def mpi_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def mpiexec(n: int, *args: str, timeout: float = 120, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Runs `mpiexec -n n python *args` in the repository root and returns the finished process.
    With check, a non-zero exit fails with the job's stderr in the message."""
    cmd = [str(MPIEXEC), "-n", str(n), sys.executable, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env(env), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd[1:])} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc


def refpar_json(n: int, *cli_args: str, timeout: float = 180, env: dict | None = None) -> dict:
    """Runs `refpar <cli_args> --json` on n ranks and returns rank 0's JSON summary (last line)."""
    proc = mpiexec(n, "-m", "refpar", *cli_args, "--json", timeout=timeout, env=env)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_script(n: int, script: str, timeout: float = 120, env: dict | None = None
               ) -> subprocess.CompletedProcess:
    """Runs a Python source string on n ranks (written to a temporary file)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(script)
    try:
        return mpiexec(n, f.name, timeout=timeout, env=env)
    finally:
        os.unlink(f.name)
