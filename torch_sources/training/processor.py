"""LLaMA-Factory's supervised (SFT) and pairwise (DPO) dataset processors (`data/processor/supervised.py`,
`pairwise.py`), plain Python.

input_ids = <bos> X1 Y1 X2 Y2 ...; labels = -100 over every prompt X_i, the ids over every
response Y_i (each assistant turn is trained; with llama3 Y_i ends with <|eot_id|>). Turns are cut to
cutoff_len with `infer_seqlen`, in order, until the budget is used up. No packing (LF packs
only for stage pt).

Pairwise: the prompt (every message but the response, system turn included) is encoded once and
each response on its own (`encode_oneturn`); `infer_seqlen` runs on the prompt and the longer
response, so both responses are cut to the same length; labels are -100 over the prompt.

A template with efficient_eos (falcon) has no eos in its assistant slot: every processor appends the
eos to the response (supervised: once, after the last turn, and turn i > 0's first prompt label is
the eos, standing for the eos the previous response never got; train_on_prompt is refused).

Images (LF's alpaca `images` column: paths, resolved against `media_dir`): a template with an mm plugin expands
each `<image>` to its image tokens before encoding, so they count against cutoff_len, and the feature keeps the
paths as the row gives them (`"images"`) for the collator; a template without one refuses images, and its features
have no `"images"` key.
"""

from __future__ import annotations

from .mm_plugin import TowerPlugin, process_messages, regularize_images
from .template import alpaca_to_messages

__all__ = ["IGNORE_INDEX", "infer_seqlen", "preprocess_supervised_example", "preprocess_supervised_dataset",
           "preprocess_pairwise_example", "preprocess_pairwise_dataset", "preprocess_unsupervised_example",
           "preprocess_unsupervised_dataset"]

IGNORE_INDEX = -100


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """Truncated (source, target) lengths; each side keeps its left part."""
    if target_len * 2 < cutoff_len:  # the target fits in half: only the source is cut
        max_target_len = cutoff_len
    elif source_len * 2 < cutoff_len:  # the source fits in half: the target gets the rest
        max_target_len = cutoff_len - source_len
    else:  # both are long: share the budget in proportion
        max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target_len = min(max_target_len, target_len)
    new_source_len = min(max(cutoff_len - new_target_len, 0), source_len)
    return new_source_len, new_target_len


def preprocess_supervised_example(encoded_pairs: list[tuple[list[int], list[int]]], cutoff_len: int,
                                  train_on_prompt: bool = False, mask_history: bool = False,
                                  efficient_eos_id: int | None = None,
                                  prefix: tuple[list[int], list[int]] = ([], [])) -> tuple[list[int], list[int]]:
    """SupervisedDatasetProcessor._encode_data_example on template.encode_multiturn's pairs;
    efficient_eos_id: the tokenizer's eos when the template has efficient_eos, else None; prefix: the plugin's
    process_token_ids([], []) (PaliGemma's image tokens), counted against cutoff_len (under mask_history the
    reversed turns go before it, as in LF)."""
    input_ids, labels = list(prefix[0]), list(prefix[1])
    total_length = len(input_ids) + (0 if efficient_eos_id is None else 1)  # room for the appended eos
    if mask_history:
        encoded_pairs = encoded_pairs[::-1]  # the last turns get the budget first
    for turn_idx, (source_ids, target_ids) in enumerate(encoded_pairs):
        if total_length >= cutoff_len:
            break
        source_len, target_len = infer_seqlen(len(source_ids), len(target_ids), cutoff_len - total_length)
        source_ids, target_ids = source_ids[:source_len], target_ids[:target_len]
        total_length += source_len + target_len
        if train_on_prompt:
            source_label = source_ids
        elif efficient_eos_id is not None and turn_idx != 0:
            source_label = [efficient_eos_id] + [IGNORE_INDEX] * (source_len - 1)
        else:
            source_label = [IGNORE_INDEX] * source_len
        if mask_history and turn_idx != 0:  # train on the last turn only
            target_label = [IGNORE_INDEX] * target_len
        else:
            target_label = target_ids
        if mask_history:  # pairs were reversed: prepend
            input_ids = source_ids + target_ids + input_ids
            labels = source_label + target_label + labels
        else:
            input_ids += source_ids + target_ids
            labels += source_label + target_label
    if efficient_eos_id is not None:
        input_ids += [efficient_eos_id]
        labels += [efficient_eos_id]
    return input_ids, labels


def _efficient_eos_id(tokenizer, template) -> int | None:
    return tokenizer.eos_token_id if template.efficient_eos else None


def _expand_images(messages: list[dict], paths: list[str], template, media_dir) -> list[dict]:
    """mm_plugin.process_messages on the example's images; without a plugin (LF's base plugin) any image is
    refused before it is read."""
    plugin = template.mm_plugin
    images = paths if plugin is None else regularize_images(paths, media_dir, plugin)
    return process_messages(messages, images, plugin)


def _token_ids(input_ids: list[int], labels: list[int] | None, paths: list[str], template, tokenizer):
    """mm_plugin.process_token_ids: a tower plugin's image tokens put into the ids (PaliGemma's before them)."""
    if isinstance(template.mm_plugin, TowerPlugin):
        return template.mm_plugin.process_token_ids(input_ids, labels, len(paths), tokenizer)
    return input_ids, labels


