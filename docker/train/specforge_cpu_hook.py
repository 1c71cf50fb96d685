"""CPU SHIM hook (remote-ops): `import specforge.core.loss` gets `specforge_cpu_loss` when torch sees no CUDA.

Installed by the CPU training image's `remote_ops_specforge_cpu.pth` (a site-packages `.pth` line
runs at every interpreter start, so SpecForge's own worker processes get it too).  The finder
answers only for `specforge.core.loss`, and only when `torch.cuda.is_available()` is False at the
moment SpecForge imports it; otherwise it steps aside and the real module (Triton kernel) loads.
"""

import importlib.abc
import importlib.util
import os
import sys

TARGET = "specforge.core.loss"
SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "specforge_cpu_loss.py")


class _CpuLossFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        import torch

        if torch.cuda.is_available():
            return None
        print("remote-ops CPU SHIM: specforge.core.loss -> specforge_cpu_loss (plain torch; no CUDA)", file=sys.stderr)
        return importlib.util.spec_from_file_location(fullname, SHIM)


def install() -> None:
    if not any(isinstance(f, _CpuLossFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _CpuLossFinder())


install()
