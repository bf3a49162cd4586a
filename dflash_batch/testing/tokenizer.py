"""A small byte-level BPE tokenizer trained on the fly, saved in HF layout with a chat template."""

from __future__ import annotations

import base64
import json
import shutil
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from dflash_batch.tokenizer import byte_of_char

SPECIAL = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 plus 30? The answer is 42.",
    "Alice has 3 apples and buys 5 more, so she has 8 apples.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens and the target verifies them.",
    "Hello world! Résumé, naïve café, 東京, emoji 🙂.",
] * 20


def stdlib_corpus(max_chars: int = 5_000_000) -> list[str]:
    """Python standard-library source: a corpus every machine has (for realistic vocab sizes)."""
    texts, total = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        texts.append(f.read_text(errors="ignore"))
        total += len(texts[-1])
        if total > max_chars:
            break
    return texts


def make_tokenizer_dir(d: Path, vocab_size: int = 400, corpus: list[str] | None = None,
                       extra_special: tuple[str, ...] = ()) -> Path:
    """`extra_special`: more special tokens (say a thinking model's <think> and </think>)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL + list(extra_special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS if corpus is None else corpus, trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", bos)])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
        "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072}))
    return d


def make_tiktoken_dir(d: Path, vocab_size: int = 400, corpus: list[str] | None = None) -> Path:
    """The same trained BPE in Kimi's layout: tiktoken.model (base64 token, rank) plus
    tokenizer_config.json with the specials in added_tokens_decoder."""
    hf = make_tokenizer_dir(d / "hf", vocab_size, corpus)
    spec = json.loads((hf / "tokenizer.json").read_text())
    config = json.loads((hf / "tokenizer_config.json").read_text())
    shutil.rmtree(hf)
    byte_of = byte_of_char()
    specials = [t["content"] for t in spec["added_tokens"]]
    merged = sorted((i, t) for t, i in spec["model"]["vocab"].items() if t not in specials and len(t) > 1)
    ranks = [bytes([b]) for b in range(256)] + [bytes(byte_of[ch] for ch in t) for _, t in merged]
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    config["added_tokens_decoder"] = {str(len(ranks) + i): {"content": t, "special": True}
                                      for i, t in enumerate(specials)}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d