def _with_images(feature: dict, paths: list[str], template) -> dict:
    return feature if template.mm_plugin is None else {**feature, "images": paths}


def preprocess_supervised_dataset(examples: list[dict], tokenizer, template, cutoff_len: int,
                                  train_on_prompt: bool = False, mask_history: bool = False,
                                  media_dir=None) -> list[dict]:
    """Alpaca rows -> [dict(input_ids, attention_mask, labels[, images])] (lists of ints, unpadded)."""
    if train_on_prompt and template.efficient_eos:  # LF's get_template_and_fix_tokenizer refuses it
        raise ValueError("Current template does not support `train_on_prompt`.")
    # a reasoning template keeps only the last turn's thought under mask_history
    discarding_history_cot = mask_history and not template.preserve_thinking
    features = []
    for example in examples:
        messages = alpaca_to_messages(example)
        if len(messages) % 2 != 0:  # LF drops rows without (odd prompt, one response)
            continue
        paths = list(example.get("images") or [])
        messages = _expand_images(messages, paths, template, media_dir)
        pairs = template.encode_multiturn(tokenizer, messages, example.get("system") or None,
                                          discarding_history_cot)
        input_ids, labels = preprocess_supervised_example(
            pairs, cutoff_len, train_on_prompt, mask_history, _efficient_eos_id(tokenizer, template),
            _token_ids([], [], paths, template, tokenizer))
        features.append(_with_images({"input_ids": input_ids, "attention_mask": [1] * len(input_ids),
                                      "labels": labels}, paths, template))
    return features


def preprocess_pairwise_example(prompt_ids: list[int], chosen_ids: list[int], rejected_ids: list[int],
                                cutoff_len: int) -> dict[str, list[int]]:
    """PairwiseDatasetProcessor._encode_data_example: the response is more important than the prompt."""
    source_len, target_len = infer_seqlen(len(prompt_ids), max(len(chosen_ids), len(rejected_ids)), cutoff_len)
    prompt_ids = prompt_ids[:source_len]
    out = {}
    for key, response in (("chosen", chosen_ids[:target_len]), ("rejected", rejected_ids[:target_len])):
        out[f"{key}_input_ids"] = prompt_ids + response
        out[f"{key}_attention_mask"] = [1] * (source_len + len(response))
        out[f"{key}_labels"] = [IGNORE_INDEX] * source_len + response
    return out


def preprocess_pairwise_dataset(examples: list[dict], tokenizer, template, cutoff_len: int,
                                media_dir=None) -> list[dict]:
    """Alpaca preference rows (instruction, input, chosen, rejected[, history, system, images]) ->
    [dict(chosen_input_ids, chosen_attention_mask, chosen_labels, rejected_*[, images])] (unpadded lists)."""
    features = []
    for example in examples:
        prompt = alpaca_to_messages({**example, "output": ""})[:-1]
        if len(prompt) % 2 != 1 or not all(isinstance(example.get(k), str) for k in ("chosen", "rejected")):
            continue  # LF's converter gives a row without two string responses none, and the processor drops it
        system = example.get("system") or None
        paths = list(example.get("images") or [])
        encoded = [template.encode_oneturn(tokenizer, _expand_images(
            prompt + [{"role": "assistant", "content": example[key]}], paths, template, media_dir), system)
            for key in ("chosen", "rejected")]  # LF expands each (prompt, response) on its own
        eos = [tokenizer.eos_token_id] if template.efficient_eos else []  # appended before the cut, as in LF
        prompt_ids, _ = _token_ids(encoded[0][0], None, paths, template, tokenizer)
        features.append(_with_images(preprocess_pairwise_example(prompt_ids, encoded[0][1] + eos,
                                                                 encoded[1][1] + eos, cutoff_len), paths, template))
    return features


def preprocess_unsupervised_example(prompt_ids: list[int], response_ids: list[int], cutoff_len: int) -> dict[str, list[int]]:
    """UnsupervisedDatasetProcessor._encode_data_example (LF's stage ppo): infer_seqlen over the prompt and the
    response, input_ids = the cut prompt (generation starts after it), labels = the cut response (unused by PPO)."""
    source_len, target_len = infer_seqlen(len(prompt_ids), len(response_ids), cutoff_len)
    return {"input_ids": prompt_ids[:source_len], "attention_mask": [1] * source_len,
            "labels": response_ids[:target_len]}


def preprocess_unsupervised_dataset(examples: list[dict], tokenizer, template, cutoff_len: int,
                                    media_dir=None) -> list[dict]:
    """Alpaca rows -> [dict(input_ids, attention_mask, labels[, images])]: the prompt through the assistant header
    (a response of one message is encoded as the label, none as an empty assistant turn), unpadded lists."""
    features = []
    for example in examples:
        messages = alpaca_to_messages(example)
        if len(messages) % 2 != 0:
            continue
        paths = list(example.get("images") or [])
        messages = _expand_images(messages, paths, template, media_dir)
        prompt_ids, response_ids = template.encode_oneturn(tokenizer, messages, example.get("system") or None)
        if template.efficient_eos:  # the label gets the eos the assistant slot lacks (before the cut)
            response_ids = response_ids + [tokenizer.eos_token_id]
        prompt_ids, _ = _token_ids(prompt_ids, None, paths, template, tokenizer)
        features.append(_with_images(preprocess_unsupervised_example(prompt_ids, response_ids, cutoff_len), paths,
                                     template))
    return features
