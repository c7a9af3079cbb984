"""Datasets for jaxfox: real daily market data bundled with ``arch`` (see :mod:`jaxfox.data.market`)."""

from jaxfox.data.market import (
    FEATURE_NAMES,
    MarketWindows,
    auc,
    build_features,
    load_prices,
    load_vix,
    make_windows,
    target,
)

__all__ = [
    "FEATURE_NAMES", "MarketWindows", "auc", "build_features", "load_prices", "load_vix", "make_windows",
    "target",
]
