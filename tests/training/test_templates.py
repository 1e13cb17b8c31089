"""LLaMA-Factory's chat templates (torch_sources/training/template.py and its JAX twin) and the tiny
per-family tokenizers (tools/make_tokenizer.py, assets/tokenizer/<family>/).

Every expected id sequence is written out from LF's rules (src/llamafactory/data/template.py,
register_template calls and the Template / Llama2Template / ReasoningTemplate classes) as the text
pieces LF tokenizes one by one (each slot element is its own `tokenizer.encode`); the ids come from
transformers' AutoTokenizer on those pieces, and the decoded ids must read back as the joined text.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import transformers

from jax_oracles.training import processor as j_processor
from jax_oracles.training import template as j_template
from torch_sources.training import processor as t_processor
from torch_sources.training import template as t_template

ROOT = Path(__file__).resolve().parents[2]
TOKENIZERS = ROOT / "assets" / "tokenizer"
# every family with a tokenizer (tools/checkpoints_<family>.py writes it)
FAMILIES = ("llama3", "bloom", "falcon", "mistral", "qwen2", "qwen3", "phi4", "starcoder2",
            "qwen2_vl", "qwen2_omni", "qwen3_vl", "qwen2_5_vl", "gemma3", "paligemma", "llava_next", "internvl")
TEMPLATE_MODULES = [t_template, j_template]
MODULES = [(t_template, t_processor), (j_template, j_processor)]

# (template, tokenizer family): LF registers no template for bloom and starcoder2, so they use "default"
PAIRS = [("default", "bloom"), ("default", "starcoder2"), ("falcon", "falcon"), ("mistral", "mistral"),
         ("qwen", "qwen2"), ("qwen3", "qwen3"), ("phi4", "phi4"), ("llama3", "llama3")]

SYSTEM = "Be brief."
MESSAGES = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Count to 3"}, {"role": "assistant", "content": "1 2 3"}]
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
THINK = "<think>\n\n</think>\n\n"  # ReasoningTemplate.add_thought(""): thought_words[0] + thought_words[1]

# LF's multiturn pairs [(user_1, assistant_1), (user_2, assistant_2)] as the pieces it encodes, with no
# system prompt and with SYSTEM. "{eos}" is the template-fixed tokenizer's eos token.
EXPECTED = {
    # user "Human: {c}" {eos} "\nAssistant:", assistant "{c}" {eos} "\n", system "System: {c}" {eos} "\n"
    "default": {
        None: [(["Human: Hi there", "{eos}", "\nAssistant:"], ["Hello!", "{eos}", "\n"]),
               (["Human: Count to 3", "{eos}", "\nAssistant:"], ["1 2 3", "{eos}", "\n"])],
        SYSTEM: [(["System: Be brief.", "{eos}", "\n", "Human: Hi there", "{eos}", "\nAssistant:"],
                  ["Hello!", "{eos}", "\n"]),
                 (["Human: Count to 3", "{eos}", "\nAssistant:"], ["1 2 3", "{eos}", "\n"])],
    },
    # efficient_eos: no eos in the assistant slot (the processors append it); system slot = bare content
    "falcon": {
        None: [(["User: Hi there\nFalcon:"], ["Hello!\n"]), (["User: Count to 3\nFalcon:"], ["1 2 3\n"])],
        SYSTEM: [(["Be brief.", "User: Hi there\nFalcon:"], ["Hello!\n"]),
                 (["User: Count to 3\nFalcon:"], ["1 2 3\n"])],
    },
    # Llama2Template: bos prefix, the system text "{c}\n\n" opens the first user content (one piece)
    "mistral": {
        None: [(["{bos}", "[INST] Hi there[/INST]"], [" Hello!", "{eos}"]),
               (["[INST] Count to 3[/INST]"], [" 1 2 3", "{eos}"])],
        SYSTEM: [(["{bos}", "[INST] Be brief.\n\nHi there[/INST]"], [" Hello!", "{eos}"]),
                 (["[INST] Count to 3[/INST]"], [" 1 2 3", "{eos}"])],
    },
    # ChatML with a default system prompt
    "qwen": {
        None: [([f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n",
                 "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"], ["Hello!<|im_end|>\n"]),
               (["<|im_start|>user\nCount to 3<|im_end|>\n<|im_start|>assistant\n"], ["1 2 3<|im_end|>\n"])],
        SYSTEM: [(["<|im_start|>system\nBe brief.<|im_end|>\n",
                   "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"], ["Hello!<|im_end|>\n"]),
                 (["<|im_start|>user\nCount to 3<|im_end|>\n<|im_start|>assistant\n"], ["1 2 3<|im_end|>\n"])],
    },
    # ReasoningTemplate, enable_thinking=True: every thought-less response gets the empty thought (labelled)
    "qwen3": {
        None: [(["<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"], [THINK, "Hello!<|im_end|>\n"]),
               (["<|im_start|>user\nCount to 3<|im_end|>\n<|im_start|>assistant\n"], [THINK, "1 2 3<|im_end|>\n"])],
        SYSTEM: [(["<|im_start|>system\nBe brief.<|im_end|>\n",
                   "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"], [THINK, "Hello!<|im_end|>\n"]),
                 (["<|im_start|>user\nCount to 3<|im_end|>\n<|im_start|>assistant\n"],
                  [THINK, "1 2 3<|im_end|>\n"])],
    },
    # ChatML with <|im_sep|> and no newlines
    "phi4": {
        None: [(["<|im_start|>user<|im_sep|>Hi there<|im_end|><|im_start|>assistant<|im_sep|>"], ["Hello!<|im_end|>"]),
               (["<|im_start|>user<|im_sep|>Count to 3<|im_end|><|im_start|>assistant<|im_sep|>"],
                ["1 2 3<|im_end|>"])],
        SYSTEM: [(["<|im_start|>system<|im_sep|>Be brief.<|im_end|>",
                   "<|im_start|>user<|im_sep|>Hi there<|im_end|><|im_start|>assistant<|im_sep|>"],
                  ["Hello!<|im_end|>"]),
                 (["<|im_start|>user<|im_sep|>Count to 3<|im_end|><|im_start|>assistant<|im_sep|>"],
                  ["1 2 3<|im_end|>"])],
    },
    "llama3": {
        None: [(["{bos}", "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n"], ["Hello!<|eot_id|>"]),
               (["<|start_header_id|>user<|end_header_id|>\n\nCount to 3<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n"], ["1 2 3<|eot_id|>"])],
        SYSTEM: [(["{bos}", "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>",
                   "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n"], ["Hello!<|eot_id|>"]),
                 (["<|start_header_id|>user<|end_header_id|>\n\nCount to 3<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n"], ["1 2 3<|eot_id|>"])],
    },
}

# ReasoningTemplate.encode_oneturn adds the empty thought to the last response only (history keeps none)
EXPECTED_QWEN3_ONETURN = {
    None: (["<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", "Hello!<|im_end|>\n",
            "<|im_start|>user\nCount to 3<|im_end|>\n<|im_start|>assistant\n"], [THINK, "1 2 3<|im_end|>\n"]),
    SYSTEM: (["<|im_start|>system\nBe brief.<|im_end|>\n",
              "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", "Hello!<|im_end|>\n",
              "<|im_start|>user\nCount to 3<|im_end|>\n<|im_start|>assistant\n"], [THINK, "1 2 3<|im_end|>\n"]),
}

# fix_special_tokens: (bos, eos, pad) after LF's rules (replace_eos -> first stop word; pad := eos if unset)
FIXED = {
    ("default", "bloom"): ("<s>", "</s>", "<pad>"),
    ("default", "starcoder2"): ("<|endoftext|>", "<|endoftext|>", "<|endoftext|>"),
    ("falcon", "falcon"): (None, "<|endoftext|>", "<|endoftext|>"),
    ("mistral", "mistral"): ("<s>", "</s>", "</s>"),
    ("qwen", "qwen2"): (None, "<|im_end|>", "<|endoftext|>"),
    ("qwen3", "qwen3"): (None, "<|im_end|>", "<|endoftext|>"),
    ("phi4", "phi4"): ("<|endoftext|>", "<|im_end|>", "<|dummy_85|>"),
    ("llama3", "llama3"): ("<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
}

# tokenizer_config.json as the family's reference release names them: (bos, eos, pad)
RAW = {
    "llama3": ("<|begin_of_text|>", "<|end_of_text|>", None),
    "bloom": ("<s>", "</s>", "<pad>"),
    "falcon": (None, "<|endoftext|>", None),
    "mistral": ("<s>", "</s>", None),
    "qwen2": (None, "<|endoftext|>", "<|endoftext|>"),
    "qwen3": (None, "<|im_end|>", "<|endoftext|>"),
    "phi4": ("<|endoftext|>", "<|im_end|>", "<|dummy_85|>"),
    "starcoder2": ("<|endoftext|>", "<|endoftext|>", None),
    "qwen2_vl": (None, "<|im_end|>", "<|endoftext|>"),  # Qwen2-VL-2B-Instruct's tokenizer_config
    "qwen2_omni": (None, "<|im_end|>", "<|endoftext|>"),  # Qwen2.5-Omni-7B's
    "qwen3_vl": (None, "<|im_end|>", "<|endoftext|>"),  # Qwen3-VL-2B-Instruct's
    "qwen2_5_vl": (None, "<|im_end|>", "<|endoftext|>"),  # Qwen2.5-VL-7B-Instruct's
    "gemma3": ("<bos>", "<eos>", "<pad>"),  # gemma-3-4b-it's
    "paligemma": ("<bos>", "<eos>", "<pad>"),  # paligemma-3b-pt-224's
    "llava_next": ("<s>", "</s>", "<unk>"),  # llava-v1.6-vicuna-7b-hf's
    "internvl": (None, "<|im_end|>", "<|endoftext|>"),  # InternVL3-1B-hf's
}
SPECIAL_IDS = {
    "bloom": {"<unk>": 400, "<s>": 401, "</s>": 402, "<pad>": 403},
    "falcon": {"<|endoftext|>": 400},
    "mistral": {"<unk>": 400, "<s>": 401, "</s>": 402},
    "qwen2": {"<|endoftext|>": 400, "<|im_start|>": 401, "<|im_end|>": 402},
    "qwen3": {"<|endoftext|>": 400, "<|im_start|>": 401, "<|im_end|>": 402, "<think>": 403, "</think>": 404},
    "phi4": {"<|endoftext|>": 400, "<|im_start|>": 401, "<|im_end|>": 402, "<|im_sep|>": 403, "<|dummy_85|>": 404},
    "starcoder2": {"<|endoftext|>": 400},
    "llama3": {"<|begin_of_text|>": 400, "<|end_of_text|>": 401, "<|eot_id|>": 404},
    "qwen2_vl": {"<|endoftext|>": 400, "<|im_start|>": 401, "<|im_end|>": 402, "<|vision_start|>": 409,
                 "<|vision_end|>": 410, "<|image_pad|>": 412, "<|video_pad|>": 413},
    "qwen2_omni": {"<|endoftext|>": 400, "<|im_end|>": 402, "<|AUDIO|>": 403, "<|audio_bos|>": 404,
                   "<|audio_eos|>": 405, "<|vision_bos|>": 409, "<|vision_eos|>": 410, "<|IMAGE|>": 412},
    # the release's ids less 151243: the Qwen-VL tokens as qwen2_vl's, then <think> 151667 at 424
    "qwen3_vl": {"<|endoftext|>": 400, "<|im_start|>": 401, "<|im_end|>": 402, "<|vision_start|>": 409,
                 "<|vision_end|>": 410, "<|image_pad|>": 412, "<|video_pad|>": 413, "<think>": 424, "</think>": 425},
    "qwen2_5_vl": {"<|endoftext|>": 400, "<|im_start|>": 401, "<|im_end|>": 402, "<|vision_start|>": 409,
                   "<|vision_end|>": 410, "<|image_pad|>": 412, "<|video_pad|>": 413},
    # the towers' families: their own specials from 400, config.json's image ids among them
    "gemma3": {"<bos>": 400, "<eos>": 401, "<pad>": 402, "<start_of_turn>": 403, "<end_of_turn>": 404,
               "<start_of_image>": 405, "<end_of_image>": 406, "<image_soft_token>": 407},
    "paligemma": {"<bos>": 400, "<eos>": 401, "<pad>": 402, "<image>": 403},
    "llava_next": {"<s>": 400, "</s>": 401, "<unk>": 402, "<image>": 403},
    "internvl": {"<|endoftext|>": 400, "<|im_start|>": 401, "<|im_end|>": 402, "<img>": 403, "</img>": 404,
                 "<IMG_CONTEXT>": 405},
}

_HF = {}


def _hf(family: str):
    if family not in _HF:
        _HF[family] = transformers.AutoTokenizer.from_pretrained(str(TOKENIZERS / family), local_files_only=True)
    return _HF[family]


def _fixed(module, name: str, family: str):
    template = module.get_template(name)
    return template, template.fix_special_tokens(module.load_tokenizer(TOKENIZERS / family))


def _expand(pieces: list[str], tok) -> list[str]:
    return [p.replace("{eos}", tok.eos_token).replace("{bos}", tok.bos_token or "") for p in pieces]


def _ids(family: str, pieces: list[str]) -> list[int]:
    """Each piece encoded on its own by the HF tokenizer (LF's per-element encode)."""
    return [i for p in pieces if p for i in _hf(family).encode(p, add_special_tokens=False)]


# ---- templates -----------------------------------------------------------------------------

@pytest.mark.parametrize("module", TEMPLATE_MODULES, ids=["torch", "jax"])
@pytest.mark.parametrize("system", [None, SYSTEM], ids=["no_system", "system"])
@pytest.mark.parametrize("name,family", PAIRS)
def test_encode_multiturn_and_oneturn_follow_lf(module, name, family, system):
    template, tok = _fixed(module, name, family)
    expected = [(_expand(u, tok), _expand(a, tok)) for u, a in EXPECTED[name][system]]
    pairs = template.encode_multiturn(tok, MESSAGES, system)
    assert pairs == [(_ids(family, u), _ids(family, a)) for u, a in expected]
    assert [(tok.decode(u), tok.decode(a)) for u, a in pairs] == [("".join(u), "".join(a)) for u, a in expected]

    if name == "qwen3":
        prompt, response = EXPECTED_QWEN3_ONETURN[system]
    else:  # the prompt is every message but the last, concatenated
        prompt = [p for u, a in expected for p in u + a][:-len(expected[-1][1])]
        response = expected[-1][1]
    got = template.encode_oneturn(tok, MESSAGES, system)
    assert got == (_ids(family, prompt), _ids(family, response))
    assert (tok.decode(got[0]), tok.decode(got[1])) == ("".join(prompt), "".join(response))


@pytest.mark.parametrize("module", TEMPLATE_MODULES, ids=["torch", "jax"])
@pytest.mark.parametrize("name,family", PAIRS)
def test_fix_special_tokens(module, name, family):
    raw = module.load_tokenizer(TOKENIZERS / family)
    assert (raw.bos_token, raw.eos_token, raw.pad_token) == RAW[family]
    tok = module.get_template(name).fix_special_tokens(raw)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == FIXED[(name, family)]
    ids = SPECIAL_IDS[family]
    assert (tok.eos_token_id, tok.pad_token_id) == (ids[tok.eos_token], ids[tok.pad_token])
    assert tok.backend.get_vocab_size() == raw.backend.get_vocab_size()  # nothing had to be added


@pytest.mark.parametrize("module", TEMPLATE_MODULES, ids=["torch", "jax"])
def test_fix_special_tokens_adds_missing_eos(module):
    raw = module.load_tokenizer(TOKENIZERS / "mistral")  # vocab 403: <unk> <s> </s> at 400..402
    # replace_eos with a stop word the vocab lacks: HF add_special_tokens appends it; pad := eos
    tok = module.get_template("qwen").fix_special_tokens(raw)
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", 403, 403)
    assert tok.encode("a<|im_end|>") == tok.encode("a") + [403]
    # no eos at all: LF adds <|endoftext|>
    tok = module.get_template("falcon").fix_special_tokens(replace(raw, eos_token=None))
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token) == ("<|endoftext|>", 403, "<|endoftext|>")
    assert raw.backend.get_vocab_size() == 403  # the loaded tokenizer is left alone
    # llama3: the second stop word is already a special token, nothing is added
    tok = module.get_template("llama3").fix_special_tokens(module.load_tokenizer(TOKENIZERS / "llama3"))
    assert tok.backend.get_vocab_size() == 416


