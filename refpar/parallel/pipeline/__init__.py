"""Pipeline parallelism: schedules as data (schedules.py, schedules_v.py), one Stage (stage.py) and
the executor that runs a rank's list (executor.py).

The V-shaped and bidirectional builders live in schedules_v.py, built on schedules.py's types;
importing it registers them in schedules.BUILDERS, so the package imports it first, whichever
module of it is asked for.
"""

from refpar.parallel.pipeline import schedules_v  # noqa: F401
