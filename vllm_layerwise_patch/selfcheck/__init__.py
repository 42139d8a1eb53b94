"""Self-checks that the patches run when they are applied (``doctor`` reports
them): each calls a patched vLLM object the way vLLM would, on vLLM's own
classes, with recording stand-ins only where a model or a GPU would be needed.

* :mod:`.hook_check` - a layer-hook patch's wrappers against a recording KV
  connector and a real forward context (gdn-layer-hooks, the KDA patches);
* :mod:`.precopy_check` - the deferred Mamba pre-copy against vLLM's bulk
  pre-copy on a real ``MambaSpecDecodeGPUContext``.

The patches import these lazily, from their ``self_check``; nothing here
imports a patch module (what a check needs of one is passed in).
"""
