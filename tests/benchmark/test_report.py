"""The report on hand-made runs: charts, claims, comparisons, and clear refusals."""

import json
import re
from pathlib import Path

import pytest

from weft.benchmark import charts
from weft.report import main

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
    return rows


def write_run(folder: Path, number: int, gpu: str, sha: str, rows: list[dict], when: str) -> Path:
    path = folder / "Linux-CPython-3.12-64bit" / f"{number:04d}_{sha[:6]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    benchmarks = [{"name": f"test_{r['experiment']}[{r.get('config', r.get('attention'))}-{r.get('S', '')}"
                           f"-{r.get('pool_fraction', '')}]", "extra_info": {**r, "gpu": gpu, "git_sha": sha}}
                  for r in rows]
    path.write_text(json.dumps({"benchmarks": benchmarks, "datetime": when, "machine_info": {}}))
    return path


def run_report(tmp_path: Path, *args: str) -> int:
    return main([*args, "--results", str(tmp_path / "results"), "--out", str(tmp_path / "out")])


def test_one_run_gives_charts_claims_and_tables(tmp_path):
    write_run(tmp_path / "results", 1, "NVIDIA H200", "abc123", records(), "2026-11-29T10:00:00")
    assert run_report(tmp_path) == 0
    out = tmp_path / "out"
    assert {p.name for p in out.glob("*.png")} == {f"{e}.png" for e in ("e1", "e3", "e4", "e5", "e7", "e8")}
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
    assert "- commit `new222`: e1, e3, e4, e5, e7, e8 (runs `0002_new222`, `0003_new222`)" in readme
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


def stated_unit(label: str) -> tuple[str, float] | None:
    """The record field a column label stands for, and the factor from the seconds stored there
    to the unit the label states: "ITL p50 (ms)" -> ("itl_p50_s", 1e3); a bare field name such
    as "itl_p50_s" states seconds by its suffix."""
    if m := re.fullmatch(r"(.+) \((m?s)\)", label):
        return m[1].lower().replace(" ", "_") + "_s", {"s": 1.0, "ms": 1e3}[m[2]]
    return (label, 1.0) if re.fullmatch(r"\w+_s", label) else None


def test_every_label_names_the_unit_its_cells_are_in(tmp_path):
    """Records hold seconds; a column or metric labelled in ms shows ms (itl_p50_s=0.0123 as 12.3),
    one labelled in s (or by the field's own name) shows s, in every table, the ratio table too."""
    timed = dict(ttft_p50_s=0.456, ttft_p90_s=0.567, ttft_p99_s=0.678, itl_p50_s=0.0123, itl_p99_s=0.0234,
                 e2e_p50_s=1.23, makespan_s=7.89)
    rows = [serving("e4", "continuous×triton", **timed), serving("e8", "continuous×triton", **timed),
            dict(experiment="e3_prefill", attention="triton", B=4, T=4096, P=16, time_s=0.00077,
                 ratio_vs_sdpa=1.45, tflops=357.0, sdpa_tflops=518.0)]
    write_run(tmp_path / "results", 1, "NVIDIA H200", "old111", rows, "2026-11-29T10:00:00")
    write_run(tmp_path / "results", 2, "NVIDIA H200", "new222", rows, "2026-11-29T11:00:00")
    assert run_report(tmp_path, "0001", "0002") == 0
    record = {r["experiment"]: r for r in rows}
    checked = set()
    for section, header, body in tables((tmp_path / "out" / "README.md").read_text()):
        for row in body:
            cells = dict(zip(header, row, strict=True))
            if "metric" in cells:  # the ratio table: the metric's label is a cell, its values two others
                where, labelled = "ratio", [(cells["metric"], cells["baseline"]), (cells["metric"], cells["this"])]
                experiment = cells["experiment"]
            else:
                where, labelled = "table", list(cells.items())
                experiment = section.split(":")[0]
            for label, cell in labelled:
                field = stated_unit(label)
                if experiment not in record or field is None or field[0] not in record[experiment]:
                    continue
                shown = float(cell.replace(",", ""))
                assert shown == pytest.approx(record[experiment][field[0]] * field[1], rel=5e-3), (section, label, cell)
                checked.add((where, experiment, field[0]))
    assert {("ratio", "e8", m) for m in ("ttft_p50_s", "itl_p50_s", "makespan_s")} <= checked
    assert ("ratio", "e3_prefill", "time_s") in checked
    assert {("table", "e4", m) for m in timed if m != "itl_p99_s"} <= checked
    assert {("table", "e8", "itl_p50_s"), ("table", "e3_prefill", "time_s")} <= checked


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        ("empty", (), "no stored runs under"),
        ("machines", ("0001", "0002"), "different machines (NVIDIA H200: 0001_aaa; cpu: 0002_bbb)"),
        ("commits", ("0001", "0002", "0003"), "span 3 commits"),
        ("one", ("0007",), "'0007': no run of that name"),
        ("one", ("--experiment", "e9"), "unknown experiment 'e9'"),
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
    assert "n/a: e4 lacks" in readme and "n/a: e5 lacks" in readme and "triton 3000 GB/s" in readme
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
