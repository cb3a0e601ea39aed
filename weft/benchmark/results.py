"""Stored perf runs (pytest-benchmark JSON) as tables, and the rules for what may be shown together.

A report is about one machine. Named runs must be one commit, with at most one other commit
of the same machine as the baseline of a comparison. The default report (every stored run)
takes each experiment from the newest commit that measured it, so a matrix run over several
sessions is shown whole; every experiment still comes from one commit, and the report names
it. Runs of one commit are merged (a benchmark run twice keeps its latest record). Anything
else is refused with a `ReportError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

EXPERIMENTS = {
    "e1": "backend sweep",
    "e2": "batch sweep",
    "e3": "decode kernel bandwidth",
    "e3_prefill": "prefill kernel",
    "e4": "arrival stream",
    "e5": "pool-size sweep",
    "e6": "block-size sweep",
    "e7": "per-tick profile",
    "e8": "standard workload",
    "e9": "serving over HTTP",
    "e11": "shared-prefix workload, prefix cache on and off",
    "e12": "ablation: each optimization off in turn",
    "e13": "single steps profiled: GPU busy and idle, time by kernel class, the floor",
    "e14": "vLLM's sampling fields: what each costs against the same requests greedy, single, or free",
    "e15": "model families: a mixture of experts' batch sweep, beside HF generate",
    "e15_e8": "model families: a mixture of experts on the standard workload, beside HF generate_batch",
    "e15_itl": "model families: batch-1 ITL over the weights floor per step",
    "e15_kernel": "model families: the fused MoE kernels' bandwidth, one layer",
    "e16": "deterministic=True: its batch-invariant kernels' cost on the standard workload and one request alone",
    "e17_kernel": "decode GEMMs: each layer at 1 and 16 rows as weft runs it, beside cuBLAS, over the copy bandwidth",
    "e17_itl": "batch-1 ITL of the dense shapes over their weights floor, beside HF's static cache (compiled)",
}
IDENTITY = ("experiment", "gpu", "git_sha")  # what every record must say about itself
# e9's latency fields (ms, as vLLM's `bench serve` names them) <- the same of weft's serving metrics (s)
E9_FROM_SECONDS = {
    f"{stat}_{client}_ms": f"{engine}_{p}_s"
    for client, engine in (("ttft", "ttft"), ("itl", "itl"), ("e2el", "e2e"))
    for stat, p in (("median", "p50"), ("p90", "p90"), ("p99", "p99"))
}


class ReportError(Exception):
    """Input the report cannot use; the message says why (no traceback for the user)."""


@dataclass(frozen=True)
class Run:
    path: Path
    datetime: str  # when pytest-benchmark saved it (ISO 8601, so it sorts)
    gpu: str
    git_sha: str
    records: pd.DataFrame  # one row per benchmark: `name`, `run`, then its extra_info

    @property
    def label(self) -> str:
        return self.path.stem


def load_run(path: Path) -> Run:
    try:
        data = json.loads(path.read_text())
        benchmarks, when = data["benchmarks"], data["datetime"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ReportError(f"{path}: not a pytest-benchmark run ({type(e).__name__}: {e})") from None
    rows = [{"name": b["name"], "run": path.stem, **b.get("extra_info", {})} for b in benchmarks]
    if not rows:
        raise ReportError(f"{path}: the run holds no benchmarks")
    records = pd.DataFrame(rows)
    missing = [k for k in IDENTITY if k not in records or records[k].isna().any()]
    if missing:
        raise ReportError(f"{path}: records without {', '.join(missing)}: not a weft perf run")
    for key in ("gpu", "git_sha"):
        if records[key].nunique() > 1:
            raise ReportError(f"{path}: one run with several values of {key}: {sorted(records[key].unique())}")
    try:
        records = normalize(records)
    except ValueError as e:
        raise ReportError(f"{path}: {e}") from None
    return Run(path, when, records["gpu"].iloc[0], records["git_sha"].iloc[0], records)


def normalize(records: pd.DataFrame) -> pd.DataFrame:
    """A run's records in the fields of the newest commits, so each fact is read in one place: an e4
    record without `clock` is on the seed's clock, `ticks` (e4 before 99cd669); e9's `request_rate`
    is a float (`inf`, every request at once, is stored as the string "inf"); an e9 record timed by
    the engine itself (`server` "offline") gets the client's ms latencies from its seconds
    (`E9_FROM_SECONDS`; it has no TPOT). A rate that is no number is a ValueError."""
    records = records.copy()
    e4, e9 = records["experiment"] == "e4", records["experiment"] == "e9"
    if e4.any():
        if "clock" not in records:
            records["clock"] = None
        records.loc[e4 & records["clock"].isna(), "clock"] = "ticks"
    if e9.any() and "request_rate" in records:
        try:
            records["request_rate"] = pd.to_numeric(records["request_rate"])
        except ValueError as e:
            raise ValueError(f"request_rate must be a number or 'inf' ({e})") from None
    for ms, s in E9_FROM_SECONDS.items():
        timed = (e9 & records[s].notna()) if s in records else None
        if timed is not None and ms in records:
            timed &= records[ms].isna()
        if timed is not None and timed.any():
            records.loc[timed, ms] = records.loc[timed, s] * 1e3
    return records


def find_runs(folder: Path) -> list[Path]:
    """Every stored run under `folder` (pytest-benchmark keeps them in per-machine subfolders)."""
    return sorted(p for p in folder.rglob("*.json") if p.is_file()) if folder.is_dir() else []


def load_stored(folder: Path) -> tuple[list[Run], list[ReportError]]:
    """Every run stored under `folder`, and why each other JSON file there is not one."""
    runs, unreadable = [], []
    for path in find_runs(folder):
        try:
            runs.append(load_run(path))
        except ReportError as e:
            unreadable.append(e)
    if not runs:
        raise ReportError(f"no stored runs under {folder}: run `uv run pytest tests/perf -m perf` first")
    return runs, unreadable


def resolve(names: list[str], folder: Path) -> list[Path]:
    """Each name is a JSON path, or a run's number or file name as pytest-benchmark saved it."""
    stored = find_runs(folder)
    paths = []
    for name in names:
        if Path(name).is_file():
            paths.append(Path(name))
            continue
        matches = [p for p in stored if p.stem == name or p.stem.split("_")[0] == name]
        if len(matches) != 1:
            found = "no run" if not matches else f"{len(matches)} runs"
            raise ReportError(f"{name!r}: {found} of that name in {folder} (give a path, or a number like 0001)")
        paths.append(matches[0])
    return paths


