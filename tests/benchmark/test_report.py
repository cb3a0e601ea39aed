"""The report on hand-made runs: charts, claims, comparisons, and clear refusals."""

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from weft.benchmark import charts
from weft.benchmark.claims import claims
from weft.benchmark.results import gather, normalize
from weft.report import determinism_notes, main

SERVING = dict(
    engine="weft", scheduler="continuous", attention="paged", model="m", dtype="bfloat16", pool_blocks=10,
    block_size=16, requests=4, input_tokens=40, output_tokens=80, makespan_s=2.0, input_tok_s=20.0,
    output_tok_s=40.0, ttft_p50_s=0.5, ttft_p90_s=0.6, ttft_p99_s=0.7, itl_p50_s=0.02, itl_p90_s=0.03,
    itl_p99_s=0.04, e2e_p50_s=1.5, e2e_p90_s=1.8, e2e_p99_s=1.9, peak_mem_bytes=2e9, preemptions=0,
    recomputed_tokens=0, steps=20, incomplete_requests=0,
)


def serving(experiment: str, config: str, **changes) -> dict:
    scheduler, _, attention = config.partition("×")
    return {**SERVING, "experiment": experiment, "config": config, "scheduler": scheduler,
            "attention": attention or "sdpa", **changes}


SLO_MS = {"ttft": 500.0, "tpot": 50.0}


def served(rate: float | str, output_tok_s: float, **changes) -> dict:
    """An e9 record of `weft serve` under load at `rate` (vLLM's `bench serve` fields, ms)."""
    return {
        "experiment": "e9", "config": "continuous×triton", "engine": "weft", "server": "weft serve",
        "scheduler": "continuous", "attention": "triton", "model": "m", "request_rate": rate,
        "name": f"test_e9_serving[triton-rate{rate if isinstance(rate, str) else f'{rate:g}'}]",
        "output_tok_s": output_tok_s, "output_throughput": output_tok_s, "makespan_s": 4000 / output_tok_s,
        "request_throughput": output_tok_s / 100, "request_goodput": output_tok_s / 100, "goodput_slo_ms": SLO_MS,
        "median_ttft_ms": 45.6, "p99_ttft_ms": 98.7, "median_tpot_ms": 7.89, "p99_tpot_ms": 9.87,
        "median_itl_ms": 6.54, "p99_itl_ms": 45.6, "median_e2el_ms": 4321.0, **changes,
    }  # fmt: skip


def e9_records(speed: float = 1.0) -> list[dict]:
    """weft serve at 4 and 16 req/s and at rate inf, and the offline engine serving the same requests."""
    return [
        serving("e9", "continuous×triton", server="offline", request_rate="inf", output_tok_s=1000.0 * speed,
                name="test_e9_offline[triton]"),
        served(4.0, 200.0 * speed),
        served(16.0, 400.0 * speed, median_ttft_ms=80.0),
        served("inf", 480.0 * speed, median_ttft_ms=1340.0, p99_ttft_ms=1360.0, request_goodput=0.0),
    ]


def records(speed: float = 1.0) -> list[dict]:
    rows = [
        serving("e4", "static×contiguous", ttft_p50_s=10.0, makespan_s=28.0, itl_p50_s=0.047),
        serving("e4", "continuous×paged", ttft_p50_s=2.0, makespan_s=14.0, itl_p50_s=0.059),
        serving("e4", "continuous×triton", ttft_p50_s=1.5 / speed, makespan_s=12.0 / speed, itl_p50_s=0.036),
        serving("e8", "hf_generate", engine="hf_generate"),
        serving("e8", "continuous×triton", output_tok_s=400.0 * speed),
        serving("e7", "continuous×paged", top_ops=[{"op": "aten::mm", "calls_per_tick": 9, "self_ms_per_tick": 3.0}]),
    ]
    rows += [serving("e1", f"continuous×{a}", S=S, itl_p50_s=S * k / 1e5) for a, k in (("paged", 2), ("triton", 1))
             for S in (128, 2048)]
    rows += [serving("e5", "continuous×triton", pool_fraction=f, output_tok_s=40.0 * f, preemptions=int(10 * (1 - f)))
             for f in (1.0, 0.5)]
    rows += [dict(experiment="e3", attention=a, S=S, B=8, P=16, gbps=g * S / 32768, copy_gbps=4000.0,
                  pct_of_copy=g * S / 32768 / 40) for a, g in (("triton", 3000.0), ("paged", 900.0))
             for S in (512, 32768)]
    return rows + e9_records(speed)


