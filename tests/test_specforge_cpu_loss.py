"""The CPU SHIM for SpecForge 0.2.0's Triton loss (docker/train/specforge_cpu_loss.py) computes what the kernel computes.

The kernel's math is read from SpecForge's own `specforge/core/loss.py` (the installed 0.2.0 wheel):
- its reference `_compute_loss` (the same file, undecorated here: `torch.compile` is not what is tested);
- `log_softmax_forward_kernel` / `log_softmax_backward_kernel` transcribed below in float64, blockwise
  as the kernel runs (online max and sum over BLOCK_SIZE columns; masked rows: loss 0, gradient 0;
  the mean over all B*T rows; the gradient `-(target * g - softmax * sum(target * g))`, g = grad / (B*T)).
Values and gradients are compared on random inputs, and the hook is checked to load the shim only
when torch sees no CUDA.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
TRAIN = Path(__file__).resolve().parents[1] / "docker" / "train"


def specforge_loss_source() -> str:
    spec = importlib.util.find_spec("specforge")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("specforge is not installed")
    return (Path(next(iter(spec.submodule_search_locations))) / "core" / "loss.py").read_text()


def shim():
    s = importlib.util.spec_from_file_location("specforge_cpu_loss", TRAIN / "specforge_cpu_loss.py")
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


def reference_compute_loss():
    """SpecForge's own `_compute_loss` from loss.py, without its `@torch.compile` decorator."""
    tree = ast.parse(specforge_loss_source())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_compute_loss")
    fn.decorator_list = []
    ns = {"torch": torch, "nn": torch.nn}
    exec(compile(ast.Module([fn], []), "specforge/core/loss.py", "exec"), ns)
    return ns["_compute_loss"]


def kernel_math(logits, target, mask, block=16):
    """The Triton kernels' arithmetic, row by row and block by block, in float64: (loss, d loss/d logits)."""
    B, T, V = logits.shape
    x = logits.double().reshape(B * T, V)
    t = target.double().reshape(B * T, V)
    keep = mask.reshape(B * T).bool()
    losses, grads = torch.zeros(B * T, dtype=torch.float64), torch.zeros(B * T, V, dtype=torch.float64)
    g = 1.0 / (B * T)  # grad_output 1, scaling_factor 1/(B*T)
    for r in range(B * T):
        if not keep[r]:
            continue
        m, d = -math.inf, 0.0
        for i in range(0, V, block):
            blk = x[r, i : i + block]
            m_new = max(m, float(blk.max()))
            d = d * math.exp(m - m_new) + float(torch.exp(blk - m_new).sum())
            m = m_new
        losses[r] = -float((t[r] * ((x[r] - m) - math.log(d))).sum())
        soft = torch.exp(x[r] - m) / d
        grads[r] = -(t[r] * g - soft * float((t[r] * g).sum()))
    return losses.mean(), grads.reshape(B, T, V)


def inputs(seed, B=2, T=9, V=67, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 3).to(dtype)
    target = torch.softmax(torch.randn(B, T, V, generator=g) * 2, -1)
    mask = (torch.rand(B, T, 1, generator=g) > 0.3).float()
    return logits, target, mask


def test_the_shim_replaces_the_kernel_specforge_ships():
    src = specforge_loss_source()
    assert "import triton" in src and "class LogSoftmaxLoss(torch.autograd.Function)" in src
    # the lines of the kernel the transcription above follows
    for line in (
        "log_softmax_logits = normalized_logits - log_normalizer",
        "tl.store(loss_ptr, -loss)",
        "return loss.squeeze(1).mean()",
        "scaling_factor = 1.0 / (B * T)",
        "grad_block = -(target_block * grad_output - normalized_grad)",
        "normalized_grad = softmax_prob * target_grad_sum",
    ):
        assert line in src, line


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_values_and_gradients_equal_the_kernels_math_and_specforges_reference(seed):
    loss_fn = shim().LogSoftmaxLoss
    logits, target, mask = inputs(seed)
    x = logits.clone().requires_grad_(True)
    got = loss_fn.apply(x, target, mask)
    got.backward()
    want, want_grad = kernel_math(logits, target, mask)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6), (got, want)
    assert torch.allclose(x.grad.double(), want_grad, rtol=1e-4, atol=1e-7)
    ref = reference_compute_loss()
    y = logits.clone().requires_grad_(True)
    r = ref(y, target, mask)
    r.backward()
    assert torch.allclose(got, r, rtol=1e-5, atol=1e-6) and torch.allclose(x.grad, y.grad, rtol=1e-4, atol=1e-7)


def test_bf16_logits_as_specforge_passes_them_get_a_bf16_gradient_of_the_same_math():
    loss_fn = shim().LogSoftmaxLoss
    logits, target, mask = inputs(5, dtype=torch.bfloat16)
    x = logits.clone().requires_grad_(True)
    got = loss_fn.apply(x, target, mask)
    got.backward()
    want, want_grad = kernel_math(logits, target, mask)  # the kernel reads bf16 and computes in fp32
    assert got.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(x.grad.double(), want_grad, rtol=2e-2, atol=1e-5)


def test_a_fully_masked_batch_is_zero_loss_and_zero_gradient():
    logits, target, _ = inputs(3)
    x = logits.clone().requires_grad_(True)
    got = shim().LogSoftmaxLoss.apply(x, target, torch.zeros(2, 9, 1))
    got.backward()
    assert float(got) == 0.0 and float(x.grad.abs().max()) == 0.0


def _import_loss(cuda: bool) -> subprocess.CompletedProcess:
    code = (
        "import sys, torch\n"
        f"torch.cuda.is_available = lambda: {cuda}\n"
        f"sys.path.insert(0, {str(TRAIN)!r})\n"
        "import specforge_cpu_hook\n"
        "import specforge.core.loss as l\n"
        "print('shim' if getattr(l, 'CPU_SHIM', False) else 'real')\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_hook_loads_the_shim_only_without_cuda():
    specforge_loss_source()
    out = _import_loss(cuda=False)
    assert out.returncode == 0 and out.stdout.strip() == "shim", out.stderr
    assert "remote-ops CPU SHIM" in out.stderr
    with_cuda = _import_loss(cuda=True)  # the hook steps aside: SpecForge's own module, which needs triton
    assert "CPU SHIM" not in with_cuda.stderr
    if importlib.util.find_spec("triton") is None:
        assert with_cuda.returncode != 0 and "No module named 'triton'" in with_cuda.stderr
    else:
        assert with_cuda.stdout.strip() == "real"
