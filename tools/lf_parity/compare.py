"""What LLaMA-Factory did against what the torch source does: exact for tokens, max abs difference for numbers.

Every function returns a plain dict (json-able): `max_abs` (None when there was nothing to compare), `max_scaled`
(the largest |LF - source| / max(1, |source|): what the tolerance judges), `n` (how many values were compared)
and, where they differ in kind (a missing step, a key only one side has, a different token), `error` naming the
first difference.

The tolerance is 1e-5 absolute up to magnitude 1 and relative beyond: a summed log-prob near -40 or a summed entropy
near 70 has a float32 spacing of 4e-6 to 8e-6, so an absolute 1e-5 there would judge one or two roundings.
"""

from __future__ import annotations

import math

import numpy as np

TOLERANCE = 1e-5  # issue 31: every comparable quantity within 1e-5 of LLaMA-Factory's
PIXEL_TOLERANCE = 1e-6  # issue 32: the collated pixel values, exact or within 1e-6 (a cell's own "tolerance")
# the collated batch's float tensors (max abs difference); every other tensor (ids, masks, labels, image grids,
# M-RoPE positions and deltas, the audio frame mask) is compared exactly
FLOAT_BATCH_KEYS = ("pixel_values", "input_features")
# Qwen2.5-Omni's audio tensors, [A, mel, frames] and [A, frames]: the frame count is the feature extractor's padded
# length (chunk_length * sampling_rate / hop_length). Where only that differs, the common frames are still compared
# and the longer side's extra frames must be masked out; the difference is an error (the cell fails), reported once
# with the two lengths, and the remaining batches are still compared.
AUDIO_FRAME_KEYS = ("input_features", "feature_attention_mask")


