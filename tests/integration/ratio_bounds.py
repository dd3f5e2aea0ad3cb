"""Importance-ratio bounds derived from what a training test controls, not from a lucky window.

The replicas serve float32 and the trainer trains in float32 on CPU: their logprobs of the same
weights agree to ~1e-6 per token. With a learning rate of RATIO_LR, Adam moves each weight by ~1e-9
per step, so no policy version differs measurably from the one that sampled: the ratio is 1 up to
numerics, and RATIO_TOL leaves three orders of magnitude for them. A larger deviation means some
replica served other weights than the trainer holds (a stale adapter, a stale prefix cache).
"""

RATIO_LR = "1e-9"
RATIO_TOL = 1e-3


def near_one(ratios: list[float]) -> bool:
    """True when there is at least one ratio and every one is within RATIO_TOL of 1."""
    return bool(ratios) and all(abs(ratio - 1) <= RATIO_TOL for ratio in ratios)
