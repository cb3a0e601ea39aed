"""One chart per experiment: seaborn on matplotlib's Agg canvas (no display, no pyplot state).

`figure` draws one experiment from a report's records and `png` renders it; `python -m
weft.report` writes those bytes to results/ and analysis.ipynb displays the same bytes inline.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import pandas as pd
import seaborn as sns
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from weft.benchmark.results import EXPERIMENTS
from weft.benchmark.workloads import CLOCKS

MS = 1e3
DPI = 110


def _figure(panels: int) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(5.5 * panels, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, panels, squeeze=False)[0])


def _lines(ax: Axes, df: pd.DataFrame, x: str, y: str, hue: str, ylabel: str, style: str | None = None) -> None:
    sns.lineplot(data=df, x=x, y=y, hue=hue, style=style or hue, markers=True, dashes=False, ax=ax)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(df[x].unique()), labels=[f"{v:g}" for v in sorted(df[x].unique())])
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)


def _bars(ax: Axes, df: pd.DataFrame, y: str, ylabel: str, x: str = "config") -> None:
    sns.barplot(data=df, x=x, y=y, hue="config", ax=ax)
    ax.set_xlabel("")
    ax.set_ylabel(ylabel)
    ax.tick_params(axis="x", labelrotation=20)


def _with_ms(df: pd.DataFrame) -> pd.DataFrame:
    return df.assign(itl_p50_ms=df["itl_p50_s"] * MS, ttft_p50_ms=df["ttft_p50_s"] * MS)


ITL = ("itl_p50_ms", "ITL p50 (ms)")
THROUGHPUT = ("output_tok_s", "output tokens/s")


def _sweep(df: pd.DataFrame, x: str, xlabel: str, hue: str, panels: tuple[tuple[str, str], ...]) -> Figure:
    """One panel per (metric, label), each a line per `hue` over `x`."""
    fig, axes = _figure(len(panels))
    df = _with_ms(df)
    for ax, (y, ylabel) in zip(axes, panels, strict=True):
        _lines(ax, df, x, y, hue, ylabel)
        ax.set_xlabel(xlabel)
    return fig


def e1(df: pd.DataFrame) -> Figure:
    return _sweep(df, "S", "prompt length S (tokens)", "config", (ITL, THROUGHPUT))


def e2(df: pd.DataFrame) -> Figure:
    return _sweep(df, "B", "batch B (requests)", "config", (THROUGHPUT, ITL))


def e3(df: pd.DataFrame) -> Figure:
    batches = sorted(df["B"].unique())
    fig, axes = _figure(len(batches))
    for ax, B in zip(axes, batches, strict=True):
        part = df[df["B"] == B].assign(P=lambda d: "P=" + d["P"].astype(str))
        _lines(ax, part, "S", "gbps", "attention", "GB/s (K/V bytes read)", style="P")
        if "copy_gbps" in part and part["copy_gbps"].notna().any():
            ax.axhline(part["copy_gbps"].max(), color="gray", linestyle="--", label="device copy")
            ax.legend(fontsize="small")
        ax.set_title(f"B = {B}")
        ax.set_xlabel("context S (tokens)")
    return fig


def _stream(df: pd.DataFrame) -> Figure:
    """The scheduler × backend comparisons (e8): latency and throughput side by side."""
    fig, (ttft, itl, span, tput) = _figure(4)
    df = _with_ms(df)
    _bars(ttft, df, "ttft_p50_ms", "TTFT p50 (ms)")
    _bars(itl, df, "itl_p50_ms", "ITL p50 (ms)")
    _bars(span, df, "makespan_s", "makespan (s)")
    _bars(tput, df, "output_tok_s", "output tokens/s")
    return fig


def e11(df: pd.DataFrame) -> Figure:
    """The shared-prefix workload with the prefix cache on and off: TTFT, throughput and the hit rate."""
    fig, (ttft, tput, hits) = _figure(3)
    df = _with_ms(df)
    _bars(ttft, df, "ttft_p50_ms", "TTFT p50 (ms)")
    _bars(tput, df, "output_tok_s", "output tokens/s")
    _bars(hits, df, "prefix_cache_hit_rate", "prompt tokens from the cache (fraction)")
    return fig


def e5(df: pd.DataFrame) -> Figure:
    fig, (tput, redo) = _figure(2)
    df = df.assign(recompute_pct=100 * df["recomputed_tokens"] / (df["input_tokens"] + df["output_tokens"]))
    for ax, y, label in ((tput, "output_tok_s", "output tokens/s"), (redo, "recompute_pct", "recomputed tokens (%)")):
        sns.lineplot(data=df, x="pool_fraction", y=y, hue="config", markers=True, style="config", ax=ax)
        ax.set_xlabel("pool (fraction of what holds every request)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.invert_xaxis()
    return fig


def e6(df: pd.DataFrame) -> Figure:
    return _sweep(df, "block_size", "block size P (tokens)", "attention", (THROUGHPUT, ITL))


def short_name(op: str, width: int = 40) -> str:
    """An op's profiler key without C++ template arguments, return type, parameters and the
    namespaces every kernel shares, at most `width` characters:
    `void at::native::reduce_kernel<512, 1, ...>(...)` -> `reduce_kernel`."""
    depth, kept = 0, []
    for ch in op:  # drop template arguments, however nested
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif not depth:
            kept.append(ch)
    name = "".join(kept).replace("(anonymous namespace)::", "").split("(", 1)[0].strip().removeprefix("void ")
    if "::" in name:
        name = name.split()[-1].removeprefix("at::native::")  # a C++ signature: the return type goes
    name = name or op
    return name if len(name) <= width else name[: width - 1] + "…"


def op_times(top_ops: list[dict]) -> pd.Series:
    """A run's profiled ops -> self ms per tick by short name (kernels that differ only in their
    template arguments summed), largest first."""
    ops = pd.DataFrame(top_ops, columns=["op", "self_ms_per_tick"])
    return ops.groupby(ops["op"].map(short_name))["self_ms_per_tick"].sum().sort_values(ascending=False)


def e7(df: pd.DataFrame) -> Figure:
    fig, axes = _figure(len(df))
    for ax, (_, row) in zip(axes, df.iterrows(), strict=True):
        ops = op_times(row["top_ops"]).reset_index()
        sns.barplot(data=ops, y="op", x="self_ms_per_tick", ax=ax, color="steelblue")
        ax.set_title(row["config"])
        ax.set_xlabel("self time per tick (ms)")
        ax.set_ylabel("")
    return fig


def _value(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1e3 else f"{v:,.0f}"


def e4(df: pd.DataFrame) -> Figure:
    """`_stream`'s four panels with a bar per arrival clock beside each config (ticks, the seed's,
    first), each bar labelled with its value so that the short ones read too."""
    fig, axes = _figure(4)
    df = _with_ms(df)
    clocks = [c for c in CLOCKS if c in set(df["clock"])]
    panels = (("ttft_p50_ms", "TTFT p50 (ms)"), ITL, ("makespan_s", "makespan (s)"), THROUGHPUT)
    for i, (ax, (y, ylabel)) in enumerate(zip(axes, panels, strict=True)):
        sns.barplot(data=df, x="config", y=y, hue="clock", hue_order=clocks, ax=ax)
        for bars in ax.containers:
            ax.bar_label(bars, fmt=_value, fontsize="x-small")
        ax.set_xlabel("")
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", labelrotation=20)
        if i:
            ax.get_legend().remove()
        else:
            ax.legend(title="arrival clock", fontsize="small")
    return fig


def _rates(df: pd.DataFrame) -> tuple[pd.DataFrame, list[float], list[str]]:
    """e9's records with `x`, where each is drawn on a log2 axis of request rates (rate inf one step
    right of the highest finite rate), and that axis' ticks and their labels."""
    finite = sorted(r for r in df["request_rate"].unique() if math.isfinite(r))
    at_inf = 2 * finite[-1] if finite else 1.0
    ticks = finite + ([at_inf] if (df["request_rate"] == math.inf).any() else [])
    labels = [f"{r:g}" for r in finite] + ["inf"] * (len(ticks) - len(finite))
    return df.assign(x=df["request_rate"].where(df["request_rate"] != math.inf, at_inf)), ticks, labels


