"""jaxfox.envs.Trading against an independent float64 NumPy computation from the raw arch prices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

from jaxfox.envs import INSTRUMENTS, LEVELS, POSITION_FEATURES, Trading
from jaxfox.envs.trading import AVAILABLE_INSTRUMENTS

FOUR = ("sp500", "nasdaq", "wti", "vix")


@pytest.fixture(scope="module")
def env():
    return Trading()


@pytest.fixture(scope="module")
def raw():
    """Closes straight from arch.data (inner join of the three series), float64, independent of jaxfox."""
    from arch.data import nasdaq, sp500, wti

    closes = pd.concat([sp500.load()["Close"].rename("sp500"), nasdaq.load()["Close"].rename("nasdaq"),
                        wti.load()["DCOILWTICO"].rename("wti")], axis=1, join="inner").dropna().astype(np.float64)
    closes.index = pd.DatetimeIndex(closes.index)
    return closes.sort_index()


def test_spans_chronological(env):
    tr0, tr1 = env.train_rows
    te0, te1 = env.test_rows
    d = env.dates
    assert np.all(np.diff(d.astype("int64")) > 0)
    assert d[tr1] <= np.datetime64("2012-12-31") < d[tr1 + 1]
    assert d[te0 - 1] < np.datetime64("2016-01-01") <= d[te0]
    assert tr1 < te0 and te1 == len(d) - 1
    assert (str(d[0])[:10], str(d[te0])[:10], str(d[-1])[:10]) == ("2000-01-05", "2016-01-04", "2018-12-28")
    # Random train resets: start in the train span and the whole episode (rewards use row end) stays in it.
    keys = jax.random.split(jax.random.key(0), 2000)
    states, _ = jax.vmap(env.reset)(keys)
    t, end = np.asarray(states.t), np.asarray(states.end)
    assert t.min() >= tr0 and end.max() <= tr1
    np.testing.assert_array_equal(end - t, env.episode_len)
    assert t.min() < 100 and t.max() > tr1 - env.episode_len - 100  # covers the span


def test_step_rewards_against_numpy(env, raw):
    rng = np.random.default_rng(0)
    step = jax.jit(env.step)
    for params, start, n in ((env.train, 10, 40), (env.test, env.test_rows[0], 30), (env.train, 3000, 5)):
        state, obs = env.reset_to(start, params)
        prev = np.zeros(3)
        for k in range(n):
            a = rng.integers(0, 5, size=3)
            state, obs, r, done = step(state, jnp.asarray(a, jnp.int32), params)
            t = start + k
            d0, d1 = env.dates[t], env.dates[t + 1]
            c0 = raw.loc[d0, list(INSTRUMENTS)].to_numpy()
            c1 = raw.loc[d1, list(INSTRUMENTS)].to_numpy()
            # next trading day of the joined calendar is the next row of the env
            assert raw.index.get_loc(d1) == raw.index.get_loc(d0) + 1
            pos = np.array([-1.0, -0.5, 0.0, 0.5, 1.0])[a]
            want = float(np.sum(pos * np.log(c1 / c0)) - 5e-4 * np.sum(np.abs(pos - prev)))
            assert float(r) == pytest.approx(want, abs=2e-6, rel=1e-5), (t, a)
            np.testing.assert_array_equal(np.asarray(state.positions), pos)
            assert int(state.t) == t + 1 and not bool(done)
            prev = pos


def test_costs_only_on_change(env):
    state, _ = env.reset_to(100)
    a = jnp.asarray([4, 0, 2], jnp.int32)
    state, _, r1, _ = env.step(state, a)
    state, _, r2, _ = env.step(state, a)
    ret1, ret2 = env.next_returns_np[100], env.next_returns_np[101]
    assert float(r1) == pytest.approx(ret1[0] - ret1[1] - 5e-4 * 2.0, abs=1e-6)
    assert float(r2) == pytest.approx(ret2[0] - ret2[1], abs=1e-6)  # no change, no cost
    zero = Trading(cost_bps=0.0)
    s, _ = zero.reset_to(100)
    _, _, r0, _ = zero.step(s, a)
    assert float(r0) == pytest.approx(ret1[0] - ret1[1], abs=1e-6)


def test_observation(env):
    from jaxfox.data.market import FEATURE_NAMES, build_features, load_prices

    f = build_features(load_prices()).dropna()
    x = f.to_numpy(np.float64)
    tr = f.index <= pd.Timestamp("2012-12-31")
    z = np.clip((x - x[tr].mean(0)) / x[tr].std(0), -10, 10)
    cols = [FEATURE_NAMES.index(c) for c in POSITION_FEATURES[:3]]
    keep = np.setdiff1d(np.arange(48), cols)
    assert env.instruments == INSTRUMENTS and (env.train_end, env.test_start) == ("2012-12-31", "2016-01-01")
    state, obs = env.reset_to(500)
    assert obs.shape == (48,) and obs.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(obs)))
    np.testing.assert_allclose(np.asarray(obs)[keep], z[500, keep], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(obs)[cols], 0.0)
    state, obs, _, _ = env.step(state, jnp.asarray([0, 3, 4], jnp.int32))
    np.testing.assert_allclose(np.asarray(obs)[keep], z[501, keep], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(obs)[cols], [-1.0, 0.5, 1.0])
    assert [env.obs_names[c] for c in cols] == ["pos_sp500", "pos_nasdaq", "pos_wti"]
    # every row of both spans is finite
    allobs = np.asarray(env.train.features)
    assert allobs.shape == (len(env.dates), 48) and np.all(np.isfinite(allobs))
    hidden = Trading(include_positions=False)
    s, o = hidden.reset_to(500)
    _, o, _, _ = hidden.step(s, jnp.asarray([0, 3, 4], jnp.int32))
    np.testing.assert_allclose(np.asarray(o), z[501], rtol=1e-5, atol=1e-5)


def test_done_and_vmap(env):
    keys = jax.random.split(jax.random.key(1), 8)
    s, o = jax.jit(jax.vmap(env.reset))(keys)
    assert o.shape == (8, 48)
    acts = jnp.asarray(np.random.default_rng(1).integers(0, 5, (8, 3)), jnp.int32)
    step_v = jax.jit(jax.vmap(env.step))
    s2, o2, r, d = step_v(s, acts)
    for i in range(8):
        si = jax.tree.map(lambda a: a[i], s)
        _, oi, ri, _ = env.step(si, acts[i])
        assert float(ri) == pytest.approx(float(r[i]), abs=1e-7)
        np.testing.assert_array_equal(np.asarray(oi), np.asarray(o2[i]))
    short = Trading(episode_len=3)
    st, _ = short.reset(jax.random.key(2))
    dones = []
    for _ in range(3):
        st, _, _, d = short.step(st, jnp.asarray([2, 2, 2], jnp.int32))
        dones.append(bool(d))
    assert dones == [False, False, True]
    # test span: one episode from its first row to its last
    st, _ = env.reset_to(env.test_rows[0], env.test)
    assert int(st.end) == env.test_rows[1]


def test_finished_episode_is_absorbing_and_never_pays_past_its_end(env, raw):
    """Stepping past done pays nothing and does not move; before the fix the state walked on past ``end``
    (t > end) and paid the returns of later rows, at the train span's end the first 2013 return."""
    tr1 = env.train_rows[1]
    a = jnp.asarray([4, 0, 3], jnp.int32)
    pos = np.array([1.0, -1.0, 0.5])
    cl = raw[list(INSTRUMENTS)]

    def want_reward(t, prev):
        c0, c1 = cl.loc[env.dates[t]].to_numpy(), cl.loc[env.dates[t + 1]].to_numpy()
        return float(np.sum(pos * np.log(c1 / c0)) - 5e-4 * np.sum(np.abs(pos - prev)))

    # (1) an episode ending at the train span's last row (2012-12-31); (2) one ending inside the span; (3) an
    # explicit end beyond the span is clamped to the span end.
    for start, end in ((tr1 - 2, None), (1000, 1002), (tr1 - 2, tr1 + 50)):
        state, _ = env.reset_to(start, env.train, end=end)
        stop = tr1 if end is None else min(end, tr1)
        assert int(state.end) == stop
        rewards, dones, ts = [], [], []
        for _ in range(6):
            state, obs, r, d = env.step(state, a)
            rewards.append(float(r)), dones.append(bool(d)), ts.append(int(state.t))
        n = stop - start
        want = [want_reward(start, np.zeros(3))] + [want_reward(t, pos) for t in range(start + 1, stop)]
        np.testing.assert_allclose(rewards[:n], want, rtol=1e-5, atol=2e-6)
        assert rewards[n:] == [0.0] * (6 - n)
        assert dones == [False] * (n - 1) + [True] * (7 - n)
        assert ts == [start + k + 1 for k in range(n)] + [stop] * (6 - n)
        np.testing.assert_array_equal(np.asarray(state.positions), pos)
        np.testing.assert_array_equal(np.asarray(obs)[list(env.position_cols)], pos)
    # the same under jit + vmap (what a fixed-length lax.scan rollout without masking sums up)
    keys = jax.random.split(jax.random.key(3), 4)
    short = Trading(episode_len=3)
    s, _ = jax.vmap(short.reset)(keys)

    def roll(s):
        def body(s, _):
            s, _, r, _ = short.step(s, a)
            return s, r
        return jax.lax.scan(body, s, None, length=8)

    s8, r8 = jax.jit(jax.vmap(roll))(s)
    np.testing.assert_array_equal(np.asarray(s8.t), np.asarray(s.t) + 3)
    for i, t0 in enumerate(np.asarray(s.t)):
        want = [want_reward(int(t0), np.zeros(3))] + [want_reward(int(t0) + k, pos) for k in (1, 2)]
        np.testing.assert_allclose(np.asarray(r8[i, :3]), want, rtol=1e-5, atol=2e-6)
        np.testing.assert_array_equal(np.asarray(r8[i, 3:]), 0.0)


