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


def test_the_cause_behind_vllms_log_prefix_and_not_a_warning():
    log = ("(Worker pid=9) WARNING 12-07 04:14:36 [utils.py:597] Failed to create oneDNN "
           "linear, fallback to torch linear. Exception: could not create a primitive\n"
           "(EngineCore pid=7) ERROR 12-07 04:15:33 [core.py:1512] Traceback (most recent "
           "call last):\n"
           "(EngineCore pid=7) ERROR 12-07 04:15:33 [core.py:1512] ValueError: Cannot get 2 "
           "free blocks from the pool\n"
           "(APIServer pid=5) ERROR 12-07 04:15:33 [async_llm.py:906] vllm.v1.engine."
           "exceptions.EngineDeadError: EngineCore encountered an issue.\n")
    assert root_cause(log) == "ValueError: Cannot get 2 free blocks from the pool"


def test_a_failed_configuration_is_one_row_with_the_cause():
    error = f"vllm serve exited (1): {root_cause(LOG)}\n" + LOG
    row = error_row("hbm", error, HEADER, 80)
    assert "\n" not in row
    assert row.startswith("| hbm | error: vllm serve exited (1): ValueError: To serve")
    assert row.count("|") == HEADER.count("|")
    # a pipe in the message does not open a cell
    assert error_row("x", "a | b", HEADER).count("|") == HEADER.count("|")


def test_a_failed_configurations_server_logs_outlive_the_work_directory(tmp_path):
    from vllm_layerwise_patch.bench.replay import ReplaySetup, keep_logs, with_cause

    work = tmp_path / "work"
    work.mkdir()
    for name in ("2x tiered@48MiB-256MiB-engine0.log", "2x tiered@48MiB-256MiB-engine1.log",
                 "hbm-part0.log"):
        (work / name).write_text(f"log of {name}\n{LOG}")
    # the other engine only saw the first one die: its own log names no cause
    (work / "2x tiered@48MiB-256MiB-engine0.log").write_text(
        "x\nvllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n")
    s = ReplaySetup(model="m", work=work, requests=[], logs=tmp_path / "out" / "failed-logs")
    got = keep_logs(s, "2x tiered@48MiB/256MiB")
    kept = got["logs"]
    assert got["cause"].startswith("ValueError: To serve at least one request")
    assert [p.rsplit("/", 1)[1] for p in kept] == ["2x tiered@48MiB-256MiB-engine0.log",
                                                   "2x tiered@48MiB-256MiB-engine1.log"]
    assert open(kept[1]).read().startswith("log of 2x tiered@48MiB-256MiB-engine1.log")
    assert "EngineDeadError" in open(kept[0]).read()
    assert keep_logs(s, "pool@64MiB") == {}  # no server log: nothing to keep
    assert keep_logs(ReplaySetup(model="m", work=work, requests=[]), "hbm") == {}
    # an HTTP 500 mid-replay gets the engine's cause on its table row
    row = error_row("2x tiered", with_cause("HTTPError: HTTP Error 500: Internal Server Error",
                                            got["cause"]), HEADER)
    assert "500: Internal Server Error (server log: ValueError: To serve" in row
    started = f"vllm serve exited (1): {got['cause']}\n{LOG}"
    assert with_cause(started, got["cause"]) == started  # (said once)
