"""Pure planning: the save plan (grids, writers, exchange) and the load plan (reads,
strategy). No I/O and no process group: simulated at thousands of ranks in one process."""