def _first_token_difference(lf_rows: list[dict], rows: list[dict]) -> str | None:
    if len(lf_rows) != len(rows):
        return f"{len(lf_rows)} rows from LF, {len(rows)} from the source"
    for i, (a, b) in enumerate(zip(lf_rows, rows)):
        for key in sorted(a):
            x, y = list(a[key]), list(b.get(key, []))
            if x != y:
                pos = next((p for p, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                return (f"row {i} {key}[{pos}]: LF {x[pos:pos + 4]} vs source {y[pos:pos + 4]} "
                        f"(lengths {len(x)} and {len(y)})")
    return None


def compare_tokens(lf: dict, source: dict) -> dict:
    """lf, source: {variant: {split: [rows]}} -> {"rows": n, "error": first difference or None, "variants": [...]}."""
    n, errors = 0, []
    for variant, splits in source.items():
        refused = ("refused" in splits, "refused" in lf.get(variant, {}))
        if any(refused):  # a variant the template refuses must be refused by both
            if not all(refused):
                errors.append(f"{variant}: refused by {'the source' if refused[0] else 'LF'} only")
            continue
        for split, rows in splits.items():
            lf_rows = lf.get(variant, {}).get(split)
            if lf_rows is None:
                errors.append(f"{variant}/{split}: LF produced no {split} set")
                continue
            keys = sorted(lf_rows[0]) if lf_rows else []
            error = _first_token_difference(lf_rows, [{k: r[k] for k in keys if k in r} for r in rows])
            if error:
                errors.append(f"{variant}/{split}: {error}")
            n += len(rows)
    return {"rows": n, "variants": sorted(source), "error": "; ".join(errors) or None,
            "refused": sorted(v for v, splits in source.items() if "refused" in splits)}


def compare_values(lf, source) -> dict:
    """Two equal-length sequences (or scalars) of floats -> max abs difference; NaN on either side is an error."""
    a, b = np.atleast_1d(np.asarray(lf, np.float64)), np.atleast_1d(np.asarray(source, np.float64))
    if a.shape != b.shape:
        return {"max_abs": None, "n": 0, "error": f"shapes differ: LF {a.shape}, source {b.shape}"}
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return {"max_abs": None, "n": int(a.size), "error": "a non-finite value"}
    if not a.size:
        return {"max_abs": None, "max_scaled": None, "n": 0, "error": None}
    diff = np.abs(a - b)
    return {"max_abs": float(diff.max()), "max_scaled": float((diff / np.maximum(1.0, np.abs(b))).max()),
            "n": int(a.size), "error": None}


def compare_adapters(lf: dict | None, source: dict) -> dict:
    """{peft name: array} on both sides (LF's saved adapter_model.safetensors) -> max abs over every entry."""
    if lf is None:
        return {"max_abs": None, "n": 0, "error": "LF saved no adapter"}
    if lf.keys() != source.keys():
        return {"max_abs": None, "n": 0, "error": f"names differ: LF only {sorted(lf.keys() - source.keys())[:3]}, "
                                                  f"source only {sorted(source.keys() - lf.keys())[:3]}"}
    results = []
    for name, value in source.items():
        result = compare_values(lf[name].ravel(), np.asarray(value).ravel())
        if result["error"]:
            return {**result, "error": f"{name}: {result['error']}"}
        results.append(result)
    return merge(results)


def compare_batches(lf: list[dict] | None, source: list[dict]) -> dict:
    """LF's collated training batches (what its trainer was handed, in order) against the source collator's on
    the same rows: every integer tensor exactly, the float ones (FLOAT_BATCH_KEYS) by max abs difference, judged at
    PIXEL_TOLERANCE. LF's position_ids carry a 4th row in front (its collator prepends a copy of the temporal
    row: transformers' text positions); rows 1-3 are compared with the source's 3, and row 0 with row 1."""
    if not lf:
        return {"max_abs": None, "n": 0, "error": "LF recorded no batches", "tolerance": PIXEL_TOLERANCE}
    if len(lf) != len(source):
        return {"max_abs": None, "n": 0, "error": f"{len(lf)} batches from LF, {len(source)} from the source",
                "tolerance": PIXEL_TOLERANCE}
    n, worst, errors, frames = 0, 0.0, [], {}
    for i, (a, b) in enumerate(zip(lf, source)):
        a = {k: np.asarray(v) for k, v in a.items()}
        if "position_ids" in a and a["position_ids"].ndim == 3 and a["position_ids"].shape[0] == 4:
            if not np.array_equal(a["position_ids"][0], a["position_ids"][1]):
                errors.append(f"batch {i}: LF's position_ids row 0 is not its temporal row")
            a["position_ids"] = a["position_ids"][1:]
        if a.keys() != b.keys():
            errors.append(f"batch {i}: keys differ: LF only {sorted(a.keys() - b.keys())}, source only "
                          f"{sorted(b.keys() - a.keys())}")
        for key in sorted(a.keys() & b.keys()):
            x, y = a[key], np.asarray(b[key])
            if x.shape != y.shape and key in AUDIO_FRAME_KEYS and x.shape[:-1] == y.shape[:-1]:
                common = min(x.shape[-1], y.shape[-1])
                frames.setdefault(key, (x.shape[-1], y.shape[-1]))
                if key == "feature_attention_mask":  # the longer side's extra frames: masked out
                    longer = x if x.shape[-1] > y.shape[-1] else y
                    if longer[..., common:].any():
                        errors.append(f"batch {i} {key}: frames past {common} are not masked out")
                x, y = x[..., :common], y[..., :common]
            if x.shape != y.shape:
                errors.append(f"batch {i} {key}: shapes LF {x.shape}, source {y.shape}")
                continue
            n += x.size
            if key not in FLOAT_BATCH_KEYS:
                if not np.array_equal(x, y):
                    at = tuple(int(j) for j in np.argwhere(x != y)[0])
                    errors.append(f"batch {i} {key}{list(at)}: LF {x[at]}, source {y[at]}")
            elif x.size:
                worst = max(worst, float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max()))
        if errors:
            break  # the first batch that differs
    if frames:  # after every batch: the frame counts are the only difference unless errors says more
        errors.insert(0, "audio frames: " + ", ".join(f"{k} LF {lf_n}, source {src_n}" for k, (lf_n, src_n)
                                                      in frames.items()) + " (the common frames compared)")
    return {"max_abs": worst, "max_scaled": worst, "n": n, "error": "; ".join(errors) or None,
            "tolerance": PIXEL_TOLERANCE, "batches": len(lf)}


def merge(results: list[dict]) -> dict:
    """Several comparisons as one cell: the worst difference, the first error."""
    errors = [r["error"] for r in results if r.get("error")]
    diffs = [r["max_abs"] for r in results if r.get("max_abs") is not None]
    scaled = [r.get("max_scaled", r["max_abs"]) for r in results if r.get("max_abs") is not None]
    return {"max_abs": max(diffs) if diffs else None, "max_scaled": max(scaled) if scaled else None,
            "n": sum(r.get("n", 0) for r in results), "error": "; ".join(errors) or None}


def within(cell: dict, tolerance: float | None = None) -> bool:
    """No error, something compared, and the scaled difference (max_abs where a cell has no scale) in tolerance
    (the cell's own "tolerance" where it has one, else TOLERANCE)."""
    tolerance = tolerance if tolerance is not None else cell.get("tolerance", TOLERANCE)
    judged = cell.get("max_scaled", cell.get("max_abs"))
    return cell.get("error") is None and judged is not None and not math.isnan(judged) and judged <= tolerance
