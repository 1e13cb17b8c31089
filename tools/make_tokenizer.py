"""Write the tiny tokenizers under assets/tokenizer/<family>/ (`python tools/make_tokenizer.py [family ...]`,
default all: llama3 bloom falcon mistral qwen2 qwen3 phi4 starcoder2).

Every family shares one byte-level BPE (vocab 400: the 256 byte symbols plus 144 merges) trained with `tokenizers`
on the SFT corpus (assets/data/sft, so run tools/make_datasets.py first) rendered as the chat
template lays it out ("user\n\n{text}"), with Llama 3's own pre-tokenizer (its split regex,
then byte-level without a regex): ids 0..399 are the same in every family, so one reward model
scores any of them, and a template's plain-text markers ("[INST]", "Human:", "User:") are whatever
the BPE makes of them, as in the real Mistral v0.1/v0.2 tokenizers. Each family's special tokens
follow at ids 400.. (all < 512, the models' vocab); Llama 3's: 400 <|begin_of_text|>,
401 <|end_of_text|>, 402 <|start_header_id|>, 403 <|end_header_id|>, 404 <|eot_id|>, then <|eom_id|>,
<|python_tag|>, <|finetune_right_pad_id|> and reserved specials. There is no BOS post-processor:
a template that wants bos inserts it itself (LLaMA-Factory's `format_prefix`).

tokenizer_config.json names bos/eos/pad as the family's reference release does (FAMILIES: Llama 3's here,
every other family's `TOKENIZER` row in its tools/checkpoints_<family>.py): e.g. the
base Meta-Llama-3.1 checkpoints (bos <|begin_of_text|>, eos <|end_of_text|>, no pad token, the
Llama 3 chat template), the case LLaMA-Factory's `replace_eos` exists for: the template makes
<|eot_id|> the eos and the pad. Two runs give byte-identical files.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import NamedTuple

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = ["VOCAB_SIZE", "SPECIAL_TOKENS", "Family", "FAMILIES", "corpus", "build_bpe", "build_tokenizer",
           "tokenizer_config", "main"]

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "assets" / "data" / "sft"
OUT_ROOT = ROOT / "assets" / "tokenizer"
OUT_DIR = OUT_ROOT / "llama3"
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


class Family(NamedTuple):  # not a dataclass: tests load this file without registering it in sys.modules
    """A family's special tokens (ids 400.. in this order) and the bos/eos/pad/unk its tokenizer_config names."""

    specials: tuple[str, ...]
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None
    # a vision-language family's processor files beside its tokenizer (file name -> JSON), as a release's model dir
    # holds them: the training data path reads its image processor there (LLaMA-Factory loads both from one dir)
    processor: dict | None = None


def _family_rows() -> dict[str, Family]:
    """Every other family's row, `TOKENIZER` in its tools/checkpoints_<family>.py (or, for a vision-language family
    whose tasks are not registered yet, its tools/vl_checkpoints_<family>.py), read statically (literal only):
    a new family registers there."""
    rows = {}
    tools = Path(__file__).parent
    for path in sorted([*tools.glob("checkpoints_*.py"), *tools.glob("vl_checkpoints_*.py")]):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TOKENIZER" for t in node.targets):
                rows[path.stem.split("checkpoints_", 1)[1]] = Family(**ast.literal_eval(node.value))
    return rows


FAMILIES = {
    "llama3": Family(SPECIAL_TOKENS, "<|begin_of_text|>", "<|end_of_text|>", chat_template=CHAT_TEMPLATE),
    **_family_rows(),
}


def build_bpe(texts: list[str]) -> Tokenizer:
    """The shared byte-level BPE, ids 0..VOCAB_SIZE-1, no special tokens."""
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
    return tok


def build_tokenizer(texts: list[str], family: str = "llama3", bpe: Tokenizer | None = None) -> Tokenizer:
    """The shared BPE (trained on texts unless given) plus the family's special tokens at ids 400.."""
    tok = Tokenizer.from_str((bpe or build_bpe(texts)).to_str())  # a copy: the shared BPE stays special-free
    specials = FAMILIES[family].specials
    tok.add_special_tokens(list(specials))
    for i, token in enumerate(specials):
        assert tok.token_to_id(token) == VOCAB_SIZE + i, token
    return tok


def tokenizer_config(family: str = "llama3") -> dict:
    fam = FAMILIES[family]
    added = {str(VOCAB_SIZE + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": True}
             for i, t in enumerate(fam.specials)}
    config = {
        "added_tokens_decoder": added,
        "bos_token": fam.bos_token,  # null where the release has none (Qwen)
        "clean_up_tokenization_spaces": True,
        "eos_token": fam.eos_token,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 256,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    # keys a release leaves out stay out (LLaMA-Factory's pad := eos needs pad unset)
    for key in ("pad_token", "unk_token", "chat_template"):
        if getattr(fam, key) is not None:
            config[key] = getattr(fam, key)
    return config


def main(argv: list[str] | None = None) -> None:
    names = list(argv or FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {list(FAMILIES)}")
    bpe = build_bpe(corpus())
    for name in names:
        out = OUT_ROOT / name
        out.mkdir(parents=True, exist_ok=True)
        tok = build_tokenizer([], name, bpe)
        tok.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(name), indent=2, sort_keys=True) + "\n")
        for file, content in (FAMILIES[name].processor or {}).items():
            (out / file).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
        print(f"wrote {out.relative_to(ROOT)} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    main(sys.argv[1:])
