"""Structured output: a sample's tokens held to a JSON schema, a regex or a list of choices.

xgrammar compiles the grammar once per distinct spec against the tokenizer's vocabulary; each
sample gets its own matcher, which the engine asks for the tokens allowed next (a bitmask per
verify row, after the drafts before it), feeds the tokens it keeps, and rolls back over drafts.
xgrammar is an optional dependency (`pip install 'dflash-batch[structured]'`): a job that asks
for structured output without it is refused before any work.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from dflash_batch.job import GRAMMAR_FIELDS, Job, JobError, SamplingSpec
from dflash_batch.tokenizer import Tokenizer


def wants_grammar(s: SamplingSpec) -> bool:
    return any(getattr(s, f) is not None for f in GRAMMAR_FIELDS)


def asks_for_grammar(job: Job) -> bool:
    """The job, or any row through sampling_columns, may ask for structured output. A request
    body (input.format openai_batch) may too: without xgrammar such a row is an error row, not
    the whole job."""
    if wants_grammar(job.sampling) or any(f in job.input.sampling_columns for f in GRAMMAR_FIELDS):
        return True
    if job.input.format != "openai_batch":
        return False
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


class Grammars:
    """Compiled grammars (cached by spec) and matcher factories for one tokenizer and model."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: list[int]):
        try:
            import xgrammar
        except ImportError:
            raise JobError("structured output (sampling.json_schema / regex / choice) needs xgrammar: "
                           "pip install 'dflash-batch[structured]'") from None
        self.xgr = xgrammar
        table = tokenizer.token_table()
        table += [""] * (vocab_size - len(table))  # ids past the tokenizer: never allowed
        vocab_type, prefix_space = xgrammar.VocabType.RAW, False
        if tokenizer.hf_tokenizer is not None:  # how tokenizer.json spells bytes and spaces
            from transformers import PreTrainedTokenizerFast

            seen = xgrammar.TokenizerInfo.from_huggingface(
                PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf_tokenizer), vocab_size=vocab_size,
                stop_token_ids=stop_ids or None)
            vocab_type, prefix_space = seen.vocab_type, seen.add_prefix_space
        # Our own table: special tokens as "" so that no grammar can spell them as text.
        info = xgrammar.TokenizerInfo(table, vocab_type, vocab_size=vocab_size, stop_token_ids=stop_ids or None,
                                      add_prefix_space=prefix_space)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self.compiled: dict[str, Any] = {}

    def compile(self, s: SamplingSpec) -> Any | None:
        """The compiled grammar of a sampling spec (None: unconstrained); raises ValueError with
        xgrammar's reason for a schema or regex it cannot compile."""
        kind = next((f for f in GRAMMAR_FIELDS if getattr(s, f) is not None), None)
        if kind is None:
            return None
        spec = getattr(s, kind)
        key = f"{kind}:{json.dumps(spec, sort_keys=True)}"
        if key not in self.compiled:
            try:
                if kind == "json_schema":  # compact JSON: whitespace cannot run on forever
                    text = spec if isinstance(spec, str) else json.dumps(spec)
                    grammar = self.compiler.compile_json_schema(text, any_whitespace=False)
                elif kind == "regex":
                    grammar = self.compiler.compile_regex(spec)
                else:  # each choice a string literal of an EBNF alternation (JSON escapes are EBNF's)
                    rule = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec)
                    grammar = self.compiler.compile_grammar(f"root ::= {rule}")
            except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError variants
                raise ValueError(f"sampling.{kind}: {e}".strip()[:2000]) from None
            self.compiled[key] = grammar
        return self.compiled[key]

    def matcher(self, compiled: Any, stop_ids: tuple[int, ...]) -> Callable[[], Any]:
        """A factory of fresh matchers; a finished grammar allows only the sample's stop ids."""
        return lambda: self.xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_ids))
