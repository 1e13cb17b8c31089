"""Properties and literal values of the five measures (grader/scoring/measures.py, DESIGN section 6)."""
import math

from hypothesis import assume, given, settings, strategies as st
from hypothesis.extra import numpy as hnp
import numpy as np
import pytest

from grader.scoring.measures import MEASURES, agreement_score, banded_scalar_score, distributional_score, scalar_score, score, tensor_score

fast = settings(max_examples=50, deadline=None)  # per test: a global profile would leak to other files

# f32 values away from the denormal range: "non-degenerate" inputs for the identity properties
finite = st.floats(-1e3, 1e3, width=32).filter(lambda x: x == 0 or abs(x) > 1e-3)
anything = st.floats(width=32, allow_nan=True, allow_infinity=True)
shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=6)


def f32_arrays(elements=finite, shape=shapes):
    return hnp.arrays(np.float32, shape, elements=elements)


def logits(lo=-10.0, hi=10.0):
    shape = st.tuples(st.integers(1, 4), st.integers(2, 8))
    return hnp.arrays(np.float32, shape, elements=st.floats(lo, hi, width=32))


def one_ulp_up(a):
    return np.nextafter(a, np.float32(np.inf)).astype(np.float32)


# ---------------------------------------------------------------- bounds and failures

@fast
@given(f32_arrays(anything), st.data())
def test_every_measure_stays_in_unit_interval_and_never_nan(a, data):
    b = data.draw(f32_arrays(anything, shape=st.just(a.shape)))
    lo = data.draw(st.floats(-1e3, 1e3))
    hi = lo + data.draw(st.floats(0, 1e3))
    for s in (tensor_score(a, b), scalar_score(a, b), distributional_score(a, b),
              agreement_score(a, b), banded_scalar_score(a, lo, hi)):
        assert isinstance(s, float) and not math.isnan(s) and 0.0 <= s <= 1.0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("measure", ["tensor", "scalar", "agreement"])
def test_nan_or_inf_in_either_operand_scores_zero(measure, bad):
    a = np.array([1.0, 2.0, 3.0], np.float32)
    b = a.copy()
    b[1] = bad
    assert score(measure, b, a) == 0.0
    assert score(measure, a, b) == 0.0


def test_distributional_nan_or_posinf_scores_zero_but_neginf_is_probability_zero():
    a = np.array([[0.0, 1.0, 2.0]], np.float32)
    for bad in (np.nan, np.inf):
        b = a.copy()
        b[0, 0] = bad
        assert distributional_score(b, a) == 0.0
    b = np.array([[-np.inf, 1.0, 2.0]], np.float32)  # top-k style masking: a legal distribution
    assert 0.5 < distributional_score(b, a) < 0.9   # 9% of the mass moved
    tiny = np.array([[-30.0, 1.0, 2.0]], np.float32)  # masking a token of probability ~1e-14
    assert distributional_score(b, tiny) > 1 - 1e-6
    assert distributional_score(np.full((1, 3), -np.inf, np.float32), a) == 0.0  # no distribution


@fast
@given(f32_arrays())
def test_shape_mismatch_scores_zero(a):
    longer = np.concatenate([a.ravel(), a.ravel()[:1]])
    for measure in ("tensor", "scalar", "distributional", "agreement"):
        assert score(measure, longer, a.ravel()) == 0.0
    if a.ndim > 1 and a.shape != a.T.shape:
        assert tensor_score(a.T, a) == 0.0  # same elements, wrong layout


def test_non_numeric_candidate_scores_zero():
    assert tensor_score(["a", "b"], [1.0, 2.0]) == 0.0
    assert agreement_score([object(), 1], [1, 1]) == 0.0


# ---------------------------------------------------------------- identity

@fast
@given(f32_arrays())
def test_identity_scores_one_and_one_ulp_is_still_near_one(a):
    twin = a.astype(np.float64)  # same values, other dtype: promotion makes them identical
    for measure in ("tensor", "scalar", "agreement"):
        assert score(measure, twin, a) == 1.0
    nudged = one_ulp_up(a)
    assert scalar_score(nudged, a) > 1 - 1e-6
    if np.linalg.norm(a) > 1e-2:
        assert tensor_score(nudged, a) > 1 - 1e-6


