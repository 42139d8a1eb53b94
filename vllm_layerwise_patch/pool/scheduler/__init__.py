"""The connector's scheduler side (the engine-core process): the hit lookup
and its cache, the pins that keep a pending load's blocks from eviction,
asynchronous loads shared between requests, the per-step plan of loads and
saves sent to the workers (:mod:`.planner`), and what this side adds to
vLLM's stats.  Nothing here imports the worker side (:mod:`..worker`)."""
