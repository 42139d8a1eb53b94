"""The pool namespace from content, without an engine (the engine checks are
in test_pool_identity.py):

* weights: any changed byte gives another identity (negative control: the
  sampled rule misses a change outside its samples); a restart reads
  nothing; processes share the hashing; a Hugging Face blob is named, not
  read; vLLM's ``download_dir`` is honoured;
* the HF config: a transformers upgrade keeps the namespace (negative
  control: the old whole-config digest changes), a page-relevant field and
  ``kv_cache_layout`` do not;
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

from vllm_layerwise_patch.pool import digests, weights


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


_IDENTITY = """
import json
from vllm_layerwise_patch.pool import digests
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
    from vllm_layerwise_patch.pool.identity import namespace_description, namespace_of
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

    from vllm_layerwise_patch.pool.identity import hf_config_identity

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
    from vllm_layerwise_patch.pool.identity import _page_relevant

    cfg = {"model_type": "x", "transformers_version": "4.0", "use_cache": True,
           "torch_dtype": "bfloat16", "top_k": 50,
           "text_config": {"model_type": "y", "transformers_version": "4.0", "top_k": 50},
           "moe": {"top_k": 2}}  # a routing setting, not a config: kept
    assert _page_relevant(cfg) == {"model_type": "x", "dtype": "bfloat16",
                                   "text_config": {"model_type": "y"}, "moe": {"top_k": 2}}
