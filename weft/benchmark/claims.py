"""The seed's five claims, restated as ratios from a run's records, next to the seed's own figures.

The seed's figures were measured by its authors on other hardware (A10G/L40S, Qwen3-0.6B):
they are targets, so the report shows both and never one in place of the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

STATIC, CONTINUOUS = "static×contiguous", "continuous×triton"


@dataclass(frozen=True)
class Claim:
    what: str
    seed: str
    measured: str  # "n/a: ..." when the run lacks what it takes
    experiments: tuple[str, ...]  # where `measured` comes from


def _rows(df: pd.DataFrame, experiment: str) -> pd.DataFrame:
    """The experiment's records, with only the columns they fill (other experiments' stay out)."""
    return df[df["experiment"] == experiment].dropna(axis="columns", how="all")


def _ratio(df: pd.DataFrame, column: str, unit: str, arrow: str) -> str:
    e4 = _rows(df, "e4")
    values = {} if e4.empty else dict(zip(e4["config"], e4[column], strict=True))
    if STATIC not in values or CONTINUOUS not in values:
        return f"n/a: e4 lacks {STATIC} or {CONTINUOUS}"
    slow, fast = values[STATIC], values[CONTINUOUS]
    ratio = slow / fast
    shown = f"{ratio:.0f}" if ratio >= 10 else f"{ratio:.2g}"  # 154×, not 1.5e+02×
    return f"{slow:.3g} {unit} {arrow} {fast:.3g} {unit} ({shown}×)"


def _itl_per_backend(df: pd.DataFrame) -> str:
    e4 = _rows(df, "e4")
    if "itl_p50_s" not in e4:
        return "n/a: no e4 records"
    return " / ".join(f"{r.itl_p50_s * 1e3:.3g} ms {r.config}" for r in e4.sort_values("itl_p50_s").itertuples())


def _scaling(df: pd.DataFrame) -> str:
    parts = []
    e3 = _rows(df, "e3")
    if not e3.empty:
        top = e3[e3["S"] == e3["S"].max()].sort_values("gbps", ascending=False).drop_duplicates("attention")
        parts.append(f"e3 at S={int(top['S'].iloc[0])} (best B, P): " + ", ".join(
            f"{r.attention} {r.gbps:.0f} GB/s ({r.pct_of_copy:.0f}% of copy)" if "pct_of_copy" in top
            else f"{r.attention} {r.gbps:.3g} GB/s"
            for r in top.itertuples()
        ))
    e1 = _rows(df, "e1")
    if not e1.empty and e1["S"].nunique() > 1:
        lo, hi = e1["S"].min(), e1["S"].max()
        growth = [
            f"{config} ×{g.loc[g['S'] == hi, 'itl_p50_s'].iloc[0] / g.loc[g['S'] == lo, 'itl_p50_s'].iloc[0]:.2g}"
            for config, g in e1.groupby("config")
            if {lo, hi} <= set(g["S"])
        ]
        parts.append(f"e1 ITL p50 growth from S={int(lo)} to S={int(hi)}: " + ", ".join(growth))
    return "; ".join(parts) or "n/a: no e3 or e1 records"


def _pool(df: pd.DataFrame) -> str:
    e5 = _rows(df, "e5")
    if e5.empty or not (e5["pool_fraction"] == 1.0).any():
        return "n/a: e5 lacks the full pool (fraction 1.0)"
    base = e5.loc[e5["pool_fraction"] == 1.0, "output_tok_s"].iloc[0]
    return ", ".join(
        f"{r.pool_fraction:g}: {100 * r.output_tok_s / base:.0f}% ({int(r.preemptions)} preemptions)"
        for r in e5.sort_values("pool_fraction", ascending=False).itertuples()
    ) + " of the full pool's output tokens/s"


def claims(df: pd.DataFrame) -> list[Claim]:
    return [
        Claim("1. TTFT p50, static×contiguous → continuous×triton (e4)", "10 s → 1.5 s (6.7×)",
              _ratio(df, "ttft_p50_s", "s", "→"), ("e4",)),
        Claim("2. makespan, static×contiguous vs continuous×triton (e4)", "28 s vs 12 s (2.3×)",
              _ratio(df, "makespan_s", "s", "vs"), ("e4",)),
        Claim("3. the triton kernel scales best with context (e3, e1)", "much better than any other backend",
              _scaling(df), ("e3", "e1")),
        Claim("4. ITL p50 per backend (e4)", "36 ms triton / 47 ms contiguous / 59 ms paged-gather",
              _itl_per_backend(df), ("e4",)),
        Claim("5. throughput as the pool shrinks (e5)", "degrades gracefully", _pool(df), ("e5",)),
    ]