@dataclass
class Selection:
    """The runs a report shows: the subject's (one machine; one commit per experiment), and
    possibly a baseline commit's."""

    subject: list[Run]
    baseline: list[Run] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was merged, superseded or left out

    @property
    def gpu(self) -> str:
        return self.subject[0].gpu

    def records(self, baseline: bool = False) -> pd.DataFrame:
        """One row per benchmark name, each experiment's from the newest commit that has it;
        within that commit the latest run's record wins."""
        runs = sorted(self.baseline if baseline else self.subject, key=lambda r: r.datetime)
        if not runs:
            return pd.DataFrame()
        frame = pd.concat([r.records for r in runs], ignore_index=True)
        newest = frame.groupby("experiment", sort=False)["git_sha"].transform("last")
        frame = frame[frame["git_sha"] == newest]
        return frame.drop_duplicates("name", keep="last").reset_index(drop=True)


def commits_by_experiment(records: pd.DataFrame) -> dict[str, list[str]]:
    """commit -> the experiments a report's records take from it, newest commit first."""
    order = records.iloc[::-1]["git_sha"].drop_duplicates()
    return {sha: sorted(set(records.loc[records["git_sha"] == sha, "experiment"])) for sha in order}


def select(runs: list[Run], explicit: bool, baseline: list[Run] | None = None) -> Selection:
    """Which runs a report shows, and against which it compares them.

    Explicit runs must share one machine and span at most two commits: the newer commit is
    the subject, the older its baseline. An explicit `baseline` (same machine, any commit,
    e.g. an earlier run of the same dirty tree) makes all of `runs` the subject, which must
    then be one commit. Without explicit runs (`explicit=False`, every stored run): the
    newest GPU run's machine (the newest CPU run's when there is no GPU run), every commit of
    it, each experiment from its newest (`Selection.records`), and no baseline: CPU runs,
    made by every local test run, never displace the published ones.
    """
    if not runs:
        raise ReportError("no runs to report on: run `pytest tests/perf -m perf` first, or name a run")
    runs = sorted(runs, key=lambda r: r.datetime)
    baseline = sorted(baseline or [], key=lambda r: r.datetime)
    newest = ([r for r in runs if r.gpu != "cpu"] or runs)[-1]
    notes = []
    if not explicit:
        others = [r for r in runs if r.gpu != newest.gpu]
        if others:  # named, not counted: local CPU runs (git-ignored) come and go with every test run
            notes.append(f"left out the stored runs of other machines: {', '.join(sorted({r.gpu for r in others}))}")
        runs = [r for r in runs if r not in others]
        return Selection(runs, [], notes)
    everything = runs + baseline
    machines = sorted({r.gpu for r in everything})
    if len(machines) > 1:
        listing = "; ".join(f"{m}: {', '.join(r.label for r in everything if r.gpu == m)}" for m in machines)
        raise ReportError(f"the runs come from different machines ({listing}): name runs of one machine")
    commits = list(dict.fromkeys(r.git_sha for r in reversed(runs)))  # newest first
    if len(commits) > (1 if baseline else 2):
        wanted = "one (the baseline is given)" if baseline else "at most two"
        raise ReportError(f"the runs span {len(commits)} commits ({', '.join(commits)}): name runs of {wanted}")
    if not baseline:
        baseline = [r for r in runs if r.git_sha != commits[0]]
        runs = [r for r in runs if r.git_sha == commits[0]]
    for group in (runs, baseline):
        if len(group) > 1:
            notes.append(f"merged runs {', '.join(r.label for r in group)} (commit {group[0].git_sha}):"
                         " a benchmark present in several keeps its latest record")
    return Selection(runs, baseline, notes)


def gather(names: list[str], baseline: list[str], folder: Path) -> Selection:
    """The runs a report on `names` shows (every run stored under `folder` when there are none),
    checked by `select`, with `baseline` named explicitly or not at all; stored JSON files that
    are not runs are noted as skipped."""
    if names:
        runs, unreadable = [load_run(p) for p in resolve(names, folder)], []
    else:
        runs, unreadable = load_stored(folder)
    selection = select(runs, bool(names), [load_run(p) for p in resolve(baseline, folder)])
    selection.notes += [f"skipped {e}" for e in unreadable]
    return selection


def restrict(frame: pd.DataFrame, column: str, wanted: list[str] | None) -> pd.DataFrame:
    """Rows whose `column` is one of `wanted` (all rows for None); unknown names are a ReportError."""
    if not wanted:
        return frame
    present = set(frame[column].dropna()) if column in frame else set()
    known = present | (set(EXPERIMENTS) if column == "experiment" else set())
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise ReportError(
            f"unknown {column} {', '.join(map(repr, unknown))}: the runs have {', '.join(sorted(present)) or 'none'}"
        )
    return frame[frame[column].isin(wanted)]
