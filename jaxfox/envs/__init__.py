"""Pure-JAX environments (functional API: ``reset(key) -> (state, obs)``, ``step(state, action) -> (state, obs,
reward, done)``; jit- and vmap-able)."""

from jaxfox.envs.trading import (
    AVAILABLE_INSTRUMENTS,
    INSTRUMENTS,
    LEVELS,
    POSITION_FEATURES,
    Trading,
    TradingParams,
    TradingState,
)

__all__ = ["AVAILABLE_INSTRUMENTS", "INSTRUMENTS", "LEVELS", "POSITION_FEATURES", "Trading", "TradingParams", "TradingState"]
