"""The distributed backend on Mooncake Store (:mod:`.backend`), built from
its pieces: the connection to the master (:mod:`.connection`), block
objects' layouts and writes (:mod:`.objects`), their readers
(:mod:`.ranges`, :mod:`.whole`, :mod:`.staged`), keys kept as plain values
(:mod:`.plain`), and the staging buffer (:mod:`.staging`)."""
