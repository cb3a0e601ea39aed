"""Grammar matchers in processes of their own.

xgrammar's accept and fill hold the interpreter lock while they run (results/HISTORY.md, 2026-12-05), so on the
engine's thread a step's grammars add their whole cost to the step's host time, and threads cannot spread it. Here
each matcher lives in one of a few worker processes (`python -m weft.inference.matchers`, so that no user script is
imported again, as multiprocessing's spawn would). The engine's side holds a `Matcher` per request; a step's
accepts and fills go to every worker at once and run side by side, each worker's fills into a buffer of shared
memory that the engine copies its rows from.

A worker answers every request in the order sent: ("accept", ids, tokens) -> (index of the first token refused or
None, each matcher's `terminated`); ("fill", ids) -> None once the buffer's first rows hold their masks; a worker's
failure comes back as ("error", text) and is raised here.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import weakref
from collections import OrderedDict
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

import torch

# worker processes and each one's fill threads: a step's host work keeps a core of its own
WORKERS = max(1, min(4, (os.cpu_count() or 1) // 4))
FILL_THREADS = max(1, (os.cpu_count() or 1) // (2 * WORKERS))
FIRST_ROWS = 64  # a worker's buffer rows at first; it doubles when a step fills more of its matchers


class MatcherPool:
    """WORKERS processes holding matchers of compiled grammars for one tokenizer: `tokenizer_info` is xgrammar's
    TokenizerInfo as its JSON, `stop_row` int32 [W] the stop tokens' bits (W = ceil(V / 32))."""

    def __init__(self, tokenizer_info: str, stop_row: torch.Tensor, grammars: int) -> None:
        self.grammars = grammars  # each worker's grammars kept (the least recently used go first)
        self.workers = [_Worker(tokenizer_info, stop_row) for _ in range(WORKERS)]
        self.ids = itertools.count()
        self.close = weakref.finalize(self, _close, self.workers)  # at close(), or once the pool is collected

    def matcher(self, key: tuple, grammar_json: str) -> Matcher:
        """A matcher at the start of the grammar compiled as `grammar_json` (xgrammar's CompiledGrammar JSON), known
        to the workers by `key`."""
        mid = next(self.ids)
        worker = self.workers[mid % len(self.workers)]
        if key in worker.grammars:
            worker.grammars.move_to_end(key)
            worker.send(("new", mid, key, None))
        else:
            worker.grammars[key] = None
            worker.send(("new", mid, key, grammar_json))
            if len(worker.grammars) > self.grammars:  # its matchers keep theirs
                worker.send(("forget", worker.grammars.popitem(last=False)[0]))
        return Matcher(self, worker, mid)

    def accept(self, handles: list[Matcher], tokens: list[int]) -> None:
        """Advance handles[i] by tokens[i], every worker's at once; a token its grammar refuses is a RuntimeError
        (a bug: it was sampled without the mask), raised once all have answered."""
        parts = self._parts(handles)
        for worker, at in parts.items():
            worker.send(("accept", [handles[i].mid for i in at], [tokens[i] for i in at]))
        refused = None
        for worker, at in parts.items():
            bad, terminated = worker.receive()
            for i, done in zip(at, terminated, strict=True):
                handles[i].terminated = done
            if bad is not None and refused is None:
                refused = tokens[at[bad]]
        if refused is not None:
            raise RuntimeError(f"token {refused} does not follow the grammar here: was it sampled without the mask?")

    def fill(self, handles: list[Matcher], bitmask: torch.Tensor) -> None:
        """Row i of bitmask (int32 [R >= len(handles), W], on the CPU) <- the tokens handles[i] allows next, every
        worker's rows at once."""
        parts = self._parts(handles)
        for worker, at in parts.items():
            worker.reserve(len(at))
            worker.send(("fill", [handles[i].mid for i in at]))
        for worker, at in parts.items():
            worker.receive()
            bitmask.index_copy_(0, torch.tensor(at), worker.rows[: len(at)])

    def _parts(self, handles: list[Matcher]) -> dict[_Worker, list[int]]:
        parts: dict[_Worker, list[int]] = {}
        for i, handle in enumerate(handles):
            parts.setdefault(handle.worker, []).append(i)
        return parts


