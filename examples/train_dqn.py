"""Branching C51 double DQN with prioritized replay on the real daily trading environment.

Environment: :class:`jaxfox.envs.Trading` (default ``--instruments sp500,nasdaq,wti``: the three daily price
series ``arch`` ships, train span 2000-2012, test span 2016-2018; ``--instruments sp500,nasdaq,wti,vix`` adds
the VIX index as a 4th branch, which is not investable (a stand-in for a VIX-tracking product) and restricts
the data to 2014-2018: train 2014-2016, test 2017-2018; one action branch per instrument, positions
-1/-0.5/0/0.5/1, 5 bps costs, 48-dim observation). Agent: :class:`jaxfox.models.branching_c51.BranchingC51`
(D = number of instruments, A = 5, N = 51, support linspace(-25, 25, 51) on rewards in percent), double-DQN
categorical loss (:func:`jaxfox.categorical_double_q_loss`), prioritized replay (:mod:`jaxfox.per`, alpha
0.5, beta annealed 0.4 -> 1), EMA target (:func:`jaxfox.ema_update`), :func:`jaxfox.fused_adamw`, batch 1024,
bfloat16 forward weights (:func:`jaxfox.cast_bf16`) over float32 master weights.

One training iteration = one step of ``--num-envs`` vmapped environments (epsilon-greedy per branch, the
transitions go into the replay buffer) + one update step (PER sample, forward online/target, loss with IS
weights, grad, AdamW, EMA, priority update: one jitted function, :func:`jaxfox.models.branching_c51.make_update`).
``--chunk`` iterations run inside one ``jax.jit`` (``lax.scan``). Episodes end by a time limit (252 days), so
the discount is gamma for every transition (no terminal states: bootstrapping through a time-limit is correct).

    python examples/train_dqn.py                      # default: 4000 updates, ~250 s on a 2-core CPU
    python examples/train_dqn.py --steps 20 --num-envs 8 --batch-size 64 --capacity 4096 \\
        --learning-starts 256 --chunk 10 --out /tmp/dqn   # smoke test

Reports the greedy policy's return over the whole test span (sum of daily rewards, log-return units, costs
included) next to buy-and-hold (+1 in every instrument, the agent's maximum long action), equal-weight
buy-and-hold (1/D in each) and flat (0); saves ``equity.png``, ``loss.png``, ``metrics.json`` and ``curves.npz``
(daily test-span rewards of each policy, their dates and the agent's positions) into ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # for examples/_cli.py, however this file is loaded (as a script, or by path)
    sys.path.insert(0, _HERE)
from _cli import check_finite, check_output_folder, usage_error  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=4000, help="update steps (one env step of all envs each)")
    p.add_argument("--seed", type=int, default=0, help="initialisation, exploration and replay seed")
    p.add_argument("--out", default="runs/dqn", help="folder for equity.png, loss.png, metrics.json and "
                   "curves.npz (a relative path is taken from the current directory)")
    p.add_argument("--num-envs", type=int, default=64, help="parallel (vmapped) environments")
    p.add_argument("--batch-size", type=int, default=1024, help="replay batch per update")
    p.add_argument("--capacity", type=int, default=2 ** 17, help="replay capacity (transitions)")
    p.add_argument("--learning-starts", type=int, default=8192, help="random transitions before updates")
    p.add_argument("--chunk", type=int, default=50, help="iterations per jitted scan (progress granularity; the "
                   "last scan runs the remainder when --steps is not a multiple)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=1e-4, help="AdamW decoupled weight decay")
    p.add_argument("--max-grad-norm", type=float, default=10.0, help="global-norm gradient clip")
    p.add_argument("--gamma", type=float, default=0.9, help="discount per trading day")
    p.add_argument("--tau", type=float, default=0.005, help="EMA weight of the online params per update")
    p.add_argument("--alpha", type=float, default=0.5, help="PER priority exponent")
    p.add_argument("--beta0", type=float, default=0.4, help="PER IS exponent at step 0 (annealed to 1)")
    p.add_argument("--v-max", type=float, default=25.0, help="support [-v_max, v_max] (reward units: percent)")
    p.add_argument("--reward-scale", type=float, default=100.0, help="reward multiplier (100: percent)")
    p.add_argument("--eps-start", type=float, default=1.0, help="epsilon-greedy exploration at step 0")
    p.add_argument("--eps-end", type=float, default=0.05, help="epsilon after the decay")
    p.add_argument("--eps-frac", type=float, default=0.5, help="fraction of --steps over which epsilon decays")
    p.add_argument("--episode-len", type=int, default=252, help="trading days per training episode")
    p.add_argument("--cost-bps", type=float, default=5.0,
                   help="transaction cost per unit of position change (basis points)")
    p.add_argument("--no-bf16", action="store_true", help="float32 forward (default: bfloat16 weights)")
    p.add_argument("--instruments", default="sp500,nasdaq,wti",
                   help="comma-separated traded instruments, one action branch each (from sp500, nasdaq, wti, "
                        "vix; vix restricts the data to 2014-2018 and is an index, not an investable price)")
    args = p.parse_args(argv)
    args.instruments = tuple(s.strip() for s in args.instruments.split(","))
    from jaxfox.envs import AVAILABLE_INSTRUMENTS
    bad = [s for s in args.instruments if s not in AVAILABLE_INSTRUMENTS]
    if bad or len(set(args.instruments)) != len(args.instruments):
        p.error(f"--instruments must be distinct names from {','.join(AVAILABLE_INSTRUMENTS)}, got "
                f"{','.join(args.instruments)}")
    for name in ("steps", "num_envs", "batch_size", "capacity", "chunk", "episode_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.learning_starts < args.batch_size:
        p.error(f"--learning-starts must be >= --batch-size ({args.batch_size}), got {args.learning_starts}")
    if args.capacity < args.learning_starts:
        p.error(f"--capacity must be >= --learning-starts ({args.learning_starts}), got {args.capacity}")
    if not 0 <= args.gamma < 1:
        p.error(f"--gamma must be in [0, 1), got {args.gamma}")
    for name in ("tau", "eps_start", "eps_end", "eps_frac", "beta0"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")
    # a negative reward scale would train the agent to lose money
    check_finite(p, args, ("reward_scale", "v_max"), low=0, strict=True)
    check_finite(p, args, ("lr", "weight_decay", "max_grad_norm", "alpha", "cost_bps"), low=0)
    check_output_folder(p, args.out)
    return args


def _stats(rewards):
    r = np.asarray(rewards, np.float64)
    sd = r.std()
    return {"total_log_return": float(r.sum()),
            "sharpe_annualised": float(np.sqrt(252) * r.mean() / sd) if sd > 0 else 0.0}


def levels_of(env, acts):
    """Positions [days, D] float64 of action indices [days, D] (the env's position levels)."""
    return np.asarray(env.train.levels, np.float64)[np.asarray(acts)]


def save_plots(out, dates, curves, loss_hist, instruments=("sp500", "nasdaq", "wti")):
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend (e.g. a notebook's) alone

    fig = Figure(figsize=(9, 4.5))
    ax = fig.subplots()
    for name, r in curves.items():
        ax.plot(dates, np.cumsum(r), label=f"{name} ({np.sum(r):+.3f})")
    span = f"{str(dates[0])[:4]}-{str(dates[-1])[:4]}" if len(dates) else "empty"
    ax.set(title=f"test span {span}, {'/'.join(instruments)}: cumulative reward\n"
                 "(sum of daily position-weighted log returns - costs)", ylabel="cumulative log return")
    ax.legend(fontsize=8)
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "equity.png"), dpi=100)
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    if loss_hist["step"]:
        ax.plot(loss_hist["step"], loss_hist["loss"], label="IS-weighted loss (chunk mean)")
        ax.plot(loss_hist["step"], loss_hist["loss_unweighted"], label="unweighted loss (chunk mean)")
    ax.set(xlabel="update step", ylabel="cross-entropy (nats)", title="categorical double-Q loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=100)


def main(argv=None) -> dict:
    """Trains and evaluates; returns the metrics dict also written to ``<out>/metrics.json``."""
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    from tqdm.auto import tqdm

    from jaxfox import per
    from jaxfox.envs import Trading
    from jaxfox.models.branching_c51 import (Transition, epsilon_greedy, greedy_actions, init_agent, make_update,
                                             support)

    t_start = time.perf_counter()
    try:  # the longest episode depends on the instruments' common span: a usage error, not a traceback
        env = Trading(episode_len=args.episode_len, cost_bps=args.cost_bps, instruments=args.instruments)
    except ValueError as e:
        usage_error(f"--episode-len {args.episode_len}: {e}")
    os.makedirs(args.out, exist_ok=True)
    tr, te = env.train, env.test
    key = jax.random.key(args.seed)
    key, k_init = jax.random.split(key)
    agent, opt, dan = init_agent(k_init, obs_dim=env.obs_dim, num_branches=env.num_branches,
                                 num_actions=env.num_actions, capacity=args.capacity, lr=args.lr,
                                 weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm)
    z = support(dan[2], args.v_max)
    bf16 = not args.no_bf16
    update = make_update(opt, dan, z, batch_size=args.batch_size, alpha=args.alpha, tau=args.tau, bf16=bf16)
    beta_at = per.beta_schedule(args.steps, args.beta0, 1.0)
    decay_steps = max(1, int(args.eps_frac * args.steps))
    n_params = int(agent.online.flat.shape[0])
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; BranchingC51 D={dan[0]} A={dan[1]} N={dan[2]}, "
          f"{n_params} params; instruments {','.join(env.instruments)}; train rows {env.train_rows} "
          f"({str(env.dates[env.train_rows[0]])[:10]}..{str(env.dates[env.train_rows[1]])[:10]}), test rows "
          f"{env.test_rows} ({str(env.dates[env.test_rows[0]])[:10]}..{str(env.dates[env.test_rows[1]])[:10]}); "
          f"{args.num_envs} envs, batch {args.batch_size}, {args.steps} updates, bf16 forward {bf16}")

    reset_v = jax.vmap(env.reset, in_axes=(0, None))
    step_v = jax.vmap(env.step, in_axes=(0, 0, None))
    warm_iters = -(-args.learning_starts // args.num_envs)  # random steps of all envs before the first update

    def env_step(agent_online, env_state, obs, key, eps):
        k_act, k_reset = jax.random.split(key)
        act = epsilon_greedy(k_act, agent_online, obs, dan, z, eps, bf16=bf16)
        s2, o2, r, done = step_v(env_state, act, tr)
        trans = Transition(obs, act, r * args.reward_scale, jnp.full_like(r, args.gamma), o2)
        rs, ro = reset_v(jax.random.split(k_reset, args.num_envs), tr)
        s2 = jax.tree.map(lambda a, b: jnp.where(done.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), rs, s2)
        o2 = jnp.where(done[:, None], ro, o2)
        return s2, o2, trans, r

    @jax.jit
    def warmup(agent, env_state, obs, key):
        def body(c, k):
            agent, s, o = c
            s, o, trans, _ = env_step(agent.online, s, o, k, 1.0)
            return (agent._replace(buffer=per.add(agent.buffer, trans)), s, o), None
        (agent, s, o), _ = jax.lax.scan(body, (agent, env_state, obs), jax.random.split(key, warm_iters))
        return agent, s, o

    @functools.partial(jax.jit, static_argnames=("length",))
    def train_chunk(agent, env_state, obs, key, length):
        def body(c, k):
            agent, s, o = c
            step = agent.step
            frac = jnp.minimum(step.astype(jnp.float32) / decay_steps, 1.0)
            eps = args.eps_start + (args.eps_end - args.eps_start) * frac
            k_env, k_up = jax.random.split(k)
            s, o, trans, r = env_step(agent.online, s, o, k_env, eps)
            agent = agent._replace(buffer=per.add(agent.buffer, trans))
            agent, info = update(agent, k_up, beta_at(step))
            return (agent, s, o), (info["loss"], info["loss_unweighted"], jnp.mean(r))
        (agent, s, o), out = jax.lax.scan(body, (agent, env_state, obs), jax.random.split(key, length))
        return agent, s, o, out

    @functools.partial(jax.jit, static_argnames=("length",))
    def rollout(online, params, start, ca, length):
        """Greedy (ca < 0) or constant-action (ca [D]) pass of ``length`` days from row ``start``."""
        s, o = env.reset_to(start, params)

        def body(c, _):
            s, o = c
            greedy = greedy_actions(online, o[None], dan, z, bf16=bf16)[0]
            a = jnp.where(ca >= 0, ca, greedy)
            s, o, r, _ = env.step(s, a, params)
            return (s, o), (r, a)
        _, (r, a) = jax.lax.scan(body, (s, o), None, length=length)
        return r, a

    def evaluate(online, params, rows, const_action):
        start, end = rows
        r, a = rollout(online, params, jnp.asarray(start, jnp.int32), jnp.asarray(const_action, jnp.int32),
                       length=int(end - start))
        return np.asarray(r, np.float64), np.asarray(a)

    key, k_reset, k_warm = jax.random.split(key, 3)
    env_state, obs = reset_v(jax.random.split(k_reset, args.num_envs), tr)
    agent, env_state, obs = warmup(agent, env_state, obs, k_warm)
    loss_hist = {"step": [], "loss": [], "loss_unweighted": [], "collect_reward": []}
    n_chunks = -(-args.steps // args.chunk)
    t_train = time.perf_counter()
    bar = tqdm(range(n_chunks), desc="dqn", file=sys.stderr)
    for i in bar:
        key, k = jax.random.split(key)
        # exactly --steps updates: the last chunk runs the remainder (one more compilation when there is one)
        length = min(args.chunk, args.steps - i * args.chunk)
        agent, env_state, obs, (lw, lu, rr) = train_chunk(agent, env_state, obs, k, length=length)
        lw, lu, rr = (float(np.mean(np.asarray(v))) for v in (lw, lu, rr))
        loss_hist["step"].append(int(agent.step))
        loss_hist["loss"].append(lw)
        loss_hist["loss_unweighted"].append(lu)
        loss_hist["collect_reward"].append(rr)
        bar.set_postfix(loss=f"{lw:.3f}", r=f"{rr * 1e4:+.1f}bp")
    train_s = time.perf_counter() - t_train

    D = env.num_branches
    greedy, flat_a, long_a = -np.ones(D, np.int32), np.full(D, 2, np.int32), np.full(D, 4, np.int32)
    r_agent, acts = evaluate(agent.online, te, env.test_rows, greedy)
    r_bh, _ = evaluate(agent.online, te, env.test_rows, long_a)
    r_flat, _ = evaluate(agent.online, te, env.test_rows, flat_a)
    t0, t1 = env.test_rows
    nr = env.next_returns_np[t0:t1]
    r_ew = nr.mean(axis=1)
    r_ew[0] -= args.cost_bps * 1e-4 * 1.0  # entering 1/D in each of the D instruments: |change| sums to D/D = 1
    r_train, _ = evaluate(agent.online, tr, (0, env.train_rows[1]), greedy)
    dates = env.dates[t0 + 1:t1 + 1]  # reward of row t is realised at the close of t + 1
    curves = {"agent (greedy)": r_agent, "buy & hold (+1 each)": r_bh, f"equal weight (1/{D} each)": r_ew,
              "flat (0)": r_flat}
    save_plots(args.out, dates, curves, loss_hist, env.instruments)
    np.savez(os.path.join(args.out, "curves.npz"), dates=dates.astype("datetime64[D]"), agent=r_agent,
             buy_and_hold=r_bh, equal_weight=r_ew, flat=r_flat, positions=levels_of(env, acts))
    levels = np.asarray(env.train.levels)
    metrics = {
        "instruments": list(env.instruments),
        "test_span": [str(env.dates[t0])[:10], str(env.dates[t1])[:10]], "test_days": int(t1 - t0),
        "test": {"agent": _stats(r_agent), "buy_and_hold": _stats(r_bh), "equal_weight": _stats(r_ew),
                 "flat": _stats(r_flat)},
        "train_span_greedy": _stats(r_train),
        "test_mean_position": {inst: float(levels[acts[:, i]].mean()) for i, inst in
                               enumerate(env.instruments)},
        "test_turnover_per_day": float(np.abs(np.diff(np.concatenate([np.zeros((1, D)), levels[acts]]), axis=0))
                                       .sum(1).mean()),
        "final_loss": loss_hist["loss"][-1] if loss_hist["loss"] else None,
        "updates": int(agent.step), "buffer_size": int(agent.buffer.size),
        "transitions": (warm_iters + int(agent.step)) * args.num_envs,
        "train_seconds": train_s, "wall_seconds": time.perf_counter() - t_start,
        "args": vars(args), "params": n_params,
    }
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    tst = metrics["test"]
    print(f"test {metrics['test_span'][0]}..{metrics['test_span'][1]} ({metrics['test_days']} days), total log "
          f"return: agent {tst['agent']['total_log_return']:+.4f}, buy&hold {tst['buy_and_hold']['total_log_return']:+.4f}"
          f", equal weight {tst['equal_weight']['total_log_return']:+.4f}, flat {tst['flat']['total_log_return']:+.4f}"
          f"; wall {metrics['wall_seconds']:.0f}s -> {args.out}")
    return metrics


if __name__ == "__main__":
    main()
