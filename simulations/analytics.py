"""Closed forms the cluster simulator is checked against, and its confidence intervals."""

from __future__ import annotations

import math

import numpy as np

from simulations.layout import _pos_int

__all__ = ["exhaustion_probability", "expected_exhaustions", "mean_ci"]


def exhaustion_probability(*, replicas: int, worker_rate_per_s: float, window_s: float) -> float:
    """P(a worker's failure finds every other replica of its stage down).

    Definition: a stage group's redundancy is *exhausted* by a failure of one of its
    workers at time ``t`` if each of the other ``R - 1`` replicas of that stage failed
    within ``(t - w, t]``, i.e. is still down in its recovery window ``w`` (a failure
    during a window restarts it, so a worker is down at ``t`` exactly when it failed at
    least once in the last ``w``).

    Derivation, for workers failing independently as Poisson processes of rate ``λ``:
    a failure at ``t`` sees the other workers as an outside observer would (PASTA), and
    each is down with probability ``P(at least one failure in w) = 1 - e^{-λw}``,
    independently. So ``p = (1 - e^{-λw})^{R-1}`` (``p = 1`` for ``R = 1``).

    Raises:
        ValueError: for ``replicas < 1`` or a negative rate or window.
    """
    _pos_int("replicas", replicas)
    if worker_rate_per_s < 0 or window_s < 0:
        raise ValueError(f"rate and window must be >= 0, got {worker_rate_per_s!r}, {window_s!r}")
    return float(-math.expm1(-worker_rate_per_s * window_s)) ** (replicas - 1)


def expected_exhaustions(
    *, stages: int, replicas: int, worker_rate_per_s: float, window_s: float, horizon_s: float
) -> float:
    """Expected number of exhausting failures over ``[0, horizon_s)`` (see
    :func:`exhaustion_probability`), for a job whose workers start alive at ``t = 0``.

    ``E = S R λ ∫_0^H (1 - e^{-λ min(t, w)})^{R-1} dt``: each of the ``S R`` workers fails
    at rate ``λ``, and before ``t = w`` the others have had only ``t`` to fail. The
    probability of at least one exhaustion is ``1 - e^{-E}`` when they are rare.

    Raises:
        ValueError: for non-positive counts or horizon, or a negative rate or window.
    """
    _pos_int("stages", stages)
    p = exhaustion_probability(
        replicas=replicas, worker_rate_per_s=worker_rate_per_s, window_s=window_s
    )
    if not horizon_s > 0:
        raise ValueError(f"horizon_s must be > 0, got {horizon_s!r}")
    ramp = min(window_s, horizon_s)
    t = np.linspace(0.0, ramp, 2001)
    ramp_integral = (
        float(np.trapezoid((-np.expm1(-worker_rate_per_s * t)) ** (replicas - 1), t))
        if ramp > 0
        else 0.0
    )
    return stages * replicas * worker_rate_per_s * ((horizon_s - ramp) * p + ramp_integral)


def mean_ci(values: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """Mean and two-sided Student-t confidence interval of per-seed values.

    The t quantile uses the Cornish-Fisher expansion (within 0.3% for 3+ degrees of
    freedom), so no scipy is needed. With one value the interval is ``(nan, nan)``.

    Raises:
        ValueError: if ``level`` is not in (0, 1) or ``values`` is empty.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("mean_ci needs at least one value")
    m = float(x.mean())
    n = x.size
    if n < 2:
        return m, math.nan, math.nan
    z = _normal_quantile(0.5 + level / 2)
    nu = n - 1
    t = (
        z
        + (z**3 + z) / (4 * nu)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * nu**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * nu**3)
    )
    half = t * float(x.std(ddof=1)) / math.sqrt(n)
    return m, m - half, m + half


def _normal_quantile(p: float) -> float:
    # Acklam's rational approximation refined by one Newton step: |error| < 1e-12.
    a = (
        -39.69683028665376,
        220.9460984245205,
        -275.9285104469687,
        138.3577518672690,
        -30.66479806614716,
        2.506628277459239,
    )
    b = (
        -54.47609879822406,
        161.5858368580409,
        -155.6989798598866,
        66.80131188771972,
        -13.28068155288572,
    )
    c = (
        -0.007784894002430293,
        -0.3223964580411365,
        -2.400758277161838,
        -2.549732539343734,
        4.374664141464968,
        2.938163982698783,
    )
    d = (0.007784695709041462, 0.3224671290700398, 2.445134137142996, 3.754408661907416)
    if p < 0.02425:
        s = math.sqrt(-2 * math.log(p))
        x = (((((c[0] * s + c[1]) * s + c[2]) * s + c[3]) * s + c[4]) * s + c[5]) / (
            (((d[0] * s + d[1]) * s + d[2]) * s + d[3]) * s + 1
        )
    elif p > 1 - 0.02425:
        return -_normal_quantile(1 - p)
    else:
        s = p - 0.5
        r = s * s
        x = (
            (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5])
            * s
            / (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
        )
    err = 0.5 * math.erfc(-x / math.sqrt(2)) - p
    return x - err * math.sqrt(2 * math.pi) * math.exp(x * x / 2)
