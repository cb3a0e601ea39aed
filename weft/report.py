"""`python -m weft.report [RUN ...]`: charts and a markdown summary of stored perf runs.

RUN is a JSON path, or a stored run's number (0001) or file name. Without RUN: the newest
stored run's machine, each experiment from the newest commit that measured it (a matrix run
over several sessions), each named with its commit. Runs of two commits of one machine: the
newer is reported and compared with the older in a ratio table; `--baseline RUN...` names
the runs to compare against explicitly (say, an earlier run of the same uncommitted tree).
Runs of several machines are refused.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from weft.benchmark import charts
from weft.benchmark.claims import claims
from weft.benchmark.results import EXPERIMENTS, ReportError, Selection, commits_by_experiment, gather, restrict

ROOT = Path(__file__).resolve().parents[1]


def _3g(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1e3 else f"{v:,.0f}"  # 1,340, not 1.34e+03


def _ms(v: float) -> str:
    return f"{v * 1e3:.3g}"


def _rate(v: float) -> str:
    return f"{v:,.0f}"


def _gb(v: float) -> str:
    return f"{v / 1e9:.1f}"


def _pct(v: float) -> str:
    return f"{100 * v:.1f}"


def _req_rate(v: float) -> str:
    return "inf" if v == float("inf") else f"{v:g}"


# column -> (header, format): the header names the unit its format shows (weft's records hold seconds
# and bytes; ITL and kernel times read best in ms, memory in GB; e9's client latencies are stored in
# ms, as vLLM's `bench serve` names them). Every table labels a metric (and a key column listed here)
# with its header, never with the record's field name, whose suffix names the stored unit instead.
COLUMNS: dict[str, tuple[str, Callable[[float], str]]] = {
    "ttft_p50_s": ("TTFT p50 (s)", _3g), "ttft_p90_s": ("TTFT p90 (s)", _3g), "ttft_p99_s": ("TTFT p99 (s)", _3g),
    "itl_p50_s": ("ITL p50 (ms)", _ms), "itl_p99_s": ("ITL p99 (ms)", _ms),
    "e2e_p50_s": ("e2e p50 (s)", _3g), "makespan_s": ("makespan (s)", _3g),
    "input_tok_s": ("input tok/s", _rate), "output_tok_s": ("output tok/s", _rate),
    "peak_mem_bytes": ("peak mem (GB)", _gb), "preemptions": ("preemptions", _rate),
    "prefix_cache_hit_rate": ("prefix cache hit rate (%)", _pct),
    "recomputed_tokens": ("recomputed tokens", _rate), "incomplete_requests": ("incomplete requests", _rate),
    "gbps": ("GB/s", _rate), "pct_of_copy": ("% of copy", _rate), "time_s": ("time (ms)", _ms),
    "ratio_vs_sdpa": ("time ÷ SDPA", _3g), "tflops": ("TFLOP/s", _3g), "sdpa_tflops": ("SDPA TFLOP/s", _3g),
    "request_rate": ("request rate (req/s)", _req_rate), "request_goodput": ("goodput (req/s)", _3g),
    "median_ttft_ms": ("TTFT p50 (ms)", _3g), "p99_ttft_ms": ("TTFT p99 (ms)", _3g),
    "median_tpot_ms": ("TPOT p50 (ms)", _3g), "p99_tpot_ms": ("TPOT p99 (ms)", _3g),
    "median_itl_ms": ("ITL p50 (ms)", _3g),
    "step_ms": ("step (ms)", _3g), "gpu_busy_ms": ("GPU busy (ms)", _3g), "gpu_idle_ms": ("GPU idle (ms)", _3g),
    "floor_ms": ("floor (ms)", _3g), "step_floor_ratio": ("step ÷ floor", _3g),
    "floor_s": ("floor (s)", _3g), "makespan_floor_ratio": ("makespan ÷ floor", _3g),
    "weights_bytes": ("weights read per step (GB)", _gb), "weights_floor_s": ("weights floor (ms)", _ms),
    "itl_floor_ratio": ("ITL p50 ÷ weights floor", _3g), "with_grouping_s": ("with grouping (ms)", _ms),
    "bytes": ("bytes moved (GB)", _gb),
    "cublas_s": ("cuBLAS (ms)", _ms), "cublas_over_weft": ("cuBLAS ÷ weft", _3g),
    "cublas_pct_of_copy": ("cuBLAS % of copy", _rate),
}
# derived columns: each a measured time over its memory-traffic floor (e13's per step, the others' per run)
RATIOS = {"step_floor_ratio": ("step_ms", "floor_ms"), "makespan_floor_ratio": ("makespan_s", "floor_s"),
          "itl_floor_ratio": ("itl_p50_s", "weights_floor_s")}
FLOOR = ["floor_s", "makespan_floor_ratio"]  # the decode-heavy experiments' columns
TABLES: dict[str, tuple[list[str], list[str]]] = {  # experiment -> (key columns, metric columns)
    "e1": (["config", "S"], ["ttft_p50_s", "itl_p50_s", "output_tok_s", "peak_mem_bytes"]),
    "e2": (["config", "B"], ["ttft_p50_s", "itl_p50_s", "output_tok_s", "peak_mem_bytes", *FLOOR]),
    "e3_prefill": (["B", "T", "P"], ["time_s", "ratio_vs_sdpa", "tflops", "sdpa_tflops"]),
    "e4": (["clock", "config"], ["ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s",
                                 "makespan_s", "output_tok_s", "preemptions"]),
    "e5": (["config", "pool_fraction", "pool_blocks"], ["output_tok_s", "makespan_s", "preemptions",
                                                        "recomputed_tokens", "ttft_p50_s", "itl_p50_s", *FLOOR]),
    "e6": (["attention", "block_size"], ["output_tok_s", "ttft_p50_s", "itl_p50_s", "peak_mem_bytes", *FLOOR]),
    "e7": (["config", "steps"], ["itl_p50_s"]),
    "e8": (["config"], ["ttft_p50_s", "itl_p50_s", "e2e_p50_s", "makespan_s", "input_tok_s", "output_tok_s",
                        "peak_mem_bytes", "incomplete_requests", *FLOOR]),
    "e11": (["config"], ["ttft_p50_s", "ttft_p99_s", "itl_p50_s", "makespan_s", "output_tok_s",
                         "prefix_cache_hit_rate"]),
    "e13": (["config", "shape", "B"], ["step_ms", "gpu_busy_ms", "gpu_idle_ms", "floor_ms", "step_floor_ratio"]),
    "e12": (["workload", "config"], ["output_tok_s", "itl_p50_s", "ttft_p50_s", "makespan_s", "steps", *FLOOR]),
    "e9": (["server", "config", "workload", "request_rate"],
           ["median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "output_tok_s",
            "request_goodput"]),
    "e14": (["workload_kind", "config"], ["output_tok_s", "itl_p50_s", "ttft_p50_s", "makespan_s",
                                          "prefix_cache_hit_rate", *FLOOR]),
    "e15": (["model", "config", "B"], ["ttft_p50_s", "itl_p50_s", "weights_floor_s", "itl_floor_ratio", "output_tok_s",
                                       "peak_mem_bytes", *FLOOR]),
    "e15_e8": (["model", "config"], ["ttft_p50_s", "itl_p50_s", "makespan_s", "output_tok_s", "peak_mem_bytes",
                                     *FLOOR]),
    "e15_itl": (["model", "config"], ["itl_p50_s", "weights_bytes", "weights_floor_s", "itl_floor_ratio",
                                      "ttft_p50_s"]),
    "e15_kernel": (["model", "B", "path", "top_k", "num_experts", "experts_touched"],
                   ["time_s", "with_grouping_s", "bytes", "gbps", "pct_of_copy"]),
    "e16": (["model", "workload_kind", "config"], ["output_tok_s", "itl_p50_s", "ttft_p50_s", "makespan_s", *FLOOR]),
    "e17_kernel": (["model", "layer", "N", "K", "M", "launch"],
                   ["time_s", "pct_of_copy", "cublas_s", "cublas_pct_of_copy", "cublas_over_weft"]),
    "e17_itl": (["model", "config"], ["itl_p50_s", "weights_bytes", "weights_floor_s", "itl_floor_ratio",
                                      "ttft_p50_s"]),
}
COMPARED = ["output_tok_s", "makespan_s", "ttft_p50_s", "itl_p50_s", "gbps", "time_s"]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _cell(column: str, value: object) -> str:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return "–"
    if column in COLUMNS and isinstance(value, int | float):
        return COLUMNS[column][1](value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def bandwidth_table(df: pd.DataFrame) -> str:
    """e3: one row per shape, one column per backend: GB/s (and % of the copy bandwidth)."""
    backends = sorted(df["attention"].unique())
    rows = []
    for (B, P, S), shape in df.groupby(["B", "P", "S"]):
        cells = {r.attention: f"{r.gbps:,.0f}" + (f" ({r.pct_of_copy:.0f}%)" if pd.notna(r.pct_of_copy) else "")
                 for r in shape.itertuples()}
        rows.append([f"{B:g}", f"{P:g}", f"{S:g}"] + [cells.get(b, "–") for b in backends])
    return markdown_table(["B", "P", "S"] + [f"{b} GB/s (% of copy)" for b in backends], rows)


def experiment_table(experiment: str, df: pd.DataFrame) -> str:
    if experiment == "e3":
        return bandwidth_table(df)
    keys, metrics = TABLES[experiment]
    for ratio, (measured, floor) in RATIOS.items():
        if measured in df and floor in df:
            df = df.assign(**{ratio: df[measured] / df[floor]})
    keys = [k for k in keys if k in df]
    metrics = [m for m in metrics if m in df and df[m].notna().any()]
    df = df.sort_values(keys)
    header = [COLUMNS[c][0] if c in COLUMNS else c for c in keys + metrics]
    rows = [[_cell(c, getattr(r, c)) for c in keys + metrics] for r in df.itertuples()]
    if experiment == "e7":
        header.append("top ops (self ms per tick)")
        for row, ops in zip(rows, df["top_ops"], strict=True):
            row.append(", ".join(f"`{op}` {ms:.2g}" for op, ms in charts.op_times(ops).head(4).items()))
    return markdown_table(header, rows)


def _one(df: pd.DataFrame, column: str) -> str:
    """`column`'s one value in `df` as text after a space (" 4"), or "" when it has none or several."""
    values = df[column].dropna().unique() if column in df else []
    return f" {values[0]:g}" if len(values) == 1 else ""


