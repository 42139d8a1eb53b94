"""The connector's worker side (each worker process): the pages vLLM
registered, the loads of a forward (layerwise or bulk) and asynchronous
loads, the saves and their send thread, the quarantine of what a failed load
touched, and the torch-only transfer pipeline; :mod:`.forward` holds them
and serves the model's per-layer calls.  Nothing here imports the scheduler
side (:mod:`..scheduler`)."""