def _percentiles(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """p50 and p99 of a client latency (`median_{metric}_ms`, `p99_{metric}_ms`) as rows of one column `ms`."""
    return pd.concat([df.assign(ms=df[f"{stat}_{metric}_ms"], percentile=label)
                      for stat, label in (("median", "p50"), ("p99", "p99"))], ignore_index=True)


def e9(df: pd.DataFrame) -> Figure:
    """The latency-throughput curve: TTFT and TPOT (p50 solid, p99 dashed; the goodput's SLO dotted),
    output tokens/s (the offline engine's dashed across) and goodput against the request rate, a line
    per server and config, so a peer server shows up beside weft."""
    offline = df[df["server"] == "offline"]
    served = df[df["server"] != "offline"]
    if "workload" in served and served["workload"].notna().any():
        # the curve's workload: that of the finite rates (a rate-inf check on another workload is left out)
        finite = served[served["request_rate"] != math.inf]
        curve = (finite if len(finite) else served)["workload"].mode().iloc[0]
        served = served[served["workload"] == curve]
    served, ticks, labels = _rates(served)
    served = served.assign(server=served["server"] + " (" + served["config"] + ")")
    slos = served["goodput_slo_ms"].dropna() if "goodput_slo_ms" in served else pd.Series(dtype=object)
    slo = slos.iloc[0] if len(slos) and all(s == slos.iloc[0] for s in slos) else {}
    fig, (ttft, tpot, tput, good) = _figure(4)
    for ax, metric in ((ttft, "ttft"), (tpot, "tpot")):
        sns.lineplot(data=_percentiles(served, metric), x="x", y="ms", hue="server", style="percentile", markers=True,
                     ax=ax)
        if metric in slo:
            ax.axhline(slo[metric], color="gray", linestyle=":", label=f"goodput SLO {slo[metric]:g} ms")
        ax.set_ylabel(f"{metric.upper()} (ms)")
    sns.lineplot(data=served, x="x", y="output_tok_s", hue="server", marker="o", ax=tput)
    for r in offline.itertuples():
        tput.axhline(r.output_tok_s, color="gray", linestyle="--", label=f"offline ({r.config}): {r.output_tok_s:,.0f}")
    tput.set_ylabel("output tokens/s")
    requests = pd.concat([served.assign(rps=served[c], requests=what) for c, what in
                          (("request_throughput", "completed"), ("request_goodput", "within the SLO"))])
    sns.lineplot(data=requests, x="x", y="rps", hue="server", style="requests", markers=True, ax=good)
    good.set_ylabel("requests/s")
    for ax in (ttft, tpot, tput, good):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, labels=labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="x-small")
    return fig


