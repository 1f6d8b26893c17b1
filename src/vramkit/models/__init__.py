"""Models shipped with vramkit, so its features can be demonstrated and benchmarked without downloads.

- :mod:`vramkit.models.dit`: a diffusion transformer with Flux-style double- and single-stream blocks
  (``DiTConfig``, ``DiT``, ``synthetic_batch``, ``flow_matching_loss``), used by ``vramkit demo`` and
  the swapping benchmarks.
"""
