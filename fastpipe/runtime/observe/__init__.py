"""Watching a pipe run: measured timelines (``pipe.trace()``), the last step's figures
(``pipe.last_step``) and profiler ranges around every action."""