def test_reset_to_stays_inside_the_span(env, raw):
    """reset_to(0, env.test) (a start relative to the span, a plausible slip) ran an "evaluation" episode over every
    row from 2000 on, paying train-span returns under the test params. A concrete start outside the span's rows is
    now an error; a traced one is clipped into them, so rewards come from test-span days only."""
    te0, te1 = env.test_rows
    for bad in (0, te0 - 1, te1 + 1):
        with pytest.raises(ValueError, match=rf"^start must be a row of the span \[start_lo, span_end\] = "
                                             rf"\[{te0}, {te1}\], got {bad}$"):
            env.reset_to(bad, env.test)
    with pytest.raises(ValueError, match=r"^start must be a row of the span .* = \[0, 3253\], got -1$"):
        env.reset_to(-1)
    with pytest.raises(TypeError, match="^start must be an integer row index"):
        env.reset_to(10.0)
    s, _ = env.reset_to(te1, env.test)  # the span's last row: done at once, pays nothing
    _, _, r, d = env.step(s, jnp.asarray([4, 4, 4], jnp.int32), env.test)
    assert float(r) == 0.0 and bool(d)
    a = jnp.asarray([4, 0, 3], jnp.int32)

    @jax.jit
    def first(start, params):
        s, _ = env.reset_to(start, params)
        s, _, r, _ = env.step(s, a, params)
        return s.t, r

    t, r = first(jnp.int32(0), env.test)
    c0, c1 = (raw.loc[env.dates[i], list(INSTRUMENTS)].to_numpy() for i in (te0, te0 + 1))
    pos = np.array([1.0, -1.0, 0.5])
    assert int(t) == te0 + 1
    assert float(r) == pytest.approx(float(np.sum(pos * np.log(c1 / c0)) - 5e-4 * 2.5), abs=2e-6, rel=1e-5)


