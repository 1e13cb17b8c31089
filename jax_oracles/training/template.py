"""LLaMA-Factory's chat templates (`data/template.py`, `register_template`), plain Python.

The JAX side keeps its own copy of torch_sources/training/template.py (an oracle stands alone).

A template turns messages into token ids, one list per message:
  message 0 gets format_prefix (e.g. bos) and, if any, the system turn (format_system);
  a user message gets format_user, an assistant message format_assistant.
A slot is a tuple of elements: text, each tokenized on its own with no special tokens added (the
tokenizer still matches the special tokens inside the text), or BOS_TOKEN / EOS_TOKEN, the
tokenizer's bos / eos id (nothing when it has none). E.g. llama3:
  user:      <|start_header_id|>user<|end_header_id|>\\n\\n{content}<|eot_id|>
             <|start_header_id|>assistant<|end_header_id|>\\n\\n
  assistant: {content}<|eot_id|>
`replace_eos` makes the first stop word (<|eot_id|>, <|im_end|>) the tokenizer's eos; it closes
every assistant slot, so it is labelled. `efficient_eos` (falcon) leaves the eos out of the
assistant slot; the processors append it. Llama2Template (mistral) merges the system text into
the first user message; ReasoningTemplate (qwen3) adds an empty thought to a response that has none.
The Qwen-VL templates carry an `mm_plugin` (training/mm_plugin.py): the processors expand each `<image>`
to its image tokens before encoding; every text template has none.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from tokenizers import Tokenizer

from jax_oracles.models.audio_processing import WhisperFeatureConfig
from jax_oracles.models.vision_processing import QwenImageProcessorConfig

from .mm_plugin import Gemma3Plugin, InternVLPlugin, LlavaNextPlugin, MMPlugin, PaliGemmaPlugin, TowerPlugin

__all__ = ["ChatTokenizer", "load_tokenizer", "BOS_TOKEN", "EOS_TOKEN", "Template", "Llama2Template",
           "ReasoningTemplate", "TEMPLATES", "register_template", "get_template", "alpaca_to_messages"]


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


BOS_TOKEN, EOS_TOKEN = "{{bos_token}}", "{{eos_token}}"  # LF's {"bos_token"} / {"eos_token"} slot elements


def _apply(slots: tuple[str, ...], **values: str) -> list[str]:
    """StringFormatter.apply: each {{name}} is replaced once per text element."""
    elements = []
    for slot in slots:
        if slot not in (BOS_TOKEN, EOS_TOKEN):
            for name, value in values.items():
                slot = slot.replace("{{" + name + "}}", value, 1)
        elements.append(slot)
    return elements


def _to_ids(tokenizer: ChatTokenizer, elements: list[str]) -> list[int]:
    """Template._convert_elements_to_ids: each text element tokenized alone (empty ones skipped)."""
    ids = []
    for elem in elements:
        if elem == BOS_TOKEN:
            ids += [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        elif elem == EOS_TOKEN:
            ids += [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        elif elem:
            ids += tokenizer.encode(elem)
    return ids


def _with_eos(tokenizer: ChatTokenizer, eos_token: str) -> ChatTokenizer:
    """Template._add_or_replace_eos_token: HF add_special_tokens({"eos_token": ...}) adds it when missing."""
    if tokenizer.eos_token == eos_token:
        return tokenizer
    return replace(_with_special_tokens(tokenizer, [eos_token]), eos_token=eos_token)


def _with_special_tokens(tokenizer: ChatTokenizer, tokens: list[str]) -> ChatTokenizer:
    """Missing tokens appended as specials (ids from the vocab's end), on a copy of the backend."""
    missing = [t for t in tokens if tokenizer.backend.token_to_id(t) is None]
    if not missing:
        return tokenizer
    backend = Tokenizer.from_str(tokenizer.backend.to_str())
    backend.add_special_tokens(missing)
    return replace(tokenizer, backend=backend)


@dataclass(frozen=True)
class Template:
    """One register_template(...) call; build it with `register_template` (it fills LF's defaults)."""

    format_user: tuple[str, ...]
    format_assistant: tuple[str, ...]
    format_system: tuple[str, ...]
    format_prefix: tuple[str, ...] = ()
    default_system: str = ""
    stop_words: tuple[str, ...] = ()
    thought_words: tuple[str, str] = ("<think>\n", "\n</think>\n\n")
    efficient_eos: bool = False
    replace_eos: bool = False
    enable_thinking: bool | None = True  # DataArguments.enable_thinking's default; LF copies it in
    preserve_thinking: bool = False  # DataArguments.preserve_thinking's default
    mm_plugin: MMPlugin | TowerPlugin | None = None  # LF's get_mm_plugin(...) of a VL template (None: LF's base)

    def bind(self, processor_dir) -> "Template":
        """The template with its tower plugin bound to the processor files of processor_dir (other templates are
        returned as they are)."""
        if isinstance(self.mm_plugin, TowerPlugin):
            return replace(self, mm_plugin=self.mm_plugin.bind(processor_dir))
        return self

    def fix_special_tokens(self, tokenizer: ChatTokenizer) -> ChatTokenizer:
        """Template.fix_special_tokens: eos := first stop word (replace_eos); an eos-less tokenizer gets
        <|endoftext|>; pad := eos if unset; the other stop words become special tokens."""
        stop_words = list(self.stop_words)
        if self.replace_eos:
            if not stop_words:
                raise ValueError("Stop words are required to replace the EOS token.")
            tokenizer = _with_eos(tokenizer, stop_words.pop(0))
        if tokenizer.eos_token_id is None:
            tokenizer = _with_eos(tokenizer, "<|endoftext|>")
        if tokenizer.pad_token_id is None:
            tokenizer = replace(tokenizer, pad_token=tokenizer.eos_token)
        return _with_special_tokens(tokenizer, stop_words)

    def _turn0(self, system: str) -> tuple[list[str], str]:
        """(elements before message 0, text put before its content): prefix + system turn."""
        return [*self.format_prefix, *(_apply(self.format_system, content=system) if system else [])], ""

    def _encode(self, tokenizer: ChatTokenizer, messages: list[dict], system: str | None) -> list[list[int]]:
        system = system or self.default_system
        encoded = []
        for i, message in enumerate(messages):
            elements, merged = self._turn0(system) if i == 0 else ([], "")
            if message["role"] == "user":
                elements += _apply(self.format_user, content=merged + message["content"])
            elif message["role"] == "assistant":
                elements += _apply(self.format_assistant, content=message["content"])
            else:
                raise NotImplementedError(f"Unexpected role: {message['role']}")
            encoded.append(_to_ids(tokenizer, elements))
        return encoded

    def encode_oneturn(self, tokenizer: ChatTokenizer, messages: list[dict],
                       system: str | None = None) -> tuple[list[int], list[int]]:
        """(all messages but the last, concatenated; the last message)."""
        encoded = self._encode(tokenizer, messages, system)
        return [t for ids in encoded[:-1] for t in ids], encoded[-1]

    def encode_multiturn(self, tokenizer: ChatTokenizer, messages: list[dict], system: str | None = None,
                         discarding_history_cot: bool = False) -> list[tuple[list[int], list[int]]]:
        """[(user_i ids, assistant_i ids)] for each consecutive (user, assistant) pair
        (discarding_history_cot only matters to ReasoningTemplate)."""
        encoded = self._encode(tokenizer, messages, system)
        return [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]


@dataclass(frozen=True)
class Llama2Template(Template):
    """LF's Llama2Template: the formatted system text (first slot element) opens the first user content."""

    def _turn0(self, system: str) -> tuple[list[str], str]:
        return list(self.format_prefix), _apply(self.format_system, content=system)[0] if system else ""


@dataclass(frozen=True)
class ReasoningTemplate(Template):
    """LF's ReasoningTemplate: a response without thought words gets the empty thought
    "<think>\\n\\n</think>\\n\\n", labelled (in the response) when enable_thinking, else in the prompt."""

    def add_thought(self, content: str = "") -> str:
        return self.thought_words[0] + self.thought_words[1] + content

    def remove_thought(self, content: str) -> str:
        """Drops every thought; also strips leading newlines when there is none (LF's lstrip)."""
        open_, close = (re.escape(w) for w in self.thought_words)
        return re.sub(f"{open_}(.*?){close}", "", content, flags=re.DOTALL).lstrip("\n")

    def _has_thought(self, content: str) -> bool:
        return any(word.strip() in content for word in self.thought_words)

    def encode_oneturn(self, tokenizer: ChatTokenizer, messages: list[dict],
                       system: str | None = None) -> tuple[list[int], list[int]]:
        messages = [dict(m) for m in messages]
        if not self.preserve_thinking:  # history responses lose their thoughts
            for i in range(1, len(messages) - 2, 2):
                messages[i]["content"] = self.remove_thought(messages[i]["content"])
        if self.enable_thinking is False:
            messages[-1]["content"] = self.remove_thought(messages[-1]["content"])
        prompt_ids, response_ids = super().encode_oneturn(tokenizer, messages, system)
        if not self._has_thought(messages[-1]["content"]):
            thought = tokenizer.encode(self.add_thought())
            if self.enable_thinking:
                response_ids = thought + response_ids
            else:
                prompt_ids = prompt_ids + thought
        return prompt_ids, response_ids

    def encode_multiturn(self, tokenizer: ChatTokenizer, messages: list[dict], system: str | None = None,
                         discarding_history_cot: bool = False) -> list[tuple[list[int], list[int]]]:
        messages = [dict(m) for m in messages]
        if self.enable_thinking is False:
            for i in range(1, len(messages), 2):
                messages[i]["content"] = self.remove_thought(messages[i]["content"])
        if discarding_history_cot:  # the last response keeps its thought
            for i in range(1, len(messages) - 2, 2):
                messages[i]["content"] = self.remove_thought(messages[i]["content"])
        encoded = self._encode(tokenizer, messages, system)
        # with discarding_history_cot only the last turn gets the empty thought
        for i in [len(messages) - 2] if discarding_history_cot else range(0, len(messages), 2):
            if not self._has_thought(messages[i + 1]["content"]):
                thought = tokenizer.encode(self.add_thought())
                if self.enable_thinking:
                    encoded[i + 1] = thought + encoded[i + 1]
                else:
                    encoded[i] = encoded[i] + thought
        return [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]


TEMPLATES: dict[str, Template] = {}


def register_template(name: str, format_user: tuple[str, ...] = ("{{content}}",),
                      format_assistant: tuple[str, ...] | None = None,
                      format_system: tuple[str, ...] = ("{{content}}",), template_class: type = Template,
                      **fields) -> None:
    """LF's register_template defaults: the assistant slot is content + eos (just content with
    efficient_eos, whose eos the processors append); the system slot is the bare content."""
    if name in TEMPLATES:
        raise ValueError(f"Template {name} already exists.")
    if format_assistant is None:
        format_assistant = ("{{content}}",) if fields.get("efficient_eos") else ("{{content}}", EOS_TOKEN)
    TEMPLATES[name] = template_class(format_user=format_user, format_assistant=format_assistant,
                                     format_system=format_system, **fields)


# bloom and starcoder2 (LF registers no template for them): eos closes every user, assistant and system slot
register_template(
    "default",
    format_user=("Human: {{content}}", EOS_TOKEN, "\nAssistant:"),
    format_assistant=("{{content}}", EOS_TOKEN, "\n"),
    format_system=("System: {{content}}", EOS_TOKEN, "\n"),
)

register_template(
    "falcon",
    format_user=("User: {{content}}\nFalcon:",),
    format_assistant=("{{content}}\n",),
    efficient_eos=True,
)

register_template(
    "llama3",
    format_user=("<|start_header_id|>user<|end_header_id|>\n\n{{content}}<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n",),
    format_assistant=("{{content}}<|eot_id|>",),
    format_system=("<|start_header_id|>system<|end_header_id|>\n\n{{content}}<|eot_id|>",),
    format_prefix=(BOS_TOKEN,),
    stop_words=("<|eot_id|>", "<|eom_id|>"),
    replace_eos=True,
)

# "mistral tokenizer v3" in LF; [INST] is plain text to the v0.1/v0.2 tokenizers
register_template(
    "mistral",
    format_user=("[INST] {{content}}[/INST]",),
    format_assistant=(" {{content}}", EOS_TOKEN),
    format_system=("{{content}}\n\n",),
    format_prefix=(BOS_TOKEN,),
    template_class=Llama2Template,
)

register_template(
    "phi4",
    format_user=("<|im_start|>user<|im_sep|>{{content}}<|im_end|><|im_start|>assistant<|im_sep|>",),
    format_assistant=("{{content}}<|im_end|>",),
    format_system=("<|im_start|>system<|im_sep|>{{content}}<|im_end|>",),
    stop_words=("<|im_end|>",),
    replace_eos=True,
)

register_template(
    "qwen",
    format_user=("<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n",),
    format_assistant=("{{content}}<|im_end|>\n",),
    format_system=("<|im_start|>system\n{{content}}<|im_end|>\n",),
    default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    stop_words=("<|im_end|>",),
    replace_eos=True,
)

register_template(
    "qwen3",
    format_user=("<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n",),
    format_assistant=("{{content}}<|im_end|>\n",),
    format_system=("<|im_start|>system\n{{content}}<|im_end|>\n",),
    stop_words=("<|im_end|>",),
    replace_eos=True,
    template_class=ReasoningTemplate,
)


# LF's Qwen-VL templates (the qwen slots), each with its plugin: the tokens LF's register_template gives it and the
# image processor (and Omni's feature extractor) of the release's preprocessor_config.json
_QWEN_SLOTS = dict(
    format_user=("<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n",),
    format_assistant=("{{content}}<|im_end|>\n",),
    format_system=("<|im_start|>system\n{{content}}<|im_end|>\n",),
    stop_words=("<|im_end|>",),
    replace_eos=True,
)

register_template(
    "qwen2_vl",
    default_system="You are a helpful assistant.",
    mm_plugin=MMPlugin("qwen2_vl", image_token="<|image_pad|>", video_token="<|video_pad|>",
                       image_processor=QwenImageProcessorConfig.qwen2_vl()),
    **_QWEN_SLOTS,
)

register_template(
    "qwen3_vl",
    mm_plugin=MMPlugin("qwen3_vl", image_token="<|image_pad|>", video_token="<|video_pad|>",
                       image_processor=QwenImageProcessorConfig.qwen3_vl()),
    template_class=ReasoningTemplate,
    **_QWEN_SLOTS,
)

register_template(
    "qwen2_omni",
    default_system="You are a helpful assistant.",
    mm_plugin=MMPlugin("qwen2_omni", image_token="<|IMAGE|>", video_token="<|VIDEO|>", audio_token="<|AUDIO|>",
                       vision_bos_token="<|vision_bos|>", vision_eos_token="<|vision_eos|>",
                       audio_bos_token="<|audio_bos|>", audio_eos_token="<|audio_eos|>",
                       image_processor=QwenImageProcessorConfig.qwen2_vl(),
                       feature_extractor=WhisperFeatureConfig.qwen2_omni()),
    **_QWEN_SLOTS,
)


# LF's templates of the fixed-size towers (issue 34), each with its plugin (bound to the checkpoint's processor files
# by Template.bind)
register_template(
    "gemma3",
    format_user=("<start_of_turn>user\n{{content}}<end_of_turn>\n<start_of_turn>model\n",),
    format_assistant=("{{content}}<end_of_turn>\n",),
    format_system=("{{content}}\n\n",),
    format_prefix=(BOS_TOKEN,),
    stop_words=("<end_of_turn>",),
    replace_eos=True,
    mm_plugin=Gemma3Plugin("gemma3", image_token="<image_soft_token>"),
    template_class=Llama2Template,
)

register_template(
    "paligemma",
    format_user=("{{content}}\n",),
    format_prefix=(BOS_TOKEN,),
    mm_plugin=PaliGemmaPlugin("paligemma", image_token="<image>"),
    template_class=Llama2Template,
)

register_template(
    "llava_next",
    format_user=("USER: {{content}} ASSISTANT:",),
    default_system=("A chat between a curious user and an artificial intelligence assistant. "
                    "The assistant gives helpful, detailed, and polite answers to the user's questions."),
    mm_plugin=LlavaNextPlugin("llava_next", image_token="<image>"),
)

register_template(
    "intern_vl",
    format_user=("<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n",),
    format_assistant=("{{content}}<|im_end|>\n",),
    format_system=("<|im_start|>system\n{{content}}<|im_end|>\n",),
    format_prefix=(BOS_TOKEN,),
    default_system="你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的多模态大语言模型。",
    stop_words=("<|im_end|>",),
    mm_plugin=InternVLPlugin("intern_vl", image_token="<image>"),
)


def get_template(name: str) -> Template:
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