def write_run(folder: Path, number: int, gpu: str, sha: str, rows: list[dict], when: str) -> Path:
    path = folder / "Linux-CPython-3.12-64bit" / f"{number:04d}_{sha[:6]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    benchmarks = [{"name": r.get("name") or f"test_{r['experiment']}[{r.get('config', r.get('attention'))}"
                                            f"-{r.get('S', '')}-{r.get('pool_fraction', '')}]",
                   "extra_info": {**{k: v for k, v in r.items() if k != "name"}, "gpu": gpu, "git_sha": sha}}
                  for r in rows]
    path.write_text(json.dumps({"benchmarks": benchmarks, "datetime": when, "machine_info": {}}))
    return path


def run_report(tmp_path: Path, *args: str) -> int:
    return main([*args, "--results", str(tmp_path / "results"), "--out", str(tmp_path / "out")])


def test_one_run_gives_charts_claims_and_tables(tmp_path):
    write_run(tmp_path / "results", 1, "NVIDIA H200", "abc123", records(), "2026-11-29T10:00:00")
    assert run_report(tmp_path) == 0
    out = tmp_path / "out"
    assert {p.name for p in out.glob("*.png")} == {f"{e}.png" for e in ("e1", "e3", "e4", "e5", "e7", "e8", "e9")}
    readme = (out / "README.md").read_text()
    assert "NVIDIA H200" in readme and "abc123" in readme
    assert "10 s → 1.5 s (6.7×)" in readme  # the seed's figure, and the run's own next to it
    assert "10 s → 1.5 s (6.7×)" in readme.split("10 s → 1.5 s (6.7×) |", 1)[1]
    assert "28 s vs 12 s (2.3×)" in readme
    assert "36 ms continuous×triton / 47 ms static×contiguous / 59 ms continuous×paged" in readme
    assert "triton 3000 GB/s (75% of copy)" in readme
    assert "continuous×paged ×16, continuous×triton ×16" in readme
    assert "0.5: 50% (5 preemptions)" in readme
    assert "pytest-benchmark --storage file://results compare" in readme


def test_two_commits_compare_newer_over_older(tmp_path):
    results = tmp_path / "results"
    write_run(results, 1, "NVIDIA H200", "old111", records(), "2026-11-29T10:00:00")
    write_run(results, 2, "NVIDIA H200", "new222", records(speed=2.0), "2026-11-29T11:00:00")
    assert run_report(tmp_path, "0001", "0002") == 0
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "commit `new222`" in readme and "baseline commit `old111`" in readme
    assert "| e8 | test_e8[continuous×triton--] | output tok/s | 400 | 800 | 2 |" in readme


def test_split_sessions_of_one_commit_merge_and_supersede_an_older_commit(tmp_path):
    results = tmp_path / "results"
    rows = records()
    write_run(results, 1, "NVIDIA H200", "old111", rows, "2026-11-29T09:00:00")
    write_run(results, 2, "NVIDIA H200", "new222", rows[:3], "2026-11-29T10:00:00")
    write_run(results, 3, "NVIDIA H200", "new222", rows[3:], "2026-11-29T11:00:00")
    (results / "notes.json").write_text("[1, 2]")
    assert run_report(tmp_path) == 0
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "- commit `new222`: e1, e3, e4, e5, e7, e8, e9 (runs `0002_new222`, `0003_new222`)" in readme
    assert "old111" not in readme and "skipped" in readme and "baseline commit" not in readme


def test_each_experiment_comes_from_the_newest_commit_that_measured_it(tmp_path):
    """A matrix measured over sessions at different commits is shown whole, never mixed in one table."""
    results = tmp_path / "results"
    e3_e4 = [r for r in records() if r["experiment"] in ("e3", "e4")]
    write_run(results, 1, "NVIDIA H200", "old111", e3_e4, "2026-11-29T09:00:00")
    e4_faster = [r for r in records(speed=2.0) if r["experiment"] == "e4"]
    write_run(results, 2, "NVIDIA H200", "new222", e4_faster, "2026-11-29T10:00:00")
    assert run_report(tmp_path) == 0
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "- commit `new222`: e4 (runs `0002_new222`)" in readme
    assert "- commit `old111`: e3 (runs `0001_old111`)" in readme
    assert "10 s → 0.75 s (13×) | `new222` |" in readme  # claim 1 from e4 of new222 only
    e3_section = readme.split("## e3: ")[1].split("## ")[0]
    e4_section = readme.split("## e4: ")[1].split("## ")[0]
    assert "Commit `old111`." in e3_section and "Commit `new222`." in e4_section
    assert "| 12 |" not in e4_section and "| 6 |" in e4_section  # old111's e4 makespan stays out