def batch_sweep_notes(df: pd.DataFrame) -> list[str]:
    """e2: at each batch size, the fastest weft configuration's output tok/s over each HF peer's (the same run)."""
    if "engine" not in df:
        return []
    measured = df[df["output_tok_s"].notna() & (df["output_tok_s"] > 0)]
    weft = measured[measured["engine"] == "weft"]
    if weft.empty:
        return []
    best = weft.loc[weft.groupby("B")["output_tok_s"].idxmax()].set_index("B")  # one row per B
    lead = best["config"].iloc[0] if best["config"].nunique() == 1 else "weft's fastest"
    notes = []
    for peer, runs in measured[measured["engine"] != "weft"].groupby("config"):
        cells = []
        for r in runs.sort_values("B").itertuples():
            if r.B in best.index:
                ours = best.loc[r.B]
                name = "" if lead != "weft's fastest" else f" ({ours.config})"
                cells.append(f"B={r.B:g}{name} {ours.output_tok_s:,.0f} ÷ {r.output_tok_s:,.0f}"
                             f" = {ours.output_tok_s / r.output_tok_s:.1f}×")
        if cells:
            notes.append(f"output tok/s, {lead} ÷ {peer}: " + "; ".join(cells) + ".")
    return notes


def clock_notes(df: pd.DataFrame) -> list[str]:
    """e4: what each clock means, with the arrival rates its records state, and how far admissions stall the
    running decodes (ITL p99 over p50)."""
    per_tick, per_s = _one(df, "arrival_rate_per_tick"), _one(df, "arrival_rate_per_s")
    stalls = "; ".join(f"{r.config} ({r.clock}) {r.itl_p99_s / r.itl_p50_s:.2f}x"
                       for r in df.itertuples() if {"itl_p50_s", "itl_p99_s"} <= set(df) and r.itl_p50_s)
    return [
        f"`ticks`: the seed's reproduction, Poisson arrivals{per_tick and ' at' + per_tick} per engine step, so a"
        " slower engine's requests also arrive more slowly.",
        f"`seconds`: Poisson arrivals{per_s and ' at' + per_s} per wall-clock second, the same instants for"
        " every engine: what a user compares. A makespan is never shorter than the last arrival.",
        *([f"ITL p99 ÷ p50 (how far admissions stall the running decodes): {stalls}."] if stalls else []),
    ]


