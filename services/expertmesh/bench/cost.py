"""What a benchmark's throughput costs: US dollars per million output tokens from the price of the machine (or
of each GPU) per hour, the field report's unit economics. Pure arithmetic; the benchmarks print it beside their
figures when given ``--price-per-hour``.

Example: a machine at $2.00 an hour serving 100 output tokens/s costs 2.00 / (100 x 3600) x 1e6 = $5.56 per
million output tokens.
"""

from __future__ import annotations

import math

from expertmesh.bench.report import BenchError

__all__ = ["check_price", "per_million_tokens"]


def check_price(price_per_hour: float | None, flag: str = "--price-per-hour") -> float | None:
    """``price_per_hour`` when it is a finite amount >= 0 (None: not priced), else a one-line ``BenchError``."""
    if price_per_hour is None:
        return None
    if not math.isfinite(price_per_hour) or price_per_hour < 0:
        raise BenchError(f"{flag} must be a finite amount of US dollars >= 0, got {price_per_hour}")
    return price_per_hour


def per_million_tokens(price_per_hour: float, tokens_per_s: float) -> float | None:
    """Dollars per million tokens produced at ``tokens_per_s`` on what costs ``price_per_hour``; None when
    nothing was produced (no rate to price)."""
    if not tokens_per_s > 0:
        return None
    return price_per_hour / (tokens_per_s * 3600.0) * 1e6