def _close(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.close()


class Matcher:
    """One request's position in its grammar, held by a worker: fill() the next step's allowed tokens, accept() the
    sampled one (a step's many at once: `MatcherPool.fill`, `MatcherPool.accept`). `terminated`: the last token
    accepted ended the output (it is complete and nothing but a stop token can follow, or it was a stop token)."""

    def __init__(self, pool: MatcherPool, worker: _Worker, mid: int) -> None:
        self.pool, self.worker, self.mid = pool, worker, mid
        self.terminated = False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (int32 [R, W], on the CPU); once the output is complete,
        the stop tokens are among them. Not to be called once a stop token is accepted."""
        self.pool.fill([self], bitmask[row : row + 1])

    def accept(self, token: int) -> None:
        """Advance by the sampled token; one the mask forbade is a bug (RuntimeError)."""
        self.pool.accept([self], [token])

    def __del__(self) -> None:
        self.worker.dropped.append(self.mid)  # the worker forgets it with the next request it gets


class _Worker:
    """One worker process, its socket and its buffer of shared memory."""

    def __init__(self, tokenizer_info: str, stop_row: torch.Tensor) -> None:
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), env=_child_env())
        theirs.close()
        self.conn = Connection(ours.detach())
        self.grammars: OrderedDict[tuple, None] = OrderedDict()  # the keys of the grammars it holds, oldest first
        self.dropped: list[int] = []
        self.memory: SharedMemory | None = None
        self.rows = torch.empty(0, stop_row.numel(), dtype=torch.int32)
        self.send(("start", tokenizer_info, stop_row.tolist(), FILL_THREADS))

    def send(self, request: tuple) -> None:
        if self.dropped:
            dropped, self.dropped = self.dropped, []
            self.conn.send(("drop", dropped))
        self.conn.send(request)

    def receive(self) -> object:
        try:
            answer = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"a grammar worker (pid {self.process.pid}) exited: {self.process.poll()}") from None
        if isinstance(answer, tuple) and answer and answer[0] == "error":
            raise RuntimeError(f"a grammar worker failed: {answer[1]}")
        return answer

    def reserve(self, rows: int) -> None:
        """A buffer of at least `rows` rows, shared with the worker."""
        if rows <= self.rows.shape[0]:
            return
        rows = max(rows, FIRST_ROWS, 2 * self.rows.shape[0])
        W = self.rows.shape[1]
        old, self.memory = self.memory, SharedMemory(create=True, size=rows * W * 4)
        self.rows = torch.frombuffer(self.memory.buf, dtype=torch.int32).view(rows, W)
        self.send(("buffer", self.memory.name, rows))
        if old is not None:
            old.close()
            old.unlink()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.wait()
        self.conn.close()
        if self.memory is not None:
            self.rows = self.rows[:0].clone()  # the view lets go of the memory before it closes
            self.memory.close()
            self.memory.unlink()
            self.memory = None


def _serve(conn: Connection) -> None:
    """A worker's loop: requests in, answers out, until None (or the engine's end of the socket closes). A request
    that fails is answered ("error", text): an accept or fill at once, any other with the next answer."""
    import xgrammar

    grammars: dict[tuple, xgrammar.CompiledGrammar] = {}
    matchers: dict[int, xgrammar.GrammarMatcher] = {}
    info = batch = stop_row = scratch = memory = rows = None
    failed: str | None = None
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        op, answer = request[0], None
        try:
            if op == "start":
                info = xgrammar.TokenizerInfo.deserialize_json(request[1])
                stop_row = torch.tensor(request[2], dtype=torch.int32)
                scratch = torch.empty(1, stop_row.numel(), dtype=torch.int32)
                batch = xgrammar.BatchGrammarMatcher(request[3])
            elif op == "new":
                _, mid, key, text = request
                if text is not None:
                    grammars[key] = xgrammar.CompiledGrammar.deserialize_json(text, info)
                matchers[mid] = xgrammar.GrammarMatcher(grammars[key])
            elif op == "forget":
                del grammars[request[1]]
            elif op == "drop":
                for mid in request[1]:
                    matchers.pop(mid, None)
            elif op == "buffer":
                if memory is not None:
                    rows = None
                    memory.close()
                memory = _attach(request[1])
                rows = torch.frombuffer(memory.buf, dtype=torch.int32).view(request[2], stop_row.numel())
            elif op == "accept":
                _, ids, tokens = request
                bad = next((i for i, (mid, token) in enumerate(zip(ids, tokens, strict=True))
                            if not matchers[mid].accept_token(token)), None)
                answer = (bad, [_terminated(matchers[mid], scratch, stop_row) for mid in ids])
            elif op == "fill":
                batch.batch_fill_next_token_bitmask([matchers[mid] for mid in request[1]], rows)
        except Exception as e:  # the engine raises it; the worker goes on serving the others
            failed = failed or f"{op}: {type(e).__name__}: {e}"
        if op in ("accept", "fill"):
            conn.send(("error", failed) if failed else answer)
            failed = None


def _terminated(matcher, scratch: torch.Tensor, stop_row: torch.Tensor) -> bool:
    """The output is complete and nothing but a stop token can follow (or a stop token was accepted): one extra fill
    where the output is complete, none elsewhere."""
    if matcher.is_terminated():
        return True
    if not matcher.is_completed():
        return False
    matcher.fill_next_token_bitmask(scratch, 0)
    return torch.equal(scratch[0], stop_row)


def _child_env() -> dict[str, str]:
    """This environment, with the directory weft is imported from first on the path (a checkout run in place)."""
    import weft

    root = os.path.dirname(os.path.dirname(os.path.abspath(weft.__file__)))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def _attach(name: str) -> SharedMemory:
    """The engine's shared memory `name`, which the engine unlinks: kept out of this process's resource tracker
    (before Python 3.13 attaching registers it, and the tracker would unlink it when this process exits)."""
    memory = SharedMemory(name=name)
    if sys.version_info < (3, 13):
        from multiprocessing import resource_tracker

        resource_tracker.unregister(memory._name, "shared_memory")
    return memory


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