@pytest.mark.parametrize("module", TEMPLATE_MODULES, ids=["torch", "jax"])
def test_reasoning_template_options(module):
    template, tok = _fixed(module, "qwen3", "qwen3")
    user = ["<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
            "<|im_start|>user\nCount to 3<|im_end|>\n<|im_start|>assistant\n"]
    # enable_thinking=False (qwen3 with --enable_thinking false): the empty thought goes to the prompt, unlabelled
    off = replace(template, enable_thinking=False)
    assert off.encode_multiturn(tok, MESSAGES) == [
        (_ids("qwen3", [user[0], THINK]), _ids("qwen3", ["Hello!<|im_end|>\n"])),
        (_ids("qwen3", [user[1], THINK]), _ids("qwen3", ["1 2 3<|im_end|>\n"]))]
    assert off.encode_oneturn(tok, MESSAGES) == (
        _ids("qwen3", [user[0], "Hello!<|im_end|>\n", user[1], THINK]), _ids("qwen3", ["1 2 3<|im_end|>\n"]))
    # discarding_history_cot (mask_history, preserve_thinking off): only the last turn gets the thought
    assert template.encode_multiturn(tok, MESSAGES, discarding_history_cot=True) == [
        (_ids("qwen3", [user[0]]), _ids("qwen3", ["Hello!<|im_end|>\n"])),
        (_ids("qwen3", [user[1]]), _ids("qwen3", [THINK, "1 2 3<|im_end|>\n"]))]
    # a response with its own thought gets no empty one
    thought = [*MESSAGES[:3], {"role": "assistant", "content": "<think>\ncount\n</think>\n\n1 2 3"}]
    assert template.encode_oneturn(tok, thought)[1] == _ids("qwen3", ["<think>\ncount\n</think>\n\n1 2 3<|im_end|>\n"])
    # remove_thought's lstrip("\n") reaches a thought-less history response in encode_oneturn
    history = [MESSAGES[0], {"role": "assistant", "content": "\nHello!"}, *MESSAGES[2:]]
    assert template.encode_oneturn(tok, history) == template.encode_oneturn(tok, MESSAGES)
    assert template.encode_multiturn(tok, history)[0][1] == _ids("qwen3", [THINK, "\nHello!<|im_end|>\n"])