def test_bad_inputs(env):
    s, _ = env.reset_to(0)
    with pytest.raises(ValueError, match="action must have shape"):
        env.step(s, jnp.zeros((4,), jnp.int32))
    with pytest.raises(TypeError, match="action must have an integer dtype"):
        env.step(s, jnp.zeros((3,), jnp.float32))
    # a concrete out-of-range action was clipped silently (5 -> +1, -1 -> -1 position)
    for bad in ([5, 0, 0], [0, -1, 2]):
        with pytest.raises(ValueError, match=r"^action entries must be in \[0, A\) = \[0, 5\)"):
            env.step(s, jnp.asarray(bad, jnp.int32))
    with pytest.raises(ValueError, match="episode_len"):
        Trading(episode_len=0)
    with pytest.raises(ValueError, match="cost_bps"):
        Trading(cost_bps=-1.0)
    with pytest.raises(ValueError, match="^test_start must be a date without a time zone"):
        Trading(test_start="2016-01-01T00:00:00+00:00")  # was a TypeError naming no argument
    for bad in ("no", 0, 0.5, None):  # each was taken for its truth value ("no" showed the positions)
        with pytest.raises(TypeError, match="^include_positions must be a bool"):
            Trading(include_positions=bad)
    assert Trading(include_positions=np.bool_(False)).position_cols == ()
    assert len(LEVELS) == 5 and env.num_branches == 3 and env.obs_dim == 48


