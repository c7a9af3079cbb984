"""Real daily market data (bundled with the ``arch`` package) as windowed features for sequence models.

Sources (all shipped inside ``arch.data``, no network access):

* ``arch.data.sp500``  -- S&P 500 index, daily OHLC + volume, 1999-01-04 .. 2018-12-31.
* ``arch.data.nasdaq`` -- NASDAQ Composite, daily OHLC + volume, same dates.
* ``arch.data.wti``    -- WTI crude spot (FRED ``DCOILWTICO``), daily close only, 1986 .. 2019.
* ``arch.data.vix``    -- CBOE VIX close, daily, but **only 2014-01-03 .. 2019-01-03**.

``arch.data.crude`` (Brent/WTI), ``core_cpi``, ``default`` and ``frenchdata`` are monthly and are not used.

Because the bundled VIX starts in 2014, inner-joining it would discard 1999-2013 (the whole default training
span), so VIX is *not* part of :func:`load_prices` / :func:`build_features`; it is loaded by :func:`load_vix`
and used only for the ``"trailing_vix"`` baseline, evaluated on the windows whose last day has a VIX close.

Pipeline: :func:`load_prices` (inner join on trading dates) -> :func:`build_features` (``m = 48`` causal
features per day) -> :func:`target` (S&P 500 next-day large-move label) -> :func:`make_windows` (``[N, T, m]``
float32 windows, chronological train/val/test split, train-only z-scoring).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pandas as pd

from jaxfox._validate import positive_int

__all__ = [
    "FEATURE_NAMES", "MarketWindows", "auc", "build_features", "load_prices", "load_vix",
    "make_windows", "target",
]

_EQUITIES = ("sp500", "nasdaq")
_OHLCV = ("Open", "High", "Low", "Close", "Volume")
_MEDIAN_DAYS = 252  # trailing window of the label's threshold
_CLIP = 10.0


_COMMON = ("ret", "ret_lag1", "ret_lag2", "ret_lag3", "ret_lag4", "absret_mean5", "hl_range", "open_close",
           "rv5", "rv21", "rv63", "parkinson21", "log_rv5_rv63", "volume_z63", "volume_chg", "ma21_dist",
           "ma63_dist", "ma252_dist", "drawdown252")

FEATURE_NAMES: list[str] = [
    *(f"sp500_{n}" for n in _COMMON), "sp500_log_absret5_med252",
    *(f"nasdaq_{n}" for n in _COMMON), "nasdaq_gap",
    "wti_ret", "wti_rv5", "wti_rv21", "wti_ma63_dist",
    "sp500_nasdaq_corr63", "sp500_wti_corr63",
    "dow_sin", "dow_cos",
]
"""Column order of :func:`build_features` (48 names). S&P 500 features come first, so ``max_features=k``
keeps the k most target-relevant blocks first. ``sp500_log_absret5_med252`` is
``log(mean |r| over 5 days / median |r| over 252 days)``. There is no ``sp500_gap`` (overnight
``log(open_t / close_{t-1})``): in the bundled S&P 500 data the open equals the previous close on ~95% of
days in 1999-2005 (a vendor artefact), so that feature would be non-stationary; ``nasdaq_gap`` is clean. For
the same reason ``sp500_open_close`` equals ``sp500_ret`` on most 1999-2005 days. Units: log returns / log
ratios in natural-log units per trading day (not annualised); vols are rolling standard deviations of daily
log returns; ``volume_z63`` is a 63-day rolling z-score of log volume; ``*_corr63`` are 63-day rolling
correlations of daily log returns; ``dow_*`` encode the weekday (Mon=0..Fri=4) on a circle of period 5."""


@functools.lru_cache(maxsize=1)
def _load_prices() -> pd.DataFrame:
    from arch.data import nasdaq, sp500, wti

    frames = []
    for inst, mod in zip(_EQUITIES, (sp500, nasdaq)):
        df = mod.load()[list(_OHLCV)].astype("float64")
        # NASDAQ reports Volume == 0 on two days (2015-05-12, 2018-01-09): a data gap -> carry last volume.
        df["Volume"] = df["Volume"].mask(df["Volume"] <= 0).ffill()
        frames.append(df.rename(columns=lambda c, i=inst: f"{i}_{c.lower()}"))
    frames.append(wti.load()["DCOILWTICO"].rename("wti_close").astype("float64").to_frame())
    prices = pd.concat([f.dropna() for f in frames], axis=1, join="inner").sort_index()
    prices.index = pd.DatetimeIndex(prices.index, name="date")
    return prices


def load_prices() -> pd.DataFrame:
    """Aligned daily prices of S&P 500, NASDAQ Composite and WTI crude (``arch.data``), 1999-2018.

    Returns:
      DataFrame ``[D days, 11 columns]`` float64 with a sorted ``DatetimeIndex`` named ``date`` and no NaNs:
      ``sp500_{open,high,low,close,volume}``, ``nasdaq_{open,high,low,close,volume}`` (index points; volume in
      shares) and ``wti_close`` (USD/barrel). Rows are the inner join of the trading dates of all three series
      (``D = 5012``: 19 equity trading days without a WTI print are dropped). ``Adj Close`` is omitted (it
      equals ``Close`` for these indices); two zero-volume NASDAQ days are forward-filled. A fresh copy of a
      memoised frame is returned on every call.
    """
    return _load_prices().copy()


@functools.lru_cache(maxsize=1)
def _load_vix() -> pd.Series:
    from arch.data import vix

    s = vix.load()["vix"].astype("float64").dropna().rename("vix_close")
    s.index = pd.DatetimeIndex(s.index, name="date")
    return s.sort_index()


def load_vix() -> pd.Series:
    """CBOE VIX daily close (index points) from ``arch.data.vix``: float64 Series, ``DatetimeIndex``, no NaNs.

    Covers only 2014-01-03 .. 2019-01-03 (that is all ``arch`` ships), hence not part of :func:`load_prices`.
    """
    return _load_vix().copy()


def _equity_features(p: pd.DataFrame, inst: str) -> dict[str, pd.Series]:
    o, h, l, c, v = (p[f"{inst}_{k}"] for k in ("open", "high", "low", "close", "volume"))
    r = np.log(c).diff()
    hl = np.log(h / l)
    logv = np.log(v)
    rv = {w: r.rolling(w).std() for w in (5, 21, 63)}
    f = {"ret": r, **{f"ret_lag{k}": r.shift(k) for k in range(1, 5)},
         "absret_mean5": r.abs().rolling(5).mean(), "hl_range": hl, "open_close": np.log(c / o),
         "gap": np.log(o / c.shift(1)), **{f"rv{w}": s for w, s in rv.items()},
         "parkinson21": np.sqrt((hl**2).rolling(21).mean() / (4.0 * np.log(2.0))),
         "log_rv5_rv63": np.log(rv[5] / rv[63]),
         "volume_z63": (logv - logv.rolling(63).mean()) / logv.rolling(63).std(),
         "volume_chg": logv.diff(),
         **{f"ma{w}_dist": np.log(c / c.rolling(w).mean()) for w in (21, 63, 252)},
         "drawdown252": np.log(c / c.rolling(252).max()),
         "log_absret5_med252": np.log(r.abs().rolling(5).mean() / r.abs().rolling(252).median())}
    return {f"{inst}_{k}": s for k, s in f.items()}


def _check_prices(prices, need) -> None:
    """ValueError naming ``prices`` unless it is a DataFrame with the columns ``need`` and a strictly increasing
    DatetimeIndex: the rolling windows, lags and next-day shifts read row order as time order."""
    if not isinstance(prices, pd.DataFrame):
        raise ValueError(f"prices must be a pandas DataFrame (load_prices()), got {type(prices).__name__}")
    if missing := [c for c in need if c not in prices.columns]:
        raise ValueError(f"prices is missing columns {missing}")
    if not isinstance(prices.index, pd.DatetimeIndex):
        raise ValueError(f"prices must have a DatetimeIndex of trading dates, got {type(prices.index).__name__}")
    if not (prices.index.is_monotonic_increasing and prices.index.is_unique):
        raise ValueError("prices must be sorted by date with no duplicate dates (strictly increasing index): row "
                         "order is time order for the rolling windows, lags and next-day label")


def build_features(prices: pd.DataFrame) -> pd.DataFrame:
    """Causal per-day features (see :data:`FEATURE_NAMES` for names and units) from :func:`load_prices` output.

    Every value on row ``t`` uses only prices of days ``<= t`` (backward rolling windows, lags, calendar),
    i.e. it is known at the close of day ``t``: no look-ahead.

    Args:
      prices: DataFrame ``[D days, ...]`` with the columns of :func:`load_prices` and a ``DatetimeIndex``.

    Returns:
      float64 DataFrame ``[D days, m = 48 features]``, columns :data:`FEATURE_NAMES`, same index as
      ``prices``. The first rows are NaN during rolling warm-up (a 252-day median of returns needs 253
      prices, so rows ``0..251`` have NaNs); later rows are finite.

    Raises:
      ValueError: if ``prices`` lacks a required column, or its index is not a strictly increasing (sorted,
        duplicate-free) ``DatetimeIndex`` (rolling windows over unsorted rows would look ahead).
    """
    need = [f"{i}_{k}" for i in _EQUITIES for k in ("open", "high", "low", "close", "volume")] + ["wti_close"]
    _check_prices(prices, need)
    f = _equity_features(prices, "sp500") | _equity_features(prices, "nasdaq")
    rets = np.log(prices[["sp500_close", "nasdaq_close", "wti_close"]]).diff()
    w = rets["wti_close"]
    f |= {"wti_ret": w, "wti_rv5": w.rolling(5).std(), "wti_rv21": w.rolling(21).std(),
          "wti_ma63_dist": np.log(prices["wti_close"] / prices["wti_close"].rolling(63).mean()),
          "sp500_nasdaq_corr63": rets["sp500_close"].rolling(63).corr(rets["nasdaq_close"]),
          "sp500_wti_corr63": rets["sp500_close"].rolling(63).corr(w)}
    dow = 2.0 * np.pi * prices.index.day_of_week.to_numpy() / 5.0
    f |= {"dow_sin": pd.Series(np.sin(dow), prices.index), "dow_cos": pd.Series(np.cos(dow), prices.index)}
    return pd.DataFrame(f, index=prices.index)[FEATURE_NAMES].astype("float64")


@functools.lru_cache(maxsize=1)
def _features() -> pd.DataFrame:
    return build_features(_load_prices())


def target(prices: pd.DataFrame) -> pd.Series:
    """Next-day large-move label for the S&P 500.

    With ``r_d = log(close_d / close_{d-1})`` (S&P 500, on the :func:`load_prices` calendar), the label of
    day ``t`` is ``1.0`` if ``|r_{t+1}| > median(|r_{t-251}|, ..., |r_t|)`` (the 252 trading days ending at
    ``t``), else ``0.0``.

    Returns:
      float64 Series ``[D days]`` named ``target``, same index as ``prices``. NaN where undefined: the first
      252 days (``r_0`` does not exist, so the first full 252-return window ends at day 252) and the last day.

    Raises:
      ValueError: ``prices`` lacks ``sp500_close`` or its index is not a strictly increasing ``DatetimeIndex``.
    """
    _check_prices(prices, ["sp500_close"])
    a = np.log(prices["sp500_close"]).diff().abs()
    med = a.rolling(_MEDIAN_DAYS).median()
    nxt = a.shift(-1)
    return (nxt > med).astype("float64").where(nxt.notna() & med.notna()).rename("target")


def auc(scores, labels) -> float:
    """ROC AUC via the Mann-Whitney U statistic (ties in ``scores`` get average ranks, i.e. count 1/2).

    Args:
      scores: array-like ``[n]`` of finite real scores (higher = more likely positive).
      labels: array-like ``[n]`` of 0/1 labels (bool / int / float).

    Returns:
      P(score of a random positive > score of a random negative) + 0.5 * P(tie), a float in [0, 1].

    Raises:
      ValueError: naming ``scores``/``labels`` on shape mismatch, non-finite scores, labels outside {0, 1},
      or when only one class is present.
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels, dtype=np.float64).ravel()
    if s.shape != y.shape:
        raise ValueError(f"scores and labels must have the same length, got {s.size} and {y.size}")
    if not np.isfinite(s).all():
        raise ValueError("scores must be finite")
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError("labels must be 0 or 1")
    pos = y == 1.0
    n1, n0 = int(pos.sum()), int((~pos).sum())
    if n1 == 0 or n0 == 0:
        raise ValueError("labels must contain both classes")
    ranks = pd.Series(s).rank(method="average").to_numpy()
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


