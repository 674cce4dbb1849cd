"""GPU checks of issue 53's fixes (skipped without a GPU; NOT RUN YET: written on a machine without one).

Each check runs in a child process (this process never initialises CUDA: the suite forks workers):
grouped-query attention in float32 on CUDA runs with the math kernel disabled (K/V expanded for the
memory-efficient kernel), the chunked cross entropy's CUDA peak stays near the bf16 logits' size, a
live generation's NCCL groups are bound (eager communicators) and a first point-to-point exchange among
a subset of ranks completes, and with three GPUs or more the multi-GPU parts of bench/gpu_check.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from ntp_nemo.launch.devices import cuda_device_count
from tests.conftest import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cuda_device_count() == 0, reason="needs a CUDA GPU (run bench/gpu_check.py on one)"),
]


def _child(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_float32_grouped_attention_runs_without_the_math_kernel():
    r = _child("""
        import json, torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from ntp_nemo.models.transformer import Attention, rope_tables
        from ntp_nemo.topology.tp_context import TPContext
        from tests.ntp_cases import LLAMA
        attn = Attention(LLAMA, TPContext(), 0.02).cuda()
        d = LLAMA.hidden_size // LLAMA.num_heads
        cos, sin = rope_tables(64, d, LLAMA.rope_theta, "cuda", torch.float32)
        q = torch.randn(2, LLAMA.num_heads, 64, d, device="cuda", requires_grad=True)
        k, v = (torch.randn(2, LLAMA.num_kv_heads, 64, d, device="cuda", requires_grad=True) for _ in "kv")
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]):  # no math
            attn.core(q, k, v, cos, sin).sum().backward()
        print(json.dumps({"ok": bool(torch.isfinite(q.grad).all())}))
    """)
    assert r["ok"]


def test_chunked_cross_entropy_peak_on_cuda():
    """bf16 logits of 4096 tokens x 128256 columns (1 GiB): forward and backward of the loss need about
    the gradient's size on top of them, not the float32 copies (several GiB) of the whole-batch loss."""
    r = _child("""
        import json, torch
        from ntp_nemo.parallel.layers import vocab_parallel_cross_entropy
        from ntp_nemo.topology.tp_context import TPContext
        x = torch.randn(4096, 128256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        t = torch.randint(0, 128256, (4096,), device="cuda")
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        vocab_parallel_cross_entropy(x, t, 0, TPContext()).sum().backward()
        torch.cuda.synchronize()
        print(json.dumps({"extra": torch.cuda.max_memory_allocated() - base, "logits": x.numel() * 2}))
    """)
    assert r["extra"] < 1.5 * r["logits"], r


@pytest.mark.skipif(cuda_device_count() < 3, reason="needs three or more CUDA GPUs")
@pytest.mark.parametrize("part", ["tp2", "tp2_compiled", "live"])
def test_multi_gpu_parts(part, tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--only", part, "--json",
                           str(out), "--keep", str(tmp_path / "runs")], capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(out.read_text())[part]["ok"], proc.stdout[-3000:]


def test_batches_reach_the_gpu_from_pinned_memory():
    r = _child("""
        import json, torch
        from ntp_nemo.lightning.lm_module import NTPLanguageModule
        seen = []
        original = torch.Tensor.to
        def to(self, *args, **kwargs):
            seen.append(self.is_pinned())
            return original(self, *args, **kwargs)
        torch.Tensor.to = to
        batch = {"micro": torch.zeros(8, 2049, dtype=torch.long), "step": 0}
        out = NTPLanguageModule.transfer_batch_to_device(None, batch, torch.device("cuda", 0), 0)
        print(json.dumps({"pinned": seen, "device": str(out["micro"].device)}))
    """)
    assert r == {"pinned": [True], "device": "cuda:0"}, r


def test_rope_on_cuda_matches_the_float64_cpu_rotation():
    """RoPE's three-kernel form (issue 53, second pass) on CUDA in float32 and bfloat16 against the CPU in
    float64, forward and the input's gradient."""
    r = _child("""
        import json, torch
        from ntp_nemo.models.transformer import apply_rope, rope_dtype, rope_tables
        x = torch.randn(2, 4, 64, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        ref_x = x.clone().requires_grad_(True)
        ref = apply_rope(ref_x, *rope_tables(64, 32, 10000.0, "cpu", torch.float64))
        ref.backward(torch.ones_like(ref))
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            xc = x.to("cuda", dtype).requires_grad_(True)
            y = apply_rope(xc, *rope_tables(64, 32, 10000.0, "cuda", rope_dtype(dtype)))
            y.backward(torch.ones_like(y))
            out[str(dtype)] = [float((y.double().cpu() - ref).abs().max()),
                               float((xc.grad.double().cpu() - ref_x.grad).abs().max())]
        print(json.dumps(out))
    """)
    assert max(r["torch.float32"]) < 1e-5, r
    assert max(r["torch.bfloat16"]) < 5e-2, r  # bf16 inputs and outputs: a few units in the last place


def test_batches_reach_cuda_from_pinned_memory_unchanged():
    """The loader pins for CUDA (`batch_loader`), the transfer copies without blocking: same tokens."""
    r = _child("""
        import json, torch
        from ntp_nemo.lightning.lm_module import NTPLanguageModule, batch_loader
        batches = [{"micro": torch.arange(24).view(2, 12), "step": s} for s in range(2)]
        out = []
        for b in batch_loader(batches, torch.device("cuda", 0)):
            pinned = b["micro"].is_pinned()
            moved = NTPLanguageModule.transfer_batch_to_device(None, b, torch.device("cuda", 0), 0)
            torch.cuda.synchronize()
            same = bool((moved["micro"].cpu() == batches[0]["micro"]).all())
            out.append([pinned, moved["micro"].is_cuda, same])
        print(json.dumps({"batches": out}))
    """)
    assert r["batches"] == [[True, True, True], [True, True, True]], r