def test_arch_ships_exactly_three_daily_price_series_over_1999_2018():
    """Why the default is D = 3 and the 4th branch (issue 4 asks for >= 4) is the VIX index over 2014-2018 only:
    every dataset in arch.data, classified from the raw files.

    A candidate instrument needs a daily DatetimeIndex (median spacing <= 4 calendar days) covering the
    train span start (<= 2000-01-05) through the test span end (>= 2018-12-28). This fails if a new arch
    release ships a fourth such series (then add it to INSTRUMENTS)."""
    import importlib
    import pkgutil

    import arch.data

    daily_full, other = [], {}
    for m in pkgutil.iter_modules(arch.data.__path__):
        mod = importlib.import_module(f"arch.data.{m.name}")
        if not hasattr(mod, "load"):
            continue
        df = mod.load()
        idx = df.index
        if not isinstance(idx, pd.DatetimeIndex):
            other[m.name] = "no date index"
            continue
        idx = idx.sort_values()
        days = float(np.median(np.diff(idx.to_numpy().astype("datetime64[s]").astype(np.int64))) / 86400.0)
        full = idx[0] <= pd.Timestamp("2000-01-05") and idx[-1] >= pd.Timestamp("2018-12-28")
        if days <= 4 and full:
            daily_full.append(m.name)
        else:
            other[m.name] = f"median spacing {days:.0f} days, {idx[0].date()} .. {idx[-1].date()}"
    assert sorted(daily_full) == ["nasdaq", "sp500", "wti"], (daily_full, other)
    assert set(INSTRUMENTS) == set(daily_full)
    # VIX is daily but starts 2014-01-03; crude (Brent, WTI), core_cpi, default are monthly; frenchdata's index
    # is yyyymm integers (monthly factors, read as nanoseconds after 1970); binary is not a time series.
    assert other["vix"].startswith("median spacing 1 days, 2014-01-03"), other["vix"]
    for name in ("crude", "core_cpi", "default"):
        assert int(other[name].split()[2]) >= 28, other[name]
    fr = arch.data.frenchdata.load().index.to_numpy().astype("int64")
    assert fr.min() == 192607 and np.all(np.isin(fr % 100, np.arange(1, 13)))
    assert other["binary"] == "no date index"


# ------------------------------------------------------------------ four instruments (VIX as the 4th branch)
@pytest.fixture(scope="module")
def env4():
    return Trading(instruments=FOUR)