def tables(markdown: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """Every markdown table of a report: (the heading of its section, header, rows)."""
    found, section, block = [], "", []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("## "):
            section = line.removeprefix("## ")
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip("|").split("|")])
        elif block:
            found.append((section, block[0], block[2:]))
            block = []
    return found


def stated_unit(label: str) -> list[tuple[str, float]]:
    """The record fields a column label may stand for, each with the factor from the unit stored
    there to the unit the label states: "ITL p50 (ms)" -> weft's itl_p50_s (seconds) x 1e3, or a
    serving client's median_itl_ms (vLLM's names, ms) x 1; "TPOT p99 (ms)" -> tpot_p99_s x 1e3 or
    p99_tpot_ms x 1; a bare field name such as "itl_p50_s" states seconds by its suffix; "goodput
    (req/s)" is request_goodput, stored in requests/s."""
    if label == "goodput (req/s)":
        return [("request_goodput", 1.0)]
    if m := re.fullmatch(r"(.+) \((m?s)\)", label):
        name, to_label = m[1].lower(), {"s": 1.0, "ms": 1e3}[m[2]]
        fields = [(name.replace(" ", "_") + "_s", to_label)]
        if stat := re.fullmatch(r"(\w+) (p\d+)", name):
            client = {"e2e": "e2el"}.get(stat[1], stat[1])
            fields.append((f"{'median' if stat[2] == 'p50' else stat[2]}_{client}_ms", to_label / 1e3))
        return fields
    return [(label, 1.0)] if re.fullmatch(r"\w+_s", label) else []


def test_every_label_names_the_unit_its_cells_are_in(tmp_path):
    """weft's records hold seconds, e9's client latencies ms; a column or metric labelled in ms shows ms
    (itl_p50_s=0.0123 as 12.3, median_itl_ms=6.54 as 6.54), one labelled in s (or by the field's own
    name) shows s, in every table, the ratio table too."""
    timed = dict(ttft_p50_s=0.456, ttft_p90_s=0.567, ttft_p99_s=0.678, itl_p50_s=0.0123, itl_p99_s=0.0234,
                 e2e_p50_s=1.23, makespan_s=7.89)
    rows = [serving("e4", "continuous×triton", **timed), serving("e8", "continuous×triton", **timed, floor_s=3.21),
            dict(experiment="e3_prefill", attention="triton", B=4, T=4096, P=16, time_s=0.00077,
                 ratio_vs_sdpa=1.45, tflops=357.0, sdpa_tflops=518.0),
            serving("e9", "continuous×triton", server="offline", request_rate="inf", name="test_e9_offline", **timed),
            served(4.0, 200.0, request_goodput=3.53),
            served("inf", 480.0, median_ttft_ms=1340.0, p99_ttft_ms=1360.0, median_tpot_ms=28.4, p99_tpot_ms=33.0,
                   median_itl_ms=26.3, makespan_s=23.8)]
    write_run(tmp_path / "results", 1, "NVIDIA H200", "old111", rows, "2026-11-29T10:00:00")
    write_run(tmp_path / "results", 2, "NVIDIA H200", "new222", rows, "2026-11-29T11:00:00")
    assert run_report(tmp_path, "0001", "0002") == 0
    by_name = {r.get("name", f"test_{r['experiment']}[{r.get('config', r.get('attention'))}--]"): r for r in rows}

    def record(experiment: str, cells: dict[str, str]) -> dict | None:
        """The one record of `experiment` a table row shows (e9's told apart by server and rate)."""
        rate = cells.get("request rate (req/s)")
        found = [r for r in rows if r["experiment"] == experiment
                 and cells.get("server", r.get("server")) == r.get("server")
                 and (rate is None or float(rate) == float(r["request_rate"]))]
        assert len(found) <= 1, (experiment, cells)
        return found[0] if found else None

    checked = set()
    for section, header, body in tables((tmp_path / "out" / "README.md").read_text()):
        for row in body:
            cells = dict(zip(header, row, strict=True))
            if "metric" in cells:  # the ratio table: the metric's label is a cell, its values two others
                where, labelled = "ratio", [(cells["metric"], cells["baseline"]), (cells["metric"], cells["this"])]
                experiment, shows = cells["experiment"], by_name.get(cells["benchmark"])
            else:
                where, labelled = "table", list(cells.items())
                experiment = section.split(":")[0]
                shows = record(experiment, cells)
            for label, cell in labelled:
                fields = [f for f in stated_unit(label) if shows and f[0] in shows]
                if not fields:
                    continue
                field, factor = fields[0]
                shown = float(cell.replace(",", ""))
                assert shown == pytest.approx(shows[field] * factor, rel=5e-3), (section, label, cell)
                checked.add((where, experiment, field))
    assert {("ratio", "e8", m) for m in ("ttft_p50_s", "itl_p50_s", "makespan_s")} <= checked
    assert ("ratio", "e3_prefill", "time_s") in checked
    assert {("table", "e4", m) for m in timed} <= checked
    e4_section = (tmp_path / "out" / "README.md").read_text().split("## e4: ")[1].split("## ")[0]
    assert "ITL p99 ÷ p50 (how far admissions stall the running decodes): continuous×triton" in e4_section
    assert f"{0.0234 / 0.0123:.2f}x." in e4_section
    assert {("table", "e8", "itl_p50_s"), ("table", "e8", "floor_s"), ("table", "e3_prefill", "time_s")} <= checked
    served_ms = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms")
    assert {("table", "e9", m) for m in (*served_ms, "ttft_p50_s", "ttft_p99_s", "itl_p50_s")} <= checked
    assert ("table", "e9", "request_goodput") in checked
    assert {("ratio", "e9", m) for m in ("makespan_s", "ttft_p50_s", "itl_p50_s")} <= checked


