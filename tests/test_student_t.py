"""Student's t for whole degrees of freedom (the contest of ``--judge auto``), against the
printed tables' values."""

import pytest

from speceyes import student_t

TABLE = [  # (p, dof, t): quantiles as tables print them, to three decimals
    (0.975, 1, 12.706), (0.975, 2, 4.303), (0.975, 3, 3.182), (0.975, 4, 2.776),
    (0.975, 10, 2.228), (0.975, 30, 2.042), (0.95, 1, 6.314), (0.95, 6, 1.943),
    (0.995, 5, 4.032), (0.025, 3, -3.182),
]


@pytest.mark.parametrize(("p", "dof", "t"), TABLE)
def test_quantiles_match_the_tables(p, dof, t):
    assert student_t.quantile(p, dof) == pytest.approx(t, abs=5e-4)
    assert student_t.cdf(t, dof) == pytest.approx(p, abs=1e-4)


def test_the_cdf_is_symmetric_and_matches_closed_forms():
    assert student_t.cdf(0.0, 7) == pytest.approx(0.5)
    assert student_t.cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(1)/pi
    assert student_t.cdf(2.0, 2) == pytest.approx(0.5 + 2 / (2 * 6**0.5))  # 1/2 + t/(2 sqrt(2+t^2))
    assert student_t.cdf(-1.3, 5) == pytest.approx(1 - student_t.cdf(1.3, 5))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="degrees of freedom"):
        student_t.cdf(1.0, 0)
    with pytest.raises(ValueError, match="p must be"):
        student_t.quantile(1.0, 3)
