"""Replay a workload's arrivals into a persistent engine: the benchmark's clock, not the engine's.

Arrivals are in engine ticks (the seed's e4): a tick is one `step` call. A request whose tick
has come is added before that step; when nothing is in flight and the next arrival is still
ahead, the clock jumps to it (an idle engine would only spin).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from weft.inference.engine import LLMEngine
from weft.inference.outputs import RequestOutput
from weft.inference.params import RequestOutputKind, SamplingParams


@dataclasses.dataclass(frozen=True)
class Arrival:
    request_id: str | int
    prompt: object  # anything add_request takes
    params: SamplingParams
    tick: int  # engine step before which it is added


def replay_ticks(engine: LLMEngine, arrivals: Sequence[Arrival]) -> list[RequestOutput]:
    """Serve `arrivals` to completion; -> their final outputs, in the order given."""
    for i, a in enumerate(arrivals):
        if isinstance(a.tick, bool) or not isinstance(a.tick, int) or a.tick < 0:
            raise ValueError(f"arrival {i} ({a.request_id!r}): its tick must be an integer >= 0, got {a.tick!r}")
    pending = sorted(arrivals, key=lambda a: a.tick)[::-1]  # the next arrival last; ties in the order given
    done: dict[str | int, RequestOutput] = {}
    tick = 0
    while len(done) < len(arrivals):
        if not engine.has_unfinished_requests():
            tick = max(tick, pending[-1].tick)
        while pending and pending[-1].tick <= tick:
            a = pending.pop()
            final = dataclasses.replace(a.params, output_kind=RequestOutputKind.FINAL_ONLY)
            engine.add_request(a.request_id, a.prompt, final)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        tick += 1
    return [done[a.request_id] for a in arrivals]

