"""The weights' part of the pool namespace (``weights_identity``).

``content`` (default): the name, size and full-content digest of every
weights file (:mod:`.digests`): any change of any byte gives another
namespace.  The first start after a file changed reads it once (about
0.2 s/GB here, logged); later starts read nothing (digests are kept per file
version); a file in a Hugging Face cache is never read (its blob name is
its digest).

``sampled``: names, sizes, safetensors headers and 8 x 4 KiB read from each
file - for checkpoints too large to read once.  It misses any change outside
those samples with the same shapes: re-saved fine-tunes of a few layers,
recalibrated quantization scales, a patched norm.  Pool entries computed
with the old weights then serve wrong tokens; choose it only when every such
change comes with a new path or ``namespace_salt``.

``load_format="dummy"``: vLLM fills the weights from a fixed seed; no file
is read.

**Unresolved**: weights the namespace cannot see - the model is not found
here, its directory holds no weights file, the loader reads them from
elsewhere (``tensorizer``, ``ipc_cache``, ``modelexpress``), or vLLM pulled
the model from object storage (``model_weights``: only the config files are
local).  Such an identity is ``{"resolved": False, ...}`` with the reason,
never an empty list of files called resolved: the connector then uses the
pool only when ``namespace_salt`` names the weights (:mod:`..connector`).

The digest runs on a thread (:func:`start`), so the connector opens its
backend meanwhile; whoever needs the namespace joins it.  vLLM builds the
connector only after the model is loaded, so the ``weights-digest-during-load``
patch starts the same digest when loading begins (:mod:`.identity.preload`):
the connector's own job then queues behind it on the one digest thread and
finds every file's digest in this process's memo (another process: in the
digest cache, or waits on the file's lock).  Each run is noted in
:data:`TRACE` (who started it, when, what it read).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import struct
import threading
import time
from typing import Any

from .digests import DigestStats, digest_files

logger = logging.getLogger("vllm.layerwise_patch")

RULES = ("content", "sampled")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".ckpt")
#: load formats whose weights are not the files of the model directory
FOREIGN_LOADERS = ("tensorizer", "ipc_cache", "modelexpress")
_SAMPLES, _SAMPLE_BYTES = 8, 4096


def resolve_model_dir(model: str, revision: str | None = None,
                      download_dir: str | None = None) -> str | None:
    """A local directory or file for ``model``: the path itself, or a
    Hugging Face id already in the cache (vLLM's ``download_dir`` when set)."""
    if os.path.isdir(model) or os.path.isfile(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, cache_dir=download_dir,
                                 local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the cache: unresolved
        return None


def weight_files(where: str, load_format: str | None = None) -> list[str]:
    """The files vLLM may load weights from (and their index files); with
    safetensors present and a format that reads them, only those."""
    if os.path.isfile(where):
        return [where]
    names = sorted(os.listdir(where))
    weights = [n for n in names if n.endswith(WEIGHT_SUFFIXES)]
    if str(load_format) not in ("pt", "gguf", "npcache") and any(
            n.endswith(".safetensors") for n in weights):
        weights = [n for n in weights if n.endswith(".safetensors")]
    return [os.path.join(where, n) for n in sorted(weights + [
        n for n in names if n.endswith("index.json")])]


def _safetensors_data_start(f: Any, size: int) -> tuple[bytes, int]:
    head = f.read(8)
    if len(head) < 8:
        return b"", 0
    (n,) = struct.unpack("<Q", head)
    if n > min(size - 8, 100 << 20):
        return b"", 0
    return f.read(n), 8 + n


def sampled_ranges(path: str) -> tuple[bytes, list[tuple[int, int]]]:
    """The sampled rule's view of a file: its safetensors header and the
    (offset, length) ranges it reads (all of a small file)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header, start = (_safetensors_data_start(f, size) if path.endswith(".safetensors")
                         else (b"", 0))
    span = size - start
    if span <= _SAMPLES * _SAMPLE_BYTES:
        return header, [(start, span)]
    # evenly spaced, the last one ends the file
    return header, [(start + (span - _SAMPLE_BYTES) * i // (_SAMPLES - 1), _SAMPLE_BYTES)
                    for i in range(_SAMPLES)]


def unresolved(model: str, revision: str | None, why: str) -> dict[str, Any]:
    """The identity of weights the namespace cannot see (``why``)."""
    return {"resolved": False, "model": model, "revision": revision, "why": why}


def _sampled(files: list[str], where: str) -> dict[str, Any]:
    if not files:
        return unresolved(where, None, f"no weights file in {where}")
    h = hashlib.sha256()
    for path in files:
        h.update(f"{os.path.basename(path)}\0{os.path.getsize(path)}\0".encode())
        header, ranges = sampled_ranges(path)
        h.update(header)
        with open(path, "rb") as f:
            for offset, length in ranges:
                f.seek(offset)
                h.update(f.read(length))
    return {"rule": "sampled", "resolved": True, "files": len(files), "digest": h.hexdigest()}


def _content(files: list[str], where: str, stats: DigestStats | None = None) -> dict[str, Any]:
    if not files:  # nothing digested is no identity: unresolved
        return unresolved(where, None, f"no weights file in {where}")
    stats = DigestStats() if stats is None else stats
    digests = digest_files(files, stats)
    logger.info("vllm-layerwise-patch pool: weights identity by content: %s", stats.summary())
    base = where if os.path.isdir(where) else os.path.dirname(where)
    return {"rule": "content", "resolved": True,
            "files": [[os.path.relpath(p, base), os.path.getsize(p), d]
                      for p, d in zip(files, digests)]}


def weights_identity(model: str, revision: str | None = None, *, rule: str = "content",
                     download_dir: str | None = None,
                     load_format: str | None = None,
                     model_weights: str | None = None,
                     stats: DigestStats | None = None) -> dict[str, Any]:
    """The weights behind ``model`` by ``rule`` (see the module); ``stats``
    (content rule) receives what the digest read.  ``model_weights``: vLLM's
    ``ModelConfig.model_weights`` (where weights pulled from object storage
    come from)."""
    if str(load_format) == "dummy":
        return {"rule": "dummy", "resolved": True}
    if str(load_format) in FOREIGN_LOADERS:
        return unresolved(model, revision, f"load_format {load_format!r} reads weights "
                          "that are not files of the model directory")
    if model_weights and model_weights != model:
        return unresolved(model, revision, f"the weights come from {model_weights}, "
                          "not from files here")
    where = resolve_model_dir(model, revision, download_dir)
    if where is None:
        return unresolved(model, revision, f"{model} is not found here")
    files = weight_files(where, load_format)
    return _content(files, where, stats) if rule == "content" else _sampled(files, where)


_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vlp-weights-digest")

#: One entry per identity computed in this process (the newest 64): ``origin``
#: ("load": started by the weights-digest-during-load patch; "connector"),
#: ``submitted``/``start``/``end`` (``time.monotonic``), ``rule``,
#: ``bytes_read``, ``bytes_total``, ``hashed``, ``cached``, ``named``,
#: ``error``.  The patch adds ``{"event": "load", "start", "end"}`` entries.
TRACE: list[dict[str, Any]] = []
_trace_lock = threading.Lock()


def note(entry: dict[str, Any]) -> dict[str, Any]:
    """Add ``entry`` to :data:`TRACE` (and return it, to be completed)."""
    with _trace_lock:
        TRACE.append(entry)
        del TRACE[:-64]
    return entry


def identity_args(vllm_config: Any, rule: str) -> tuple[tuple, dict[str, Any]]:
    """The :func:`weights_identity` arguments for ``vllm_config``'s model."""
    mc, load = vllm_config.model_config, getattr(vllm_config, "load_config", None)
    return ((str(mc.model), getattr(mc, "revision", None)),
            {"rule": rule, "download_dir": getattr(load, "download_dir", None),
             "load_format": str(getattr(load, "load_format", None)),
             "model_weights": getattr(mc, "model_weights", None) or None})


def _run(entry: dict[str, Any], args: tuple, kw: dict[str, Any]) -> dict[str, Any]:
    stats = DigestStats()
    entry["start"] = time.monotonic()
    try:
        # (looked up when it runs, so tests can stand in for weights_identity)
        return globals()["weights_identity"](*args, stats=stats, **kw)
    except BaseException as exc:
        entry["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        entry.update(end=time.monotonic(), bytes_read=stats.bytes_read,
                     bytes_total=stats.bytes_total, hashed=stats.hashed,
                     cached=stats.cached, named=stats.named)


def submit(vllm_config: Any, rule: str, origin: str = "connector",
           model: str | None = None) -> tuple[concurrent.futures.Future, dict[str, Any]]:
    """The weights identity of ``vllm_config``'s model (or of the weights
    files at ``model``: weights reloaded from another path), computed on the
    digest thread after any digest already queued there, and its
    :data:`TRACE` entry."""
    args, kw = identity_args(vllm_config, rule)
    if model is not None:
        args, kw = (model, None), dict(kw, model_weights=None)
    entry = note({"event": "digest", "origin": origin, "rule": rule,
                  "submitted": time.monotonic(), "error": None})
    return _pool.submit(_run, entry, args, kw), entry


def start(vllm_config: Any, rule: str) -> concurrent.futures.Future:
    """The weights identity of ``vllm_config``'s model (:func:`submit`).
    Digests are kept per file version: a job behind one for the same files
    (started with loading), or the second connector side of an in-process
    engine, reads nothing."""
    return submit(vllm_config, rule)[0]
