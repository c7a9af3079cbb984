"""The issue-4 DQN agent on gymnax CartPole-v1: a sanity check of the loss, the sampler and the update.

The same agent as ``examples/train_dqn.py`` (no copy of its update: :func:`jaxfox.models.branching_c51.make_update`
and :func:`~jaxfox.models.branching_c51.init_agent`): branching C51 with ONE branch and two actions
(D = 1, A = 2), double-DQN categorical loss (:func:`jaxfox.categorical_double_q_loss`), prioritized replay
(:mod:`jaxfox.per`, beta annealed to 1), EMA target (:func:`jaxfox.ema_update`), :func:`jaxfox.fused_adamw`,
bfloat16 forward weights over float32 master weights. Trunk 4 -> 256 -> 128 (the Trading net with obs_dim 4).

Environment: ``gymnax.make("CartPole-v1")`` (500-step time limit, reward 1 per step). ``--num-envs`` copies are
stepped in lock step (vmap; gymnax auto-resets). Transitions store the pre-reset observation
(``info["final_observation"]``) and discount ``gamma * (1 - terminated)``: a pole that falls is terminal
(discount 0); the 500-step time limit (``truncated``) is NOT terminal, so it bootstraps (Pardo et al. 2018).

Evaluation: the greedy policy (no epsilon) on ``--eval-episodes`` fresh episodes (vmapped, to the 500-step limit);
the score is the mean undiscounted return. Every ``--eval-every`` iterations it is evaluated; with
``--stop-at R`` (default 475, the gymnasium "solved" threshold of CartPole-v1) an evaluation with mean >= R is
confirmed on ``--final-eval-episodes`` (default 100) fresh episodes and training stops when that mean is >= R
too; then a FINAL evaluation on another ``--final-eval-episodes`` episodes (an independent key) is reported.

Defaults follow CleanRL's ``c51.py`` CartPole-v1 settings where they apply (lr 2.5e-4, gamma 0.99, 101 atoms
on [-100, 100], batch 128, buffer 10k, epsilon 1 -> 0.05 over half the run, 10k random steps first, one
update per 10 env steps via ``--num-envs 10`` and one update per iteration, hard target copy every 500 env
steps ~ EMA tau = 0.02 per update here) and a budget of 500k environment steps.

    python examples/train_cartpole.py                         # to mean eval >= 475 or 500k env steps
    python examples/train_cartpole.py --total-steps 4000 --learning-starts 1000 --eval-every 100

Writes ``metrics.json`` (and ``curve.png``: eval return vs env steps) into ``--out``.
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
from _cli import check_finite, check_output_folder  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--total-steps", type=int, default=500_000, help="environment-step budget (all envs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/cartpole", help="folder for curve.png and metrics.json (a relative "
                   "path is taken from the current directory)")
    p.add_argument("--num-envs", type=int, default=10, help="vmapped envs; one update per step of all of them")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--capacity", type=int, default=10_000)
    p.add_argument("--learning-starts", type=int, default=10_000, help="random env steps before updates")
    p.add_argument("--num-atoms", type=int, default=101)
    p.add_argument("--v-max", type=float, default=100.0, help="support linspace(-v_max, v_max, num_atoms)")
    p.add_argument("--lr", type=float, default=2.5e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=10.0)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--tau", type=float, default=0.02, help="EMA weight of the online params per update")
    p.add_argument("--alpha", type=float, default=0.5, help="PER priority exponent")
    p.add_argument("--beta0", type=float, default=0.4, help="PER IS exponent at the start (annealed to 1)")
    p.add_argument("--eps-start", type=float, default=1.0)
    p.add_argument("--eps-end", type=float, default=0.05)
    p.add_argument("--eps-frac", type=float, default=0.5, help="fraction of the budget over which eps decays")
    p.add_argument("--eval-every", type=int, default=500, help="iterations between evaluations (= jit chunk)")
    p.add_argument("--eval-episodes", type=int, default=32)
    p.add_argument("--final-eval-episodes", type=int, default=100)
    p.add_argument("--stop-at", type=float, default=475.0, help="stop at the first eval with mean >= this "
                   "(a value above 500 never stops early)")
    p.add_argument("--no-bf16", action="store_true", help="float32 forward (default: bfloat16 weights)")
    args = p.parse_args(argv)
    for name in ("total_steps", "num_envs", "batch_size", "capacity", "num_atoms", "eval_every",
                 "eval_episodes", "final_eval_episodes"):
        if getattr(args, name) < (2 if name == "num_atoms" else 1):
            p.error(f"--{name.replace('_', '-')} must be >= {2 if name == 'num_atoms' else 1}, "
                    f"got {getattr(args, name)}")
    if args.learning_starts < args.batch_size:
        p.error(f"--learning-starts must be >= --batch-size ({args.batch_size}), got {args.learning_starts}")
    # the warm-up runs whole steps of all envs (learning_starts rounded up to a multiple of num_envs); at least
    # one training iteration (one step of every env, one update) must fit in the budget after it
    need = (-(-args.learning_starts // args.num_envs) + 1) * args.num_envs
    if args.total_steps < need:
        p.error(f"--total-steps must be >= {need} (the warm-up's --learning-starts {args.learning_starts} rounded "
                f"up to whole steps of --num-envs {args.num_envs}, plus one training step), got {args.total_steps}")
    if not 0 <= args.gamma < 1:
        p.error(f"--gamma must be in [0, 1), got {args.gamma}")
    check_finite(p, args, ("v_max",), low=0, strict=True)
    check_finite(p, args, ("lr", "weight_decay", "max_grad_norm", "alpha"), low=0)
    for name in ("tau", "eps_start", "eps_end", "eps_frac", "beta0"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")
    if args.stop_at != args.stop_at:
        p.error("--stop-at must be a number (inf: never stop early), got nan")
    check_output_folder(p, args.out)
    return args


def make_cartpole_fns(env, env_params, args, dan, z, bf16):
    """Pure functions (collect step, greedy evaluation) around a gymnax env; used by main and the tests."""
    import jax
    import jax.numpy as jnp

    from jaxfox.models.branching_c51 import Transition, epsilon_greedy, greedy_actions

    step_v = jax.vmap(env.step, in_axes=(0, 0, 0, None))
    reset_v = jax.vmap(env.reset, in_axes=(0, None))

    def collect(online, env_state, obs, key, eps):
        """One step of every env: returns (env_state', obs', Transition [n_envs], reward [n_envs], done [n_envs])."""
        k_act, k_env = jax.random.split(key)
        act = epsilon_greedy(k_act, online, obs, dan, z, eps, bf16=bf16)  # [n, 1]
        n = obs.shape[0]
        o2, s2, r, term, trunc, info = step_v(jax.random.split(k_env, n), env_state, act[:, 0], env_params)
        disc = args.gamma * (1.0 - term.astype(jnp.float32))
        trans = Transition(obs.astype(jnp.float32), act, r.astype(jnp.float32), disc.astype(jnp.float32),
                           info["final_observation"].astype(jnp.float32))
        return s2, o2, trans, r, jnp.logical_or(term, trunc)

    def evaluate(online, key, n_episodes):
        """Mean and per-episode undiscounted return [n_episodes] of the greedy policy (500-step limit)."""
        obs, st = reset_v(jax.random.split(key, n_episodes), env_params)

        def body(c, k):
            st, obs, ret, alive = c
            a = greedy_actions(online, obs, dan, z, bf16=bf16)[:, 0]
            obs, st, r, term, trunc, _ = step_v(jax.random.split(k, n_episodes), st, a, env_params)
            ret = ret + jnp.where(alive, r, 0.0)
            alive = alive & ~(term | trunc)
            return (st, obs, ret, alive), None

        init = (st, obs, jnp.zeros((n_episodes,), jnp.float32), jnp.ones((n_episodes,), bool))
        (_, _, ret, _), _ = jax.lax.scan(body, init, jax.random.split(key, env_params.max_steps_in_episode))
        return ret

    return reset_v, collect, evaluate


def main(argv=None) -> dict:
    """Trains and evaluates; returns the metrics dict also written to ``<out>/metrics.json``."""
    args = parse_args(argv)
    try:
        import gymnax
    except ImportError as e:
        raise SystemExit(f"train_cartpole.py needs gymnax: pip install '.[cartpole]' ({e})") from e
    import jax
    import jax.numpy as jnp
    from tqdm.auto import tqdm

    from jaxfox import per
    from jaxfox.models.branching_c51 import init_agent, make_update, support

    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    env, env_params = gymnax.make("CartPole-v1")
    obs_dim = int(env.observation_space(env_params).shape[0])
    key = jax.random.key(args.seed)
    key, k_init, k_eval_final = jax.random.split(key, 3)
    agent, opt, dan = init_agent(k_init, obs_dim=obs_dim, num_branches=1, num_actions=env.num_actions,
                                 num_atoms=args.num_atoms, capacity=args.capacity, lr=args.lr,
                                 weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm)
    z = support(args.num_atoms, args.v_max)
    bf16 = not args.no_bf16
    update = make_update(opt, dan, z, batch_size=args.batch_size, alpha=args.alpha, tau=args.tau, bf16=bf16)
    reset_v, collect, evaluate = make_cartpole_fns(env, env_params, args, dan, z, bf16)
    n_env = args.num_envs
    warm_iters = -(-args.learning_starts // n_env)
    train_iters = (args.total_steps - warm_iters * n_env) // n_env
    beta_at = per.beta_schedule(max(1, train_iters), args.beta0, 1.0)
    decay = max(1, int(args.eps_frac * args.total_steps / n_env))  # in iterations, counted from step 0
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; CartPole-v1 obs {obs_dim}, BranchingC51 "
          f"D={dan[0]} A={dan[1]} N={dan[2]} on [-{args.v_max:g}, {args.v_max:g}], "
          f"{int(agent.online.flat.shape[0])} params; {n_env} envs, batch {args.batch_size}, "
          f"<= {train_iters} updates, seed {args.seed}")

    @jax.jit
    def warmup(agent, s, o, key):
        def body(c, k):
            agent, s, o = c
            s, o, trans, _, _ = collect(agent.online, s, o, k, 1.0)
            return (agent._replace(buffer=per.add(agent.buffer, trans)), s, o), None
        (agent, s, o), _ = jax.lax.scan(body, (agent, s, o), jax.random.split(key, warm_iters))
        return agent, s, o

    @functools.partial(jax.jit, static_argnames=("length",))
    def train_chunk(agent, s, o, key, it0, length):
        def body(c, k):
            agent, s, o, it = c
            frac = jnp.minimum((it + warm_iters).astype(jnp.float32) / decay, 1.0)
            eps = args.eps_start + (args.eps_end - args.eps_start) * frac
            k_env, k_up = jax.random.split(k)
            s, o, trans, r, done = collect(agent.online, s, o, k_env, eps)
            agent = agent._replace(buffer=per.add(agent.buffer, trans))
            agent, info = update(agent, k_up, beta_at(agent.step))
            return (agent, s, o, it + 1), (info["loss_unweighted"], jnp.sum(done))
        (agent, s, o, _), out = jax.lax.scan(body, (agent, s, o, it0), jax.random.split(key, length))
        return agent, s, o, out

    eval_j = jax.jit(evaluate, static_argnums=2)

    key, k_reset, k_warm = jax.random.split(key, 3)
    obs, env_state = reset_v(jax.random.split(k_reset, n_env), env_params)
    agent, env_state, obs = warmup(agent, env_state, obs, k_warm)
    hist = {"env_steps": [], "eval_mean": [], "loss": [], "episodes": [], "confirm": []}
    solved_at = None
    it = 0
    t_train = time.perf_counter()
    n_chunks = -(-train_iters // args.eval_every)
    bar = tqdm(range(n_chunks), desc="cartpole", file=sys.stderr)
    for _ in bar:
        key, k, k_ev = jax.random.split(key, 3)
        # at most --total-steps: the last chunk runs the remainder (one more compilation when there is one)
        length = min(args.eval_every, train_iters - it)
        agent, env_state, obs, (loss, dones) = train_chunk(agent, env_state, obs, k, jnp.asarray(it, jnp.int32),
                                                           length=length)
        it += length
        ret = np.asarray(eval_j(agent.online, k_ev, args.eval_episodes))
        steps = (warm_iters + it) * n_env
        hist["env_steps"].append(steps)
        hist["eval_mean"].append(float(ret.mean()))
        hist["loss"].append(float(np.mean(np.asarray(loss))))
        hist["episodes"].append(int(np.sum(np.asarray(dones))))
        bar.set_postfix(steps=steps, eval=f"{ret.mean():.1f}", loss=f"{hist['loss'][-1]:.3f}")
        if ret.mean() >= args.stop_at:  # confirm on more, fresh episodes before stopping (less selection bias)
            key, k_conf = jax.random.split(key)
            conf = float(np.asarray(eval_j(agent.online, k_conf, args.final_eval_episodes)).mean())
            hist["confirm"].append([steps, conf])
            if conf >= args.stop_at:
                solved_at = steps
                break
    train_s = time.perf_counter() - t_train
    final = np.asarray(eval_j(agent.online, k_eval_final, args.final_eval_episodes))
    metrics = {
        "env_steps": int((warm_iters + it) * n_env), "updates": int(agent.step),
        "solved_at_env_steps": solved_at, "stop_at": args.stop_at,
        "final_eval_mean": float(final.mean()), "final_eval_min": float(final.min()),
        "final_eval_episodes": args.final_eval_episodes,
        "train_seconds": train_s, "wall_seconds": time.perf_counter() - t_start,
        "history": hist, "args": vars(args), "jax": jax.__version__,
    }
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    _plot(args.out, hist, args.stop_at)
    print(f"env steps {metrics['env_steps']}, updates {metrics['updates']}, confirmed eval >= {args.stop_at:g} at "
          f"{solved_at}; final greedy eval over {args.final_eval_episodes} episodes: mean "
          f"{metrics['final_eval_mean']:.1f} (min {metrics['final_eval_min']:.0f}); train {train_s:.0f}s, wall "
          f"{metrics['wall_seconds']:.0f}s -> {args.out}")
    return metrics


def _plot(out, hist, stop_at):
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend (e.g. a notebook's) alone

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot(hist["env_steps"], hist["eval_mean"], marker=".")
    ax.axhline(stop_at, color="k", lw=0.8, ls="--")
    ax.set(xlabel="environment steps", ylabel="mean greedy eval return", title="branching C51 on CartPole-v1")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "curve.png"), dpi=100)


if __name__ == "__main__":
    main()