@pytest.fixture(scope="module")
def raw4():
    """Closes of sp500, nasdaq, wti and the VIX level straight from arch.data (inner join), float64."""
    from arch.data import nasdaq, sp500, vix, wti

    closes = pd.concat([sp500.load()["Close"].rename("sp500"), nasdaq.load()["Close"].rename("nasdaq"),
                        wti.load()["DCOILWTICO"].rename("wti"), vix.load()["vix"].rename("vix")],
                       axis=1, join="inner").dropna().astype(np.float64)
    closes.index = pd.DatetimeIndex(closes.index)
    return closes.sort_index()


def test_four_spans_chronological_inside_vix_range(env4, raw4):
    d = env4.dates
    # the rows are exactly the days on which all four arch series have a close
    np.testing.assert_array_equal(d, raw4.index.to_numpy())
    assert env4.num_branches == 4 and env4.instruments == FOUR and env4.obs_dim == 48
    assert (env4.train_end, env4.test_start) == ("2016-12-31", "2017-01-01")
    tr0, tr1 = env4.train_rows
    te0, te1 = env4.test_rows
    assert np.all(np.diff(d.astype("int64")) > 0)
    assert d[0] >= np.datetime64("2014-01-03") and tr0 == 0 and te1 == len(d) - 1
    assert d[tr1] <= np.datetime64("2016-12-31") < d[tr1 + 1] and tr1 + 1 == te0
    assert d[te0 - 1] < np.datetime64("2017-01-01") <= d[te0]
    assert [str(x)[:10] for x in (d[0], d[tr1], d[te0], d[-1])] == ["2014-01-03", "2016-12-30", "2017-01-03",
                                                                      "2018-12-28"]
    assert (tr1 + 1, te1 - te0 + 1) == (755, 498)
    keys = jax.random.split(jax.random.key(3), 2000)
    states, _ = jax.vmap(env4.reset)(keys)
    t, end = np.asarray(states.t), np.asarray(states.end)
    assert t.min() >= tr0 and end.max() <= tr1
    np.testing.assert_array_equal(end - t, env4.episode_len)
    # explicit dates override the vix defaults; the 3-instrument defaults are unchanged by the vix ones
    e = Trading(instruments=["vix", "sp500"], train_end="2015-12-31", test_start="2016-06-01", episode_len=100)
    assert str(e.dates[e.train_rows[1]])[:10] == "2015-12-31" and str(e.dates[e.test_rows[0]])[:10] == "2016-06-01"
    assert e.instruments == ("vix", "sp500") and e.train_end == "2015-12-31"


