"""Tokenizers and chat templates, without transformers.

Two tokenizer formats are read: `tokenizer.json` (HF `tokenizers`) and `tiktoken.model`
(Kimi-style BPE ranks, special tokens from tokenizer_config.json's added_tokens_decoder).
Chat templates come from an override file, `chat_template.jinja` or tokenizer_config.json and
render in jinja2's sandbox with the same environment transformers uses, so the rendered text and
ids match `apply_chat_template`. Rendered chats are encoded without adding special tokens (the
template owns BOS), which is what keeps BOS from being doubled.
"""

from __future__ import annotations

import base64
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils

from dflash_batch.job import JobError

# Kimi's pre-tokeniser pattern (its tokenization_kimi.py): Han runs, cased words with English
# contractions, numbers in threes, punctuation runs, whitespace.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def _token_text(tok: Any) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as e:
        raise JobError(f"{path}: not valid JSON: {e}") from None


def byte_of_char() -> dict[str, int]:
    """Inverse of the byte-level alphabet: printable bytes stand for themselves, the others
    for code points from 256 up (GPT-2's mapping)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


class Tokenizer:
    """encode/decode plus the chat template and special tokens of one tokenizer directory."""

    def __init__(self, directory: str | Path, chat_template_path: str | None = None):
        d = Path(directory)
        self.config = _read_json(d / "tokenizer_config.json")
        if (d / "tokenizer.json").is_file():
            self._backend = _HFBackend(d / "tokenizer.json")
        elif (d / "tiktoken.model").is_file():
            self._backend = _TiktokenBackend(d / "tiktoken.model", self.config)
        else:
            raise JobError(f"{d}: no tokenizer.json or tiktoken.model found")
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_id = self._backend.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self._backend.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template = _find_template(d, self.config, chat_template_path)
        self._chat_globals: dict[str, Any] | None = None

    # -- tokens --------------------------------------------------------------------------------
    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        ids = self._backend.encode_batch(texts, add_special_tokens)
        if add_special_tokens and self.bos_id is not None:
            # A raw prompt that already starts with the BOS text would get a second BOS.
            ids = [x[1:] if len(x) > 1 and x[0] == x[1] == self.bos_id else x for x in ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids)

    def decode_special(self, ids: list[int]) -> str:
        """The text of `ids` with their special tokens written out (a tool call's markers)."""
        return self._backend.decode_special(ids)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (b"" for a special token): a token that holds part of
        a UTF-8 character has them though its decoded text cannot (OpenAI logprobs' `bytes`)."""
        return self._backend.token_bytes(token)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Ids this tokenizer can produce (special tokens included)."""
        return self._backend.vocab_size

    def token_table(self) -> list[str | bytes]:
        """Each id's token as the vocabulary spells it (tokenizer.json's strings, tiktoken's
        bytes), special tokens as "": what a grammar engine reads (grammar.py)."""
        return self._backend.token_table()

    @property
    def hf_tokenizer(self):
        """The `tokenizers.Tokenizer` behind a tokenizer.json, else None."""
        return getattr(self._backend, "tok", None)

    # -- chat ----------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], template_kwargs: dict[str, Any]) -> str:
        if self.chat_template is None:
            raise JobError("the tokenizer has no chat template; set model.chat_template or use "
                           "input.prompt_column")
        template = _compile(self.chat_template)
        if self._chat_globals is None:
            # tools/documents are None unless given, as in transformers: templates test `tools is
            # defined` and must see what they see there. Merged once: the template's globals
            # are a ChainMap, slow to copy on every render.
            self._chat_globals = {**template.globals, "tools": None, "documents": None,
                                  "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        context = {**self._chat_globals, **template_kwargs, "messages": messages,
                   "add_generation_prompt": True}
        # A shared context skips jinja's per-render copy of the globals: 2.5x faster renders.
        return jinja2.utils.concat(template.root_render_func(template.new_context(context, shared=True)))


class _HFBackend:
    def __init__(self, path: Path):
        import tokenizers

        self.tok = tokenizers.Tokenizer.from_file(str(path))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self._byte_level: bool | None = None  # token_bytes: known at its first call

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def decode_special(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def token_table(self) -> list[str | bytes]:
        special = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}
        table: list[str | bytes] = [""] * self.vocab_size
        for token, i in self.tok.get_vocab(with_added_tokens=True).items():
            table[i] = "" if token in special else token
        return table

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def token_bytes(self, token: int) -> bytes:
        spelled = self.tok.id_to_token(token)
        if spelled is None or not self.decode([token]):  # unassigned, or special
            return b""
        if self._byte_level is None:  # how the vocabulary spells bytes: GPT-2's alphabet or <0xNN> pieces
            self._byte_level = "ByteLevel" in json.dumps(json.loads(self.tok.to_str()).get("decoder"))
            self._byte_of = byte_of_char()
        if self._byte_level:
            return bytes(self._byte_of[c] for c in spelled)
        if len(spelled) == 6 and spelled.startswith("<0x") and spelled.endswith(">"):
            return bytes([int(spelled[3:5], 16)])
        return spelled.replace("\u2581", " ").encode()


class _TiktokenBackend:
    def __init__(self, path: Path, config: dict):
        import tiktoken

        ranks = {}
        for line in path.read_bytes().splitlines():
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
        special = {v["content"]: int(k) for k, v in config.get("added_tokens_decoder", {}).items()
                   if int(k) >= len(ranks)}
        self.enc = tiktoken.Encoding(name=path.parent.name, pat_str=KIMI_PATTERN,
                                     mergeable_ranks=ranks, special_tokens=special)
        self.special_ids = set(special.values())
        self.vocab_size = self.enc.n_vocab
        self.bos = _token_text(config.get("bos_token"))
        self.add_bos = bool(config.get("add_bos_token", False))

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        # One text at a time: tiktoken's encode_batch hands each text to a thread pool, which
        # costs more than encoding a prompt-sized text (2.5x slower here).
        specials = self.enc.special_tokens_set
        ids = [self.enc.encode(t, allowed_special=specials, disallowed_special=()) for t in texts]
        if add_special_tokens and self.add_bos and self.bos:
            bos = self.enc.encode_single_token(self.bos)
            ids = [[bos, *x] for x in ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode([i for i in ids if i not in self.special_ids])

    def decode_special(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    def token_table(self) -> list[str | bytes]:
        return [self.token_bytes(i) for i in range(self.vocab_size)]

    def token_bytes(self, token: int) -> bytes:
        try:
            return b"" if token in self.special_ids else self.enc.decode_single_token_bytes(token)
        except KeyError:  # an id the encoding leaves unassigned
            return b""

    def token_to_id(self, token: str) -> int | None:
        try:
            return self.enc.encode_single_token(token)
        except KeyError:
            return None


def _find_template(d: Path, config: dict, override: str | None) -> str | None:
    if override:
        p = Path(override)
        if not p.is_file():
            raise JobError(f"model.chat_template: {override} does not exist")
        return p.read_text()
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    t = config.get("chat_template")
    if isinstance(t, list):  # named templates: [{name, template}, ...]
        t = {x.get("name"): x.get("template") for x in t}.get("default")
    return t


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    # The same sandboxed environment transformers builds for apply_chat_template.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def stop_token_ids(model_dir: str | Path, tokenizer: Tokenizer) -> list[int]:
    """The model's end-of-sequence ids: generation_config.json, else config.json, else the
    tokenizer's eos token."""
    d = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        cfg = _read_json(d / name)
        cfg = cfg.get("text_config", cfg) if "eos_token_id" not in cfg else cfg
        eos = cfg.get("eos_token_id")
        if eos is not None:
            return sorted(set(eos if isinstance(eos, list) else [eos]))
    return [tokenizer.eos_id] if tokenizer.eos_id is not None else []