E4_CONFIGS = ("static×contiguous", "continuous×paged", "continuous×triton")


def on_clock(clock: str | None, ttft: tuple[float, ...], makespan: tuple[float, ...], itl: tuple[float, ...]):
    """e4 records of the three configs on `clock` (None: an older record, without the key)."""
    extra = {} if clock is None else {"clock": clock}
    return [serving("e4", c, ttft_p50_s=t, makespan_s=m, itl_p50_s=i, **extra)
            for c, t, m, i in zip(E4_CONFIGS, ttft, makespan, itl, strict=True)]


@pytest.mark.parametrize("order", ["ticks first", "seconds first", "ticks without the key"])
def test_claims_take_each_clock_from_its_own_records(order):
    """Claims 1, 2 and 4 come from the ticks records (the seed's clock) and their restatements from the
    seconds records, in whichever order the run holds them; a record without `clock` is on ticks."""
    ticks = on_clock(None if order == "ticks without the key" else "ticks", (6.57, 0.118, 0.0314),
                     (24.4, 19.3, 2.45), (0.0877, 0.0642, 0.00816))
    seconds = on_clock("seconds", (4.46, 0.126, 0.0425), (27.6, 25.0, 18.2), (0.0656, 0.0647, 0.00475))
    for r in seconds:
        r.update(requests=64, arrival_rate_per_s=4.0)
    rows = seconds + ticks if order == "seconds first" else ticks + seconds
    measured = [c.measured for c in claims(normalize(pd.DataFrame(rows)))]
    assert measured[0] == "6.57 s → 0.0314 s (209×)"
    assert measured[1] == "4.46 s → 0.0425 s (105×)"
    assert measured[2] == "24.4 s vs 2.45 s (10×)"
    assert measured[3] == "27.6 s vs 18.2 s (1.5×); the arrivals alone: 15.8 s expected (64 requests at 4 /s)"
    assert measured[5] == "8.16 ms continuous×triton / 64.2 ms continuous×paged / 87.7 ms static×contiguous"
    assert measured[6] == "4.75 ms continuous×triton / 64.7 ms continuous×paged / 65.6 ms static×contiguous"
    what = [c.what for c in claims(pd.DataFrame(rows))]
    assert "arrivals in engine ticks" in what[0] and "arrivals in wall-clock seconds" in what[1]


