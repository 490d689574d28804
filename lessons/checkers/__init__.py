"""The checkers of the course's exercises, one lesson's ideas per file (lessons/checks.py runs them
and holds the older ones): memory.py (lesson 2), seconds.py (lesson 5), overlap.py (lesson 9),
with common.py's `Wrong` and `close`."""
