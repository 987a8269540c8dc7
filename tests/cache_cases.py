"""Worker functions for tests/test_capture_cache.py (run on the gloo worker pool)."""

from __future__ import annotations

import os


def parallelize_counting_exports(rank, world, cache, seed=0):
    """parallelize the tiny Llama at dp=2 x tp=2 with the capture cache in ``cache``: how many times this
    rank ran torch.export, the loss of one step, and the seconds parallelize took."""
    import time

    import torch

    import mcompile as mc
    from mcompile.models import get_preset

    os.environ["MCOMPILE_CACHE"] = cache
    calls = []
    real = torch.export.export

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    torch.export.export = counting
    try:
        pre = get_preset("llama3-tiny")
        torch.manual_seed(seed)
        model = pre.build()
        g = torch.Generator().manual_seed(1)
        ids, labels = torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 256, (4, 16), generator=g)
        t = time.perf_counter()
        pm = mc.parallelize(model, mc.Mesh(dp=2, tp=2), (ids, labels))
        seconds = time.perf_counter() - t
        loss = pm.train_step(ids, labels)
    finally:
        torch.export.export = real
    return len(calls), float(loss), seconds