def test_a_claim_refuses_two_records_of_one_config_on_one_clock():
    rows = on_clock("ticks", (6.0, 0.1, 0.03), (24.0, 19.0, 2.4), (0.09, 0.06, 0.008))
    rows += on_clock("ticks", (7.0, 0.1, 0.04), (25.0, 19.0, 2.5), (0.09, 0.06, 0.008))[2:]
    measured = [c.measured for c in claims(normalize(pd.DataFrame(rows)))]
    assert measured[0] == measured[2] == measured[5] == (
        "n/a: e4 has several records of continuous×triton on the ticks clock")
    assert measured[1] == "n/a: no e4 records on the seconds clock"


def test_e9_draws_the_latency_throughput_curve_with_rate_inf_at_the_right_end(tmp_path):
    """A line per server, inf the last tick, the offline engine's output tok/s across, and the server
    at rate inf over it in the report."""
    write_run(tmp_path / "results", 1, "NVIDIA H200", "abc123", e9_records(), "2026-11-29T10:00:00")
    assert run_report(tmp_path) == 0
    readme = (tmp_path / "out" / "README.md").read_text()
    e9 = readme.split("## e9: serving over HTTP")[1]
    assert "| weft serve | continuous×triton | inf | 1,340 | 1,360 | 7.89 | 9.87 | 6.54 | 480 | 0 |" in e9
    assert "| offline | continuous×triton | inf | 500 | 700 | – | – | 20 | 1,000 | – |" in e9
    assert "weft serve (continuous×triton) at rate inf ÷ offline, output tok/s: 480 ÷ 1,000 = 0.48×." in e9
    assert "goodput: requests/s meeting TTFT ≤ 500 ms and TPOT ≤ 50 ms." in e9
    assert (tmp_path / "out" / "e9.png").read_bytes().startswith(b"\x89PNG")
    fig = charts.figure("e9", gather([], [], tmp_path / "results").records(), "NVIDIA H200")
    for ax in fig.axes:
        assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "16", "inf"]
    legend = [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
    assert "weft serve (continuous×triton)" in legend and "offline (continuous×triton): 1,000" in legend


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        ("empty", (), "no stored runs under"),
        ("machines", ("0001", "0002"), "different machines (NVIDIA H200: 0001_aaa; cpu: 0002_bbb)"),
        ("commits", ("0001", "0002", "0003"), "span 3 commits"),
        ("one", ("0007",), "'0007': no run of that name"),
        ("one", ("--experiment", "e10"), "unknown experiment 'e10'"),
        ("one", ("--attention", "flash"), "unknown attention 'flash'"),
        ("one", ("--model", "gpt2"), "unknown model 'gpt2'"),
        ("one", ("--experiment", "e6"), "no records left after the filters"),
        ("broken", ("0001",), "not a pytest-benchmark run"),
    ],
)
def test_bad_input_exits_1_with_a_message(tmp_path, capsys, setup, args, message):
    results = tmp_path / "results"
    results.mkdir()
    if setup in ("machines", "commits", "one"):
        write_run(results, 1, "NVIDIA H200", "aaa", records(), "2026-11-29T10:00:00")
    if setup in ("machines", "commits"):
        gpu = "cpu" if setup == "machines" else "NVIDIA H200"
        write_run(results, 2, gpu, "bbb", records(), "2026-11-29T11:00:00")
    if setup == "commits":
        write_run(results, 3, "NVIDIA H200", "ccc", records(), "2026-11-29T12:00:00")
    if setup == "broken":
        (results / "0001_x.json").write_text("{not json")
    assert run_report(tmp_path, *args) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_explicit_baseline_compares_runs_of_one_commit(tmp_path):
    results = tmp_path / "results"
    write_run(results, 1, "NVIDIA H200", "abc-dirty", records(), "2026-11-29T10:00:00")
    write_run(results, 2, "NVIDIA H200", "abc-dirty", records(speed=2.0), "2026-11-29T11:00:00")
    assert run_report(tmp_path, "0002", "--baseline", "0001") == 0
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "| e8 | test_e8[continuous×triton--] | output tok/s | 400 | 800 | 2 |" in readme


