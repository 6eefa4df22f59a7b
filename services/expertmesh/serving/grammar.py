"""Structured output: a grammar per sequence, as a mask on its next token's logits.

Glossary
- *grammar spec* (``GrammarSpec``): what a request asks its output to be: any JSON object, JSON that
  validates against a schema, or text that matches a regular expression. Plain data, hashable: the key
  of the compile cache.
- *compiled grammar* (``CompiledGrammar``): a spec checked against this model's tokenizer, holding a
  matcher in its start state. Compiled once per spec (``Grammars``, an LRU cache), copied per sequence.
- *matcher* (``TokenMatcher``): one sequence's place in its grammar. Before each new token it gives the
  tokens the grammar allows next (``allowed``, bool [V]); the engine sets the others' logits to -inf
  before sampling and feeds the chosen token back (``accept``). When the grammar can go no further
  (``finished``) the sequence ends with reason ``stop``; end-of-sequence is allowed only where the
  output so far is complete.

The grammar library is llguidance (the one vLLM's ``guidance`` backend and llama.cpp use): it compiles
JSON schemas and regular expressions lazily against the tokenizer's byte-level vocabulary, so a token
that spans several JSON characters is allowed exactly when all of them are. It needs a fast (Rust)
tokenizer; a model without one refuses structured output with a message that says so. Why not xgrammar,
which vLLM and SGLang also use: on a CPU install it pulls triton (286 MB) beside torch; llguidance is one
3 MB wheel with no dependencies, and its masks are computed on the host, where the engine samples.

Masking changes which token is chosen, never the model's log-probabilities (reported before any control,
as vLLM reports them). A request without a grammar takes none of this path: ``exact`` stays bit-identical.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

import torch

from expertmesh.contracts.errors import InvalidRequest

#: bytes of a schema or regular expression one request may send (a bound on what the compiler is given)
MAX_GRAMMAR_BYTES = 64 * 1024
#: compiled grammars kept (least recently used go first)
CACHE_SIZE = 64

GrammarKind = Literal["json_object", "json_schema", "regex"]


class GrammarError(InvalidRequest):
    """A grammar the compiler refused, or one this model cannot take; ``field`` names where it came from."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}", field=field_name)


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must be. ``source``: the schema as canonical JSON (sorted keys), or the regex; ''
    for any JSON object. ``field``: the request field it came from, named in errors."""

    kind: GrammarKind
    source: str = ""
    field: str = "response_format"

    @classmethod
    def json_object(cls, field_name: str = "response_format") -> GrammarSpec:
        return cls("json_object", "", field_name)

    @classmethod
    def json_schema(cls, schema: Any, field_name: str = "response_format.json_schema.schema") -> GrammarSpec:
        """``schema``: a JSON schema as a dict (or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise GrammarError(field_name, f"the schema is not JSON: {err}") from None
        if not isinstance(schema, dict):
            raise GrammarError(field_name, f"a JSON schema is an object, got {type(schema).__name__}")
        source = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        return cls("json_schema", source, field_name)._bounded()

    @classmethod
    def regex(cls, pattern: str, field_name: str = "regex") -> GrammarSpec:
        return cls("regex", pattern, field_name)._bounded()

    def _bounded(self) -> GrammarSpec:
        size = len(self.source.encode())
        if size > MAX_GRAMMAR_BYTES:
            raise GrammarError(self.field, f"is {size} bytes; this server compiles at most {MAX_GRAMMAR_BYTES}")
        return self

    def grammar_text(self) -> str:
        """The llguidance grammar of this spec. JSON is compact (no whitespace between tokens, as vLLM's
        default): a model with random or weak weights cannot pad it with spaces until the length limit."""
        from llguidance import LLMatcher

        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        schema = self.source or '{"type":"object"}'
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        except ValueError as err:
            raise GrammarError(self.field, f"the schema cannot be compiled: {err}") from None


class TokenMatcher:
    """One sequence's place in its grammar (llguidance's ``LLMatcher``)."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self._vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens the grammar allows next (end-of-sequence only where the output is complete)."""
        bias = self._matcher.compute_logit_bias()  # one byte per token: 0 refused, 200 allowed
        allowed = torch.frombuffer(bytearray(bias), dtype=torch.uint8)[: self._vocab_size] > 0
        if allowed.numel() < self._vocab_size:  # ids past the tokenizer's own (padding rows of the embedding)
            allowed = torch.cat([allowed, allowed.new_zeros(self._vocab_size - allowed.numel())])
        return allowed

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [V] with every token the grammar refuses at -inf."""
        return scores.float().masked_fill(~self.allowed(), float("-inf"))

    def accept(self, token: int) -> None:
        """Feed the chosen token; one the mask did not allow is a bug, not a request error."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar can take no further token: the output is complete."""
        return self._matcher.is_stopped()


@dataclass(frozen=True)
class CompiledGrammar:
    """A spec compiled for this model; ``matcher()`` starts a sequence at its beginning."""

    spec: GrammarSpec
    _start: Any  # LLMatcher in its start state, never advanced
    _vocab_size: int

    def matcher(self) -> TokenMatcher:
        return TokenMatcher(self._start.deep_copy(), self._vocab_size)


class Grammars:
    """Compiles grammar specs for one model's tokenizer, and keeps the latest ``CACHE_SIZE``.

    ``tokenizer``: the model's Hugging Face tokenizer (None: structured output is refused);
    ``vocab_size``: the width of its logits; ``eos_ids``: the tokens that end a sequence."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Collection[int] = ()):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_ids = sorted(eos_ids)
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._ll_tokenizer = None
        self.compiled = 0  # specs compiled (cache misses), for tests and metrics

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        key = GrammarSpec(spec.kind, spec.source)  # the field it came from is not part of what it is
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            self.compiled += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        from llguidance import LLMatcher

        tokenizer = self._llg_tokenizer(spec.field)
        text = spec.grammar_text()
        error = LLMatcher.validate_grammar(text, tokenizer)
        if error:
            what = "schema" if spec.kind != "regex" else "regular expression"
            raise GrammarError(spec.field, f"the {what} cannot be compiled: {error}")
        matcher = LLMatcher(tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(spec.field, f"the grammar cannot be compiled: {matcher.get_error()}")
        return CompiledGrammar(spec, matcher, self._vocab_size)

    def _llg_tokenizer(self, field_name: str):
        """llguidance's view of the tokenizer, built on first use (~ms for a small vocabulary, ~1 s for 150k)."""
        with self._lock:
            if self._ll_tokenizer is not None:
                return self._ll_tokenizer
        if self._tokenizer is None:
            raise GrammarError(field_name, "structured output needs the model's tokenizer, and this model has none")
        import llguidance.hf

        try:
            built = llguidance.hf.from_tokenizer(
                self._tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_ids or None
            )
        except ValueError as err:  # a slow (Python) tokenizer: llguidance reads the Rust one
            raise GrammarError(field_name, f"structured output needs a fast tokenizer: {err}") from None
        with self._lock:
            self._ll_tokenizer = built
        return built
