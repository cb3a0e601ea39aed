"""The seed's five claims, restated as ratios from a run's records, next to the seed's own figures.

The seed's figures were measured by its authors on other hardware (A10G/L40S, Qwen3-0.6B):
they are targets, so the report shows both and never one in place of the other. Its e4 counted
arrivals in engine ticks, so a slower engine also saw its requests arrive more slowly; claims 1, 2
and 4 come from e4's `ticks` records, each restated from its `seconds` records (the same arrival
instants for every engine), which the seed has no figure for.
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


def _e4(df: pd.DataFrame, clock: str) -> pd.DataFrame | str:
    """e4's records on one clock, one per config; a string saying why not when the run lacks them or
    has two records of one config there (a claim never picks one of them silently)."""
    e4 = _rows(df, "e4")
    e4 = e4[e4["clock"] == clock] if "clock" in e4 else e4.iloc[:0]
    if e4.empty:
        return f"n/a: no e4 records on the {clock} clock"
    twice = sorted(e4.loc[e4["config"].duplicated(), "config"].unique())
    if twice:
        return f"n/a: e4 has several records of {', '.join(twice)} on the {clock} clock"
    return e4


def _ratio(df: pd.DataFrame, clock: str, column: str, unit: str, arrow: str) -> str:
    e4 = _e4(df, clock)
    if isinstance(e4, str):
        return e4
    values = dict(zip(e4["config"], e4[column], strict=True))
    if STATIC not in values or CONTINUOUS not in values:
        return f"n/a: e4 lacks {STATIC} or {CONTINUOUS} on the {clock} clock"
    slow, fast = values[STATIC], values[CONTINUOUS]
    ratio = slow / fast
    shown = f"{ratio:.0f}" if ratio >= 10 else f"{ratio:.2g}"  # 154×, not 1.5e+02×
    return f"{slow:.3g} {unit} {arrow} {fast:.3g} {unit} ({shown}×)"


def _makespan_on_the_wall_clock(df: pd.DataFrame) -> str:
    """Claim 2 on the seconds clock, with the span the arrivals alone take on average: a makespan is
    never shorter than the last arrival, so the ratio of two understates the engines' own."""
    ratio = _ratio(df, "seconds", "makespan_s", "s", "vs")
    e4 = _e4(df, "seconds")
    if ratio.startswith("n/a") or isinstance(e4, str) or not {"requests", "arrival_rate_per_s"} <= set(e4):
        return ratio
    n, rate = e4["requests"].unique(), e4["arrival_rate_per_s"].unique()
    if len(n) != 1 or len(rate) != 1:
        return ratio
    return f"{ratio}; the arrivals alone: {(n[0] - 1) / rate[0]:.3g} s expected ({n[0]:g} requests at {rate[0]:g} /s)"


def _itl_per_backend(df: pd.DataFrame, clock: str) -> str:
    e4 = _e4(df, clock)
    if isinstance(e4, str):
        return e4
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


TICKS = "seed's reproduction, arrivals in engine ticks"
SECONDS = "arrivals in wall-clock seconds, the same instants for every engine"
UNSEEN = "– (the seed counted arrivals in ticks)"


def claims(df: pd.DataFrame) -> list[Claim]:
    """The seed's five claims, 1, 2 and 4 from e4 on the seed's clock (ticks); each of those followed
    by the same claim on the wall clock (seconds), which the seed did not measure."""
    ttft, span = ("ttft_p50_s", "s", "→"), ("makespan_s", "s", "vs")
    return [
        Claim(f"1. TTFT p50, static×contiguous → continuous×triton (e4, {TICKS})", "10 s → 1.5 s (6.7×)",
              _ratio(df, "ticks", *ttft), ("e4",)),
        Claim(f"1. the same, {SECONDS} (e4)", UNSEEN, _ratio(df, "seconds", *ttft), ("e4",)),
        Claim(f"2. makespan, static×contiguous vs continuous×triton (e4, {TICKS})", "28 s vs 12 s (2.3×)",
              _ratio(df, "ticks", *span), ("e4",)),
        Claim(f"2. the same, {SECONDS} (e4)", UNSEEN, _makespan_on_the_wall_clock(df), ("e4",)),
        Claim("3. the triton kernel scales best with context (e3, e1)", "much better than any other backend",
              _scaling(df), ("e3", "e1")),
        Claim(f"4. ITL p50 per backend (e4, {TICKS})", "36 ms triton / 47 ms contiguous / 59 ms paged-gather",
              _itl_per_backend(df, "ticks"), ("e4",)),
        Claim(f"4. the same, {SECONDS} (e4)", UNSEEN, _itl_per_backend(df, "seconds"), ("e4",)),
        Claim("5. throughput as the pool shrinks (e5)", "degrades gracefully", _pool(df), ("e5",)),
    ]