def test_a_run_of_one_experiment_reports_the_other_claims_as_missing(tmp_path):
    e3_only = [r for r in records() if r["experiment"] == "e3"]
    write_run(tmp_path / "results", 1, "NVIDIA H200", "abc123", e3_only, "2026-11-29T10:00:00")
    assert run_report(tmp_path) == 0
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "n/a: no e4 records on the ticks clock" in readme and "n/a: e5 lacks" in readme
    assert "triton 3000 GB/s" in readme
    assert "| 8 | 16 | 32768 | 900 (22%) | 3,000 (75%) |" in readme


def test_a_newer_cpu_run_does_not_displace_the_gpu_run(tmp_path):
    """Every local `uv run pytest` stores a CPU run; the default report stays on the published GPU one."""
    write_run(tmp_path / "results", 1, "NVIDIA H200", "abc123", records(), "2026-11-29T10:00:00")
    write_run(tmp_path / "results" / "cpu", 1, "cpu", "def456", records(), "2026-11-29T12:00:00")
    assert run_report(tmp_path) == 0
    summary = (tmp_path / "out" / "README.md").read_text()
    assert "NVIDIA H200" in summary and "abc123" in summary and "def456" not in summary.split("left out")[0]
    assert "- left out the stored runs of other machines: cpu\n" in summary  # named, so no count of local runs


def test_profiled_kernels_are_named_short_and_summed_by_name():
    ops = [
        {"op": "void at::native::elementwise_kernel<128, 4, Mul<float> >(int, Mul<float>)", "self_ms_per_tick": 0.5},
        {"op": "aten::mm", "self_ms_per_tick": 0.75},
        {"op": "void at::native::elementwise_kernel<128, 4, Add<float> >(int, Add<float>)", "self_ms_per_tick": 0.5},
        {"op": "x" * 60, "self_ms_per_tick": 0.1},
    ]
    times = charts.op_times(ops)
    assert list(times.index) == ["elementwise_kernel", "aten::mm", "x" * 39 + "…"]
    assert list(times) == [1.0, 0.75, 0.1]
    assert charts.op_times([]).empty


@pytest.mark.parametrize(
    ("op", "short"),
    [
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, 4>(int*, int)", "CatArrayBatchedCopy"),
        ("std::enable_if<!T7, void>::type internal::gemvx::kernel<int, float>(Params<int>)", "internal::gemvx::kernel"),
        ("Memcpy HtoD (Pageable -> Device)", "Memcpy HtoD"),
        ("void _split_kernel<4>(float*)", "_split_kernel"),
        ("_merge_kernel", "_merge_kernel"),
    ],
)
def test_short_names_of_real_profiler_keys(op, short):
    assert charts.short_name(op) == short


def test_e9_pairs_by_workload_and_sets_weft_beside_the_peer(tmp_path):
    """The curve (workload e9) at each rate for weft and the peer; HTTP's cost from the standard workload
    at rate inf against offline on that workload; goodput ratios rate by rate."""
    on = {"workload": "e9"}
    rows = [
        serving("e9", "continuous×triton", server="offline", request_rate="inf", output_tok_s=1000.0,
                name="test_e9_offline[triton]", workload="standard"),
        served("inf", 950.0, name="test_e9_standard_at_rate_inf[triton]", workload="standard"),
        served(4.0, 200.0, request_goodput=3.0, **on),
        served("inf", 400.0, request_goodput=0.5, **on),
        served(4.0, 20.0, request_goodput=0.25, server="transformers serve", config="hf_serve", engine="hf_serve",
               name="test_e9_peer_curve[rate4]", **on),
        served("inf", 30.0, request_goodput=0.0, server="transformers serve", config="hf_serve", engine="hf_serve",
               name="test_e9_peer_curve[rateinf]", **on),
    ]
    write_run(tmp_path / "results", 1, "NVIDIA H200", "abc123", rows, "2026-11-29T10:00:00")
    assert run_report(tmp_path) == 0
    e9 = (tmp_path / "out" / "README.md").read_text().split("## e9: serving over HTTP")[1]
    assert "weft serve (continuous×triton) at rate inf ÷ offline, output tok/s: 950 ÷ 1,000 = 0.95×." in e9
    assert "400 ÷ 1,000" not in e9  # the curve's rate inf served other requests than offline did
    assert ("goodput, weft (continuous×triton) ÷ transformers serve (hf_serve): 4 req/s: 3.00 ÷ 0.25 = 12.0×; "
            "inf req/s: 0.50 ÷ 0.00 = ∞ (the peer's is 0).") in e9
    fig = charts.figure("e9", gather([], [], tmp_path / "results").records(), "NVIDIA H200")
    legend = {t.get_text() for t in fig.axes[2].get_legend().get_texts()}
    assert {"weft serve (continuous×triton)", "transformers serve (hf_serve)"} <= legend
    drawn = {float(y) for line in fig.axes[2].get_lines() for y in line.get_ydata()}
    assert {200.0, 400.0, 20.0, 30.0} <= drawn and 950.0 not in drawn  # the standard workload's point is not


