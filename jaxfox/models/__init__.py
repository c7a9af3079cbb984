"""Models built from jaxfox ops: perception v0 (embedding -> CfC -> head); the full model comes later."""

from jaxfox.models.perception_v0 import (
    DEFAULTS,
    PerceptionV0,
    benchmark_step,
    evaluate,
    loss_fn,
    make_model,
    make_optimizer,
    predict_logits,
    train_step,
)

__all__ = [
    "DEFAULTS", "PerceptionV0", "benchmark_step", "evaluate", "loss_fn", "make_model", "make_optimizer",
    "predict_logits", "train_step",
]
