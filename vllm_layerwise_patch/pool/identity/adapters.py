"""LoRA adapters by content.

vLLM's prefix hash names a request's adapter by its name and path only
(``_gen_lora_extra_hash_keys``): an adapter updated in place would hit the
pages computed with its old weights.  So the pool names every block of a
request that runs an adapter by ``H(vLLM's block hash, adapter digest)``,
where the digest covers the name, size and full content of each of the
adapter's files (``*.json`` and weights; :mod:`.digests`, kept per file
version like the model's weights).  The scheduler derives every key, load
and save of the request from these names, so the workers never see the
plain hashes.

The digest names what the workers compute with, which is not always what
the files hold now: vLLM's worker loads an adapter when a step first needs
it (or again with ``load_inplace``) and keeps that copy until it evicts it,
whatever happens to the files meanwhile.  So the digest is taken where the
adapter is loaded (:mod:`.loaded_adapters`, the ``lora-digest-at-load``
patch), and the workers report after each step the digests of the adapters
they hold (:class:`..metadata.AdapterReport`).  The scheduler
(:class:`AdapterKeys`) names a request by the workers' digest of its adapter
when they hold it, else by the digest of its files (the workers will load
those), and keeps that name for the request's life; each worker checks,
every step, that the adapter it computes the request with has that digest -
if not (the adapter was evicted and loaded again from changed files in
between), the request's load is handed to vLLM's load-failure policy and
its pages are not stored.  (With ``load_async`` a hit loads before the
request is computed: only adapters the workers hold are loaded, checked when
the load starts; an eviction and a reload from changed files between that
load and the computation is not caught.)  Until the workers have reported
that they take these digests (the patch applied in every worker), and for
an adapter whose files are not on this machine, requests with an adapter do
not use the pool: no lookup, no save.
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


def adapter_files(lora_request: Any) -> list[str]:
    """The adapter's files here (none: not found, or its weights come from
    elsewhere - a tensorizer URI, vLLM 0.30/0.31)."""
    if getattr(lora_request, "tensorizer_config_dict", None):
        return []
    where = resolve_model_dir(str(getattr(lora_request, "lora_path", "") or ""))
    if where is None:
        return []
    if os.path.isfile(where):
        return [where]
    return sorted(os.path.join(where, n) for n in os.listdir(where)
                  if n.endswith(WEIGHT_SUFFIXES + (".json",))
                  and os.path.isfile(os.path.join(where, n)))


def adapter_digest(lora_request: Any, files: list[str] | None = None) -> bytes | None:
    """16 bytes naming the adapter's content (its ``files``, default
    :func:`adapter_files`), or None when its files are not found here."""
    files = adapter_files(lora_request) if files is None else files
    if not files:
        return None
    h = hashlib.sha256(b"vllm-layerwise-pool adapter\0")
    for path, digest in zip(files, digest_files(files)):
        h.update(f"{os.path.basename(path)}\0{os.path.getsize(path)}\0{digest}\0".encode())
    return h.digest()[:16]


def adapter_of(request: Any) -> tuple[int, bytes] | None:
    """(vLLM's adapter id, the digest the pool names it by) of a request seen
    through :class:`AdapterKeys` - what a worker checks - or None."""
    digest = getattr(request, "adapter_digest", None)
    if digest is None:
        return None
    return int(request.lora_request.lora_int_id), digest


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

    def __init__(self, request: Any, digest: bytes, pool_reads: bool = True) -> None:
        self._request, self.adapter_digest, self._memo = request, digest, []
        self.pool_reads = pool_reads  # False: saved, never loaded (see AdapterKeys.view)

    @property
    def block_hashes(self) -> _AdapterHashes:
        return _AdapterHashes(self._request.block_hashes, self.adapter_digest, self._memo)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


class AdapterKeys:
    """The scheduler's view of each request (:meth:`view`), from what the
    workers report holding (:meth:`learn`)."""

    def __init__(self, files_only: bool = False) -> None:
        self._views: dict[str, Any] = {}
        self._warned = False
        self.checked = False  # every worker takes digests where it loads (reported)
        self.held: dict[int, bytes | None] = {}  # adapter id -> digest of the copy held
        # the rule before the fix (tests): the files' digest at the first lookup
        self.files_only = files_only

    def learn(self, report: Any) -> None:
        """A step's :class:`..metadata.AdapterReport` (all workers')."""
        self.checked, self.held = bool(report.checked), dict(report.held)

    def _digest(self, lora: Any) -> bytes | None:
        """What the workers will compute ``lora`` with: the copy they hold,
        else its files (they load those)."""
        if not self.checked and not self.files_only:
            return None
        lora_id = getattr(lora, "lora_int_id", None)
        if lora_id in self.held and not self.files_only:
            return self.held[lora_id]
        try:
            return adapter_digest(lora)
        except OSError:
            return None

    def view(self, request: Any, async_loads: bool = False) -> Any:
        """``request`` itself (no adapter), its :class:`AdapterRequest`, or
        None: it does not use the pool (the workers do not check adapters,
        or this adapter's content is not known here).  With ``async_loads``
        a hit is loaded before the request is computed - before its worker
        loads the adapter: only an adapter the workers hold is loaded from
        the pool (they check it when the load starts), others are saved
        only."""
        lora = getattr(request, "lora_request", None)
        if not lora:
            return request
        rid = request.request_id
        if rid not in self._views:
            digest = self._digest(lora)
            if digest is None and self.checked and not self._warned:
                self._warned = True
                logger.warning("vllm-layerwise-patch pool: LoRA adapter %r (%s) has no "
                               "files here to fingerprint, or the workers hold a copy they "
                               "could not; its requests do not use the pool (further "
                               "adapters are not logged)", getattr(lora, "lora_name", None),
                               getattr(lora, "lora_path", None))
            reads = not async_loads or getattr(lora, "lora_int_id", None) in self.held
            self._views[rid] = None if digest is None else AdapterRequest(request, digest, reads)
        return self._views[rid]

    def forget(self, request: Any) -> None:
        self._views.pop(getattr(request, "request_id", None), None)
