"""What names a stored page: the pool namespace (model, layout, cache dtypes,
vLLM release, hashing) and the content digests of the weights and of LoRA
adapters that go into it, with the weights' digest started while vLLM loads
them.  Both sides use it; it imports neither."""