@dataclasses.dataclass(frozen=True)
class MarketWindows:
    """Windowed, normalised market features with chronological splits (see :func:`make_windows`).

    Attributes:
      x_train, x_val, x_test: float32 ``[N windows, T time, m features]``, z-scored with training statistics
        and clipped to ``[-10, 10]``; ``x[i, -1]`` is the last (most recent) day of window ``i``.
      y_train, y_val, y_test: float32 ``[N]`` in ``{0, 1}``: :func:`target` of each window's last day.
      dates_train, dates_val, dates_test: ``datetime64[ns]`` ``[N]``: date of each window's last day.
      feature_names: the ``m`` names of the feature axis (a prefix of :data:`FEATURE_NAMES`).
      baselines: ``{"trailing_abs_return": (val_auc, test_auc), "trailing_vix": (val_auc, test_auc)}``,
        single-score AUCs (see :func:`make_windows`).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    dates_train: np.ndarray
    dates_val: np.ndarray
    dates_test: np.ndarray
    feature_names: list[str]
    baselines: dict


def _timestamp(value, name: str) -> pd.Timestamp:
    try:
        ts = pd.Timestamp(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} is not a valid date: {value!r}") from e
    if pd.isna(ts):
        raise ValueError(f"{name} is not a valid date: {value!r}")
    if ts.tz is not None:  # the data's dates are tz-naive: comparing them with an aware date raises a TypeError
        raise ValueError(f"{name} must be a date without a time zone (the data's dates are tz-naive), got {value!r}")
    return ts


def make_windows(window: int = 64, *, train_end: str = "2012-12-31", val_end: str = "2015-12-31",
                 max_features: int | None = None) -> MarketWindows:
    """Sliding windows of :func:`build_features` with :func:`target` labels, split chronologically.

    * Rows with any NaN feature (the 252-day rolling warm-up at the start) are dropped before windowing
      (judged on all 48 features, so ``max_features`` does not change N or the dates).
    * A window ending on day ``t`` holds the feature rows of days ``t-T+1..t`` (``T = window``) and is
      labelled ``target(t)``; windows with a NaN label are dropped.
    * Split by the last day ``t``: train ``t <= train_end < `` val ``t <= val_end <`` test. The label of ``t``
      looks at day ``t+1``, so a window is also dropped (purged) if day ``t+1`` lies in the next split: every
      label is computed from returns strictly inside its own split's span or before it (the label's trailing
      median and the window's features may reach back across a boundary; both are past data). This purges one
      window at each of the two boundaries.
    * Normalisation: each feature is z-scored with the mean and (population) std over the feature rows that
      fall in training windows (first training window's first day .. last training window's last day, all
      ``<= train_end``), then clipped to ``[-10, 10]`` and cast to float32. Validation/test rows are never
      used for the statistics.
    * Baselines (AUC of a single score against the labels, val and test windows):
      ``"trailing_abs_return"``: mean of ``|r|`` of the S&P 500 over days ``t-4..t`` (chosen over ``|r_t|``,
      which scores lower on both val and test); ``"trailing_vix"``: VIX close on day ``t``. VIX exists only
      from 2014-01-03, so the VIX AUC uses the windows whose last day has a VIX close (with the default
      dates: the 2014-2015 part of validation and all of test); NaN if a split has no such window.

    Args:
      window: ``T``, days per window (int >= 2).
      train_end: last date (inclusive) of the training split; anything ``pandas.Timestamp`` parses.
      val_end: last date (inclusive) of the validation split; must be after ``train_end``.
      max_features: keep the first ``max_features`` of :data:`FEATURE_NAMES` (>= 1; values above ``m`` keep
        all); ``None`` keeps all 48.

    Returns:
      :class:`MarketWindows`. With the defaults: N = 3190 / 755 / 749 (train / val / test), m = 48.

    Raises:
      ValueError: naming ``window`` (not an int >= 2, or so long a split is empty), ``train_end`` / ``val_end``
        (unparseable, with a time zone, or not ``train_end < val_end``), or ``max_features`` (< 1).
    """
    window = positive_int("window", window, 2)
    t_end, v_end = _timestamp(train_end, "train_end"), _timestamp(val_end, "val_end")
    if not t_end < v_end:
        raise ValueError(f"train_end ({train_end}) must be before val_end ({val_end})")
    if max_features is not None:
        max_features = positive_int("max_features", max_features)

    prices = _load_prices()
    names = FEATURE_NAMES[:max_features]
    feats = _features().dropna()[names]  # drop warm-up rows of all 48 features: N does not depend on m
    if window > len(feats):
        raise ValueError(f"window ({window}) is longer than the {len(feats)} available days")
    end = feats.index.to_numpy()[window - 1:]  # [N] last day of each candidate window
    y = target(prices).reindex(feats.index).to_numpy()[window - 1:]
    nxt = prices.index.to_series().shift(-1).reindex(feats.index).to_numpy()[window - 1:]  # day t+1 (NaT last)
    ok = ~np.isnan(y)
    split = {
        "train": ok & (end <= t_end) & (nxt <= t_end),
        "val": ok & (end > t_end) & (end <= v_end) & (nxt <= v_end),
        "test": ok & (end > v_end),
    }
    for k, m in split.items():
        if not m.any():
            raise ValueError(f"window={window}, train_end={train_end}, val_end={val_end}: empty {k} split")

    x = feats.to_numpy()
    idx = np.flatnonzero(split["train"])  # window i covers rows i .. i+T-1
    rows = x[idx[0]:idx[-1] + window]  # every row that falls in a training window (they are contiguous)
    mu, sd = rows.mean(axis=0), rows.std(axis=0)
    x = np.clip((x - mu) / np.where(sd > 0, sd, 1.0), -_CLIP, _CLIP).astype(np.float32)
    xw = np.lib.stride_tricks.sliding_window_view(x, window, axis=0)  # [N, m, T] view, no copy

    absret5 = np.log(prices["sp500_close"]).diff().abs().rolling(5).mean().reindex(feats.index).to_numpy()
    vix = _load_vix().reindex(feats.index).to_numpy()

    def score_auc(score, m):
        s = score[window - 1:][m]
        keep = ~np.isnan(s)
        yy = y[m][keep]
        return auc(s[keep], yy) if keep.any() and 0 < yy.sum() < yy.size else float("nan")

    out = {}
    for k, m in split.items():
        out[f"x_{k}"] = np.ascontiguousarray(xw[m].transpose(0, 2, 1))
        out[f"y_{k}"] = y[m].astype(np.float32)
        out[f"dates_{k}"] = end[m].astype("datetime64[ns]")
    baselines = {name: (score_auc(s, split["val"]), score_auc(s, split["test"]))
                 for name, s in (("trailing_abs_return", absret5), ("trailing_vix", vix))}
    return MarketWindows(**out, feature_names=list(names), baselines=baselines)

