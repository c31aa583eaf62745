"""This CPU's arithmetic peaks next to what the linears reach: the floor under any compute-bound
figure (serving under load, prefill, exact float32 verify rows).

  python bench/bench_peak.py --threads 2 --rows 16,64,256

1. Instruction throughput, one thread, a register-only loop of 12 independent chains (compiled here
   with g++): ``vfmadd231ps`` ymm (float32, 16 flops), ``vpmaddubsw`` ymm (32 multiply-adds: 64
   integer ops) and the int8 kernels' inner pair ``vpmaddubsw`` + ``vpaddw`` (64 ops a pair); with
   AVX-512 ``vfmadd231ps`` zmm (32 flops), with AVX-512 BF16 ``vdpbf16ps`` zmm (64 flops) and with
   AVX512-VNNI ``vpdpbusd`` zmm (64 byte multiply-adds: 128 integer ops). ns
   per instruction (per pair); × threads gives the machine's peak.
2. GFLOPS of ``x @ w.T`` in torch (oneDNN / MKL) in float32 and bfloat16, and of
   ``turbospec.ops.linear`` on the same bfloat16 weights and inputs (its dot-product kernel from 4
   rows), on float32 weights, and with int8 activations on the Q4_0 blocks interleaved by 16 rows
   (the int8 mode's layout; GOPS), for SmolLM2's linear shapes. Best of repeated calls.

Only same-run ratios mean anything: another machine, another day, other figures.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

LOOP = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstring>
constexpr int N = 12;
#ifdef WITH_AVX512
__attribute__((target("avx512f"))) float fma_loop(long it) {
  __m512 acc[N]; for (int i = 0; i < N; ++i) acc[i] = _mm512_set1_ps(i * 1e-3f);
  __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-9f);
  for (long t = 0; t < it; ++t) {
#pragma GCC unroll 12
    for (int i = 0; i < N; ++i) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
    asm volatile("" : "+v"(a));
  }
  __m512 s = acc[0]; for (int i = 1; i < N; ++i) s = _mm512_add_ps(s, acc[i]); return _mm512_reduce_add_ps(s);
}
#endif
#ifdef WITH_BF16
__attribute__((target("avx512f,avx512bf16"))) float dp_loop(long it) {
  __m512 acc[N]; for (int i = 0; i < N; ++i) acc[i] = _mm512_set1_ps(i * 1e-3f);
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x0001);
  for (long t = 0; t < it; ++t) {
#pragma GCC unroll 12
    for (int i = 0; i < N; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    asm volatile("" : "+v"(a));
  }
  __m512 s = acc[0]; for (int i = 1; i < N; ++i) s = _mm512_add_ps(s, acc[i]); return _mm512_reduce_add_ps(s);
}
#endif
#ifdef WITH_VNNI
// vpdpbusd zmm: 64 byte multiply-adds into 16 int32 lanes (128 integer ops), the int8 kernels' inner
// instruction on CPUs with AVX512-VNNI
__attribute__((target("avx512f,avx512vnni"))) float dpbusd_loop(long it) {
  __m512i acc[N]; for (int i = 0; i < N; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(2);
  for (long t = 0; t < it; ++t) {
#pragma GCC unroll 12
    for (int i = 0; i < N; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    asm volatile("" : "+v"(a));
  }
  __m512i s = acc[0]; for (int i = 1; i < N; ++i) s = _mm512_xor_si512(s, acc[i]);
  return (float)_mm512_reduce_add_epi32(s);
}
#endif
// AVX2: float32 FMA (16 flops), vpmaddubsw alone (32 multiply-adds: 64 integer ops), and the int8
// kernels' inner pair, one vpmaddubsw + one vpaddw per 32 multiply-adds (N / 2 chains of each).
__attribute__((target("avx2,fma"))) float fma_ymm_loop(long it) {
  __m256 acc[N]; for (int i = 0; i < N; ++i) acc[i] = _mm256_set1_ps(i * 1e-3f);
  __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-9f);
  for (long t = 0; t < it; ++t) {
#pragma GCC unroll 12
    for (int i = 0; i < N; ++i) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
    asm volatile("" : "+v"(a));
  }
  __m256 s = acc[0]; for (int i = 1; i < N; ++i) s = _mm256_add_ps(s, acc[i]);
  float o[8]; _mm256_storeu_ps(o, s); return o[0];
}
__attribute__((target("avx2"))) float maddubs_loop(long it) {
  __m256i acc[N]; for (int i = 0; i < N; ++i) acc[i] = _mm256_set1_epi8(i);
  __m256i b = _mm256_set1_epi8(1);
  for (long t = 0; t < it; ++t) {
#pragma GCC unroll 12
    for (int i = 0; i < N; ++i) acc[i] = _mm256_maddubs_epi16(acc[i], b);
    asm volatile("" : "+v"(b));
  }
  __m256i s = acc[0]; for (int i = 1; i < N; ++i) s = _mm256_xor_si256(s, acc[i]);
  return (float)_mm256_extract_epi32(s, 0);
}
__attribute__((target("avx2"))) float pair_loop(long it) {
  __m256i acc[N / 2], w[N / 2];  // distinct weights per chain (one shared product would be computed once)
  for (int i = 0; i < N / 2; ++i) acc[i] = _mm256_set1_epi16(i), w[i] = _mm256_set1_epi8(i + 1);
  __m256i b = _mm256_set1_epi8(1);
  for (long t = 0; t < it; ++t) {
#pragma GCC unroll 6
    for (int i = 0; i < N / 2; ++i) acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(w[i], b));
    asm volatile("" : "+v"(b));
  }
  __m256i s = acc[0]; for (int i = 1; i < N / 2; ++i) s = _mm256_xor_si256(s, acc[i]);
  return (float)_mm256_extract_epi32(s, 0);
}
template <class F> double best_ns(F f, long it, int per) {
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    auto t = std::chrono::steady_clock::now(); volatile float v = f(it); (void)v;
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    if (s < best) best = s;
  }
  return best / (it * double(per)) * 1e9;
}
int main() {
  const long it = 50000000;
  printf("{\"fma_ymm_ns\": %.4f", best_ns(fma_ymm_loop, it, N));
  printf(", \"maddubs_ymm_ns\": %.4f", best_ns(maddubs_loop, it, N));
  printf(", \"maddubs_add_ymm_ns\": %.4f", best_ns(pair_loop, it, N / 2));
#ifdef WITH_AVX512
  printf(", \"fma_zmm_ns\": %.4f", best_ns(fma_loop, it, N));
#endif
#ifdef WITH_VNNI
  printf(", \"dpbusd_zmm_ns\": %.4f", best_ns(dpbusd_loop, it, N));
#endif
#ifdef WITH_BF16
  printf(", \"dpbf16_zmm_ns\": %.4f", best_ns(dp_loop, it, N));
#endif
  printf("}\n");
}
"""

