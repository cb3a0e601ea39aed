"""Replay a workload's arrivals into a persistent engine: the benchmark's clock, not the engine's.

- `replay_ticks`: arrivals in engine ticks (the seed's e4). A tick is one `step` call; a request
  whose tick has come is added before that step; when nothing is in flight and the next arrival
  is still ahead, the clock jumps to it (an idle engine would only spin).
- `replay_seconds`: arrivals in wall-clock seconds from the start. A request is added at the first
  step boundary after its instant, with that instant as its arrival time, so its TTFT includes the
  wait a server would make it do; an idle engine sleeps until the next arrival.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from weft.inference.engine import LLMEngine
from weft.inference.outputs import RequestOutput
from weft.inference.params import RequestOutputKind, SamplingParams


@dataclasses.dataclass(frozen=True)
class Arrival:
    request_id: str | int
    prompt: object  # anything add_request takes
    params: SamplingParams
    at: int | float  # the engine tick before which it is added, or seconds after the start


def replay_ticks(engine: LLMEngine, arrivals: Sequence[Arrival]) -> list[RequestOutput]:
    """Serve `arrivals` (`at`: ticks) to completion; -> their final outputs, in the order given."""
    for i, a in enumerate(arrivals):
        if isinstance(a.at, bool) or not isinstance(a.at, int) or a.at < 0:
            raise ValueError(f"arrival {i} ({a.request_id!r}): its tick must be an integer >= 0, got {a.at!r}")
    pending, done = _pending(arrivals), {}
    tick = 0
    while len(done) < len(arrivals):
        if not engine.has_unfinished_requests():
            tick = max(tick, pending[-1].at)
        while pending and pending[-1].at <= tick:
            _add(engine, pending.pop())
        _step(engine, done)
        tick += 1
    return [done[a.request_id] for a in arrivals]


def replay_seconds(engine: LLMEngine, arrivals: Sequence[Arrival]) -> list[RequestOutput]:
    """Serve `arrivals` (`at`: seconds) to completion; -> their final outputs, in the order given."""
    pending, done = _pending(arrivals), {}
    start = time.perf_counter()
    while len(done) < len(arrivals):
        now = time.perf_counter()
        while pending and start + pending[-1].at <= now:
            a = pending.pop()
            _add(engine, a, arrival_time=start + a.at)
        if engine.has_unfinished_requests():
            _step(engine, done)
        elif pending:
            time.sleep(max(0.0, start + pending[-1].at - time.perf_counter()))
    return [done[a.request_id] for a in arrivals]


def _pending(arrivals: Sequence[Arrival]) -> list[Arrival]:
    """The arrivals, the next one last (ties in the order given)."""
    return sorted(arrivals, key=lambda a: a.at)[::-1]


def _add(engine: LLMEngine, a: Arrival, arrival_time: float | None = None) -> None:
    final = dataclasses.replace(a.params, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request(a.request_id, a.prompt, final, arrival_time=arrival_time)


def _step(engine: LLMEngine, done: dict[str | int, RequestOutput]) -> None:
    for out in engine.step():
        if out.finished:
            done[out.request_id] = out