# ---- processors ----------------------------------------------------------------------------

ROW = {"instruction": "Count to 3", "input": "", "output": "1 2 3", "history": [["Hi there", "Hello!"]]}


@pytest.mark.parametrize("template_module,processor", MODULES, ids=["torch", "jax"])
def test_falcon_efficient_eos_labels(template_module, processor):
    template, tok = _fixed(template_module, "falcon", "falcon")
    eos = tok.eos_token_id
    (u1, a1), (u2, a2) = [(_ids("falcon", u), _ids("falcon", a)) for u, a in EXPECTED["falcon"][None]]
    (feature,) = processor.preprocess_supervised_dataset([ROW], tok, template, cutoff_len=64)
    # <u1 a1 u2 a2 eos>; turn 2's first prompt label is the eos that a1 lacks
    assert feature["input_ids"] == u1 + a1 + u2 + a2 + [eos]
    assert feature["labels"] == [-100] * len(u1) + a1 + [eos] + [-100] * (len(u2) - 1) + a2 + [eos]
    assert tok.decode(feature["input_ids"]) == ("User: Hi there\nFalcon:Hello!\nUser: Count to 3\nFalcon:1 2 3\n"
                                                "<|endoftext|>")
    # the appended eos is budgeted first: total_length starts at 1
    n = len(u1) + len(a1)
    ids, labels = processor.preprocess_supervised_example([(u1, a1), (u2, a2)], n + 1, efficient_eos_id=eos)
    assert ids == u1 + a1 + [eos] and labels == [-100] * len(u1) + a1 + [eos]
    with pytest.raises(ValueError, match="train_on_prompt"):
        processor.preprocess_supervised_dataset([ROW], tok, template, cutoff_len=64, train_on_prompt=True)
    # pairwise and unsupervised: the eos ends each response (before the cut)
    pair = {**ROW, "chosen": "1 2 3", "rejected": "3 2 1"}
    (out,) = processor.preprocess_pairwise_dataset([pair], tok, template, cutoff_len=64)
    prompt = u1 + a1 + u2
    assert out["chosen_input_ids"] == prompt + _ids("falcon", ["1 2 3\n"]) + [eos]
    assert out["rejected_labels"] == [-100] * len(prompt) + _ids("falcon", ["3 2 1\n"]) + [eos]
    (out,) = processor.preprocess_unsupervised_dataset([ROW], tok, template, cutoff_len=64)
    assert out["input_ids"] == prompt and out["labels"] == a2 + [eos]


