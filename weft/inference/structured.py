"""Structured outputs: a JSON schema, a regex, a choice of strings or an EBNF grammar constrains each
generated token, through xgrammar.

Per engine, a `GrammarCompiler` (from the tokenizer) compiles each request's `StructuredOutputsParams`
once, on threads of its own (the request waits in the engine, outside the scheduler, until it is compiled); per
request, a `Matcher` follows the tokens generated so far and holds the tokens it allows next, as an int32
bitmask row [1, ceil(V / 32)] on the CPU (bit j of word w allows token 32 w + j), refilled as it accepts a token.
The scheduler advances a step's matchers one after another (spread over threads, or filled in xgrammar's batch
call, they took longer: results/logs/h100_json_step*.log). The step's sampling state copies their rows to the
logits' device, where the sampler applies them as they are (weft.layers.sampler.ban_unset). xgrammar is imported
at first use: `import weft` stays light.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from weft.errors import ParamTypeError, ParamValueError
from weft.layers.bitmask import token_bitmask
from weft.utils import cdiv

if TYPE_CHECKING:
    import xgrammar

PARAM = "structured_outputs"
_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
# xgrammar's errors open with "[hh:mm:ss] /project/cpp/file.cc:line: ", which says nothing to the user
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match: exactly one field set (vLLM's StructuredOutputsParams names)."""

    json: str | dict | None = None  # a JSON schema, as a dict or its JSON text
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None  # the output is exactly one of these; kept as a tuple
    grammar: str | None = None  # EBNF as xgrammar reads it (GBNF-style), root rule `root`
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str | dict):
            _type_error(f"json must be a JSON schema (a dict or its JSON text), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                _type_error(f"{name} must be a string, got {type(value).__name__}")
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple):
                _type_error(f"choice must be a list of strings, got {type(self.choice).__name__}")
            for i, option in enumerate(self.choice):
                if not isinstance(option, str):
                    _type_error(f"choice[{i}] must be a string, got {type(option).__name__}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool):
            _type_error(f"json_object must be a bool, got {type(self.json_object).__name__}")

        chosen = [name for name in _FIELDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            got = " and ".join(chosen) if chosen else "none"
            raise ParamValueError(f"{PARAM}: set exactly one of {', '.join(_FIELDS)}; got {got}", param=PARAM)
        if self.choice is not None:
            if not self.choice:
                _value_error("choice is empty: give at least one string")
            if "" in self.choice:
                _value_error(f"choice[{self.choice.index('')}] is empty")
        if self.grammar is not None and not self.grammar.strip():
            _value_error("grammar is empty")
        field = chosen[0]
        # a schema keys by its compact text: a dict and its JSON text share one compiled grammar
        value = _schema_text(self.json) if field == "json" else getattr(self, field)
        object.__setattr__(self, "_key", (field, value))

    def key(self) -> tuple:
        """A hashable key for the compiled grammar: (field, value), a schema as compact JSON text."""
        return self._key

    def __hash__(self) -> int:  # a dict schema would make the generated hash fail
        return hash(self._key)


def _type_error(message: str) -> NoReturn:
    raise ParamTypeError(f"{PARAM}.{message}", param=PARAM)


def _value_error(message: str) -> NoReturn:
    raise ParamValueError(f"{PARAM}.{message}", param=PARAM)


def _schema_text(schema: str | dict) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            _value_error(f"json is not valid JSON text: {e}")
    if not isinstance(schema, dict):
        _value_error(f"json must be a JSON schema object, got a JSON {type(schema).__name__}")
    try:
        # keys keep their order: the output writes an object's properties in the schema's order
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except TypeError as e:
        _type_error(f"json is not JSON-serialisable: {e}")
    except ValueError as e:  # NaN or infinity
        _value_error(f"json is not valid JSON: {e}")


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer; built once per engine.

    `vocab_size` is the logits' width V (it may exceed len(tokenizer): the ids past the tokenizer are never
    allowed, and xgrammar never sees them: a model's padded vocabulary, Qwen3-0.6B's 151,936 ids beside SmolLM2's
    49,152 tokens, made each fill 24x slower). `stop_token_ids` are the tokens a complete output may end with
    (default: the tokenizer's EOS).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int] | None = None,
                 cache_size: int = 128) -> None:
        import xgrammar

        stops = sorted(stop_token_ids) if stop_token_ids is not None else None
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=stops)
        # the LRU below is the one cache: xgrammar's own would keep every grammar ever compiled. The two compiles
        # (below) take half the cores between them, at least a thread each: the rest are the steps' (on 2 cores, a
        # stream's largest gap beside a long compile: 1.15 s with 8 threads, 0.61 s with 1;
        # results/logs/serve_grammar_stall_*.log)
        threads = max(1, (os.cpu_count() or 1) // 4)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.stop_token_ids: tuple[int, ...] = tuple(info.stop_token_ids)
        self._stop_row = token_bitmask(self.stop_token_ids, vocab_size)[0]
        self.words = cdiv(len(tokenizer), 32)  # the words of a bitmask row that xgrammar fills; the rest stay 0
        # compiling against the vocabulary takes seconds for a large grammar (a choice of 30,000 strings: 4-11 s on
        # 2 cores) and lets go of the interpreter lock: it runs on threads of its own, so that it holds up no step;
        # two, so that one long compile holds up no other request's
        self._threads = ThreadPoolExecutor(2, thread_name_prefix="weft-grammar")
        self._cache: OrderedDict[tuple, Future[xgrammar.CompiledGrammar]] = OrderedDict()  # LRU, by spec.key()
        self.cache_size = cache_size

    def compile(self, spec: StructuredOutputsParams) -> Future[xgrammar.CompiledGrammar]:
        """spec's grammar, compiled or compiling (cached by spec.key()); an invalid one is a ParamValueError saying
        why, raised here (parsing it takes milliseconds). Whoever waits on it keeps this Future: the cache may drop
        it meanwhile."""
        key = spec.key()
        grammar = self._cache.get(key)
        if grammar is None:
            grammar = self._threads.submit(self._compiler.compile_grammar, _parse(key))
            self._cache[key] = grammar
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return grammar

    def drop(self, grammar: Future[xgrammar.CompiledGrammar]) -> None:
        """No request waits for `grammar` any more: a compile not started yet is not started (and leaves the cache);
        one running ends on its thread, and stays cached."""
        if grammar.cancel():
            self._cache = OrderedDict((k, g) for k, g in self._cache.items() if g is not grammar)

    def matcher(self, grammar: xgrammar.CompiledGrammar) -> Matcher:
        """A matcher at the start of a compiled grammar."""
        return Matcher(grammar, self._stop_row, self.words)

    def close(self) -> None:
        """Drop the compiles not started; one running ends on its thread, its grammar unused."""
        self._threads.shutdown(wait=False, cancel_futures=True)


def _parse(key: tuple) -> xgrammar.Grammar:
    """A StructuredOutputsParams key's grammar, before it meets the vocabulary; an invalid one is a ParamValueError."""
    import xgrammar

    field, value = key
    try:
        if field == "json":
            # compact separators: small models given free whitespace may emit it without end
            return xgrammar.Grammar.from_json_schema(value, any_whitespace=False)
        if field == "json_object":
            return xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if field == "regex":
            return xgrammar.Grammar.from_regex(value)
        if field == "choice":  # JSON's string escapes are EBNF's
            return xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                     for c in value))
        return xgrammar.Grammar.from_ebnf(value)
    except RuntimeError as e:
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}.get(field, "value")
        reason = _XGRAMMAR_PREFIX.sub("", str(e)).strip()
        raise ParamValueError(f"{PARAM}.{field}: invalid {what}: {reason}", param=PARAM) from None