@fast
@given(logits())
def test_distributional_identity(a):
    assert distributional_score(a.astype(np.float64), a) == 1.0
    assert distributional_score(one_ulp_up(a), a) > 1 - 1e-6


def test_zero_tensors_are_identical_not_degenerate():
    # LoRA-A gradients at step 0 are exactly zero (B = 0): a right answer must score 1
    z = np.zeros((4, 8), np.float32)
    assert tensor_score(z.copy(), z) == 1.0
    assert tensor_score(np.full_like(z, 1e-3), z) == 0.0


def test_empty_vs_empty():
    e = np.zeros((0, 3), np.float32)
    assert agreement_score(e, e.copy()) == 1.0
    assert tensor_score(e, e.copy()) == 1.0
    assert scalar_score(e, e.copy()) == 1.0
    assert agreement_score(e, np.zeros((3, 0))) == 0.0


# ---------------------------------------------------------------- tensor

def test_tensor_literal():
    # cos = 1/sqrt(2), norm ratio = 1/sqrt(2) -> sqrt(1/2)
    assert tensor_score([1.0, 1.0], [1.0, 0.0]) == pytest.approx(math.sqrt(0.5), abs=1e-7)
    assert tensor_score([1.0, 0.0], [-1.0, 0.0]) == 0.0  # anti-aligned: cos clipped at 0
    assert tensor_score([1.0, 0.0], [0.0, 1.0]) == 0.0


@fast
@given(f32_arrays(), st.floats(0.1, 10.0).filter(lambda k: abs(k - 1) > 0.01))
def test_uniform_scaling_lowers_tensor_score(a, k):
    assume(np.linalg.norm(a) > 1e-2)
    s = tensor_score((a * k).astype(np.float32), a)
    assert s < 1.0 - 1e-3
    assert s == pytest.approx(math.sqrt(min(k, 1 / k)), abs=1e-4)  # cos stays 1: the ratio decides


# ---------------------------------------------------------------- scalar

def test_scalar_literal():
    assert scalar_score(1.0, 1.1) == pytest.approx(1 - 0.2 / 2.1, abs=1e-6)
    assert scalar_score([1.0, 2.0], [1.0, 3.0]) == pytest.approx((1 + (1 - 2 / 5)) / 2, abs=1e-6)
    assert scalar_score(0.0, 0.0) == 1.0


@fast
@given(st.floats(1e-3, 1e6), st.sampled_from([3.0, 1 / 3, -1.0]))
def test_scalar_zero_once_values_differ_by_their_mean_magnitude(x, factor):
    # |x - y| = (|x| + |y|) / 2 for y = 3x, x/3; the sign flip y = -x is further still
    y = x * factor
    assert scalar_score(x, y) < 1e-6


# ---------------------------------------------------------------- distributional

@fast
@given(logits(), st.data())
def test_additive_constant_per_row_leaves_distributional_at_one(a, data):
    c = data.draw(hnp.arrays(np.float32, (a.shape[0], 1), elements=st.floats(-10, 10, width=32)))
    assert distributional_score(a + c, a) >= 1 - 1e-6


@fast
@given(logits(-3.0, 3.0), st.one_of(st.floats(0.5, 0.9), st.floats(1.1, 2.0)))
def test_temperature_lowers_distributional(a, t):
    assume((a.max(axis=-1) - a.min(axis=-1)).max() >= 1.0)  # some row is not flat
    assert distributional_score((a * t).astype(np.float32), a) < 1 - 1e-4


def test_distributional_literal_and_mask():
    one_hot_a = np.array([[0.0, -np.inf]], np.float32)
    one_hot_b = np.array([[-np.inf, 0.0]], np.float32)
    assert distributional_score(one_hot_a, one_hot_b) == 0.0  # disjoint supports: JSD = ln 2
    ref = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], np.float32)
    cand = np.array([[1.0, 2.0, 3.0], [np.nan, 5.0, 0.0]], np.float32)
    assert distributional_score(cand, ref) == 0.0
    assert distributional_score(cand, ref, mask=np.array([True, False])) == 1.0  # padding ignored
    with pytest.raises(ValueError):
        distributional_score(cand, ref, mask=np.array([True]))


def test_distributional_axis():
    a = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)
    b = a + np.arange(5, dtype=np.float32)  # constant per column = per position when axis=0
    assert distributional_score(b, a, axis=0) >= 1 - 1e-6
    assert distributional_score(b, a, axis=-1) < 0.99