def serving_notes(df: pd.DataFrame) -> list[str]:
    """e9: what the servers are, the goodput's SLOs, and each server's output tok/s at rate inf over
    the offline engine's of the same config (what HTTP costs)."""
    notes = [
        "`server`: loaded over HTTP by a client with vLLM's `bench serve` conventions, timed on the client"
        " (a peer server gets rows of its own); `offline`: the same engine options serving the same requests"
        " without HTTP (as `LLM.generate` does), timed by the engine (no TPOT)."
    ]
    slos = df["goodput_slo_ms"].dropna() if "goodput_slo_ms" in df else pd.Series(dtype=object)
    if len(slos) and all(slo == slos.iloc[0] for slo in slos):
        notes.append("goodput: requests/s meeting " + " and ".join(
            f"{metric.upper()} ≤ {ms:g} ms" for metric, ms in slos.iloc[0].items()) + ".")
    offline = df[df["server"] == "offline"]
    at_inf = df[(df["server"] != "offline") & (df["request_rate"] == float("inf"))]
    for r in at_inf.sort_values(["server", "config"]).itertuples():
        base = offline[(offline["config"] == r.config) & _same_workload(offline, r)]["output_tok_s"]
        if len(base) == 1:
            notes.append(f"{r.server} ({r.config}) at rate inf ÷ offline, output tok/s: {r.output_tok_s:,.0f} ÷"
                         f" {base.iloc[0]:,.0f} = {r.output_tok_s / base.iloc[0]:.2f}×.")
    notes += goodput_ratios(df[df["server"] != "offline"])
    return notes