def test_four_next_returns_and_rewards_against_numpy(env4, raw4):
    c = raw4[list(FOUR)].to_numpy()
    want = np.zeros_like(c)
    want[:-1] = np.log(c[1:] / c[:-1])  # vix: log(vix[t+1] / vix[t]) on the joined calendar
    np.testing.assert_allclose(env4.next_returns_np, want, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(np.asarray(env4.train.next_returns), want, rtol=1e-6, atol=1e-7)
    rng = np.random.default_rng(4)
    step = jax.jit(env4.step)
    levels = np.array([-1.0, -0.5, 0.0, 0.5, 1.0])
    for params, start, n in ((env4.train, 0, 30), (env4.train, 700, 40), (env4.test, env4.test_rows[0], 30)):
        state, _ = env4.reset_to(start, params)
        prev = np.zeros(4)
        for k in range(n):
            a = rng.integers(0, 5, size=4)
            state, obs, r, done = step(state, jnp.asarray(a, jnp.int32), params)
            t = start + k
            pos = levels[a]
            exp = float(np.sum(pos * np.log(c[t + 1] / c[t])) - 5e-4 * np.sum(np.abs(pos - prev)))
            assert float(r) == pytest.approx(exp, abs=2e-6, rel=1e-5), (t, a)
            np.testing.assert_array_equal(np.asarray(obs)[list(env4.position_cols)], pos)
            assert int(state.t) == t + 1 and not bool(done)
            prev = pos
    # buy & hold over the whole test span: sum of daily log returns = log(last / first close), one entry cost
    te0, te1 = env4.test_rows
    s, _ = env4.reset_to(te0, env4.test)

    def body(s, _):
        s, _, r, d = env4.step(s, jnp.full((4,), 4, jnp.int32), env4.test)
        return s, (r, d)
    _, (rs, ds) = jax.lax.scan(body, s, None, length=te1 - te0)
    exp = float(np.sum(np.log(c[te1] / c[te0])) - 4 * 5e-4)
    assert float(np.sum(np.asarray(rs, np.float64))) == pytest.approx(exp, abs=1e-4)
    assert bool(ds[-1]) and not bool(ds[:-1].any())
    # branch order follows `instruments`: +1 vix, -1 sp500, costs on 2 units
    e = Trading(instruments=("vix", "sp500"))
    s, _ = e.reset_to(10)
    _, _, r, _ = e.step(s, jnp.asarray([4, 0], jnp.int32))
    i = e.train_rows[0] + 10
    d0, d1 = e.dates[i], e.dates[i + 1]
    exp = (np.log(raw4.loc[d1, "vix"] / raw4.loc[d0, "vix"]) - np.log(raw4.loc[d1, "sp500"] / raw4.loc[d0, "sp500"])
           - 2 * 5e-4)
    assert float(r) == pytest.approx(float(exp), abs=2e-6)


def test_four_observation_train_only_zscore_and_positions(env4, raw4):
    from jaxfox.data.market import FEATURE_NAMES, build_features, load_prices

    f = build_features(load_prices()).dropna().reindex(raw4.index)  # features on the full price calendar
    x = f.to_numpy(np.float64)
    tr = f.index <= pd.Timestamp("2016-12-31")
    z = np.clip((x - x[tr].mean(0)) / x[tr].std(0), -10, 10)  # statistics of 2014-01-03..2016-12-30 only
    names = ["sp500_open_close", "dow_sin", "dow_cos", "nasdaq_open_close"]
    cols = [FEATURE_NAMES.index(n) for n in names]
    assert list(POSITION_FEATURES) == names and list(env4.position_cols) == cols
    assert [env4.obs_names[i] for i in cols] == ["pos_sp500", "pos_nasdaq", "pos_wti", "pos_vix"]
    keep = np.setdiff1d(np.arange(48), cols)
    te0 = env4.test_rows[0]
    for params, t in ((env4.train, 200), (env4.test, te0)):
        s, obs = env4.reset_to(t, params)
        assert obs.shape == (48,) and obs.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(obs)[keep], z[t, keep], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(obs)[cols], 0.0)
        s, obs, _, _ = env4.step(s, jnp.asarray([0, 1, 3, 4], jnp.int32), params)
        np.testing.assert_allclose(np.asarray(obs)[keep], z[t + 1, keep], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(obs)[cols], [-1.0, -0.5, 0.5, 1.0])
    assert np.all(np.isfinite(np.asarray(env4.train.features)))
    # nasdaq_open_close (4th position column) is nasdaq_ret - nasdaq_gap on every row: no information lost
    i = FEATURE_NAMES.index
    np.testing.assert_allclose(x[:, i("nasdaq_open_close")], x[:, i("nasdaq_ret")] - x[:, i("nasdaq_gap")],
                               atol=1e-12)
    hidden = Trading(instruments=FOUR, include_positions=False)
    assert hidden.position_cols == ()
    s, o = hidden.reset_to(300)
    _, o, _, _ = hidden.step(s, jnp.asarray([0, 1, 3, 4], jnp.int32))
    np.testing.assert_allclose(np.asarray(o), z[301], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"action must have shape \[D\] = \[4\]"):
        env4.step(s, jnp.zeros((3,), jnp.int32))


@pytest.mark.parametrize("bad", ["sp500", (), ["sp500", "sp500"], ("sp500", "gold"), (1, 2), None,
                                 ("SP500",), {"sp500": 1}])
def test_bad_instruments(bad):
    with pytest.raises(ValueError, match="^instruments must"):
        Trading(instruments=bad)


