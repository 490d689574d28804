"""`refpar app`: start the Streamlit app on localhost and print its address.

    refpar app                 # http://localhost:8501
    refpar app --port 8600

Streamlit runs as a subprocess (`python -m streamlit run app/Home.py --server.headless true ...`),
so this module never imports streamlit and `refpar --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from refpar.config import ConfigError

HELP = "start the Streamlit app (sharding, pipeline, communication, memory, plan, real runs) on localhost"

ROOT = Path(__file__).resolve().parents[2]  # the checkout holding refpar/ and app/


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8501, help="localhost port (default 8501)")


def command(port: int) -> list[str]:
    """The argument list that starts the app (headless: this process prints the address)."""
    return [sys.executable, "-m", "streamlit", "run", str(ROOT / "app" / "Home.py"),
            "--server.headless", "true", "--server.address", "localhost", "--server.port", str(port),
            "--browser.gatherUsageStats", "false"]


def run(args) -> int:
    if not 1024 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} must be between 1024 and 65535")
    if not (ROOT / "app" / "Home.py").exists():
        raise ConfigError(f"the app is not next to refpar ({ROOT / 'app'} is missing); run refpar app "
                          "from a clone of the repository")
    if importlib.util.find_spec("streamlit") is None:
        raise ConfigError("streamlit is not installed; pip install -e '.[app]' and run refpar app again")
    print(f"refpar app: http://localhost:{args.port} (Ctrl-C stops it)", flush=True)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    try:
        return subprocess.call(command(args.port), cwd=ROOT, env=env)
    except KeyboardInterrupt:
        return 0
