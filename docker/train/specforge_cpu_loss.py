"""CPU SHIM for SpecForge 0.2.0's `specforge/core/loss.py` (remote-ops, docker/train/).

SpecForge's `LogSoftmaxLoss` is a Triton GPU kernel, and its module imports `triton` at the top,
so SpecForge cannot train on a machine without CUDA (`ModuleNotFoundError: No module named
'triton'`).  This module is put in its place ONLY when torch sees no CUDA device
(`specforge_cpu_hook.py`, loaded by a `.pth` file of the CPU training image); on a GPU host the
real module and its kernel run, untouched.

It computes what the kernel computes, in plain torch: for each of the B*T rows of `logits`
[B, T, V], `-sum_v target[v] * log_softmax(logits)[v]` (in float32) where `position_mask` is set
and 0 where it is not, averaged over all B*T rows; autograd gives the kernel's hand-written
gradient `(softmax * sum(target) - target) * grad / (B*T)` on the masked rows, 0 elsewhere.
tests/test_specforge_cpu_loss.py checks both against the kernel's math read from SpecForge's file.
"""

import torch

CPU_SHIM = True  # what the hook and the tests look for


class LogSoftmaxLoss:
    """Drop-in for `specforge.core.loss.LogSoftmaxLoss` (only `.apply` is called)."""

    @staticmethod
    def apply(logits: torch.Tensor, target: torch.Tensor, position_mask: torch.Tensor) -> torch.Tensor:
        B, T, V = logits.shape
        logp = torch.log_softmax(logits.float(), dim=-1)
        row = -(target.float() * logp).sum(-1)  # [B, T]
        keep = position_mask.reshape(B, T).bool()
        return torch.where(keep, row, torch.zeros_like(row)).mean()