@pytest.mark.parametrize("template_module,processor", MODULES, ids=["torch", "jax"])
def test_eos_in_slot_templates_append_nothing(template_module, processor):
    for name, family in PAIRS:
        if name == "falcon":  # the one efficient_eos template
            continue
        template, tok = _fixed(template_module, name, family)
        pairs = template.encode_multiturn(tok, t_template.alpaca_to_messages(ROW))
        (feature,) = processor.preprocess_supervised_dataset([ROW], tok, template, cutoff_len=256)
        assert feature["input_ids"] == [i for u, a in pairs for i in u + a], name
        assert feature["labels"] == [i for u, a in pairs for i in [-100] * len(u) + a], name


@pytest.mark.parametrize("name,family", PAIRS)
def test_torch_and_jax_twins_agree_on_the_dataset(name, family):
    rows = json.loads((ROOT / "assets" / "data" / "sft" / "train.json").read_text())[:24]
    out = []
    for template_module, processor in MODULES:
        template, tok = _fixed(template_module, name, family)
        out.append([processor.preprocess_supervised_dataset(rows, tok, template, 128, mask_history=mask)
                    for mask in (False, True)])
        out[-1].append(processor.preprocess_unsupervised_dataset(rows, tok, template, 128))
    assert out[0] == out[1]


