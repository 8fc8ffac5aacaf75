#!/usr/bin/env python3
"""The PyTorch 2.x side of `tandem-bench autograd`.

It measures what tools/bench/bench_autograd.cpp measures for tandem -- a chain
of 1,000 tiny elementwise ops (forward+backward) and one pre-norm transformer
block step at 1 and 2 threads -- with the same trial protocol as
tools/bench/libtorch_autograd.cpp, and prints one JSON object of the same
shape. Attention is F.scaled_dot_product_attention(is_causal=True), PyTorch's
fused CPU attention. tandem-bench runs it in its own process (with and without
OMP_WAIT_POLICY=passive), found through TANDEM_BENCH_PYTHON or python3 on PATH.

With --device cuda (tandem-bench autograd --device cuda; Note [Autograd on a
GPU] in bench_autograd_cuda.cpp) it measures the block step only, once, on its
GPU, synchronising with torch.cuda.synchronize() at the end of each phase, and
fails when PyTorch has no CUDA. For f32 inputs scaled_dot_product_attention
runs the memory-efficient kernel there (flash attention takes f16/bf16 only).

With --llama it measures one Llama decoder layer instead (RMSNorm,
grouped-query attention with the rotary embedding, SwiGLU; Note [Llama block
benchmark] in bench_autograd_llama.cpp), at 1 and 2 threads, written with
torch.nn.functional as transformers' eager LlamaDecoderLayer computes it.

With --device cuda --attention bf16|f32 --attention-shape B,H,S,D it measures
causal F.scaled_dot_product_attention forward+backward alone (Note [Attention
on a GPU] in bench_autograd_attention.cpp): bf16 through the flash kernel
(forced), f32 through the kernel PyTorch picks.

A comparison tool only, never a dependency of tandem or of its tests.

  pytorch_autograd.py [--chain-trials N] [--block-trials N] [--min-trial-ms X]
                      [--device cpu|cuda] [--llama]
                      [--attention bf16|f32 --attention-shape B,H,S,D]
"""
import argparse
import json
import math
import os
import resource
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

# Note [Autograd benchmark workload] in bench_autograd_workload.h: these
# constants and workload_values() must match that file bit for bit.
CHAIN_OPS = 1000
CHAIN_NUMEL = 4
BATCH, SEQ, MODEL, HEADS, HIDDEN = 4, 256, 256, 4, 1024
MASK64 = (1 << 64) - 1


