"""Tests for jaxfox.data.market (real arch-bundled daily data; CPU only, a few seconds)."""

import itertools

import numpy as np
import pandas as pd
import pytest

from jaxfox.data import market


@pytest.fixture(scope="module")
def w():
    return market.make_windows()


SPLITS = ("train", "val", "test")


def test_prices_aligned():
    p = market.load_prices()
    assert isinstance(p.index, pd.DatetimeIndex) and p.index.is_monotonic_increasing and p.index.is_unique
    assert not p.isna().any().any()
    assert p.index[0].year == 1999 and p.index[-1].year == 2018
    assert p is not market.load_prices()  # memoised, but callers get copies


def test_features_causal_and_finite():
    p = market.load_prices()
    f = market.build_features(p)
    assert list(f.columns) == market.FEATURE_NAMES and len(market.FEATURE_NAMES) == 48
    body = f.dropna()
    assert len(f) - len(body) == 252 and body.index[0] == f.index[252]
    assert np.isfinite(body.to_numpy()).all()
    # No look-ahead: scrambling every price after a cut date leaves features up to the cut unchanged.
    cut = p.index[3000]
    q = p.copy()
    rng = np.random.default_rng(0)
    q.loc[q.index > cut] *= rng.uniform(0.5, 2.0, size=q.loc[q.index > cut].shape)
    g = market.build_features(q)
    pd.testing.assert_frame_equal(f.loc[:cut], g.loc[:cut])
    assert not f.loc[f.index > cut].equals(g.loc[g.index > cut])


def test_shapes_dtypes(w):
    m = len(market.FEATURE_NAMES)
    assert w.feature_names == market.FEATURE_NAMES
    for k in SPLITS:
        x, y, d = getattr(w, f"x_{k}"), getattr(w, f"y_{k}"), getattr(w, f"dates_{k}")
        assert x.dtype == np.float32 and y.dtype == np.float32 and d.dtype == np.dtype("datetime64[ns]")
        assert x.ndim == 3 and x.shape[1:] == (64, m) and x.shape[0] == y.shape[0] == d.shape[0] > 500
        assert np.isfinite(x).all() and np.abs(x).max() <= 10.0
        assert set(np.unique(y)) == {0.0, 1.0} and 0.4 < y.mean() < 0.6
        assert (np.diff(d) > np.timedelta64(0, "ns")).all()


def test_chronological_split(w):
    assert w.dates_train.max() < w.dates_val.min() and w.dates_val.max() < w.dates_test.min()
    assert w.dates_train.max() <= np.datetime64("2012-12-31") < w.dates_val.min()
    assert w.dates_val.max() <= np.datetime64("2015-12-31") < w.dates_test.min()


def test_windows_match_feature_rows(w):
    # Consecutive training windows overlap by T-1 days; the last row of a window is its end date's features.
    assert np.array_equal(w.x_train[1:, :-1], w.x_train[:-1, 1:])
    small = market.make_windows(8, max_features=5)
    assert small.x_test.shape[1:] == (8, 5) and small.feature_names == market.FEATURE_NAMES[:5]
    assert np.array_equal(small.dates_test, w.dates_test)  # same label days, independent of m


def _raw_labels(dates):
    """Independent numpy label: |r_{t+1}| > median |r| over days t-251..t, raw arch S&P 500 close."""
    from arch.data import sp500, wti

    sp = sp500.load()["Close"]
    common = np.intersect1d(sp.index.to_numpy(), wti.load()["DCOILWTICO"].dropna().index.to_numpy())
    close = sp.to_numpy()[np.searchsorted(sp.index.to_numpy(), common)]
    r = np.abs(np.diff(np.log(close)))  # r[j] is the return of day j+1
    out = []
    for t in np.searchsorted(common, dates):
        assert t >= 252 and t + 1 < len(common)
        out.append(float(r[t] > np.median(r[t - 252:t])))  # r[t] = day t+1; r[t-252:t] = days t-251..t
    return np.array(out)


def test_labels_recomputed_from_raw_close(w):
    rng = np.random.default_rng(1)
    for k in SPLITS:
        d, y = getattr(w, f"dates_{k}"), getattr(w, f"y_{k}")
        pick = np.r_[0, len(d) - 1, rng.choice(len(d), 20, replace=False)]
        np.testing.assert_array_equal(_raw_labels(d[pick]), y[pick])
    p = market.load_prices()
    t = market.target(p)
    assert t.iloc[:252].isna().all() and np.isnan(t.iloc[-1]) and t.iloc[252:-1].notna().all()