def reported_section(tmp_path: Path, rows: list[dict], experiment: str) -> str:
    """The report's section of `experiment`, from one H200 run of `rows`."""
    write_run(tmp_path / "results", 1, "NVIDIA H200", "abc123", rows, "2026-11-29T10:00:00")
    assert run_report(tmp_path) == 0
    return (tmp_path / "out" / "README.md").read_text().split(f"## {experiment}:")[1]


def test_e11_sets_the_cache_off_beside_on(tmp_path):
    rows = [serving("e11", "continuous×triton", prefix_caching=True, workload="shared", ttft_p50_s=0.2,
                    output_tok_s=7000.0, prefix_cache_hit_rate=0.86, name="test_e11_shared_prefix[cache]"),
            serving("e11", "continuous×triton, no prefix cache", prefix_caching=False, workload="shared",
                    ttft_p50_s=0.9, output_tok_s=3500.0, prefix_cache_hit_rate=0.0,
                    name="test_e11_shared_prefix[nocache]")]
    e11 = reported_section(tmp_path, rows, "e11")
    assert ("shared: TTFT p50 without ÷ with the cache: 0.900 ÷ 0.200 s = 4.50×; output tok/s with ÷ without:"
            " 7,000 ÷ 3,500 = 2.00×.") in e11


def test_e2_divides_the_fastest_weft_config_by_each_peer_per_batch(tmp_path):
    rows = [serving("e2", config, engine=engine, B=B, output_tok_s=tok_s, name=f"test_e2_batch_sweep[B{B}-{config}]")
            for config, engine, per_b in (("continuous×paged", "weft", (10.0, 40.0)),
                                          ("continuous×triton", "weft", (150.0, 600.0)),
                                          ("hf_generate", "hf_generate", (10.0, 50.0)),
                                          ("hf_generate_static", "hf_generate_static", (60.0, 200.0)))
            for B, tok_s in zip((1, 4), per_b, strict=True)]
    e2 = reported_section(tmp_path, rows, "e2")
    assert "output tok/s, continuous×triton ÷ hf_generate: B=1 150 ÷ 10 = 15.0×; B=4 600 ÷ 50 = 12.0×." in e2
    assert "output tok/s, continuous×triton ÷ hf_generate_static: B=1 150 ÷ 60 = 2.5×; B=4 600 ÷ 200 = 3.0×." in e2
    assert "continuous×paged ÷" not in e2
    rows[2]["output_tok_s"] = 5.0  # triton's B=1: paged is the faster there now, so each cell names its config
    e2 = reported_section(tmp_path, rows, "e2")
    assert ("output tok/s, weft's fastest ÷ hf_generate: B=1 (continuous×paged) 10 ÷ 10 = 1.0×;"
            " B=4 (continuous×triton) 600 ÷ 50 = 12.0×.") in e2


def test_e12_divides_each_ablation_by_the_defaults(tmp_path):
    rows = [serving("e12", f"continuous×triton{off}", workload="w", output_tok_s=tok_s, itl_p50_s=itl, steps=9,
                    name=f"test_e12_ablation[w{off}]")
            for off, tok_s, itl in (("", 1000.0, 0.010), (", no CUDA graphs", 250.0, 0.040),
                                    (", no chunked prefill", 800.0, 0.011))]
    rows.append(serving("e12", "hf_generate_static", workload="w", output_tok_s=100.0, itl_p50_s=0.035, steps=9,
                        name="test_e12_batch1_peer"))
    e12 = reported_section(tmp_path, rows, "e12")
    assert ("w, against continuous×triton with the engine's defaults: no CUDA graphs: 0.25× the output tok/s,"
            " 4.00× the ITL p50; no chunked prefill: 0.80× the output tok/s, 1.10× the ITL p50.") in e12
    assert "w: ITL p50 of hf_generate_static ÷ continuous×triton's: 35.00 ÷ 10.00 ms = 3.50×." in e12