def workload_values(salt, n, scale, offset):
    # splitmix64 in uint64 arithmetic, which wraps modulo 2^64 as in C++.
    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=np.uint64) + np.uint64(((salt << 32) + 0x9E3779B97F4A7C15) & MASK64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    # Exact in f32: a multiple of 2^-23 in [-1, 1).
    u = (z >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-23) - np.float32(1.0)
    # u * scale is exact (scale is a power of two); + offset rounds once in f32.
    return torch.from_numpy(u) * scale + offset


def workload_tensor(salt, shape, scale, offset=0.0):
    n = math.prod(shape)
    return workload_values(salt, n, scale, offset).reshape(shape).contiguous()


def leaf(t):
    return t.requires_grad_(True)


class Chain:
    def __init__(self):
        self.x = leaf(workload_tensor(11, [CHAIN_NUMEL], 1.0))
        self.c = workload_tensor(12, [CHAIN_NUMEL], 0.125)

    def forward(self):
        y = self.x
        for i in range(CHAIN_OPS):
            if i % 3 == 0:
                y = y * 0.9
            elif i % 3 == 1:
                y = y + self.c
            else:
                y = torch.tanh(y)
        return y.sum()

    def step(self, times):
        t0 = time.perf_counter()
        loss = self.forward()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.x.grad = None  # set to none, as tandem's zero_grad
        times[0] += t1 - t0
        times[1] += t2 - t1

    def check(self):
        loss = self.forward()
        loss.backward()
        g = self.x.grad.sum().item()
        self.x.grad = None
        return [loss.item(), g]


class Block:
    def __init__(self, device="cpu"):
        # Made on the CPU, then copied: the same bits on every device.
        def make(salt, shape, scale, offset=0.0):
            return workload_tensor(salt, shape, scale, offset).to(device)

        self.ln1_w = leaf(make(1, [MODEL], 0.125, 1.0))
        self.ln1_b = leaf(make(2, [MODEL], 0.125))
        self.w_qkv = leaf(make(3, [3 * MODEL, MODEL], 1.0 / 16))
        self.w_o = leaf(make(4, [MODEL, MODEL], 1.0 / 16))
        self.ln2_w = leaf(make(5, [MODEL], 0.125, 1.0))
        self.ln2_b = leaf(make(6, [MODEL], 0.125))
        self.w_gate = leaf(make(7, [HIDDEN, MODEL], 1.0 / 16))
        self.w_up = leaf(make(8, [HIDDEN, MODEL], 1.0 / 16))
        self.w_down = leaf(make(9, [MODEL, HIDDEN], 1.0 / 32))
        self.x = make(10, [BATCH, SEQ, MODEL], 1.0)
        # Each phase ends when the device has finished it.
        self.synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def params(self):
        return [self.ln1_w, self.ln1_b, self.w_qkv, self.w_o, self.ln2_w, self.ln2_b,
                self.w_gate, self.w_up, self.w_down]

    def loss(self):
        B, S, D, H = BATCH, SEQ, MODEL, HEADS
        Dh = D // H
        h = F.layer_norm(self.x, (D,), self.ln1_w, self.ln1_b, 1e-5)
        q, k, v = F.linear(h, self.w_qkv).split(D, -1)

        def heads(t):
            return t.view(B, S, H, Dh).transpose(1, 2)

        a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        y = self.x + F.linear(a.transpose(1, 2).reshape(B, S, D), self.w_o)
        h = F.layer_norm(y, (D,), self.ln2_w, self.ln2_b, 1e-5)
        m = F.linear(F.silu(F.linear(h, self.w_gate)) * F.linear(h, self.w_up), self.w_down)
        return (y + m).mean()

    def step(self, times):
        t0 = time.perf_counter()
        loss = self.loss()
        self.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        self.synchronize()
        t2 = time.perf_counter()
        for p in self.params():
            p.grad = None
        times[0] += t1 - t0
        times[1] += t2 - t1

    def check(self):
        loss = self.loss()
        loss.backward()
        values = [loss.item()]
        for p in self.params():
            values.append(p.grad.to(torch.float64).norm().item())
            p.grad = None
        return values


class LlamaBlock:
    """Note [Llama block benchmark]: the layer of tools/train/llama.h, same bits."""
    B, S, D, H, KV, DH, INNER, EPS, THETA = 4, 256, 256, 8, 4, 32, 768, 1e-6, 10000.0

    def __init__(self):
        B, S, D, H, KV, DH, INNER = self.B, self.S, self.D, self.H, self.KV, self.DH, self.INNER
        self.ln1 = leaf(workload_tensor(11, [D], 0.125, 1.0))
        self.wq = leaf(workload_tensor(12, [H * DH, D], 1.0 / 16))
        self.wk = leaf(workload_tensor(13, [KV * DH, D], 1.0 / 16))
        self.wv = leaf(workload_tensor(14, [KV * DH, D], 1.0 / 16))
        self.wo = leaf(workload_tensor(15, [D, H * DH], 1.0 / 16))
        self.ln2 = leaf(workload_tensor(16, [D], 0.125, 1.0))
        self.wg = leaf(workload_tensor(17, [INNER, D], 1.0 / 16))
        self.wu = leaf(workload_tensor(18, [INNER, D], 1.0 / 16))
        self.wd = leaf(workload_tensor(19, [D, INNER], 1.0 / 32))
        self.x = workload_tensor(20, [B, S, D], 1.0)
        # Rotary tables in f64, rounded once (as tandem's rope_tables).
        inv = 1.0 / self.THETA ** (torch.arange(0, DH, 2, dtype=torch.float64) / DH)
        angle = torch.arange(S, dtype=torch.float64)[:, None] * inv[None, :]
        angle = torch.cat([angle, angle], dim=-1)
        self.cos, self.sin = angle.cos().float(), angle.sin().float()

    def params(self):
        return [self.ln1, self.wq, self.wk, self.wv, self.wo, self.ln2, self.wg, self.wu,
                self.wd]

    def rms(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.EPS))

    def rotate(self, t):  # (B, heads, S, DH)
        half = self.DH // 2
        return t * self.cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * self.sin

    def loss(self):
        B, S, H, KV, DH = self.B, self.S, self.H, self.KV, self.DH
        h = self.rms(self.x, self.ln1)
        q = F.linear(h, self.wq).view(B, S, H, DH).transpose(1, 2)
        k = F.linear(h, self.wk).view(B, S, KV, DH).transpose(1, 2)
        v = F.linear(h, self.wv).view(B, S, KV, DH).transpose(1, 2)
        a = F.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v, is_causal=True,
                                           enable_gqa=True)
        y = self.x + F.linear(a.transpose(1, 2).reshape(B, S, H * DH), self.wo)
        h = self.rms(y, self.ln2)
        m = F.linear(F.silu(F.linear(h, self.wg)) * F.linear(h, self.wu), self.wd)
        return (y + m).mean()

    step = Block.step
    check = Block.check
    synchronize = staticmethod(lambda: None)


