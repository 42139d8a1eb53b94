"""``bench --trace --admission all,reused``: the pool's admission rules side
by side at each capacity - token hit rate against the bytes the pool saved
(``vllm:layerwise_pool_save_bytes`` summed over the replay), each rule
against ``all`` at the same capacity.  Issue #37's goal for a rule: a hit
rate within 5 points of ``all`` with at least 30 % fewer bytes saved."""

from __future__ import annotations

import os
from typing import Any

#: a rule meets the goal at a capacity with at most this many points of hit
#: rate lost against ``all`` ...
MAX_HIT_LOSS = 0.05
#: ... and at least this fraction fewer bytes saved
MIN_BYTES_CUT = 0.30


def compare(results: dict[str, dict[str, Any]], caps: list[str], rules: list[str]
            ) -> list[dict[str, Any]]:
    """One row per capacity and rule (``pool@CAP`` is ``all``,
    ``pool@CAP/RULE`` the others): hit rates, bytes and blocks saved, blocks
    not admitted, and against ``all``: hit rate points lost, fraction of bytes
    saved cut, the goal met."""
    rows = []
    for cap in caps:
        base = None
        for rule in rules:
            r = results.get(f"pool@{cap}" if rule == "all" else f"pool@{cap}/{rule}")
            if not r or r.get("error"):
                continue
            p = r["pool"]
            row = {"capacity": cap, "capacity_bytes": r.get("capacity_bytes"), "rule": rule,
                   "hit_rate": r["hit_rate"]["hbm"] + r["hit_rate"]["pool"],
                   "pool_hit_rate": r["hit_rate"]["pool"],
                   "bytes_saved": p.get("save_bytes_sum", 0.0),
                   "blocks_saved": p.get("blocks_saved", 0.0),
                   "blocks_not_admitted": p.get("blocks_not_admitted", 0.0),
                   "evictions": p.get("evictions", 0.0),
                   "ttft_p50_s": r["ttft_s"]["p50"]}
            if rule == "all":
                base = row
            elif base is not None:
                loss = base["hit_rate"] - row["hit_rate"]
                cut = (1 - row["bytes_saved"] / base["bytes_saved"]
                       if base["bytes_saved"] else 0.0)
                row.update(hit_points_lost=loss, bytes_saved_cut=cut,
                           goal_met=loss <= MAX_HIT_LOSS and cut >= MIN_BYTES_CUT)
            rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = ["## Admission rules", "",
             "Hit rate against bytes saved, each rule against `all` at the same pool "
             f"capacity (goal: at most {MAX_HIT_LOSS:.0%} points of hit rate lost with at "
             f"least {MIN_BYTES_CUT:.0%} fewer bytes saved).", "",
             "| capacity | admission | total hit | pool hit | saved (MiB) | blocks saved | "
             "not admitted | evictions | TTFT p50 (s) | hit points lost | bytes saved cut | "
             "goal |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = ("-", "-", "-") if r["rule"] == "all" else (
            f"{100 * r['hit_points_lost']:.1f}", f"{r['bytes_saved_cut']:.0%}",
            "met" if r["goal_met"] else "not met")
        lines.append(
            f"| {r['capacity']} | {r['rule']} | {r['hit_rate']:.1%} | {r['pool_hit_rate']:.1%} | "
            f"{r['bytes_saved'] / (1 << 20):.0f} | {r['blocks_saved']:.0f} | "
            f"{r['blocks_not_admitted']:.0f} | {r['evictions']:.0f} | "
            f"{r['ttft_p50_s']:.3f} | {vs[0]} | {vs[1]} | {vs[2]} |")
    return lines + [""]


def plot(rows: list[dict[str, Any]], out_dir: str) -> list[str]:
    """Token hit rate against MiB saved, one marker per rule and capacity."""
    if not rows:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, rule in enumerate(dict.fromkeys(r["rule"] for r in rows)):
        mine = [r for r in rows if r["rule"] == rule]
        ax.scatter([r["bytes_saved"] / (1 << 20) for r in mine],
                   [100 * r["hit_rate"] for r in mine], color=f"C{i}", label=rule)
        for r in mine:
            ax.annotate(r["capacity"], (r["bytes_saved"] / (1 << 20), 100 * r["hit_rate"]),
                        fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("bytes saved into the pool (MiB)")
    ax.set_ylabel("prompt tokens hit (%)")
    ax.set_ylim(0, 100)
    ax.set_xlim(left=0)
    ax.set_title("Admission rules: hit rate against bytes saved (trace replay)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = os.path.join(out_dir, "admission_hit_rate_vs_bytes_saved.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
