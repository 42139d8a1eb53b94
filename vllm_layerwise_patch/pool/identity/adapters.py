"""LoRA adapters by content (scheduler side).

vLLM's prefix hash names a request's adapter by its name and path only
(``_gen_lora_extra_hash_keys``): an adapter updated in place would hit the
pages computed with its old weights.  So the pool names every block of a
request that runs an adapter by ``H(vLLM's block hash, adapter digest)``,
where the digest covers the name, size and full content of each of the
adapter's files (``*.json`` and weights; :mod:`.digests`, kept per file
version like the model's weights).  The scheduler derives every key, load
and save of the request from these names, so the workers never see the
plain hashes.

The digest is taken when the scheduler first looks the request up and kept
for the request's life, so its lookup, loads and saves agree.  A request
whose adapter cannot be fingerprinted (its files are not on this machine)
does not use the pool: no lookup, no save.

vLLM keeps an adapter it has loaded until it evicts it (or a request asks
``load_inplace``): an adapter file changed under a running engine names the
pages that engine still computes with the old weights by the new content.
Restart the engine (or load the adapter in place) after changing one.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from typing import Any

from .digests import digest_files
from .weights import WEIGHT_SUFFIXES, resolve_model_dir

logger = logging.getLogger("vllm.layerwise_patch")


def adapter_digest(lora_request: Any) -> bytes | None:
    """16 bytes naming the adapter's content, or None when its files are
    not found here."""
    where = resolve_model_dir(str(getattr(lora_request, "lora_path", "") or ""))
    if where is None:
        return None
    if os.path.isfile(where):
        files = [where]
    else:
        files = sorted(os.path.join(where, n) for n in os.listdir(where)
                       if n.endswith(WEIGHT_SUFFIXES + (".json",))
                       and os.path.isfile(os.path.join(where, n)))
    if not files:
        return None
    h = hashlib.sha256(b"vllm-layerwise-pool adapter\0")
    for path, digest in zip(files, digest_files(files)):
        h.update(f"{os.path.basename(path)}\0{os.path.getsize(path)}\0{digest}\0".encode())
    return h.digest()[:16]


def mix(block_hash: Any, digest: bytes) -> bytes:
    """A block's pool name under an adapter."""
    return hashlib.sha256(digest + bytes(block_hash)).digest()


class _AdapterHashes(Sequence):
    """A request's block hashes, each mixed with the adapter digest (on
    first use; vLLM appends to the underlying list as blocks complete)."""

    def __init__(self, hashes: Sequence[Any], digest: bytes, memo: list[bytes]) -> None:
        self._hashes, self._digest, self._memo = hashes, digest, memo

    def __len__(self) -> int:
        return len(self._hashes)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        while len(self._memo) <= i:
            self._memo.append(mix(self._hashes[len(self._memo)], self._digest))
        return self._memo[i]


class AdapterRequest:
    """A request seen through its adapter's content: ``block_hashes`` are
    the pool's names, everything else is the request's."""

    def __init__(self, request: Any, digest: bytes) -> None:
        self._request, self.adapter_digest, self._memo = request, digest, []

    @property
    def block_hashes(self) -> _AdapterHashes:
        return _AdapterHashes(self._request.block_hashes, self.adapter_digest, self._memo)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


class AdapterKeys:
    """The scheduler's view of each request (:meth:`view`)."""

    def __init__(self) -> None:
        self._views: dict[str, Any] = {}
        self._warned = False

    def view(self, request: Any) -> Any:
        """``request`` itself (no adapter), its :class:`AdapterRequest`, or
        None: its adapter cannot be fingerprinted, it does not use the pool."""
        lora = getattr(request, "lora_request", None)
        if not lora:
            return request
        rid = request.request_id
        if rid not in self._views:
            try:
                digest = adapter_digest(lora)
            except OSError:
                digest = None
            if digest is None and not self._warned:
                self._warned = True
                logger.warning("vllm-layerwise-patch pool: LoRA adapter %r (%s) has no "
                               "files here to fingerprint; its requests do not use the pool "
                               "(further adapters are not logged)",
                               getattr(lora, "lora_name", None),
                               getattr(lora, "lora_path", None))
            self._views[rid] = None if digest is None else AdapterRequest(request, digest)
        return self._views[rid]

    def forget(self, request: Any) -> None:
        self._views.pop(getattr(request, "request_id", None), None)
