"""The tiered backend: an embedded LMDB near tier in front of Mooncake Store
(:mod:`.backend`)."""
