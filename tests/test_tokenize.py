"""Tokenisation and chat templates against transformers' apply_chat_template."""

from __future__ import annotations

import base64
import json

import pytest
from transformers import AutoTokenizer

from dflash_batch.tokenizer import KIMI_PATTERN, Tokenizer, stop_token_ids
from dflash_batch.testing.tokenizer import CHAT_TEMPLATE, make_tiktoken_dir

# A template in the style of real ones: system handling, tojson, loop controls, raise_exception,
# a kwarg switch, and no BOS of its own.
RICH_TEMPLATE = """
{%- if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}{% set rest = messages[1:] %}
{%- else %}{% set sys = 'You are helpful.' %}{% set rest = messages %}{% endif %}
<|im_start|>system
{{ sys }}{% if tools is defined %} tools={{ tools | tojson }}{% endif %}<|im_end|>
{% for m in rest %}
{%- if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
{%- if m['content'] == 'SKIP' %}{% continue %}{% endif %}
<|im_start|>{{ m['role'] }}
{{ m['content'] | trim }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if reasoning_effort is defined %}<effort>{{ reasoning_effort }}</effort>{% endif %}{% endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 plus 30?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": " Hello world!  "},
     {"role": "assistant", "content": "Bonjour."}, {"role": "user", "content": "SKIP"},
     {"role": "user", "content": "東京 café 🙂"}],
]


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, RICH_TEMPLATE], ids=["bos-template", "rich-template"])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False, "reasoning_effort": "high",
                                         "tools": [{"name": "calc", "args": ["a", "b"]}]}])
def test_chat_template_matches_transformers(tmp_path, tokenizer_dir, template, kwargs):
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    for f in tokenizer_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, theirs = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for conv in CONVERSATIONS:
        text = ours.render_chat(conv, kwargs)
        assert text == theirs.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, **kwargs)
        ids = ours.encode_batch([text], add_special_tokens=False)[0]
        expected = theirs.apply_chat_template(conv, tokenize=True, add_generation_prompt=True,
                                              return_dict=False, **kwargs)
        assert ids == list(expected)
        assert ids.count(ours.bos_id) == text.count("<|bos|>") <= 1  # never a doubled BOS


def test_chat_template_file_override_and_raise(tmp_path, tokenizer_dir):
    (tmp_path / "t.jinja").write_text("{{ raise_exception('no chat here') }}")
    tok = Tokenizer(tokenizer_dir, str(tmp_path / "t.jinja"))
    with pytest.raises(Exception, match="no chat here"):
        tok.render_chat([{"role": "user", "content": "x"}], {})


def test_raw_prompts_get_one_bos(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    theirs = AutoTokenizer.from_pretrained(tokenizer_dir)
    plain, with_bos = tok.encode_batch(["hello world", "<|bos|>hello world"], add_special_tokens=True)
    assert plain == theirs("hello world")["input_ids"] and plain[0] == tok.bos_id
    assert with_bos == plain  # transformers would give two BOS here
    assert tok.decode(plain) == "hello world"


def test_stop_ids_come_from_generation_config(model_dir):
    tok = Tokenizer(model_dir)
    assert stop_token_ids(model_dir, tok) == [tok.token_to_id("<|im_end|>")]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 3]}))
    assert stop_token_ids(model_dir, tok) == [3, 7]


def _write_tiktoken(d, merges: list[bytes]) -> None:
    ranks = [bytes([i]) for i in range(256)] + merges
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    n = len(ranks)
    specials = {str(n): "[BOS]", str(n + 1): "[EOS]", str(n + 2): "<|im_end|>", str(n + 3): "<|im_user|>"}
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "[BOS]", "eos_token": "[EOS]", "add_bos_token": True,
        "added_tokens_decoder": {k: {"content": v, "special": True} for k, v in specials.items()},
        "chat_template": "{% for m in messages %}<|im_user|>{{ m['content'] }}<|im_end|>{% endfor %}"}))


def test_tiktoken_kimi_style_tokenizer(tmp_path):
    _write_tiktoken(tmp_path, [b"th", b"the", b" the", b"ll", b"llo", b"he", b"hello"])
    tok = Tokenizer(tmp_path)
    assert tok.bos_id == 263 and tok.eos_id == 264
    text = "hello the world, 東京 12345 don't"
    (ids,) = tok.encode_batch([text], add_special_tokens=True)
    assert ids[0] == tok.bos_id and tok.decode(ids) == text
    assert tok.token_to_id("hello") == 262 and 262 in ids
    chat = tok.render_chat([{"role": "user", "content": "hello"}], {})
    (cids,) = tok.encode_batch([chat], add_special_tokens=False)
    assert cids == [266, 262, 265]  # specials inside the rendered text become their ids


def test_tiktoken_batches_match_tiktokens_own_batch_encoder(tmp_path):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    d = make_tiktoken_dir(tmp_path / "kimi", vocab_size=600)
    tok = Tokenizer(d)
    texts = ["<|bos|><|im_start|>user\nhello<|im_end|>", "The quick brown fox. 東京 12345 don't",
             "  spaces\n\n\tand tabs  ", "🙂" * 5, "", "Alice has 3 apples" * 40]
    specials = {v["content"]: int(k) for k, v in
                json.loads((d / "tokenizer_config.json").read_text())["added_tokens_decoder"].items()}
    enc = tiktoken.Encoding("kimi", pat_str=KIMI_PATTERN, special_tokens=specials,
                            mergeable_ranks=load_tiktoken_bpe(str(d / "tiktoken.model")))
    assert tok.encode_batch(texts, add_special_tokens=False) == enc.encode_batch(texts, allowed_special="all")
    assert [tok.decode(x) for x in tok.encode_batch(texts, add_special_tokens=False)][1:] == texts[1:]
