"""The live-tensor memory tracker, checked against bytes counted by hand."""

from __future__ import annotations

import torch

from mcompile.runtime.memory import MemoryTracker


def test_tracker_counts_saved_activations_parameters_gradients_and_adam_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    params = list(model.parameters())
    p_bytes = sum(p.numel() * 4 for p in params)
    tracker = MemoryTracker()
    tracker.register(params, "parameters")
    with tracker:
        loss = model(x).square().mean()
        # saved for backward: linear1's output (GELU's input), GELU's output (linear2's input), the
        # model output (square's input); plus the 0-d loss. x was made before tracking.
        after_forward = tracker.current["activations"]
        loss.backward()
        tracker.register([p.grad for p in params], "gradients")
        opt.step()
        tracker.register_optimizer(opt)
    assert after_forward == 4 * (64 * 1024 + 64 * 1024 + 64 * 8) + 4
    assert tracker.current["parameters"] == p_bytes
    assert tracker.current["gradients"] == p_bytes
    # AdamW: exp_avg and exp_avg_sq per parameter, plus a 0-d fp32 step per parameter
    assert tracker.current["optimizer"] == 2 * p_bytes + 4 * len(params)
    assert tracker.peak_total >= after_forward + 2 * p_bytes
    del loss
    assert tracker.current["activations"] < after_forward  # freed with the graph
