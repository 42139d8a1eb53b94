"""A configuration whose server fails to start names the cause in the
bench's table: the engine core's exception, not the front end's
"initialization failed" or the top of a traceback."""

from __future__ import annotations

from vllm_layerwise_patch.bench.report import error_row
from vllm_layerwise_patch.testing.server import root_cause

LOG = """INFO 12-07 03:20:01 [core.py:90] Initializing a V1 LLM engine
(EngineCore pid=7) ERROR 12-07 03:20:09 [core.py:1020] EngineCore failed to start.
Traceback (most recent call last):
  File "vllm/v1/core/kv_cache_utils.py", line 700, in check_enough_kv_cache_memory
    raise ValueError(
ValueError: To serve at least one request with the models's max seq len (8192), (36.0 MiB KV cache is needed, which is larger than the available KV cache memory (32.0 MiB).
Traceback (most recent call last):
  File "vllm/v1/engine/utils.py", line 1431, in wait_for_engine_startup
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""

HEADER = "| config | a | b | c |"


def test_the_first_exception_of_the_log_is_the_cause():
    assert root_cause(LOG).startswith("ValueError: To serve at least one request")
    assert root_cause("INFO nothing raised\n") == "(no exception in the log)"
    # (a dotted exception name counts too)
    assert root_cause("x\nlmdb.MapFullError: full\n") == "lmdb.MapFullError: full"


def test_a_failed_configuration_is_one_row_with_the_cause():
    error = f"vllm serve exited (1): {root_cause(LOG)}\n" + LOG
    row = error_row("hbm", error, HEADER, 80)
    assert "\n" not in row
    assert row.startswith("| hbm | error: vllm serve exited (1): ValueError: To serve")
    assert row.count("|") == HEADER.count("|")
    # a pipe in the message does not open a cell
    assert error_row("x", "a | b", HEADER).count("|") == HEADER.count("|")


def test_a_failed_configurations_server_logs_outlive_the_work_directory(tmp_path):
    from vllm_layerwise_patch.bench.replay import ReplaySetup, keep_logs

    work = tmp_path / "work"
    work.mkdir()
    for name in ("2x tiered@48MiB-256MiB-engine0.log", "2x tiered@48MiB-256MiB-engine1.log",
                 "hbm-part0.log"):
        (work / name).write_text(f"log of {name}\n{LOG}")
    s = ReplaySetup(model="m", work=work, requests=[], logs=tmp_path / "out" / "failed-logs")
    kept = keep_logs(s, "2x tiered@48MiB/256MiB")["logs"]
    assert [p.rsplit("/", 1)[1] for p in kept] == ["2x tiered@48MiB-256MiB-engine0.log",
                                                   "2x tiered@48MiB-256MiB-engine1.log"]
    assert open(kept[1]).read().startswith("log of 2x tiered@48MiB-256MiB-engine1.log")
    assert keep_logs(s, "pool@64MiB") == {}  # no server log: nothing to keep
    assert keep_logs(ReplaySetup(model="m", work=work, requests=[]), "hbm") == {}