def _same_workload(df: pd.DataFrame, record: object) -> pd.Series:
    """Rows of `df` on `record`'s workload (every row, where records do not name one)."""
    if "workload" not in df or pd.isna(getattr(record, "workload", None)):
        return pd.Series(True, index=df.index)
    return df["workload"] == record.workload


def goodput_ratios(served: pd.DataFrame) -> list[str]:
    """weft's goodput over a peer server's, rate by rate, where both served the same workload."""
    if "request_goodput" not in served or served["server"].nunique() < 2:
        return []
    weft = served[served["engine"] == "weft"]
    lines = []
    for (server, config), peer in served[served["engine"] != "weft"].groupby(["server", "config"]):
        cells = []
        for p in peer.sort_values("request_rate").itertuples():
            w = weft[(weft["request_rate"] == p.request_rate) & _same_workload(weft, p)]
            if len(w) != 1:
                continue
            ours, theirs = w["request_goodput"].iloc[0], p.request_goodput
            ratio = f"{ours / theirs:.1f}×" if theirs else ("∞ (the peer's is 0)" if ours else "– (both 0)")
            cells.append(f"{p.request_rate:g} req/s: {ours:.2f} ÷ {theirs:.2f} = {ratio}")
        if cells:
            lines.append(f"goodput, weft ({weft['config'].iloc[0]}) ÷ {server} ({config}): " + "; ".join(cells) + ".")
    return lines


