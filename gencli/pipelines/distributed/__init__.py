"""Batch inference past one machine, on Ray Data (``--ray [ADDRESS]``).

:mod:`.runtime` starts or joins the Ray runtime and holds what every distributed command shares
(:class:`RayOptions`, the actor-pool arguments of ``map_batches``, the sharded-output directory),
:mod:`.replica_warnings` brings the workers' warnings back to the driver;
:mod:`.forecast`, :mod:`.images` (classify, zeroshot, similarity), :mod:`.text` (generate) and
:mod:`.diffusion` (txt2img) run the commands, doing the per-batch work with the
single-process pipeline's own functions so that the output is identical by construction.

Nothing here imports Ray at import time, and nothing outside this package imports this package
unless the user passed ``--ray``: without it, Ray is never loaded.
"""
