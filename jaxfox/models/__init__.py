"""Models built from jaxfox ops: perception v0 (embedding -> CfC -> head), the full Perception model
(VSN -> CfC -> attention pool -> GRN head), the branching C51 DQN and the auxiliary trainers (``jaxfox.models.aux``:
IQL value pair, IQN head, attention trainer)."""

from jaxfox.models import aux
from jaxfox.models.aux import AuxConfig, AuxTrainers, make_aux
from jaxfox.models.branching_c51 import BranchingC51
from jaxfox.models.perception import FULL_DEFAULTS, Perception
from jaxfox.models.perception_v0 import (
    DEFAULTS,
    PerceptionV0,
    benchmark_step,
    evaluate,
    loss_fn,
    make_model,
    make_optimizer,
    predict_logits,
    train_epoch,
    train_step,
)

__all__ = [
    "aux", "AuxConfig", "AuxTrainers", "make_aux",
    "BranchingC51", "Perception", "FULL_DEFAULTS",
    "DEFAULTS", "PerceptionV0", "benchmark_step", "evaluate", "loss_fn", "make_model", "make_optimizer",
    "predict_logits", "train_epoch", "train_step",
]