# ---- tokenizers ----------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_loads_with_autotokenizer(family):
    hf = _hf(family)
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == RAW[family]
    for token, i in SPECIAL_IDS[family].items():
        assert hf.convert_tokens_to_ids(token) == i
    assert len(hf) < 512  # the models' vocab
    chat = t_template.load_tokenizer(TOKENIZERS / family)
    text = "Human: Count to 3\nAssistant: [INST] 1 2 3 User: ok\nFalcon:"
    assert hf.encode(text, add_special_tokens=False) == chat.encode(text)


def test_bpe_ids_are_shared_across_families():
    files = {f: json.loads((TOKENIZERS / f / "tokenizer.json").read_text()) for f in FAMILIES}
    base = files["llama3"]["model"]
    assert len(base["vocab"]) == 400 and sorted(base["vocab"].values()) == list(range(400))
    for family, data in files.items():
        assert data["model"] == base, family  # same vocab ids 0..399 and merges
        assert data["pre_tokenizer"] == files["llama3"]["pre_tokenizer"], family
        assert {t["content"]: t["id"] for t in data["added_tokens"]}.items() >= SPECIAL_IDS[family].items()
        assert all(400 <= t["id"] < 512 and t["special"] for t in data["added_tokens"]), family


def test_tokenizer_files_are_reproducible():
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_tokenizer", ROOT / "tools" / "make_tokenizer.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert sorted(tool.FAMILIES) == sorted(FAMILIES)  # the rows are found in the family files, in name order
    bpe = tool.build_bpe(tool.corpus())
    for family in FAMILIES:
        d = TOKENIZERS / family
        assert tool.build_tokenizer([], family, bpe).to_str(pretty=True) == (d / "tokenizer.json").read_text(), family
        config = json.dumps(tool.tokenizer_config(family), indent=2, sort_keys=True) + "\n"
        assert config == (d / "tokenizer_config.json").read_text(), family
