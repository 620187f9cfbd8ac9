"""The MoE tail on Hopper (the seeds' ``moe/tail.py`` and ``moe/tail_runtime.py``), TP-general.

Two PDL-chained kernels, the seeds' front and tail halves: a front (:mod:`.fronts`:
NormFront's normalized rows in functional mode, TailFront's partial latent into every
rank's box in publish mode, PollNormFront's rows from those boxes before the publish-mode
wave), then the tail: :mod:`.split`'s MoeTail (K split over a cluster, mma.sync) below
MIN_WAVE_GROUPS token groups, :mod:`.wave`'s WaveMoeTail (no K split, wgmma, xn multicast)
from there on; in publish mode up to MAX_WAVE_TP, the wave at every batch
(MIN_POLL_WAVE_GROUPS). :mod:`.common` holds what they share
(the boxes' sums, polls and re-arm, the output packets); :mod:`.host` the compiles, the
variant of each call shape and the ``kimi`` ops' adapters.
"""

from .host import register

__all__ = ["register"]