SHAPES = ((1536, 576), (576, 1536), (576, 576), (49152, 576))  # SmolLM2: gate/up, down, q/o, LM head


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def instruction_rates(flags: set[str]) -> dict:
    if "avx2" not in flags:
        return {"skipped": "no AVX2"}
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "loop.cpp"), os.path.join(d, "loop")
        with open(src, "w") as f:
            f.write(LOOP)
        cmd = (["g++", "-O2", "-o", exe, src] + (["-DWITH_AVX512"] if "avx512f" in flags else [])
               + (["-DWITH_BF16"] if "avx512_bf16" in flags else [])
               + (["-DWITH_VNNI"] if "avx512_vnni" in flags else []))
        subprocess.run(cmd, check=True)
        return json.loads(subprocess.run([exe], check=True, capture_output=True, text=True).stdout)


def best_seconds(f, flops: float) -> float:
    for _ in range(3):
        f()
    reps = max(5, min(200, int(2e10 / flops)))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="16,64,256", help="input rows (comma list)")
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                   help="linear shapes N x K (comma list; default: SmolLM2's gate/up, down, q/o, LM head)")
    p.add_argument("--out", default=None, help="JSON file for the figures")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from gguf import GGMLQuantizationType, quants
    from turbospec import ops
    from turbospec.ops import reference
    flags = cpu_flags()
    rates = instruction_rates(flags)
    print("instruction throughput, 1 thread, 12 chains:", rates)
    for k, v in list(rates.items()):
        if k.endswith("_ns"):
            # ops per instruction (a multiply-add is 2): vpmaddubsw ymm 32 multiply-adds (the
            # maddubs_add pair's time is per pair)
            per = {"dpbusd_zmm": 128, "dpbf16_zmm": 64, "fma_zmm": 32, "fma_ymm": 16, "maddubs_ymm": 64, "maddubs_add_ymm": 64}[k[:-3]]
            rates[k.replace("_ns", "_peak_gops")] = round(per / v * args.threads, 1)
    print("peak G(FL)OPS at", args.threads, "threads:", {k: v for k, v in rates.items() if k.endswith("gops")})
    rows = [int(r) for r in args.rows.split(",")]
    table = []
    g = torch.Generator().manual_seed(0)
    print("| shape (N x K) | rows | torch fp32 | torch bf16 | turbospec fp32 | turbospec bf16 | turbospec int8 (Q4_0) |")
    print("|---|---|---|---|---|---|---|")
    for n, k in (tuple(map(int, sh.split("x"))) for sh in args.shapes.split(",")):
        w = torch.randn(n, k, generator=g) * 0.05
        wb = w.bfloat16()
        wq = reference.interleave_blocks(torch.from_numpy(quants.quantize(w.numpy(), GGMLQuantizationType.Q4_0).copy()), 2, k)
        for r in rows:
            x = torch.randn(r, k, generator=g)
            xb = x.bfloat16()
            flops = 2.0 * r * n * k
            cells = {
                "torch_fp32": best_seconds(lambda: x @ w.t(), flops),
                "torch_bf16": best_seconds(lambda: xb @ wb.t(), flops),
                "turbospec_fp32": best_seconds(lambda: ops.linear(x, [w], [0], None), flops),
                "turbospec_bf16": best_seconds(lambda: ops.linear(xb, [wb], [30], None), flops),
                "turbospec_int8_q4_0": best_seconds(lambda: ops.linear(x, [wq], [2002], None, activations=8), flops),
            }
            gf = {c: round(flops / s / 1e9, 1) for c, s in cells.items()}
            table.append({"shape": f"{n}x{k}", "rows": r, **gf})
            print(f"| {n}x{k} | {r} | {gf['torch_fp32']} | {gf['torch_bf16']} | {gf['turbospec_fp32']} | "
                  f"{gf['turbospec_bf16']} | {gf['turbospec_int8_q4_0']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "threads": args.threads,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rates": rates,
                       "avx512_bf16": "avx512_bf16" in flags, "linear": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
