"""The embedded pool's directory on disk: where it lives (per-user default,
private fallback), who may read and write it, the directory opened once and
used through descriptors, and which processes hold it open."""
