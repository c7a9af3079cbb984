"""The main job: train the perception model on real market data and compare it with single-feature baselines.

Models (``--model``): ``full`` (the default): per-variable embedding -> VSN at every step -> CfC -> attention
pooling over time -> GRN head -> logit (:mod:`jaxfox.models.perception`), which also reports the VSN's mean
variable weights (all of them printed, largest first, and drawn in ``vsn_weights.png``); ``v0``: per-variable
embedding -> CfC -> last state -> logit (:mod:`jaxfox.models.perception_v0`). The CfC runs jaxfox.cfc_scan's
CUDA kernels on a GPU and the pure-JAX reference on CPU. Data: :func:`jaxfox.data.market.make_windows`
(S&P 500, NASDAQ, WTI features 1999-2018; train <= 2012, validation 2013-2015, test 2016-2018).
Target: is the next day's absolute S&P 500 log return above its trailing 252-day median?

    python examples/train_perception.py                    # defaults: the README's main job (full model)
    python examples/train_perception.py --epochs 1 --max-train-windows 256 --out /tmp/quick
    python examples/train_perception.py --model v0         # the smaller model without the TFT blocks

Prints per-epoch train loss, validation loss and AUC; keeps the parameters of the best validation AUC;
reports the test AUC of those next to the trailing-|return| and trailing-VIX baselines (test span); saves
``curves.png`` and ``metrics.json`` (and ``vsn_weights.png`` for ``full``) into ``--out``. The defaults of
both models were chosen on validation AUC only (the test span was not used to choose anything).
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
from _cli import check_finite, check_output_folder, usage_error  # noqa: E402


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: ...)" except for options whose default depends on --model (their help says it)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
    from jaxfox.data.market import FEATURE_NAMES
    from jaxfox.models import DEFAULTS as D  # model/optimizer defaults, shared with jaxfox.bench
    from jaxfox.models.perception import FULL_DEFAULTS as F

    p.add_argument("--model", choices=("full", "v0"), default="full",
                   help="full: embedding -> VSN -> CfC -> attention pool -> GRN head; "
                        "v0: embedding -> CfC -> last state")
    p.add_argument("--epochs", type=int, default=15, help="passes over the training windows")
    p.add_argument("--batch-size", type=int, default=32, help="windows per AdamW step")
    p.add_argument("--window", type=int, default=64, help="T, trading days per window")
    p.add_argument("--hidden", type=int, default=D["hidden"], help="H, CfC state size")
    p.add_argument("--embed-dim", type=int, default=None,
                   help=f"d, embedding width per variable (v0: CfC input m*d); default {D['embed_dim']} (v0), "
                        f"{F['embed_dim']} (full)")
    p.add_argument("--backbone-units", type=int, default=D["backbone_units"], help="U, CfC backbone width")
    full_only = {"vsn_hidden": F["vsn_hidden"], "vsn_out": F["vsn_out"], "heads": F["num_heads"]}
    p.add_argument("--vsn-hidden", type=int, default=None,
                   help=f"full only: hidden width of the VSN's GRNs; default {F['vsn_hidden']}")
    p.add_argument("--vsn-out", type=int, default=None,
                   help=f"full only: VSN output width (CfC input); default {F['vsn_out']}")
    p.add_argument("--heads", type=int, default=None,
                   help=f"full only: attention-pooling heads (divide H); default {F['num_heads']}")
    p.add_argument("--lr", type=float, default=D["lr"], help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=D["weight_decay"], help="AdamW decoupled weight decay")
    p.add_argument("--input-noise", type=float, default=0.6,
                   help="std of Gaussian noise added to the (z-scored) training inputs of every batch; 0 = off")
    p.add_argument("--max-features", type=int, default=None,
                   help=f"use the first k of the {len(FEATURE_NAMES)} features (default: all)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and shuffling seed")
    p.add_argument("--out", default=None,
                   help="folder for curves.png, vsn_weights.png (full model) and metrics.json "
                        "(default: runs/perception, or runs/perception_v0 with --model v0; a relative path is "
                        "taken from the current directory)")
    p.add_argument("--max-train-windows", type=int, default=None,
                   help="use only the most recent N training windows (quick runs; default: all)")
    args = p.parse_args(argv)
    if args.out is None:  # one folder per model: a v0 run must not sit beside an older full run's vsn_weights.png
        args.out = "runs/perception" if args.model == "full" else "runs/perception_v0"
    if args.embed_dim is None:
        args.embed_dim = D["embed_dim"] if args.model == "v0" else F["embed_dim"]
    for name, default in full_only.items():  # the v0 model has no VSN or attention pool: refuse, don't ignore
        if args.model == "v0" and getattr(args, name) is not None:
            p.error(f"--{name.replace('_', '-')} applies to --model full only (v0 has no VSN or attention pool)")
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in ("epochs", "batch_size", "window", "hidden", "embed_dim", "backbone_units", "vsn_hidden", "vsn_out",
                 "heads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_finite(p, args, ("lr", "weight_decay", "input_noise"), low=0)
    check_output_folder(p, args.out)
    if args.model == "full" and args.hidden % args.heads:
        p.error(f"--heads ({args.heads}) must divide --hidden ({args.hidden})")
    if args.max_features is not None and not 1 <= args.max_features <= len(FEATURE_NAMES):
        p.error(f"--max-features must be in [1, {len(FEATURE_NAMES)}], got {args.max_features}")
    if args.max_train_windows is not None and args.max_train_windows < args.batch_size:
        p.error(f"--max-train-windows must be >= --batch-size ({args.batch_size}), got {args.max_train_windows}")
    return args


def save_curves(path, history, baselines_val):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ep = np.arange(1, len(history["train_loss"]) + 1)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(ep, history["train_loss"], "o-", label="train (mean over epoch)")
    a.plot(ep, history["val_loss"], "o-", label="validation")
    a.set(xlabel="epoch", ylabel="binary cross-entropy", title="loss")
    # legends below the axes: inside, they covered curves or baseline lines
    a.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    b.plot(ep, history["val_auc"], "o-", label="model (validation)")
    for (name, v), style in zip(baselines_val.items(), (":", "--")):
        if np.isfinite(v):
            note = ", 2014-15 windows: VIX data start in 2014" if name == "trailing_vix" else ""
            b.axhline(v, color="gray", linestyle=style, label=f"{name} (validation{note})")
    b.set(xlabel="epoch", ylabel="ROC AUC", title="validation AUC")
    b.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    for ax in (a, b):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")  # "tight": the legends below the axes included
    plt.close(fig)


def save_weights(path, names, weights, title):
    """Horizontal bar chart of the VSN's mean variable weights (all variables, largest on top)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = np.argsort(weights)  # ascending: barh draws the first at the bottom
    fig, ax = plt.subplots(figsize=(7, max(3.0, 0.22 * len(names) + 1.0)))
    ax.barh(np.arange(len(order)), np.asarray(weights)[order], color="tab:blue")
    ax.set_yticks(np.arange(len(order)), [names[i] for i in order], fontsize=7)
    ax.axvline(1.0 / len(names), color="gray", linestyle="--", label=f"uniform 1/m = {1.0 / len(names):.4f}")
    ax.set(xlabel="mean VSN weight", title=title)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> dict:
    """Runs the job; returns the metrics dict that is also written to ``<out>/metrics.json``."""
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tqdm.auto import tqdm

    import jaxfox
    from jaxfox.data.market import make_windows
    from jaxfox.models import evaluate, make_model, make_optimizer, train_epoch

    if args.model == "full":
        from jaxfox.models import perception as full

        def evaluate(model, x, y):  # noqa: F811 - (loss, AUC) as v0's; the weights are read after training
            return full.evaluate(model, x, y)[:2]

        train_epoch = full.train_epoch  # noqa: F811

    kernels = jaxfox.kernels_available()
    reason = jaxfox.kernels_unavailable_reason()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; CfC kernels used: {kernels}"
          + ("" if kernels else f" ({reason})"))

    t0 = time.perf_counter()
    try:  # errors that depend on the data (a window longer than the series): a usage error, not a traceback
        data = make_windows(args.window, max_features=args.max_features)
    except ValueError as e:
        usage_error(f"--window {args.window}: {e}")
    x_train, y_train = data.x_train, data.y_train
    if args.max_train_windows is not None:
        x_train, y_train = x_train[-args.max_train_windows:], y_train[-args.max_train_windows:]
    n, T, m = x_train.shape
    if n < args.batch_size:
        usage_error(f"--batch-size must be <= the {n} training windows of --window {args.window}, "
                    f"got {args.batch_size}")
    os.makedirs(args.out, exist_ok=True)  # after the checks that need the data: a usage error leaves no folder
    print(f"data: train {x_train.shape}, val {data.x_val.shape}, test {data.x_test.shape} "
          f"([windows, days, features]); positives train/val/test {y_train.mean():.3f}/"
          f"{data.y_val.mean():.3f}/{data.y_test.mean():.3f}; loaded in {time.perf_counter() - t0:.1f}s")

    rngs = nnx.Rngs(args.seed)
    if args.model == "full":
        model = full.make_model(m, embed_dim=args.embed_dim, vsn_hidden=args.vsn_hidden, vsn_out=args.vsn_out,
                                hidden=args.hidden, backbone_units=args.backbone_units, num_heads=args.heads,
                                rngs=rngs)
        desc = (f"Perception m={m} d={args.embed_dim} VSN hidden/out {args.vsn_hidden}/{args.vsn_out} "
                f"H={args.hidden} U={args.backbone_units} heads={args.heads}")
    else:
        model = make_model(m, hidden=args.hidden, embed_dim=args.embed_dim, backbone_units=args.backbone_units,
                           rngs=rngs)
        desc = f"PerceptionV0 m={m} d={args.embed_dim} H={args.hidden} U={args.backbone_units}"
    optimizer = make_optimizer(model, lr=args.lr, weight_decay=args.weight_decay)
    n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"model: {desc}, "
          f"{n_params} parameters; AdamW lr={args.lr} wd={args.weight_decay}, batch {args.batch_size}, "
          f"input noise {args.input_noise}")

    # The training windows live on the device; each epoch (a new shuffle, fresh input noise, n // batch
    # fixed-shape AdamW steps) is one compiled call, so the host does not dispatch every step.
    x_dev, y_dev = jnp.asarray(x_train), jnp.asarray(y_train)
    keys = jax.random.split(jax.random.key(args.seed), args.epochs)
    history = {"train_loss": [], "val_loss": [], "val_auc": [], "epoch_s": [], "eval_s": []}
    best = {"val_auc": -np.inf, "epoch": 0, "params": None}
    bar = tqdm(range(1, args.epochs + 1), desc="epochs", leave=False, file=sys.stderr)
    for epoch in bar:
        t_ep = time.perf_counter()
        losses = train_epoch(model, optimizer, x_dev, y_dev, keys[epoch - 1], batch_size=args.batch_size,
                             input_noise=args.input_noise)
        train_loss = float(np.mean(jax.device_get(losses)))
        bar.set_postfix(loss=f"{train_loss:.4f}")
        t_eval = time.perf_counter()
        val_loss, val_auc = evaluate(model, data.x_val, data.y_val)
        t_end = time.perf_counter()
        history["train_loss"].append(train_loss)
        history["val_loss"].append(val_loss)
        history["val_auc"].append(val_auc)
        history["epoch_s"].append(t_eval - t_ep)
        history["eval_s"].append(t_end - t_eval)
        mark = ""
        if val_auc > best["val_auc"]:
            best = {"val_auc": val_auc, "epoch": epoch,
                    "params": jax.tree.map(np.array, nnx.state(model, nnx.Param))}
            mark = "  *best"
        tqdm.write(f"epoch {epoch:3d}  train loss {train_loss:.4f}  val loss {val_loss:.4f}  val AUC {val_auc:.4f}  "
                   f"({t_eval - t_ep:.2f}s train + {t_end - t_eval:.2f}s eval){mark}", file=sys.stdout)

    # Back onto the devices with the placement the parameters have now (replicated on the training mesh), so
    # the evaluation below reuses the compiled forward instead of compiling it again for uncommitted arrays.
    nnx.update(model, jax.tree.map(lambda b, cur: jax.device_put(b, cur.sharding), best["params"],
                                   nnx.state(model, nnx.Param)))
    if args.model == "full":
        test_loss, test_auc, w_test = full.evaluate(model, data.x_test, data.y_test)
        w_val = full.evaluate(model, data.x_val, data.y_val)[2]
    else:
        test_loss, test_auc = evaluate(model, data.x_test, data.y_test)
    base_test = {k: v[1] for k, v in data.baselines.items()}
    base_val = {k: v[0] for k, v in data.baselines.items()}
    beats = bool(all(test_auc > v for v in base_test.values()))
    print(f"\nbest epoch {best['epoch']} (val AUC {best['val_auc']:.4f})")
    print(f"TEST AUC {test_auc:.4f}  (test loss {test_loss:.4f})")
    for k, v in base_test.items():
        print(f"  baseline {k:20s} test AUC {v:.4f}  (val {base_val[k]:.4f})")
    print(f"beats both single-feature baselines on the test span: {'YES' if beats else 'NO'}")
    print(f"epoch wall times (s, training part; epoch 1 includes compilation): "
          + ", ".join(f"{s:.3f}" for s in history["epoch_s"]))
    print(f"CfC kernels used: {kernels}" + ("" if kernels else f" ({reason})"))
    if args.model == "full":
        names = list(data.feature_names)
        print(f"\nVSN mean variable weights, all {m} (best epoch, test windows, mean over windows and days; "
              f"uniform 1/m = {1.0 / m:.4f}), largest first, test (validation):")
        width = max(len(s) for s in names)
        cells = [f"{names[i]:{width}s} {w_test[i]:.4f} ({w_val[i]:.4f})" for i in np.argsort(-w_test)]
        for row in range(0, len(cells), 3):
            print("  " + "   ".join(cells[row:row + 3]))

    metrics = {
        "args": vars(args), "n_params": n_params, "platform": jax.devices()[0].platform,
        "kernels_available": kernels, "kernels_unavailable_reason": reason,
        "n_train": int(n), "n_val": int(len(data.y_val)), "n_test": int(len(data.y_test)),
        "history": history, "best_epoch": best["epoch"], "best_val_auc": best["val_auc"],
        "test_auc": test_auc, "test_loss": test_loss,
        "baselines_test": base_test, "baselines_val": base_val, "beats_baselines": beats,
        "total_s": time.perf_counter() - t0,
    }
    if args.model == "full":
        metrics["vsn_weights_test"] = {k: float(v) for k, v in zip(names, w_test)}
        metrics["vsn_weights_val"] = {k: float(v) for k, v in zip(names, w_val)}
        save_weights(os.path.join(args.out, "vsn_weights.png"), names, w_test,
                     f"VSN mean variable weights (test windows, best epoch {best['epoch']})")
    save_curves(os.path.join(args.out, "curves.png"), history, base_val)
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    print(f"saved {args.out}/curves.png" + (f", {args.out}/vsn_weights.png" if args.model == "full" else "")
          + f" and {args.out}/metrics.json")
    return metrics


if __name__ == "__main__":
    main()
