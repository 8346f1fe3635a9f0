"""Helpers for tests on tiny random-init models: weights that exercise every norm and bias, and a
decode-step module driven token by token."""

from __future__ import annotations

import numpy as np


def perturb(model):
    """Random init leaves norms at identity and biases at zero: perturb them so they matter."""
    import torch

    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
            elif n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.5)
    return model


def run_step(step, ids):
    """Drive a decode-step module (pipeline/graphs/decode_graph.py) token by token, the runtime's slot
    writes done in torch: (logits [len(ids), vocab], each step's new K/V)."""
    import torch

    args = list(step.example_inputs())
    logits, news = [], []
    with torch.no_grad():
        for p, t in enumerate(ids):
            args[0] = torch.tensor([[t]], dtype=torch.int64)
            args[1] = torch.tensor([p], dtype=torch.int64)
            out = step(*args)
            logits.append(out[0][0, 0].numpy().copy())
            news.append([o.numpy().copy() for o in out[1:]])
            for j, layer in enumerate(step.plan):
                slot = p % layer["ring"] if layer["ring"] else p
                args[2 + 2 * j][:, :, slot] = out[1 + 2 * j][:, :, 0]
                args[3 + 2 * j][:, :, slot] = out[2 + 2 * j][:, :, 0]
    return np.stack(logits), news
