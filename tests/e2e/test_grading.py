"""The grader on real candidates: the oracles reach the noise ceiling, a torch import is reward 0,
and a planted migration bug lowers exactly the levels it touches."""
import shutil
from pathlib import Path

import pytest

from catalog.tasks import compose_task
from grader.app import grade

pytestmark = [pytest.mark.sandbox, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
SOLUTION_TREES = ("jax_oracles", "serving_engine", "conversion")
# One task per class in CI, plus the family least like Llama of each class, through the family-generic probes:
# bloom-sft (ALiBi, LayerNorm, interleaved fused qkv, embedding LayerNorm, `transformer.h` layout) and
# gpt-oss-chunked (sinks, a top-k MoE, MXFP4 experts, YaRN and its feature checks). Every task under -m slow
# (`make test-full`); every family's model is also held against transformers and torch in its own fast test.
# CI's smoke subset: Llama training, chunked serving with prefix reuse (Qwen2: the cheapest serving task to grade,
# half gemma4-chunked's L5 time), and a vision-language task (Qwen2-VL SFT: the processor on the shipped images, the
# tower, M-RoPE, pixels through L4-L6); every other recorded task (gemma4, bloom-sft's ALiBi path and gpt-oss
# included) grades in the slow test below (`make test-full`), each family's model against transformers in CI
SMOKE = ("llama3-sft", "qwen2-chunked", "qwen2-vl-sft")
ALL_TASKS = sorted(p.stem for p in (ROOT / "references").glob("*.h5"))


def _copy_oracles(dst: Path) -> Path:
    for tree in SOLUTION_TREES:
        shutil.copytree(ROOT / tree, dst / tree, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _edit(root: Path, rel: str, old: str, new: str) -> None:
    p = root / rel
    text = p.read_text()
    assert text.count(old) == 1, f"{rel}: the edit target must occur exactly once"
    p.write_text(text.replace(old, new))


def _grade(task, candidate, tmp_path, **kw):
    return grade(compose_task(task), candidate, ROOT / "references", tmp_path / "reports", quiet=True, **kw)


def _assert_at_ceiling(report):
    bad = [(c["level"], c["name"], c["score"], c["reason"]) for c in report["checks"]
           if (c["aspect"] == "numeric" and c["score"] < 0.999) or c["score"] < 0.99]
    assert not bad, bad
    assert report["reward"] >= 0.99 and report["earned_levels"] == 6, report["reward"]


@pytest.mark.parametrize("task", SMOKE)
def test_oracle_grades_at_the_noise_ceiling(task, tmp_path):
    _assert_at_ceiling(_grade(task, ROOT, tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("task", [t for t in ALL_TASKS if t not in SMOKE])
def test_every_recorded_task_grades_at_the_noise_ceiling(task, tmp_path):
    _assert_at_ceiling(_grade(task, ROOT, tmp_path))


def test_a_copy_that_imports_torch_through_a_helper_scores_zero(tmp_path):
    cand = _copy_oracles(tmp_path / "cand")
    (cand / "jax_oracles/models/_numerics.py").write_text("import torch\n\nEPS = torch.finfo(torch.float32).eps\n")
    _edit(cand, "jax_oracles/models/llama3.py", "from jax_oracles.training.lora import LoraLinear",
          "from jax_oracles.training.lora import LoraLinear\nfrom jax_oracles.models import _numerics  # noqa")
    report = _grade("llama3-sft", cand, tmp_path)
    assert report["reward"] == 0.0 and report["gated"] and "torch" in report["gated"]
    assert all(c["score"] == 0.0 for c in report["checks"])


def _scores(report):
    return {f'{c["level"]}/{c["name"]}': c["score"] for c in report["checks"]}


@pytest.mark.slow  # CI time (~33 s): the seeded-defect sweep catches a wrong theta (make sweep); make test-full runs it
def test_a_wrong_rope_theta_lowers_rope_and_everything_above_it(tmp_path):
    cand = _copy_oracles(tmp_path / "cand")
    _edit(cand, "jax_oracles/models/rope.py", "np.float64(_f32(theta)) **", "np.float64(_f32(theta * 0.5)) **")
    clean = _scores(_grade("llama3-sft", ROOT, tmp_path, levels=("L1", "L3")))
    bugged = _grade("llama3-sft", cand, tmp_path, levels=("L1", "L3"))
    s = _scores(bugged)
    assert s["L1/rope"] < clean["L1/rope"] - 1e-3
    assert s["L3/logits_b3_t33_pad"] < clean["L3/logits_b3_t33_pad"]
    for untouched in ("L1/rms_norm", "L1/mlp", "L1/attention_core", "L1/lora_linear", "L1/data_tokens"):
        assert s[untouched] == clean[untouched], untouched
    assert bugged["earned_levels"] == 0 and bugged["reward"] < 0.999


@pytest.mark.slow  # CI time: the seeded-defect sweep catches both (make sweep); make test-full runs it
def test_unshifted_labels_lower_the_loss_levels_only(tmp_path):
    cand = _copy_oracles(tmp_path / "cand")
    _edit(cand, "jax_oracles/training/loss.py", "labels[:, 1:]", "labels[:, :-1]")
    s, clean = (_scores(_grade("llama3-sft", c, tmp_path, levels=("L3", "L4"))) for c in (cand, ROOT))
    assert s["L4/loss_step0"] < clean["L4/loss_step0"] - 1e-3
    assert s["L4/lora_grads_step0"] < clean["L4/lora_grads_step0"] - 1e-3
    assert s["L3/logits_b2_t16_pad"] == clean["L3/logits_b2_t16_pad"]


@pytest.mark.slow  # CI time: the seeded-defect sweep catches both (make sweep); make test-full runs it
def test_a_kv_write_off_by_one_slot_lowers_the_paged_levels(tmp_path):
    cand = _copy_oracles(tmp_path / "cand")
    _edit(cand, "serving_engine/kernels/write_kv.py", "jnp.where(slot_mapping < 0, num_slots, slot_mapping)",
          "jnp.where(slot_mapping < 0, num_slots, slot_mapping + 1)")
    s, clean = (_scores(_grade("llama3-core", c, tmp_path, levels=("L1", "L2", "L4"))) for c in (cand, ROOT))
    assert s["L2/decoder_layer_paged"] < clean["L2/decoder_layer_paged"] - 1e-3
    assert s["L4/cache_state"] < clean["L4/cache_state"] - 1e-3
    assert s["L1/norm"] == clean["L1/norm"]
