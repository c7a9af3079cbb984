"""The auxiliary trainers (IQL value pair, IQN head, attention trainer) on transitions collected by the DQN agent
on the real daily trading data.

1. DQN: a :class:`jaxfox.models.branching_c51.BranchingC51` agent (:func:`~jaxfox.models.branching_c51.init_agent`,
   :func:`~jaxfox.models.branching_c51.make_update`: PER, double-DQN categorical loss, EMA target, fused AdamW) is
   trained for ``--dqn-steps`` updates on :class:`jaxfox.envs.Trading` (train span), as in ``examples/train_dqn.py``
   but shorter (default 500 updates: the point here is the aux trainers, not the policy).
2. Collection: ``--num-envs`` environments run the agent's epsilon-greedy policy (``--eps``) for
   ``--collect-steps`` steps. Each transition keeps obs, reward (x ``--reward-scale``, percent), discount
   (gamma), next obs, the window of the last ``--seq-len`` observations ending at obs (repeated first obs
   after a reset), and q = mean over branches of the target network's Q(s, a_d) (the IQL target).
3. Aux training: ``--steps`` steps of :func:`jaxfox.models.aux.make_aux`'s ``aux_step`` (ONE jitted function:
   IQL pair 48 -> 256 -> 128 -> 1 with expectiles 0.7/0.9 (``AuxConfig``'s default ``iql_impl="fused"``: with two
   hidden layers that is the ``"vmap"`` batched-GEMM path, the kernel path covers one), IQN with quantile Huber
   loss against an EMA target, attention pool over the window -> linear head regressing the scaled reward), each
   trainer with its own uniformly sampled minibatch of ``--batch-size`` transitions.

With a GPU, call with ``--concurrent`` to set ``--xla_gpu_command_buffer_scheduling_mode=CONCURRENT``
(:func:`jaxfox.enable_concurrent_command_buffers`, before JAX starts) so that the trainers can overlap (on the
H200 they have not so far: the IQN trainer's kernels fill every SM, BENCHMARKS.md).

    python examples/train_aux.py                          # ~a few minutes on a CPU
    python examples/train_aux.py --dqn-steps 10 --num-envs 8 --collect-steps 40 --steps 30 \\
        --batch-size 64 --seq-len 4 --out /tmp/aux        # smoke test

Prints and saves (``<out>/metrics.json``) the trainers' losses at the start and end of training
(means over the first and last 10 % of steps).
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--dqn-steps", type=int, default=500, help="DQN updates before collecting")
    p.add_argument("--num-envs", type=int, default=64, help="parallel (vmapped) environments")
    p.add_argument("--collect-steps", type=int, default=252, help="env steps per env collected for the aux trainers")
    p.add_argument("--steps", type=int, default=500, help="aux training steps")
    p.add_argument("--batch-size", type=int, default=1024, help="minibatch per trainer")
    p.add_argument("--seq-len", type=int, default=16, help="observation window of the attention trainer")
    p.add_argument("--eps", type=float, default=0.1, help="epsilon of the collecting policy")
    p.add_argument("--gamma", type=float, default=0.9, help="discount per trading day")
    p.add_argument("--reward-scale", type=float, default=100.0, help="reward multiplier (100: percent)")
    p.add_argument("--lr", type=float, default=3e-4, help="aux trainers' learning rate")
    p.add_argument("--seed", type=int, default=0, help="initialisation, exploration and sampling seed")
    p.add_argument("--concurrent", action="store_true",
                   help="enable CONCURRENT command-buffer scheduling (GPU; must precede JAX's start)")
    p.add_argument("--out", default="runs/aux", help="folder for metrics.json (a relative path is taken from the "
                   "current directory)")
    args = p.parse_args(argv)
    for name in ("dqn_steps", "num_envs", "collect_steps", "steps", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.eps <= 1:
        p.error(f"--eps must be in [0, 1], got {args.eps}")
    if not 0 <= args.gamma < 1:
        p.error(f"--gamma must be in [0, 1), got {args.gamma}")
    check_finite(p, args, ("reward_scale",), low=0, strict=True)
    check_finite(p, args, ("lr",), low=0)
    check_output_folder(p, args.out)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.concurrent:
        import jaxfox

        jaxfox.enable_concurrent_command_buffers()
    import jax
    import jax.numpy as jnp
    from tqdm.auto import tqdm

    import jaxfox
    from jaxfox import per
    from jaxfox.envs import Trading
    from jaxfox.models.aux import AuxConfig, make_aux
    from jaxfox.models.branching_c51 import (Transition, epsilon_greedy, forward, init_agent, make_update,
                                             q_values, support)

    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    env = Trading()
    tr = env.train
    E, T = args.num_envs, args.seq_len
    key = jax.random.key(args.seed)
    key, k_init = jax.random.split(key)
    batch_dqn = min(256, E * 16)
    capacity = max(4096, 2 * batch_dqn)
    agent, opt, dan = init_agent(k_init, obs_dim=env.obs_dim, num_branches=env.num_branches,
                                 num_actions=env.num_actions, capacity=capacity)
    z = support(dan[2], 25.0)
    update = make_update(opt, dan, z, batch_size=batch_dqn)
    reset_v = jax.vmap(env.reset, in_axes=(0, None))
    step_v = jax.vmap(env.step, in_axes=(0, 0, None))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; kernels used: {jaxfox.kernels_available()}; "
          f"D={env.num_branches} instruments, obs {env.obs_dim}; concurrent command buffers: "
          f"{jaxfox.concurrent_command_buffers_enabled()}")

    def env_step(online, s, o, k, eps):
        k_act, k_reset = jax.random.split(k)
        act = epsilon_greedy(k_act, online, o, dan, z, eps)
        s2, o2, r, done = step_v(s, act, tr)
        trans = Transition(o, act, r * args.reward_scale, jnp.full_like(r, args.gamma), o2)
        rs, ro = reset_v(jax.random.split(k_reset, E), tr)
        s_next = jax.tree.map(lambda a, b: jnp.where(done.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), rs, s2)
        o_next = jnp.where(done[:, None], ro, o2)
        return s_next, o_next, trans, done

    # 1. DQN: fill the buffer with random transitions, then dqn_steps updates (one env step each).
    @jax.jit
    def dqn_phase(agent, s, o, key):
        k_fill, k_train = jax.random.split(key)

        def fill(c, k):
            agent, s, o = c
            s, o, trans, _ = env_step(agent.online, s, o, k, 1.0)
            return (agent._replace(buffer=per.add(agent.buffer, trans)), s, o), None

        n_fill = -(-batch_dqn // E) + 1
        (agent, s, o), _ = jax.lax.scan(fill, (agent, s, o), jax.random.split(k_fill, n_fill))

        def body(c, k):
            agent, s, o = c
            k_env, k_up = jax.random.split(k)
            eps = jnp.maximum(0.1, 1.0 - agent.step.astype(jnp.float32) / max(1, args.dqn_steps // 2))
            s, o, trans, _ = env_step(agent.online, s, o, k_env, eps)
            agent = agent._replace(buffer=per.add(agent.buffer, trans))
            agent, info = update(agent, k_up, 0.4)
            return (agent, s, o), info["loss"]

        (agent, s, o), losses = jax.lax.scan(body, (agent, s, o), jax.random.split(k_train, args.dqn_steps))
        return agent, s, o, losses

    key, k_reset, k_dqn, k_col = jax.random.split(key, 4)
    s, o = reset_v(jax.random.split(k_reset, E), tr)
    agent, s, o, dqn_losses = dqn_phase(agent, s, o, k_dqn)
    dqn_losses = np.asarray(dqn_losses)
    # means over the first and last 10 % of the updates (at least one each), as for the aux losses below: a fixed
    # 10 made "first" and "last" the same updates when there were 10 or fewer
    kd = max(1, args.dqn_steps // 10)
    dqn_loss = [float(dqn_losses[:kd].mean()), float(dqn_losses[-kd:].mean())]
    print(f"DQN: {args.dqn_steps} updates, loss {dqn_loss[0]:.3f} -> {dqn_loss[1]:.3f} (means of the first and last "
          f"{kd})")

    # 2. Collect with the agent's epsilon-greedy policy, with observation windows and target Q.
    @jax.jit
    def collect(agent, s, o, key):
        win0 = jnp.repeat(o[:, None], T, axis=1)

        def body(c, k):
            s, o, win = c
            s2, o2, trans, done = env_step(agent.online, s, o, k, args.eps)
            q = q_values(forward(agent.target, o, dan), z)                                # [E, D, A]
            q_a = jnp.take_along_axis(q, trans.action[..., None], axis=-1)[..., 0].mean(-1)
            rec = {"obs": o, "reward": trans.reward, "discount": trans.discount, "next_obs": trans.next_obs,
                   "seq": win, "q": q_a}
            nxt = jnp.concatenate([win[:, 1:], o2[:, None]], axis=1)
            win2 = jnp.where(done[:, None, None], jnp.repeat(o2[:, None], T, axis=1), nxt)
            return (s2, o2, win2), rec

        _, recs = jax.lax.scan(body, (s, o, win0), jax.random.split(key, args.collect_steps))
        return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), recs)

    data = collect(agent, s, o, k_col)
    n = int(data["obs"].shape[0])
    print(f"collected {n} transitions; reward (x{args.reward_scale:g}) mean {float(data['reward'].mean()):+.3f} "
          f"std {float(data['reward'].std()):.3f}; target Q mean {float(data['q'].mean()):+.3f}")

    # 3. Aux trainers.
    cfg = AuxConfig(obs_dim=env.obs_dim, iql_hidden=(256, 128), seq_len=T, seq_dim=env.obs_dim, num_heads=4,
                    lr=args.lr)
    aux = make_aux(cfg)
    key, k_aux = jax.random.split(key)
    state = aux.init(k_aux)
    B = args.batch_size

    @jax.jit
    def train_step(state, data, key):
        k1, k2, k3 = jax.random.split(key, 3)
        take = lambda k, names: {m: data[m][jax.random.randint(k, (B,), 0, n)] for m in names}  # noqa: E731
        ki = jax.random.randint(k1, (B,), 0, n)
        batch = {"iql": {"obs": data["obs"][ki], "q": data["q"][ki]},
                 "iqn": take(k2, ("obs", "reward", "discount", "next_obs")),
                 "attn": (lambda b: {"seq": b["seq"], "y": b["reward"]})(take(k3, ("seq", "reward")))}
        return aux.aux_step(state, batch)

    hist = {"iql": [], "iql_0.7": [], "iql_0.9": [], "iqn": [], "attn": []}
    bar = tqdm(range(args.steps), desc="aux", file=sys.stderr)
    t_train = time.perf_counter()
    for _ in bar:
        key, k = jax.random.split(key)
        state, info = train_step(state, data, k)
        info = jax.device_get(info)
        for name in ("iql", "iqn", "attn"):
            hist[name].append(float(info[name]))
        hist["iql_0.7"].append(float(info["iql_per_net"][0]))
        hist["iql_0.9"].append(float(info["iql_per_net"][1]))
        bar.set_postfix(iql=f"{info['iql']:.3f}", iqn=f"{info['iqn']:.3f}", attn=f"{info['attn']:.3f}")
    train_s = time.perf_counter() - t_train
    m = max(1, args.steps // 10)
    first = {k: float(np.mean(v[:m])) for k, v in hist.items()}
    last = {k: float(np.mean(v[-m:])) for k, v in hist.items()}
    metrics = {"first_loss": first, "last_loss": last, "transitions": n, "aux_steps": args.steps,
               "dqn_loss": dqn_loss,
               "aux_train_seconds": train_s, "wall_seconds": time.perf_counter() - t_start,
               "kernels_available": jaxfox.kernels_available(),
               "concurrent_command_buffers": jaxfox.concurrent_command_buffers_enabled(), "args": vars(args)}
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    for k in hist:
        print(f"  {k:8s} loss {first[k]:.4f} -> {last[k]:.4f}")
    print(f"aux: {args.steps} steps in {train_s:.1f}s; wall {metrics['wall_seconds']:.0f}s -> {args.out}")
    return metrics


if __name__ == "__main__":
    main()
