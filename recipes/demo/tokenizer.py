"""A small byte-level BPE for the demo pair, trained on the recipe's own data, in HF layout.

Special tokens: <|bos|> starts every sample; <|im_end|> ends an assistant turn and is the eos
the target learns to emit (the job stops on it); <|eos|> ends plain-text samples; <|mask|> is
the drafter's filler token: it never occurs in the data, so the target never predicts it and its
(frozen, randomly initialised) embedding row stays distinct from every real token's.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from recipes.demo import data

SPECIAL = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|mask|>"]
BOS, PLAIN_EOS, EOS, PAD, MASK = "<|bos|>", "<|eos|>", "<|im_end|>", "<|pad|>", "<|mask|>"

# ChatML-style; the same shape as dflash_batch/testing/tokenizer.py. The template owns BOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(seed: int, count: int, code_rate: float) -> list[str]:
    """Training text for the merges: questions, answers and chat role names (the specials are
    atomic, so how the chats are rendered does not change the merges)."""
    def render(messages):
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return turns + "<|im_start|>assistant\n"

    text = [s.prompt + s.response for s in data.samples(seed, count, render, code_rate=code_rate)]
    # Snippets of code even when the data has none, so a code prompt still tokenizes compactly.
    return text + data.stdlib_snippets(random.Random(seed), max(count // 20, 10))


def train_tokenizer(directory: str | Path, vocab_size: int = 1024, seed: int = 0, count: int = 20000,
                    code_rate: float = 0.0) -> Path:
    """Train, then save tokenizer.json + tokenizer_config.json into directory."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(seed, count, code_rate), trainer)
    # A raw (non-chat) prompt encoded with special tokens gets BOS, as the chats have it.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "mask_token": MASK,
        "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096}, indent=2))
    return d


def vocab_size(directory: str | Path) -> int:
    return Tokenizer.from_file(str(Path(directory) / "tokenizer.json")).get_vocab_size()


def special_ids(directory: str | Path) -> dict[str, int]:
    tok = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    return {name: tok.token_to_id(name) for name in SPECIAL}
