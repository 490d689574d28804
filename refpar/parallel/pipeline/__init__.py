"""Pipeline parallelism at run time: one Stage (stage.py) and the executor that runs a rank's list
(executor.py). The lists themselves are data, in refpar/schedules/ (the types in its __init__.py;
builders.py, builders_v.py: the papers' schedules; simulate.py: running them in order; formats.py:
the grid and torch's CSV; published.py: the papers' closed forms), so the planner reads them without
importing any runtime code.
"""