def prefix_cache_notes(df: pd.DataFrame) -> list[str]:
    """e11: TTFT p50 without the cache over with it, and output tok/s with it over without, per workload."""
    notes = []
    for workload, runs in df.groupby("workload"):
        on, off = runs[runs["prefix_caching"] == True], runs[runs["prefix_caching"] == False]  # noqa: E712
        if len(on) == 1 and len(off) == 1:
            on, off = on.iloc[0], off.iloc[0]
            ttft, tok_s = off.ttft_p50_s / on.ttft_p50_s, on.output_tok_s / off.output_tok_s
            notes.append(f"{workload}: TTFT p50 without ÷ with the cache: {off.ttft_p50_s:.3f} ÷ {on.ttft_p50_s:.3f} s"
                         f" = {ttft:.2f}×; output tok/s with ÷ without:"
                         f" {on.output_tok_s:,.0f} ÷ {off.output_tok_s:,.0f} = {tok_s:.2f}×.")
    return notes


def ablation_notes(df: pd.DataFrame) -> list[str]:
    """e12: each configuration's output tok/s and ITL p50 over the engine defaults', per workload; a peer's
    ITL p50 over the defaults'."""
    notes = []
    for workload, runs in df.groupby("workload"):
        weft = runs["config"].str.contains("×")
        base = runs[weft & ~runs["config"].str.contains(", no ")]
        if len(base) != 1:
            continue
        b = base.iloc[0]
        cells = [f"{r.config.split(', ', 1)[1]}: {r.output_tok_s / b.output_tok_s:.2f}× the output tok/s,"
                 f" {r.itl_p50_s / b.itl_p50_s:.2f}× the ITL p50" for r in runs.itertuples() if ", no " in r.config]
        if cells:
            notes.append(f"{workload}, against {b.config} with the engine's defaults: " + "; ".join(cells) + ".")
        notes += [f"{workload}: ITL p50 of {r.config} ÷ {b.config}'s: {r.itl_p50_s * 1e3:.2f} ÷"
                  f" {b.itl_p50_s * 1e3:.2f} ms = {r.itl_p50_s / b.itl_p50_s:.2f}×."
                  for r in runs[~weft].itertuples()]
    return notes


def profile_notes(df: pd.DataFrame) -> list[str]:
    """e13: each step's GPU time by kernel class, largest first; a GPU busy time below the floor, flagged."""
    notes = []
    for r in df.sort_values(["config", "shape"]).itertuples():
        classes = getattr(r, "gpu_ms_by_class", None)
        if isinstance(classes, dict) and classes:
            notes.append(f"{r.config} {r.shape}, GPU ms by kernel class: "
                         + ", ".join(f"{cls} {ms:.3g}" for cls, ms in classes.items()) + ".")
        floor, busy = getattr(r, "floor_ms", None), getattr(r, "gpu_busy_ms", None)
        if pd.notna(floor) and pd.notna(busy) and busy < floor:
            notes.append(f"{r.config} {r.shape}: the profiled GPU busy time ({busy:.3g} ms) is below the floor"
                         f" ({floor:.3g} ms): either the step did not move the bytes the floor counts or the"
                         " profiler missed some of its kernels; its wall time is the measure.")
    return notes


def sampling_notes(df: pd.DataFrame) -> list[str]:
    """e14: in each workload, every sampling's output tok/s over its baseline's: greedy (n1 for the n's)."""
    notes = []
    for kind, rows in df.groupby("workload_kind", sort=False):
        base = rows[rows["sampling"].isin(("greedy", "n1"))]
        if len(base) != 1:
            continue
        b = base.iloc[0]
        notes += [f"{kind}: {r.config} ÷ {b.config}, output tok/s: {r.output_tok_s:,.0f} ÷ {b.output_tok_s:,.0f} ="
                  f" {r.output_tok_s / b.output_tok_s:.2f}×." for r in rows.drop(base.index).itertuples()]
    return notes


