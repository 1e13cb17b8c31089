"""Write the tiny Llama 3 tokenizer under assets/tokenizer/llama3/.

A byte-level BPE (vocab 400: the 256 byte symbols plus 144 merges) trained with `tokenizers`
on the SFT corpus (assets/data/sft, so run tools/make_datasets.py first) rendered as the chat
template lays it out ("user\n\n{text}"), with Llama 3's own pre-tokenizer (its split regex,
then byte-level without a regex), followed by Llama 3's special tokens: 400 <|begin_of_text|>, 401 <|end_of_text|>,
402 <|start_header_id|>, 403 <|end_header_id|>, 404 <|eot_id|>, then <|eom_id|>,
<|python_tag|>, <|finetune_right_pad_id|> and reserved specials (all ids < 512, the model's
vocab). There is no BOS post-processor: the chat template inserts bos itself, as
LLaMA-Factory's llama3 template does. tokenizer_config.json follows the base Meta-Llama-3.1
checkpoints (bos <|begin_of_text|>, eos <|end_of_text|>, no pad token, the Llama 3 chat template), the
case LLaMA-Factory's `replace_eos` exists for: the template makes <|eot_id|> the eos and the pad.
Two runs give byte-identical files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = ["VOCAB_SIZE", "SPECIAL_TOKENS", "corpus", "build_tokenizer", "tokenizer_config", "main"]

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "assets" / "data" / "sft"
OUT_DIR = ROOT / "assets" / "tokenizer" / "llama3"
VOCAB_SIZE = 400
SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(8)),
)
# Meta-Llama-3's pre-tokenizer split pattern (tokenizer.json): newline runs are one piece, so
# the "\n\n" after every header can become a single token, as in the real vocab.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Meta-Llama-3-8B-Instruct's chat template (bos, then header-wrapped, trimmed turns).
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def corpus(data_dir: Path = DATA_DIR) -> list[str]:
    """Every turn of the SFT splits in file order, as "{role}\n\n{text}" (the template minus specials)."""
    lines = []
    for split in ("train", "eval"):
        for row in json.loads((data_dir / f"{split}.json").read_text()):
            turns = [*(row.get("history") or []),
                     [row["instruction"] + ("\n" + row["input"] if row["input"] else ""), row["output"]]]
            for user, assistant in turns:
                lines += [f"user\n\n{user}", f"assistant\n\n{assistant}"]
    return lines


def build_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:  # specials must land on ids 400.. exactly
        raise ValueError(f"BPE vocab is {tok.get_vocab_size()}, expected {VOCAB_SIZE}: corpus too small")
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == VOCAB_SIZE + i, token
    return tok


def tokenizer_config() -> dict:
    added = {str(VOCAB_SIZE + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": True}
             for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "added_tokens_decoder": added,
        "bos_token": "<|begin_of_text|>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": True,
        "eos_token": "<|end_of_text|>",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 256,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def main(argv: list[str] | None = None) -> None:
    del argv
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(corpus())
    tok.save(str(OUT_DIR / "tokenizer.json"))
    (OUT_DIR / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, sort_keys=True) + "\n")
    print(f"wrote {OUT_DIR.relative_to(ROOT)} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    main(sys.argv[1:])
