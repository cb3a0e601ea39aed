"""Workloads: seeded synthetic requests (random token ids), arrivals and length mixes.

Arrivals are on one of two clocks: engine ticks (a tick is one engine step: the seed's e4, where a
slower engine also sees requests arrive more slowly) or wall-clock seconds (as a server sees them).

Everything is drawn from `random.Random(seed)`, so a workload is the same on every machine
and Python version; token ids are uniform in [0, V) because no tokenizer is involved.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

STANDARD_REQUESTS = 256
STANDARD_LENGTHS = (100, 1024)  # prompt and output lengths are each uniform in this range
STANDARD_SEED = 0


@dataclass(frozen=True)
class Request:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # generated with ignore_eos, so exactly this many
    arrival_tick: int = 0  # engine step at which the request joins the queue (clock "ticks")
    arrival_s: float = 0.0  # seconds after the run starts (clock "seconds")

    @property
    def max_len(self) -> int:
        """Prompt plus output: the longest the sequence grows."""
        return len(self.prompt_token_ids) + self.max_tokens


CLOCKS = ("ticks", "seconds")


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[Request, ...]
    clock: str = "ticks"  # which arrival field counts, see CLOCKS

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def prompts(self) -> list[list[int]]:
        return [list(r.prompt_token_ids) for r in self.requests]

    @property
    def offline(self) -> bool:
        """Every request is there at the start (what a batch API such as HF `generate` can serve)."""
        return all(r.arrival_tick == 0 and r.arrival_s == 0 for r in self.requests)

    @property
    def input_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def max_len(self) -> int:
        return max(r.max_len for r in self.requests)

    def blocks_needed(self, block_size: int) -> int:
        """Blocks of `block_size` tokens for every request to be resident at once (the full pool).

        A request caches every token but its last generated one.
        """
        return sum(math.ceil((r.max_len - 1) / block_size) for r in self.requests)

    def largest_request_blocks(self, block_size: int) -> int:
        """The smallest pool that can still run every request (one at a time)."""
        return max(math.ceil((r.max_len - 1) / block_size) for r in self.requests)

    def warmup(self, max_tokens: int) -> Workload:
        """A cheap warm-up of the same shapes: the same lengths and arrivals, at most `max_tokens` each, and the
        same prefixes shared among its prompts (so it compiles what the timed run's cache hits run), but each token
        id replaced by the next one the workload uses: it leaves nothing in a prefix cache that the timed run could
        find."""
        ids = sorted({t for r in self.requests for t in r.prompt_token_ids})
        following = dict(zip(ids, ids[1:] + ids[:1], strict=True))
        requests = tuple(
            replace(r, prompt_token_ids=tuple(following[t] for t in r.prompt_token_ids),
                    max_tokens=min(r.max_tokens, max_tokens))
            for r in self.requests
        )
        return Workload(f"{self.name}-warmup", requests, self.clock)


def random_prompts(lengths: Sequence[int], vocab_size: int, rng: random.Random) -> list[tuple[int, ...]]:
    return [tuple(rng.randrange(vocab_size) for _ in range(n)) for n in lengths]


def poisson_times(n: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival instants of a Poisson process with `rate` arrivals per unit of time; the first is at 0."""
    if rate <= 0:
        raise ValueError(f"arrival rate must be > 0, got {rate}")
    t, times = 0.0, [0.0]
    for _ in range(n - 1):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def fixed(batch: int, prompt_len: int, max_tokens: int, vocab_size: int, seed: int = 0) -> Workload:
    """`batch` requests of one prompt length, all at tick 0."""
    rng = random.Random(seed)
    prompts = random_prompts([prompt_len] * batch, vocab_size, rng)
    requests = tuple(Request(p, max_tokens) for p in prompts)
    return Workload(f"fixed-B{batch}-S{prompt_len}-new{max_tokens}", requests)


def uniform(
    n: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    seed: int,
    name: str,
) -> Workload:
    """`n` requests at tick 0 whose prompt and output lengths are uniform in the given closed ranges."""
    rng = random.Random(seed)
    prompt_lens = [rng.randint(*prompt_range) for _ in range(n)]
    max_tokens = [rng.randint(*output_range) for _ in range(n)]
    prompts = random_prompts(prompt_lens, vocab_size, rng)
    return Workload(name, tuple(Request(p, m) for p, m in zip(prompts, max_tokens, strict=True)))


def standard(
    vocab_size: int, n: int = STANDARD_REQUESTS, lengths: tuple[int, int] = STANDARD_LENGTHS
) -> Workload:
    """The standard serving workload: 256 requests, seed 0, prompt and output lengths each U[100, 1024].

    `n` and `lengths` only shrink it for the CPU, where the suite runs at toy sizes.
    """
    name = f"standard-{n}x{lengths[0]}-{lengths[1]}"
    return uniform(n, lengths, lengths, vocab_size, STANDARD_SEED, name)


def arrival_stream(
    n: int,
    prompt_lengths: Sequence[int],
    max_tokens: int,
    rate: float,
    vocab_size: int,
    seed: int = 0,
    clock: str = "ticks",
) -> Workload:
    """`n` requests, prompt lengths drawn from the mix `prompt_lengths`, arriving as a Poisson stream of
    `rate` requests per tick or per second (`clock`). A seed gives the same prompts and instants on
    either clock: only the unit of time differs."""
    if clock not in CLOCKS:
        raise ValueError(f"unknown clock {clock!r}: choose from {', '.join(CLOCKS)}")
    rng = random.Random(seed)
    lengths = [rng.choice(prompt_lengths) for _ in range(n)]
    prompts = random_prompts(lengths, vocab_size, rng)
    times = poisson_times(n, rate, rng)
    if clock == "ticks":
        requests = tuple(Request(p, max_tokens, arrival_tick=int(t)) for p, t in zip(prompts, times, strict=True))
    else:
        requests = tuple(Request(p, max_tokens, arrival_s=t) for p, t in zip(prompts, times, strict=True))
    return Workload(f"stream-{n}-rate{rate:g}" + ("" if clock == "ticks" else "-per-s"), requests, clock)


def shared_prefix(
    groups: int, per_group: int, system_len: int, question_len: int, max_tokens: int, vocab_size: int, seed: int = 0
) -> Workload:
    """SGLang's generated-shared-prefix shape: `groups` long system prompts, each followed by `per_group`
    short questions; requests take the groups in turn (a group's first request comes early), all at once."""
    rng = random.Random(seed)
    systems = random_prompts([system_len] * groups, vocab_size, rng)
    questions = random_prompts([question_len] * (groups * per_group), vocab_size, rng)
    requests = tuple(
        Request(systems[i % groups] + q, max_tokens) for i, q in enumerate(questions)
    )
    return Workload(f"shared-{groups}x{per_group}-sys{system_len}-q{question_len}", requests)
