"""Pipeline parallelism: schedules as data (schedules.py: the types; builders.py, builders_v.py: the
papers' schedules; simulate.py: running them in order; formats.py: the grid and torch's CSV;
published.py: the papers' closed forms), one Stage (stage.py) and the executor that runs a rank's
list (executor.py).
"""