class Matcher:
    """One request's position in its grammar and the tokens it allows next (`next`): accept() the sampled token."""

    def __init__(self, grammar: xgrammar.CompiledGrammar, stop_row: torch.Tensor, words: int) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(grammar)
        self._stop_row = stop_row  # int32 [ceil(V / 32)]: the stop tokens' bits only
        # the tokens allowed next, int32 [1, ceil(V / 32)]; once the output is complete, the stop tokens are among
        # them; not to be read once a stop token is accepted
        self.next = torch.zeros(1, stop_row.numel(), dtype=torch.int32)
        self._filled = self.next[:, :words]  # the tokenizer's words, which xgrammar fills
        self.terminated = False  # nothing but a stop token can follow, or a stop token was accepted
        self._refill()

    def accept(self, token: int) -> bool:
        """Advance by the sampled token, and find what may follow -> False, and no step, for a token the grammar
        does not allow here (sampled where a request's rules together allowed nothing)."""
        if not self._matcher.accept_token(token):
            return False
        self._refill()
        return True

    def _refill(self) -> None:
        if self._matcher.is_terminated():  # a stop token was accepted: xgrammar fills no row past it
            self.terminated = True
            return
        self._matcher.fill_next_token_bitmask(self._filled, 0)
        self.terminated = self._matcher.is_completed() and torch.equal(self.next[0], self._stop_row)
