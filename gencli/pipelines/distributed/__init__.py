"""Batch inference past one machine, on Ray Data (``--ray [ADDRESS]``): the shared runtime.

:mod:`.runtime` starts or joins the Ray runtime and holds what every distributed command shares
(:class:`RayOptions`, the actor-pool arguments of ``map_batches``, the sharded-output directory);
:mod:`.replica_warnings` brings the workers' warnings back to the driver. Each family's adapter lives
beside it (``pipelines/forecast/ray.py``, ``pipelines/vision/ray.py`` for classify, zeroshot and
similarity, ``pipelines/text/ray.py``, ``pipelines/diffusion/ray.py``) and does the per-batch work
with the single-process pipeline's own functions, so the output is identical by construction.

Nothing here imports Ray at import time, and no adapter is imported unless the user passed
``--ray``: without it, Ray is never loaded.
"""
