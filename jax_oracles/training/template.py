"""LLaMA-Factory's chat template for Llama 3 (`data/template.py`, template "llama3"), plain Python.

The JAX side keeps its own copy of torch_sources/training/template.py (an oracle stands alone).

A template turns messages into token ids, one list per message:
  message 0 gets the prefix (bos) and, if any, the system turn;
  user:      <|start_header_id|>user<|end_header_id|>\\n\\n{content}<|eot_id|>
             <|start_header_id|>assistant<|end_header_id|>\\n\\n
  assistant: {content}<|eot_id|>
Each slot string is tokenized whole with no special tokens added (the tokenizer still
matches the special tokens inside the text). `replace_eos` makes the first stop word,
<|eot_id|>, the tokenizer's eos; it closes every assistant slot, so it is labelled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from tokenizers import Tokenizer

__all__ = ["ChatTokenizer", "load_tokenizer", "Llama3Template", "TEMPLATES", "get_template", "alpaca_to_messages"]


@dataclass(frozen=True)
class ChatTokenizer:
    """The few tokenizer calls LLaMA-Factory's data pipeline makes, over a `tokenizers` backend."""

    backend: Tokenizer
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None = None

    def encode(self, text: str) -> list[int]:  # = HF tokenizer.encode(text, add_special_tokens=False)
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.pad_token)


def _token_name(value) -> str | None:
    return value["content"] if isinstance(value, dict) else value  # HF writes AddedToken dicts too


def load_tokenizer(tokenizer_dir) -> ChatTokenizer:
    """tokenizer.json + the bos/eos/pad names of tokenizer_config.json."""
    d = Path(tokenizer_dir)
    config = json.loads((d / "tokenizer_config.json").read_text())
    return ChatTokenizer(Tokenizer.from_file(str(d / "tokenizer.json")), _token_name(config.get("bos_token")),
                         _token_name(config.get("eos_token")), _token_name(config.get("pad_token")))


@dataclass(frozen=True)
class Llama3Template:
    """register_template(name="llama3", ...) in LLaMA-Factory; one turn = (user, assistant)."""

    format_user: str = ("<|start_header_id|>user<|end_header_id|>\n\n{{content}}<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    format_assistant: str = "{{content}}<|eot_id|>"
    format_system: str = "<|start_header_id|>system<|end_header_id|>\n\n{{content}}<|eot_id|>"
    default_system: str = ""
    stop_words: tuple[str, ...] = ("<|eot_id|>", "<|eom_id|>")
    replace_eos: bool = True

    def fix_special_tokens(self, tokenizer: ChatTokenizer) -> ChatTokenizer:
        """Template.fix_special_tokens: eos := first stop word (replace_eos), pad := eos if unset."""
        if self.replace_eos:
            tokenizer = replace(tokenizer, eos_token=self.stop_words[0])
        if tokenizer.pad_token_id is None:
            tokenizer = replace(tokenizer, pad_token=tokenizer.eos_token)
        return tokenizer

    def _encode(self, tokenizer: ChatTokenizer, messages: list[dict], system: str | None) -> list[list[int]]:
        system = system or self.default_system
        encoded = []
        for i, message in enumerate(messages):
            ids = []
            if i == 0:  # format_prefix = {bos_token}, then the system turn
                if tokenizer.bos_token_id is not None:
                    ids.append(tokenizer.bos_token_id)
                if system:
                    ids += tokenizer.encode(self.format_system.replace("{{content}}", system))
            if message["role"] == "user":
                slot = self.format_user
            elif message["role"] == "assistant":
                slot = self.format_assistant
            else:
                raise NotImplementedError(f"Unexpected role: {message['role']}")
            ids += tokenizer.encode(slot.replace("{{content}}", message["content"]))
            encoded.append(ids)
        return encoded

    def encode_oneturn(self, tokenizer: ChatTokenizer, messages: list[dict],
                       system: str | None = None) -> tuple[list[int], list[int]]:
        """(all messages but the last, concatenated; the last message)."""
        encoded = self._encode(tokenizer, messages, system)
        return [t for ids in encoded[:-1] for t in ids], encoded[-1]

    def encode_multiturn(self, tokenizer: ChatTokenizer, messages: list[dict],
                         system: str | None = None) -> list[tuple[list[int], list[int]]]:
        """[(user_i ids, assistant_i ids)] for each consecutive (user, assistant) pair."""
        encoded = self._encode(tokenizer, messages, system)
        return [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]


TEMPLATES = {"llama3": Llama3Template()}


def get_template(name: str) -> Llama3Template:
    if name not in TEMPLATES:
        raise ValueError(f"Template {name} does not exist.")
    return TEMPLATES[name]


def alpaca_to_messages(example: dict) -> list[dict]:
    """LLaMA-Factory's AlpacaDatasetConverter: history turns, then instruction + "\\n" + input
    (input only when non-empty), then the output as the single response."""
    messages = []
    for old_prompt, old_response in example.get("history") or []:
        messages += [{"role": "user", "content": old_prompt}, {"role": "assistant", "content": old_response}]
    query = [text for text in (example.get("instruction"), example.get("input")) if text]
    messages.append({"role": "user", "content": "\n".join(query)})
    messages.append({"role": "assistant", "content": example["output"]})
    return messages