def test_bad_span_dates_with_vix():
    assert set(AVAILABLE_INSTRUMENTS) == set(FOUR)
    with pytest.raises(ValueError, match=r"^train_end \(2012-12-31\) leaves 0 train rows"):
        Trading(instruments=FOUR, train_end="2012-12-31", test_start="2016-01-01")
    with pytest.raises(ValueError, match=r"^test_start \(2019-06-01\) leaves 0 test rows"):
        Trading(instruments=FOUR, test_start="2019-06-01")
    with pytest.raises(ValueError, match="^train_end is not a valid date"):
        Trading(instruments=FOUR, train_end="not a date")
    with pytest.raises(ValueError, match="^test_start is not a valid date"):
        Trading(test_start=[1, 2])
    with pytest.raises(ValueError, match=r"^episode_len must be <= 754"):
        Trading(instruments=FOUR, episode_len=800)


def test_train_dqn_four_instruments_tiny(tmp_path, raw4):
    """examples/train_dqn.py --instruments ...vix: D = 4 branches, baselines from the env's D (not 3)."""
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_dqn.py")
    spec = importlib.util.spec_from_file_location("train_dqn_four", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for bad in ("sp500,gold", "sp500,sp500", ""):
        with pytest.raises(SystemExit):
            mod.parse_args(["--instruments", bad])
    assert mod.parse_args([]).instruments == INSTRUMENTS
    out = str(tmp_path / "dqn4")
    m = mod.main(["--steps", "10", "--num-envs", "8", "--batch-size", "64", "--capacity", "4096",
                  "--learning-starts", "256", "--chunk", "10", "--out", out, "--instruments", ",".join(FOUR)])
    disk = json.load(open(os.path.join(out, "metrics.json")))
    assert disk["instruments"] == list(FOUR) and list(m["test_mean_position"]) == list(FOUR)
    assert disk["test_span"] == ["2017-01-03", "2018-12-28"] and disk["test_days"] == 497
    c = raw4[(raw4.index >= "2017-01-03") & (raw4.index <= "2018-12-28")][list(FOUR)].to_numpy()
    gross = np.log(c[-1] / c[0])  # per-instrument sum of daily log returns over the test span
    assert disk["test"]["buy_and_hold"]["total_log_return"] == pytest.approx(gross.sum() - 4 * 5e-4, abs=1e-4)
    # 1/4 in each: entering costs 4 * 1/4 units * 5 bps
    assert disk["test"]["equal_weight"]["total_log_return"] == pytest.approx(gross.mean() - 5e-4, abs=1e-4)
    assert disk["test"]["flat"]["total_log_return"] == 0.0
    curves = np.load(os.path.join(out, "curves.npz"))
    assert curves["positions"].shape == (497, 4) and curves["agent"].shape == (497,)
    assert str(curves["dates"][0]) == "2017-01-04" and str(curves["dates"][-1]) == "2018-12-28"
    assert os.path.getsize(os.path.join(out, "equity.png")) > 1000


def test_numpy_int64_actions_and_starts_are_checked_before_jax_narrows_them(env):
    """jnp.asarray turns a NumPy int64 2**32 + 4 into int32 4 (x64 off): step played action 4 and reset_to started
    at row 5 for out-of-range values, which the concrete checks exist to refuse."""
    s, _ = env.reset_to(0)
    with pytest.raises(ValueError, match=r"^action entries must be in \[0, A\) = \[0, 5\), got \[4294967300, 0, 0\]"):
        env.step(s, np.array([2**32 + 4, 0, 0], np.int64))
    with pytest.raises(ValueError, match=r"^start must be a row of the span .* = \[0, 3253\], got 4294967301$"):
        env.reset_to(np.int64(2**32 + 5))
    # in-range NumPy int64 values still work, with the same result as int32 ones
    s1, _, r1, _ = env.step(s, np.array([4, 0, 3], np.int64))
    s2, _, r2, _ = env.step(s, jnp.asarray([4, 0, 3], jnp.int32))
    np.testing.assert_array_equal(np.asarray(s1.positions), [1.0, -1.0, 0.5])
    assert float(r1) == float(r2) and int(env.reset_to(np.int64(7))[0].t) == 7