def peer_notes(df: pd.DataFrame) -> list[str]:
    """e15_e8: weft's output tok/s over each HF peer's, per model (the same run)."""
    notes = []
    for model, rows in df.groupby("model"):
        weft, peers = rows[rows["engine"] == "weft"], rows[rows["engine"] != "weft"]
        notes += [f"{model}, output tok/s, {w.config} ÷ {p.config}: {w.output_tok_s:,.0f} ÷ {p.output_tok_s:,.0f} ="
                  f" {w.output_tok_s / p.output_tok_s:.1f}×." for w in weft.itertuples() for p in peers.itertuples()]
    return notes


def family_notes(df: pd.DataFrame) -> list[str]:
    """e15_itl: each pair of dense models' batch-1 ITL p50, one over the other, beside their weights' (the same
    machinery: no family should cost more than its bytes)."""
    dense = df[df["num_experts"] == 0].sort_values("model") if "num_experts" in df else df.iloc[:0]
    return [f"ITL p50, {a.model} ÷ {b.model}: {a.itl_p50_s * 1e3:.2f} ÷ {b.itl_p50_s * 1e3:.2f} ms ="
            f" {a.itl_p50_s / b.itl_p50_s:.2f}× (weights read per step: {a.weights_bytes / b.weights_bytes:.2f}×)."
            for a, b in itertools.combinations(dense.itertuples(), 2)]


def kernel_notes(df: pd.DataFrame) -> list[str]:
    """e15_kernel: what its times and bytes count."""
    return ["time: the gate_up and down kernels, path `pairs` a program per (token, expert) pair (few pairs: the"
            " layer's whole expert pass), path `grouped` over pairs already grouped by expert; with grouping: the"
            " layer's whole expert pass (`fused_experts`). Bytes moved: each expert the tokens touch (its gate_up and"
            " down), the tokens in and the outputs out (`pairs`: each token's, summed; `grouped`: each pair's); % of"
            " copy: their rate over the copy bandwidth."]


def determinism_notes(df: pd.DataFrame) -> list[str]:
    """e16: deterministic over default, output tok/s on e8's workload and ITL p50 alone (the same run), per model."""
    notes = []
    for model, by_model in df.groupby("model", sort=False):
        for kind, metric, name, scale, unit in (("e8", "output_tok_s", "output tok/s", 1, ""),
                                                ("b1", "itl_p50_s", "ITL p50", 1e3, " ms")):
            rows = by_model[by_model["workload_kind"] == kind]
            on, off = rows[rows["deterministic"] == True], rows[rows["deterministic"] == False]  # noqa: E712
            if len(on) == len(off) == 1:
                a, b = on[metric].iloc[0], off[metric].iloc[0]
                digits = 3 if scale > 1 else 0
                notes.append(f"{model}, {kind}, {name}, deterministic ÷ default: {a * scale:,.{digits}f} ÷ "
                             f"{b * scale:,.{digits}f}{unit} = {a / b:.2f}×.")
    return notes


def decode_gemm_notes(df: pd.DataFrame) -> list[str]:
    """e17_kernel: what its times count."""
    return ["time: GPU time per call replayed from a CUDA graph over copies of the weight that together outgrow the"
            " L2; % of copy: the weight's bytes at the copy bandwidth over the time. launch: the tuned launch weft"
            " runs (tiles, step along K, warps, stages, splits of K), or cublas where the tuner kept it."
            " gate_up: with the MLP's SiLU x up after it, in weft's launch or by weft's SiLU x up kernel after"
            " cuBLAS."]