def main_llama(args):
    block = LlamaBlock()
    torch.set_num_threads(1)
    out = {"program": "pytorch_autograd.py --llama", "torch_version": torch.__version__,
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
           "check": block.check()}
    threads = []
    for n in (1, 2):
        torch.set_num_threads(n)
        t = measure(block.step, args.block_trials, args.min_trial_ms * 1e-3)
        t["threads"] = n
        threads.append(t)
    out["llama_block"] = {"threads": threads}
    print(json.dumps(out))
    return 0


def median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 == 1 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def measure(step, trials, min_trial_s):
    """The protocol of bench_autograd_workload.cpp's measure()."""
    times = [0.0, 0.0]
    step(times)  # warm-up
    reps = 1
    while True:
        start = time.perf_counter()
        for _ in range(reps):
            step(times)
        t = time.perf_counter() - start
        if t >= min_trial_s or reps >= (1 << 20):
            break
        reps = max(2 * reps, math.ceil(reps * 1.2 * min_trial_s / t))
    total, forward, backward, cpu = [], [], [], []
    for _ in range(trials):
        times = [0.0, 0.0]
        cpu_start = time.process_time()
        start = time.perf_counter()
        for _ in range(reps):
            step(times)
        total.append((time.perf_counter() - start) / reps)
        cpu.append((time.process_time() - cpu_start) / reps)
        forward.append(times[0] / reps)
        backward.append(times[1] / reps)
    return {
        "median_ms": median(total) * 1e3,
        "forward_median_ms": median(forward) * 1e3,
        "backward_median_ms": median(backward) * 1e3,
        "cpu_median_ms": median(cpu) * 1e3,
        "min_ms": min(total) * 1e3,
        "reps": reps,
        "trials": trials,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain-trials", type=int, default=11)
    parser.add_argument("--block-trials", type=int, default=7)
    parser.add_argument("--min-trial-ms", type=float, default=20.0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--llama", action="store_true", help="the Llama decoder layer instead")
    parser.add_argument("--attention", choices=["bf16", "f32"],
                        help="with --device cuda: causal attention alone, in this dtype")
    parser.add_argument("--attention-shape", default="4,16,2048,64", help="B,H,S,D")
    args = parser.parse_args()
    if args.chain_trials < 1 or args.block_trials < 1 or not args.min_trial_ms > 0:
        parser.error("expected positive trial counts and --min-trial-ms")
    major = int(torch.__version__.split(".")[0])
    if major < 2:
        print(f"pytorch_autograd.py: expected PyTorch 2.x, got {torch.__version__}", file=sys.stderr)
        return 1
    if args.device == "cuda" and args.attention:
        return main_attention(args)
    if args.device == "cuda":
        return main_cuda(args)
    if args.llama:
        return main_llama(args)

    out = {
        "program": "pytorch_autograd.py",
        "torch_version": torch.__version__,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
        "blas_threads": "torch.set_num_threads",
        "cpu_capability": getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")(),
        "attention": "F.scaled_dot_product_attention(is_causal=True)",
    }
    torch.set_num_threads(1)
    chain, block = Chain(), Block()
    out["check"] = {"chain": chain.check(), "block": block.check()}
    chain_json = measure(chain.step, args.chain_trials, args.min_trial_ms * 1e-3)
    chain_json["ops"] = CHAIN_OPS
    out["chain"] = chain_json
    threads = []
    for n in (1, 2):
        torch.set_num_threads(n)
        t = measure(block.step, args.block_trials, args.min_trial_ms * 1e-3)
        t["threads"] = n
        t["torch_num_threads"] = torch.get_num_threads()
        threads.append(t)
    out["block"] = {
        "shape": {"B": BATCH, "S": SEQ, "d": MODEL, "heads": HEADS, "hidden": HIDDEN},
        "threads": threads,
    }
    out["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(json.dumps(out))
    return 0


def main_cuda(args):
    """The block step on the GPU, once (no thread settings): --device cuda."""
    if not torch.cuda.is_available():
        print(f"pytorch_autograd.py: expected CUDA, got torch {torch.__version__} with "
              "torch.cuda.is_available() False", file=sys.stderr)
        return 1
    # f32 as tandem's cuBLAS calls (no TF32; tensor/cuda/gemm.cu).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    sdp = torch.backends.cuda
    out = {
        "program": "pytorch_autograd.py",
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "attention": "F.scaled_dot_product_attention(is_causal=True); enabled backends: "
                     f"flash {sdp.flash_sdp_enabled()} (f16/bf16 only), "
                     f"memory-efficient {sdp.mem_efficient_sdp_enabled()}, "
                     f"math {sdp.math_sdp_enabled()}",
        "allow_tf32": False,
    }
    block = Block("cuda")
    out["check"] = {"block": block.check()}
    torch.cuda.reset_peak_memory_stats()
    step = measure(block.step, args.block_trials, args.min_trial_ms * 1e-3)
    out["block"] = {
        "shape": {"B": BATCH, "S": SEQ, "d": MODEL, "heads": HEADS, "hidden": HIDDEN},
        "device": "cuda:0",
        "gpu": torch.cuda.get_device_name(0),
        "step": step,
    }
    out["max_memory_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(out))
    return 0


class Attention:
    """Causal attention of (B, H, S, D) q, k, v and the loss sum(f32(out) * w)."""

    def __init__(self, shape, dtype):
        def make(salt, requires_grad):
            t = workload_tensor(salt, shape, 1.0).to(dtype).to("cuda")
            return leaf(t) if requires_grad else t

        self.q, self.k, self.v = make(21, True), make(22, True), make(23, True)
        self.w = workload_tensor(24, shape, 1.0).to("cuda")
        self.flash = dtype != torch.float32

    def loss(self, outs=None):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backends = [SDPBackend.FLASH_ATTENTION] if self.flash else \
            [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
        with sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=True).float()
        if outs is not None:
            outs.append(out)
        return (out * self.w).sum()

    def step(self, times):
        t0 = time.perf_counter()
        loss = self.loss()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        for t in (self.q, self.k, self.v):
            t.grad = None
        times[0] += t1 - t0
        times[1] += t2 - t1

    def check(self):
        """L2 norms of out, dq, dk, dv (as tandem's check)."""
        outs = []
        self.loss(outs).backward()
        values = [outs[0].detach().norm().item()]
        for t in (self.q, self.k, self.v):
            values.append(t.grad.float().norm().item())
            t.grad = None
        return values


def main_attention(args):
    """Attention alone on the GPU: --device cuda --attention bf16|f32."""
    if not torch.cuda.is_available():
        print(f"pytorch_autograd.py: expected CUDA, got torch {torch.__version__} with "
              "torch.cuda.is_available() False", file=sys.stderr)
        return 1
    shape = [int(x) for x in args.attention_shape.split(",")]
    if len(shape) != 4 or min(shape) < 1:
        print(f"pytorch_autograd.py: expected --attention-shape B,H,S,D, got "
              f"{args.attention_shape}", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = torch.bfloat16 if args.attention == "bf16" else torch.float32
    attention = Attention(shape, dtype)
    out = {
        "program": "pytorch_autograd.py",
        "torch_version": torch.__version__,
        "dtype": args.attention,
        "shape": shape,
        "backend": "flash (forced)" if attention.flash else "memory-efficient first",
        "gpu": torch.cuda.get_device_name(0),
        "check": attention.check(),
        "step": measure(attention.step, args.block_trials, args.min_trial_ms * 1e-3),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