def test_labels_strictly_in_split(w):
    idx = market.load_prices().index
    nxt = {k: idx[idx.searchsorted(getattr(w, f"dates_{k}")) + 1] for k in ("train", "val")}
    assert nxt["train"].max() <= pd.Timestamp("2012-12-31")
    assert nxt["val"].max() <= pd.Timestamp("2015-12-31")


def test_normalisation_from_train_only(w):
    rows = np.concatenate([w.x_train[0], w.x_train[1:, -1]])  # each training-span row exactly once
    assert np.abs(rows.mean(0)).max() < 0.01  # clipping at +-10 moves a few features slightly
    assert np.abs(rows.std(0) - 1.0).max() < 0.01
    later = np.concatenate([w.x_val[:, -1], w.x_test[:, -1]])
    assert np.abs(later.mean(0)).max() > 0.1  # statistics were not refit on val/test


def test_auc_matches_bruteforce():
    rng = np.random.default_rng(0)
    for n in (2, 7, 50, 301):
        s = rng.integers(0, 5, n).astype(float)  # many ties
        y = rng.integers(0, 2, n)
        y[:2] = (0, 1)
        pos, neg = s[y == 1], s[y == 0]
        brute = np.mean([(a > b) + 0.5 * (a == b) for a, b in itertools.product(pos, neg)])
        assert market.auc(s, y) == pytest.approx(brute, abs=1e-12)
        assert market.auc(-s, y) == pytest.approx(1.0 - brute, abs=1e-12)
    assert market.auc([1.0, 2.0, 3.0], [0, 0, 1]) == 1.0
    for bad in (([1.0, 2.0], [0, 0]), ([1.0, 2.0], [0, 2]), ([1.0], [0, 1]), ([np.nan, 1.0], [0, 1])):
        with pytest.raises(ValueError):
            market.auc(*bad)


def test_baselines_informative(w):
    assert set(w.baselines) == {"trailing_abs_return", "trailing_vix"}
    for name, (val, test) in w.baselines.items():
        assert 0.55 < val < 0.75 and 0.55 < test < 0.75, (name, val, test)
    d = pd.DatetimeIndex(w.dates_test)
    vix = market.load_vix().reindex(d).to_numpy()
    assert market.auc(vix, w.y_test) == pytest.approx(w.baselines["trailing_vix"][1])


@pytest.mark.parametrize("kwargs, name", [
    ({"window": 1}, "window"), ({"window": 2.5}, "window"), ({"window": 10**6}, "window"),
    ({"train_end": "not a date"}, "train_end"), ({"val_end": "2015-13-45"}, "val_end"),
    ({"train_end": "2016-01-01"}, "train_end"), ({"train_end": "1990-01-01"}, "train_end"),
    ({"max_features": 0}, "max_features"),
    ({"train_end": "2012-12-31T00:00:00+00:00"}, "train_end"),  # tz-aware: was a TypeError naming nothing
    ({"val_end": pd.Timestamp("2015-12-31", tz="America/New_York")}, "val_end"),
])
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        market.make_windows(**kwargs)


def test_unsorted_or_undated_prices_are_refused():
    """build_features / target read row order as time order. Reversed rows ran silently and every rolling feature
    of a day then came from the LATER days (look-ahead), the label from the previous day; a RangeIndex raised an
    AttributeError naming no argument, a missing sp500_close a bare KeyError."""
    p = market.load_prices()
    # sorted input: day t's 5-day mean |r| uses the returns of days t-4..t (NumPy); the refused orders below made
    # it (and every rolling feature) read other days
    r = np.diff(np.log(p["sp500_close"].to_numpy()))  # r[i] = log(c[i+1] / c[i])
    t = 1000
    assert market.build_features(p)["sp500_absret_mean5"].iloc[t] == pytest.approx(np.abs(r[t - 5:t]).mean(), rel=1e-12)
    for bad in (p.iloc[::-1], pd.concat([p.iloc[:10], p.iloc[9:]]), p.sample(frac=1.0, random_state=0)):
        with pytest.raises(ValueError, match="^prices must be sorted by date with no duplicate dates"):
            market.build_features(bad)
        with pytest.raises(ValueError, match="^prices must be sorted by date with no duplicate dates"):
            market.target(bad)
    with pytest.raises(ValueError, match="^prices must have a DatetimeIndex of trading dates, got RangeIndex"):
        market.build_features(p.reset_index(drop=True))
    with pytest.raises(ValueError, match=r"^prices is missing columns \['sp500_close'\]"):
        market.target(p.drop(columns="sp500_close"))
    with pytest.raises(ValueError, match="^prices must be a pandas DataFrame"):
        market.target(p["sp500_close"])
