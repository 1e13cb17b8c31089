"""What both halves of a probe do the same way, so that they cannot drift apart: a config as arrays, a layout as
arrays, ragged rows padded, and the engine loop of a serving run. numpy and the standard library only: the sealed
child imports this module from its copy of the twin (twin/seal.py CHILD_FILES)."""
from __future__ import annotations

import dataclasses
import importlib
import re
import traceback

import numpy as np

__all__ = ["flat_config", "grouped", "importable", "layout_arrays", "pad_rows", "serve"]


def flat_config(obj, prefix: str = "") -> dict[str, np.ndarray]:
    """A config as {dotted field path: array}: dataclass fields and dict keys (sorted) recursively, sequences by
    index, bools as bool, integers as int64, floats as float32, strings and None as str; an empty container
    still says it is there."""
    if dataclasses.is_dataclass(obj):
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, dict):
        items = sorted((str(k), v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):  # a tuple on one side and a list on the other are the same config
        items = list(enumerate(obj))
    elif obj is None or isinstance(obj, str):
        return {prefix: np.str_(str(obj))}
    elif isinstance(obj, (bool, np.bool_)):
        return {prefix: np.bool_(obj)}
    elif isinstance(obj, (int, np.integer)):
        return {prefix: np.int64(obj)}
    else:  # a float, or an array of them
        return {prefix: np.asarray(obj, np.float32)}
    if not items:
        return {prefix: np.str_(type(obj).__name__ + "()")}
    out = {}
    for k, v in items:
        out.update(flat_config(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def importable(modules) -> dict[str, np.ndarray]:
    """{module: 1 if it imports, else 0} (candidate side; the failure's traceback goes to the child's stderr)."""
    out = {}
    for module in map(str, modules):
        try:
            importlib.import_module(module)
            out[module] = np.int32(1)
        except Exception:  # any failure while importing is the finding, reported per module
            traceback.print_exc()
            out[module] = np.int32(0)
    return out


def layout_arrays(layout: dict) -> dict[str, np.ndarray]:
    """{name: shape} -> sorted names, and their shapes i64[n, max rank] padded with -1."""
    names = sorted(layout)
    shapes = np.full((len(names), max(map(len, layout.values()), default=0)), -1, np.int64)
    for i, name in enumerate(names):
        shapes[i, : len(layout[name])] = layout[name]
    return {"names": np.array(names), "shapes": shapes}


def grouped(inp: dict, letter: str) -> list[dict]:
    """{"<letter><i>.<rest>": v} -> [{rest: v} for i in order] (s<i>: a step, m<i>: a micro-batch, p<i>: a prompt):
    the flat inputs file's names for nested batches."""
    groups: dict[int, dict] = {}
    for key, v in inp.items():
        m = re.fullmatch(rf"{letter}(\d+)\.(.+)", key)
        if m:
            groups.setdefault(int(m[1]), {})[m[2]] = v
    return [groups[i] for i in sorted(groups)]


def pad_rows(rows, width=None, fill=-1, dtype=np.int64) -> np.ndarray:
    width = max(map(len, rows), default=0) if width is None else width
    out = np.full((len(rows), width), fill, dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def serve(engine, sampling_params_cls, inp, max_steps: int = 500) -> dict[str, np.ndarray]:
    """Add each request at its arrival step, step() until every one finished -> the scheduler's stats, the
    chosen tokens' log-probs, the output ids. `engine` and `sampling_params_cls` are either side's own."""
    prompts = [[int(x) for x in row if x >= 0] for row in inp["prompts"]]
    done, step = {}, 0
    while len(done) < len(prompts):
        if step >= max_steps:
            raise RuntimeError(f"{len(prompts) - len(done)} requests unfinished after {max_steps} steps")
        for i in np.flatnonzero(inp["arrival_step"] == step):
            seed = int(inp["seed"][i])
            images = {"images": [inp[f"image_{i}"].astype(np.uint8)]} if f"image_{i}" in inp else {}
            engine.add_request(str(i), prompts[i], sampling_params_cls(
                temperature=float(inp["temperature"][i]), top_k=int(inp["top_k"][i]), top_p=float(inp["top_p"][i]),
                max_tokens=int(inp["max_tokens"][i]), seed=None if seed < 0 else seed, ignore_eos=True, logprobs=0),
                **images)
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        step += 1
    outs = [done[str(i)] for i in range(len(prompts))]
    stats = engine.stats()
    width = int(inp["max_tokens"].max())
    return {**{k: np.int64(stats[k]) for k in ("num_steps", "num_prefix_hit_blocks", "num_preemptions",
                                               "num_free_blocks")},
            "logprobs": pad_rows([[lp[tok].logprob for tok, lp in zip(o.output_token_ids, o.logprobs)] for o in outs],
                                 width, 0.0, np.float32),
            "output_ids": pad_rows([o.output_token_ids for o in outs], width)}