def e16(df: pd.DataFrame) -> Figure:
    """What deterministic=True costs: e8's output tok/s, and one request's ITL, each config beside the other, per
    model."""
    fig, axes = _figure(2)
    df = _with_ms(df)
    for ax, kind, (y, ylabel), title in zip(axes, ("e8", "b1"), (THROUGHPUT, ITL),
                                            ("e8's workload", "one request alone"), strict=True):
        _bars(ax, df[df["workload_kind"] == kind], y, ylabel, x="model")
        ax.set_title(title)
        ax.legend(fontsize="x-small")
    return fig


def e17_kernel(df: pd.DataFrame) -> Figure:
    """Each linear layer's share of the copy bandwidth at one row, weft's launch beside cuBLAS, a panel per model."""
    one = df[df["M"] == 1]
    bars = pd.concat([one.assign(pct=one["pct_of_copy"], kernel="weft"),
                      one.assign(pct=one["cublas_pct_of_copy"], kernel="cuBLAS")])
    models = list(dict.fromkeys(one["model"]))
    fig, axes = _figure(len(models))
    for ax, model in zip(axes, models, strict=True):
        sns.barplot(data=bars[bars["model"] == model], x="layer", y="pct", hue="kernel", ax=ax)
        ax.set_title(model)
        ax.set_xlabel("")
        ax.set_ylabel("% of copy bandwidth, one row")
        ax.legend(fontsize="x-small")
    return fig


def e17_itl(df: pd.DataFrame) -> Figure:
    """Batch-1 ITL p50 per model, weft beside HF's compiled static cache, a dashed line at each model's weights floor;
    and each over that floor."""
    fig, (itl, ratio) = _figure(2)
    df = _with_ms(df).assign(over_floor=df["itl_p50_s"] / df["weights_floor_s"])
    _bars(itl, df, *ITL, x="model")
    for i, r in enumerate(df.drop_duplicates("model").itertuples()):  # the bars' order: models as they first come
        itl.hlines(r.weights_floor_s * MS, i - 0.4, i + 0.4, colors="black", linestyles="--",
                   label="weights floor" if i == 0 else None)
    _bars(ratio, df, "over_floor", "ITL p50 ÷ weights floor", x="model")
    ratio.axhline(1.0, color="black", linestyle="--")
    for ax in (itl, ratio):
        ax.legend(fontsize="x-small")
    return fig


CHARTS: dict[str, Callable[[pd.DataFrame], Figure]] = {
    "e1": e1,
    "e2": e2,
    "e3": e3,
    "e4": e4,
    "e5": e5,
    "e6": e6,
    "e7": e7,
    "e8": _stream,
    "e9": e9,
    "e11": e11,
    "e16": e16,
    "e17_kernel": e17_kernel,
    "e17_itl": e17_itl,
}


def figure(experiment: str, records: pd.DataFrame, gpu: str) -> Figure | None:
    """`experiment`'s chart from a report's records (its rows are picked out of all of them),
    titled with the machine and the commit they come from; None when it has no chart or no rows."""
    df = records[records["experiment"] == experiment]
    if experiment not in CHARTS or df.empty:
        return None
    fig = CHARTS[experiment](df)
    fig.suptitle(f"{experiment}: {EXPERIMENTS[experiment]} — {gpu} @ {df['git_sha'].iloc[0][:12]}")
    return fig


def png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()
