"""The embedded backend: one LMDB environment, no server, several processes
(:mod:`.backend`), with its eviction, files, transaction gate and fill."""