def itl_peer_notes(df: pd.DataFrame) -> list[str]:
    """e17_itl: per model, weft's batch-1 ITL p50 over its weights floor and over HF's (the same run)."""
    notes = []
    for model, rows in df.groupby("model", sort=False):
        weft, peers = rows[rows["engine"] == "weft"], rows[rows["engine"] != "weft"]
        for w in weft.itertuples():
            if pd.notna(w.weights_floor_s):
                notes.append(f"{model}, weft's ITL p50 ÷ weights floor: {w.itl_p50_s * 1e3:.2f} ÷ "
                             f"{w.weights_floor_s * 1e3:.2f} ms = {w.itl_p50_s / w.weights_floor_s:.2f}×.")
            notes += [f"{model}, ITL p50, {p.config} ÷ {w.config}: {p.itl_p50_s * 1e3:.2f} ÷ {w.itl_p50_s * 1e3:.2f} ms"
                      f" = {p.itl_p50_s / w.itl_p50_s:.2f}×." for p in peers.itertuples()]
    return notes


NOTES: dict[str, Callable[[pd.DataFrame], list[str]]] = {
    "e2": batch_sweep_notes, "e4": clock_notes, "e9": serving_notes, "e11": prefix_cache_notes,
    "e12": ablation_notes, "e13": profile_notes, "e14": sampling_notes, "e15": batch_sweep_notes,
    "e15_e8": peer_notes, "e15_itl": family_notes, "e15_kernel": kernel_notes, "e16": determinism_notes,
    "e17_kernel": decode_gemm_notes, "e17_itl": itl_peer_notes,
}


def experiment_notes(experiment: str, df: pd.DataFrame) -> str:
    """What an experiment's table needs said beside it, as markdown bullets ("" for none)."""
    return "\n".join(f"- {note}" for note in NOTES[experiment](df)) if experiment in NOTES else ""


def ratio_table(subject: pd.DataFrame, baseline: pd.DataFrame) -> str:
    """One row per benchmark in both and metric in `COMPARED`: the metric by its header (with the
    unit both cells are shown in), baseline, this, and this ÷ baseline."""
    joined = subject.merge(baseline, on="name", suffixes=("", "_base"))
    rows = []
    for r in joined.sort_values(["experiment", "name"]).to_dict("records"):
        for m in COMPARED:
            new, old = r.get(m), r.get(f"{m}_base")
            if pd.notna(new) and pd.notna(old) and old:
                header = COLUMNS[m][0]
                rows.append([r["experiment"], r["name"], header, _cell(m, old), _cell(m, new), f"{new / old:.3g}"])
    if not rows:
        return "No benchmark appears in both commits."
    return markdown_table(["experiment", "benchmark", "metric", "baseline", "this", "this ÷ baseline"], rows)


def _commit_of(subject: pd.DataFrame, experiments: tuple[str, ...]) -> str:
    shas = subject.loc[subject["experiment"].isin(experiments), "git_sha"].drop_duplicates()
    return ", ".join(f"`{sha[:12]}`" for sha in shas) or "–"


def claims_table(subject: pd.DataFrame) -> str:
    """The seed's claims beside the records' own figures, each with the commits it comes from."""
    return markdown_table(["claim", "seed (its authors' hardware)", "measured here", "commit"],
                          [[c.what, c.seed, c.measured, _commit_of(subject, c.experiments)] for c in claims(subject)])