# ---------------------------------------------------------------- banded

@fast
@given(st.floats(-1e3, 1e3), st.floats(0, 1e3), st.floats(0, 1))
def test_banded_is_one_inside_the_band(lo, width, u):
    hi = lo + width
    assert banded_scalar_score(lo + u * (hi - lo), lo, hi) == 1.0


@fast
@given(st.floats(0.1, 10), st.floats(0.01, 1), st.floats(1e-3, 100))
def test_banded_outside_is_scalar_against_nearest_edge(lo, width, excess):
    hi = lo + width
    assert banded_scalar_score(hi + excess, lo, hi) == pytest.approx(scalar_score(hi + excess, hi))
    assert banded_scalar_score(lo - excess, lo, hi) == pytest.approx(scalar_score(lo - excess, lo))
    assert banded_scalar_score(hi + excess, lo, hi) < 1.0


def test_banded_literal_and_dispatch():
    assert banded_scalar_score(2.2, 1.9, 2.0) == pytest.approx(1 - 0.4 / 4.2, abs=1e-6)
    assert score("banded", 2.2, (1.9, 2.0)) == banded_scalar_score(2.2, 1.9, 2.0)
    assert score("banded", np.array([1.95, 2.2]), np.array([1.9, 2.0])) == pytest.approx(
        (1 + 1 - 0.4 / 4.2) / 2, abs=1e-6)
    assert banded_scalar_score(np.nan, 1.9, 2.0) == 0.0
    with pytest.raises(ValueError):
        banded_scalar_score(2.0, 2.1, 2.0)


# ---------------------------------------------------------------- agreement

def test_agreement_literals():
    assert agreement_score([1, 2, 3], [1, 2, 4]) == pytest.approx(2 / 3)
    assert agreement_score([[1, -100], [5, 6]], [[1, -100], [5, 6]]) == 1.0
    assert agreement_score([1, 2, 3], [1, 2]) == 0.0
    assert agreement_score(np.array([1, 2], np.int32), np.array([1.0, 2.0], np.float32)) == 1.0
    assert agreement_score(np.array([True, False]), np.array([1, 1])) == 0.5
    big = np.array([2**40 + 1], np.int64)  # compared as int64, not rounded through float32
    assert agreement_score(big, big - 1) == 0.0
    assert agreement_score([0.5, np.nan], [0.5, np.nan]) == 0.0


def test_score_dispatch():
    assert set(MEASURES) == {"tensor", "scalar", "distributional", "banded", "agreement"}
    assert score("tensor", [1.0, 1.0], [1.0, 0.0]) == tensor_score([1.0, 1.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="unknown measure"):
        score("cosine", [1.0], [1.0])


def test_error_figures_read_like_a_numerics_report():
    from grader.scoring.measures import DIGITS_CAP, error_figures
    ref = np.array([1.0, -2.0, 4.0], np.float32)
    assert error_figures([(ref.copy(), ref)]) == {"max_abs_diff": 0.0, "rel_l2": 0.0, "digits": DIGITS_CAP}
    f = error_figures([(ref * (1 + 1e-4), ref)])  # every element off by 1e-4 relative: 4 agreeing digits
    assert f["digits"] == pytest.approx(4.0, abs=0.01) and f["max_abs_diff"] == pytest.approx(4e-4, rel=1e-2)
    f = error_figures([(ref, ref), (np.float32([0.0, 3.0]), np.float32([0.0, 3.3]))])  # pooled over outputs
    assert f["rel_l2"] == pytest.approx(0.3 / np.linalg.norm([1, 2, 4, 0, 3.3]), rel=1e-5)
    masked = np.array([0.5, -np.inf, 1.0])  # equal -inf entries (sampler masks) agree
    assert error_figures([(masked.copy(), masked)])["digits"] == DIGITS_CAP
    for bad in (np.array([0.5, 0.0, 1.0]), np.array([0.5, -np.inf]), np.array([np.nan, -np.inf, 1.0])):
        assert error_figures([(bad, masked)]) == {"max_abs_diff": np.inf, "rel_l2": np.inf, "digits": 0.0}
    assert error_figures([(np.float32([1e-7]), np.float32([0.0]))])["digits"] == pytest.approx(7.0, abs=0.01)
    assert error_figures([(["a"], ["a"])]) is None  # nothing numeric to report