def test_e13_shows_busy_idle_floor_and_kernel_classes(tmp_path):
    rows = [dict(experiment="e13", config="continuous×triton", shape=shape, B=256, step_ms=9.0, gpu_busy_ms=busy,
                 gpu_idle_ms=9.0 - busy, floor_ms=4.0, gpu_ms_by_class={"attention": 3.5, "gemm": 3.0},
                 name=f"test_e13_step_profile[{shape}]") for shape, busy in (("decode-B", 8.0), ("decode-B1", 3.0))]
    e13 = reported_section(tmp_path, rows, "e13")
    assert "| continuous×triton | decode-B | 256 | 9 | 8 | 1 | 4 | 2.25 |" in e13  # step ÷ floor
    assert "continuous×triton decode-B, GPU ms by kernel class: attention 3.5, gemm 3." in e13
    assert "decode-B1: the profiled GPU busy time (3 ms) is below the floor (4 ms)" in e13
    assert "decode-B: the profiled" not in e13


def test_decode_heavy_tables_show_the_floor_and_each_makespan_over_it(tmp_path):
    rows = [serving("e8", "continuous×triton", makespan_s=6.0, floor_s=4.0),
            serving("e8", "hf_generate", engine="hf_generate", makespan_s=240.0, floor_s=4.0)]
    e8 = reported_section(tmp_path, rows, "e8")
    header = next(line for line in e8.splitlines() if line.startswith("| config"))
    assert header.endswith("| floor (s) | makespan ÷ floor |")
    assert re.search(r"\| continuous×triton \|.*\| 6 \|.*\| 4 \| 1\.5 \|$", e8, re.M)
    assert re.search(r"\| hf_generate \|.*\| 240 \|.*\| 4 \| 60 \|$", e8, re.M)
    e4 = reported_section(tmp_path / "e4", [serving("e4", "continuous×triton", floor_s=4.0)], "e4")
    assert "floor" not in e4  # arrivals, not the memory, set e4's makespan


def test_e15_itl_shows_each_model_over_its_floor_and_divides_the_dense_families(tmp_path):
    rows = [serving("e15_itl", "continuous×triton", model=model, B=1, itl_p50_s=itl, weights_bytes=nbytes,
                    weights_floor_s=floor, num_experts=experts, name=f"test_e15_batch1_itl[{model}]")
            for model, itl, nbytes, floor, experts in (("llama-3.1-8b", 0.0039, 15.0e9, 0.0035, 0),
                                                       ("qwen3-8b", 0.0038, 15.1e9, 0.0035, 0),
                                                       ("qwen3-30b-a3b", 0.0029, 6.1e9, 0.00145, 128))]
    e15 = reported_section(tmp_path, rows, "e15_itl")
    assert "| qwen3-30b-a3b | continuous×triton | 2.9 | 6.1 | 1.45 | 2 |" in e15  # ITL ÷ its weights floor
    assert "ITL p50, llama-3.1-8b ÷ qwen3-8b: 3.90 ÷ 3.80 ms = 1.03× (weights read per step: 0.99×)." in e15
    assert "qwen3-30b-a3b ÷" not in e15 and "÷ qwen3-30b-a3b" not in e15  # a mixture of experts is no dense peer


def test_the_determinism_notes_give_each_models_ratios():
    rows = [serving("e16", "continuous×triton", model=m, workload_kind=kind, deterministic=on,
                    output_tok_s=tok * (0.9 if on else 1.0), itl_p50_s=itl * (1.1 if on else 1.0))
            for m, tok, itl in (("small", 1000.0, 0.002), ("large", 400.0, 0.004))
            for kind in ("e8", "b1") for on in (False, True)]
    notes = determinism_notes(pd.DataFrame(rows))
    assert notes == [
        "small, e8, output tok/s, deterministic ÷ default: 900 ÷ 1,000 = 0.90×.",
        "small, b1, ITL p50, deterministic ÷ default: 2.200 ÷ 2.000 ms = 1.10×.",
        "large, e8, output tok/s, deterministic ÷ default: 360 ÷ 400 = 0.90×.",
        "large, b1, ITL p50, deterministic ÷ default: 4.400 ÷ 4.000 ms = 1.10×.",
    ]
    assert charts.e16(pd.DataFrame(rows)) is not None