def summary(selection: Selection, subject: pd.DataFrame, baseline: pd.DataFrame, drawn: list[str]) -> str:
    out = [
        "# weft benchmark report",
        "",
        f"Machine **{selection.gpu}**. Each experiment comes from one commit, the newest that measured it:",
    ]
    for sha, experiments in commits_by_experiment(subject).items():
        runs = ", ".join(f"`{r}`" for r in subject.loc[subject["git_sha"] == sha, "run"].drop_duplicates())
        out.append(f"- commit `{sha}`: {', '.join(experiments)} (runs {runs})")
    out.append("Written by `python -m weft.report`; every figure below comes from those runs' `extra_info`.")
    if selection.gpu == "cpu":
        out += ["", "> CPU run: toy sizes on a tiny random model, to keep the suite alive. Never publish these."]
    out += [f"- {note}" for note in selection.notes]
    out += ["", "## The seed's claims, from these runs", ""]
    out.append(claims_table(subject))
    for experiment, title in EXPERIMENTS.items():
        df = subject[subject["experiment"] == experiment]
        if df.empty:
            continue
        out += ["", f"## {experiment}: {title}", "", f"Commit {_commit_of(df, (experiment,))}.", ""]
        if experiment in drawn:
            out += [f"![{experiment}]({experiment}.png)", ""]
        out.append(experiment_table(experiment, df))
        if notes := experiment_notes(experiment, df):
            out += ["", notes]
    missing = [e for e in EXPERIMENTS if e not in set(subject["experiment"])]
    if missing:
        out += ["", f"Not measured on this machine: {', '.join(missing)}."]
    if not baseline.empty:
        base = selection.baseline
        out += ["", f"## This commit ÷ baseline commit `{base[0].git_sha}`",
                f"Baseline runs: {', '.join(f'`{r.label}`' for r in base)}.", "",
                ratio_table(subject, baseline)]
    out += [
        "", "## Comparing runs with pytest-benchmark", "",
        "pytest-benchmark's own view of the same JSON: wall time of each benchmarked serving run",
        "(one round each; the serving metrics above live in `extra_info`):", "",
        "```",
        "uv run pytest-benchmark --storage file://results compare 0001 0002 --group-by=name --columns=min",
        "uv run python -m weft.report 0001 0002          # two commits: the newer, with a ratio table",
        "uv run python -m weft.report 0002 --baseline 0001   # any two runs of one machine",
        "```",
    ]
    return "\n".join(out) + "\n"


def report(
    names: list[str],
    baseline: list[str],
    results: Path,
    out: Path | None,
    filters: dict[str, list[str] | None],
) -> tuple[Path, list[Path]]:
    """Loads, checks, filters, draws and writes; -> (README path, chart paths)."""
    selection = gather(names, baseline, results)
    subject, baseline = selection.records(), selection.records(baseline=True)
    for column, wanted in filters.items():
        subject = restrict(subject, column, wanted)  # the ratio table joins the baseline on these names
    if subject.empty:
        raise ReportError("no records left after the filters")
    out = out or (results / "cpu" if selection.gpu == "cpu" else results)
    out.mkdir(parents=True, exist_ok=True)
    charts_written = []
    for experiment in charts.CHARTS:
        fig = charts.figure(experiment, subject, selection.gpu)
        if fig is not None:
            path = out / f"{experiment}.png"
            path.write_bytes(charts.png(fig))
            charts_written.append(path)
    readme = out / "README.md"
    readme.write_text(summary(selection, subject, baseline, [p.stem for p in charts_written]))
    return readme, charts_written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weft.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", metavar="RUN", help="JSON path, or stored run number / name")
    parser.add_argument("--baseline", nargs="+", default=[], metavar="RUN", help="compare against these runs")
    parser.add_argument("--results", type=Path, default=ROOT / "results", help="where runs are stored")
    parser.add_argument("--out", type=Path, help="for charts and README.md (default: results/, CPU: results/cpu/)")
    parser.add_argument("--experiment", nargs="+", help=f"only these: {', '.join(EXPERIMENTS)}")
    parser.add_argument("--attention", nargs="+", help="only records of these backends (HF's: sdpa)")
    parser.add_argument("--model", nargs="+", help="only records of these models")
    args = parser.parse_args(argv)
    filters = {"experiment": args.experiment, "attention": args.attention, "model": args.model}
    try:
        readme, written = report(args.runs, args.baseline, args.results, args.out, filters)
    except ReportError as e:
        print(f"weft.report: {e}", file=sys.stderr)
        return 1
    print(f"wrote {readme} and {len(written)} chart(s): {', '.join(p.name for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
