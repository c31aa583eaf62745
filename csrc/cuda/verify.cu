// verify, CUDA: fused softmax + speculative acceptance over a chain or tree
// (spec: reference.verify; CPU twin: csrc/cpu/verify.cpp).
//
// Variant: one thread block per batch row (the walk down a tree is sequential, the vocabulary
// is not). At each visited node the block sweeps the node's logits with block-wide reductions:
//   1. validity + max + argmax (NaN / +inf / all -inf -> accept_len = -1). On large vocabularies a
//      first kernel computes these for every node of every row at once, a block per chunk of
//      kStatsItems * 256 logits (grid B * N x chunks: the whole GPU reads, where one block per
//      row read 128k float32 logits in ~55 µs on an H100), and the row's block combines the node's
//      chunk results. Max and first argmax are exact under any grouping, so both paths give the
//      same bits; the first kernel reads every node, visited or not, at full bandwidth;
//   2. greedy: move to the first child whose token is the argmax, else emit it;
//   3. sampling: x = logits / temperature; top-k threshold = the k-th largest x by a 4-bit radix
//      select on order-preserving keys (8 counting passes, no sort); softmax sum in float64;
//      top-p threshold = the smallest kept probability by the same radix descent on the
//      probabilities' bits, carrying the mass above each bucket (the value rule of
//      logits_to_probs, ties kept together); recursive rejection over the children in node
//      order; inverse-CDF sampling by a tiled block scan that stops at the first tile crossing
//      u * total.
// Nothing is allocated and nothing is stored per vocabulary entry: p and q are recomputed where
// needed from the logits, draft_probs and the node's rejection history (token, residual mass,
// q mass of each rejected sibling, in shared memory), replaying the reference's float64
// operations in the same order, so the values equal those of a stored copy. A rejection costs
// one pass, O(V * rejections so far). Randomness comes from `uniform`, outputs go to the caller's
// buffers, there is no host sync: the op can be captured in a CUDA graph. Bad parents or token
// ids mark the row invalid (accept_len = -1) instead of reading out of bounds.
//
// Each row reads its own temperature / top_k / top_p from [B] tensors (exactly: a float64 value acts
// as the scalar double did, a float32 value as that float; new values need no graph recapture); a
// bad value (negative or non-finite temperature, negative top_k, top_p outside (0, 1]) marks the row
// invalid, as the host cannot be told without a sync. Draft id -1 marks a padding node: it must come
// after the row's real nodes (else the row is invalid) and is never a child (the child loops stop at
// the row's first padding node), so a padded row gives what it gives alone.
//
// Logit processing (optional; reference.verify): a row with a logit bias, penalties or a token
// bitmask writes each visited node's processed logits to a float32 workspace row [V] (one pass:
// bias, repetition, frequency, presence with the committed counts, then the node's bitmask; then the
// path's distinct tokens again with their path counts added, one thread each), and the node's steps
// below read that row instead of the raw logits (the chunk pass, computed on raw logits, is not used
// for such rows). The arithmetic is the reference's, one rounding per operation (no FMA), so the
// processed logits equal the CPU kernel's. min_p (after temperature, before top-k): a token is
// dropped when expf(x - x_max) / sum < min_p * (1 / sum), the float32 probabilities of this kernel's
// own softmax; a bad penalty or min_p marks the row invalid. output_counts are taken as given (the
// CPU kernel raises on a negative count).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../checks.h"
#include "common.cuh"
#include "launch.cuh"

namespace turbospec {
namespace gpu {
namespace {

constexpr int kMaxThreads = 512;

#ifdef TURBOSPEC_EMULATE
// Test hook (tests/ops/cuda_emu): -1 the real choice; 0 no chunk pass; > 0 the chunk pass with
// chunks of that many logits.
inline int64_t verify_emu_chunk = -1;
#endif

// Validity, max and first argmax of one chunk of one node's logits.
struct NodeStats {
  float value;  // max over the chunk (-inf if none above)
  int flags;    // bit 0: a NaN or +inf; bit 1: a value other than -inf
  int64_t index;
};

struct VerifyParams {
  const void* logits;          // [B, N, V], vocab dim contiguous
  int64_t logits_s0, logits_s1;
  int logits_type;             // FloatType
  const void* draft_probs;     // [B, N, V] or nullptr (point-mass drafts)
  int64_t draft_s0, draft_s1;
  int draft_type;
  const int64_t* parents;      // [B, N] contiguous
  const int64_t* tokens;       // [B, N] contiguous
  const float* uniform;        // [B, N] contiguous
  int64_t* accept_len;         // [B]
  int64_t* accept_index;       // [B, N]
  int64_t* output_token_ids;   // [B, N]
  const void* temperature;     // [B] float32 or float64 (temperature_f64), contiguous
  const int64_t* top_k;        // [B] contiguous
  const void* top_p;           // [B] float32 or float64 (top_p_f64), contiguous
  bool temperature_f64, top_p_f64;
  int N;
  int64_t V;
  const NodeStats* stats;  // [B, N, splits] from verify_stats_kernel, or nullptr: scan here
  int splits;
  // logit processing (each nullptr when not given)
  const int32_t* counts;        // output_counts [B, V] contiguous
  const bool* prompt;           // prompt_mask [B, V]
  const float* bias;            // logit_bias [B, V]
  const int32_t* bitmask;       // token_bitmask [B, N, words]
  int64_t words;
  const void* presence;         // [B] float32 / float64 (presence_f64), or nullptr
  const void* frequency;
  const void* repetition;
  const void* min_p;
  bool presence_f64, frequency_f64, repetition_f64, min_p_f64;
  float* processed;             // workspace [B, V] for the processed logits, or nullptr (no processing)
};

// One row's logit processing.
struct RowProcessing {
  const int32_t* counts;  // [V] or nullptr
  const bool* prompt;
  const float* bias;
  const int32_t* bitmask;  // the row's [N, words]
  float presence, frequency, repetition;
};

// reference.process_logits for one token with output count c, one rounding per operation.
__device__ __forceinline__ float process_one(float x, int64_t v, int64_t c, const RowProcessing& pr,
                                             const int32_t* mask_row) {
  if (pr.bias != nullptr) x = add_rn(x, pr.bias[v]);
  if (pr.repetition != 1.0f && (c > 0 || (pr.prompt != nullptr && pr.prompt[v])))
    x = x > 0.0f ? x / pr.repetition : mul_rn(x, pr.repetition);
  if (c > 0) {
    if (pr.frequency != 0.0f) x = add_rn(x, -mul_rn(pr.frequency, static_cast<float>(c)));
    if (pr.presence != 0.0f) x = add_rn(x, -pr.presence);
  }
  if (mask_row != nullptr && !((static_cast<uint32_t>(mask_row[v >> 5]) >> (v & 31)) & 1u))
    x = -__uint_as_float(0x7f800000u);
  return x;
}

// Large vocabularies: node (b, n) = blockIdx.x, chunk = blockIdx.y of `chunk` logits. Each thread
// loads kStatsItems values before comparing any (the loads are independent: many in flight).
constexpr int kStatsThreads = 256, kStatsItems = 16;
constexpr int64_t kStatsMinVocab = 8192;

struct StatsParams {
  const void* logits;
  int64_t s0, s1;
  int N;
  int64_t V, chunk;
  int splits;
  NodeStats* out;
};

__device__ __forceinline__ void stats_update(float v, int64_t i, int& flags, ArgMax& best) {
  const float kInf = __uint_as_float(0x7f800000u);
  if (isnan(v) || v == kInf) flags |= 1;
  if (v != -kInf) flags |= 2;
  if (v > best.value) best = ArgMax{v, i};
}

template <int kType>
__global__ void __launch_bounds__(kStatsThreads) verify_stats_kernel(const StatsParams P) {
  __shared__ int red_i[kMaxWarps];
  __shared__ ArgMax red_am[kMaxWarps];
  const float kInf = __uint_as_float(0x7f800000u);
  const int64_t r = blockIdx.x, b = r / P.N, n = r % P.N;
  const void* row = static_cast<const char*>(P.logits) + (b * P.s0 + n * P.s1) * (kType == kF32 ? 4 : 2);
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * P.chunk;
  const int64_t c1 = c0 + P.chunk < P.V ? c0 + P.chunk : P.V;
  const int64_t step = static_cast<int64_t>(blockDim.x) * kStatsItems;
  int flags = 0;
  ArgMax best{-kInf, P.V};
  for (int64_t start = c0 + threadIdx.x; start < c1; start += step) {
    float v[kStatsItems];
#pragma unroll
    for (int j = 0; j < kStatsItems; ++j) {
      const int64_t i = start + static_cast<int64_t>(j) * blockDim.x;
      v[j] = i < c1 ? load_float(row, i, kType) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kStatsItems; ++j) {
      const int64_t i = start + static_cast<int64_t>(j) * blockDim.x;
      if (i < c1) stats_update(v[j], i, flags, best);
    }
  }
  flags = block_reduce(flags, Or(), red_i);
  best = block_argmax(best, red_am);
  if (threadIdx.x == 0) P.out[r * P.splits + blockIdx.y] = NodeStats{best.value, flags, best.index};
}

// The target distribution at the current node, p = logits_to_probs(row), after the rejections of
// the node's first `rejected` children: enough to recompute p(i) and q(i) for any i.
struct NodeDist {
  const void* row;      // target logits [V] (or the processed row)
  int type;             // row's FloatType
  const void* q_row;    // draft_probs [V], or nullptr (point masses)
  float temperature;    // the row's (> 0)
  float x_max;          // max of x = row / temperature
  bool min_p;           // min_p in force: a token is dropped when expf(x - x_max) * inv_sum0 < min_p_threshold
  float inv_sum0;       // 1 / softmax sum over every token (min_p)
  float min_p_threshold;
  float kth;            // top-k threshold on x (-inf: none)
  float inv_sum1;       // 1 / first softmax sum (top-p)
  float min_kept;       // top-p threshold on the first softmax probabilities
  float inv_sum;        // 1 / softmax sum over the kept tokens
  bool top_p;
  int rejected;
  int64_t rej_token[kMaxTreeNodes];
  double rej_rs[kMaxTreeNodes];  // residual mass after the rejection (<= 0: p kept)
  double rej_qs[kMaxTreeNodes];  // q mass left after removing the token (<= 0: q kept)
};

struct VerifySmem {
  double red_d[kMaxWarps];
  int64_t red_l[kMaxWarps];
  int red_i[kMaxWarps];
  ArgMax red_am[kMaxWarps];
  int bins_i[kMaxWarps * 16];
  double bins_d[kMaxWarps * 16];
  int total_i[16];
  double total_d[16];
  int64_t parents[kMaxTreeNodes];
  int64_t tokens[kMaxTreeNodes];
  float uniform[kMaxTreeNodes];
  int64_t path[kMaxTreeNodes];
  int64_t emitted[kMaxTreeNodes];
  int children[kMaxTreeNodes];
  int num_children;
  int num_real;  // nodes [0, num_real) are real, the rest padding (draft id -1)
  int next;
  int flag;
  NodeDist dist;
  // the row's logit processing (shared: kept out of the registers of the rows without it)
  RowProcessing proc;
  float* processed;  // the workspace row, or nullptr: no processing for this row
  float min_p;       // 0: off
};

__device__ __forceinline__ float scaled_logit(const void* row, int type, int64_t i, float temperature) {
  return load_float(row, i, type) / temperature;
}

// x = logits / temperature after min_p (-inf for a token min_p drops): top-k's input.
__device__ __forceinline__ float filtered_x(const NodeDist& d, int64_t i) {
  const float x = scaled_logit(d.row, d.type, i, d.temperature);
  if (d.min_p && !(expf(x - d.x_max) * d.inv_sum0 >= d.min_p_threshold)) return -__uint_as_float(0x7f800000u);
  return x;
}

// Row b of a float32 or float64 [B] tensor, exactly.
__device__ __forceinline__ double load_real(const void* base, int64_t b, bool f64) {
  return f64 ? static_cast<const double*>(base)[b] : static_cast<double>(static_cast<const float*>(base)[b]);
}

// First softmax (before top-p) of the top-k-kept logits, as float32: top-p's input.
__device__ __forceinline__ float first_prob(const VerifyParams& P, const NodeDist& d, int64_t i) {
  const float x = filtered_x(d, i);
  return x >= d.kth ? expf(x - d.x_max) * d.inv_sum1 : 0.0f;
}

// p(i) before any rejection: logits_to_probs rounded to float32, as float64.
__device__ __forceinline__ double base_prob(const VerifyParams& P, const NodeDist& d, int64_t i) {
  const float x = filtered_x(d, i);
  if (!(x >= d.kth)) return 0.0;
  const float e = expf(x - d.x_max);
  if (d.top_p && !(e * d.inv_sum1 >= d.min_kept)) return 0.0;
  return static_cast<double>(e * d.inv_sum);
}

// p(i) (and q(i) if q_out) after the node's rejections so far, by the reference's float64 steps
// in order: point mass: p <- p with p(x) = 0, / rs; with q: p <- max(p - q, 0) / rs, then
// q <- q with q(x) = 0, / qs. Point masses have q = 1.
__device__ __forceinline__ double current_p(const VerifyParams& P, const NodeDist& d, int64_t i,
                                            double* q_out = nullptr) {
  double p = base_prob(P, d, i);
  const bool load_q = d.q_row != nullptr && (q_out != nullptr || d.rejected > 0);
  double q = load_q ? static_cast<double>(load_float(d.q_row, i, P.draft_type)) : 1.0;
  for (int j = 0; j < d.rejected; ++j) {
    const bool removed = i == d.rej_token[j];
    const double rs = d.rej_rs[j];
    if (d.q_row == nullptr) {
      if (rs > 0.0) p = removed ? 0.0 : p / rs;
    } else {
      if (rs > 0.0) p = fmax(p - q, 0.0) / rs;
      q = removed ? 0.0 : (d.rej_qs[j] > 0.0 ? q / d.rej_qs[j] : q);
    }
  }
  if (q_out != nullptr) *q_out = q;
  return p;
}

// Key of the k-th largest x = logits / temperature (1 <= k < V): a 4-bit radix descent from the
// most significant digit, counting the elements under the current prefix per digit.
__device__ uint32_t kth_largest_key(const VerifyParams& P, const NodeDist& dist, int64_t k, VerifySmem& sm) {
  uint32_t prefix = 0, mask = 0;
  int64_t need = k;
  for (int shift = 28; shift >= 0; shift -= 4) {
    int bins[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) bins[j] = 0;
    for (int64_t i = threadIdx.x; i < P.V; i += blockDim.x) {
      const uint32_t key = ordered_key(filtered_x(dist, i));
      if ((key & mask) == prefix) {
        const uint32_t d = (key >> shift) & 15u;
#pragma unroll
        for (int j = 0; j < 16; ++j) bins[j] += d == static_cast<uint32_t>(j);
      }
    }
    block_sum_bins(bins, sm.bins_i, sm.total_i);
    int digit = 0;
    for (int d = 15; d >= 0; --d) {
      if (sm.total_i[d] >= need) {
        digit = d;
        break;
      }
      need -= sm.total_i[d];
    }
    prefix |= static_cast<uint32_t>(digit) << shift;
    mask |= 15u << shift;
  }
  return prefix;
}

// The smallest probability top-p keeps: min{v present : mass of probabilities > v < top_p}
// (logits_to_probs' rule: a sorted position is kept while the mass strictly before it is < top_p,
// so ties are kept together). Radix descent on the float bits (probabilities are >= 0, so their
// bit patterns sort like their values), carrying `above` = the mass of all larger buckets: in
// each level the answer lies in the lowest non-empty bucket whose mass above is < top_p.
__device__ float top_p_min_kept(const VerifyParams& P, const NodeDist& dist, double top_p, VerifySmem& sm) {
  uint32_t prefix = 0, mask = 0;
  double above = 0.0;
  for (int shift = 28; shift >= 0; shift -= 4) {
    int count[16];
    double mass[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      count[j] = 0;
      mass[j] = 0.0;
    }
    for (int64_t i = threadIdx.x; i < P.V; i += blockDim.x) {
      const float p = first_prob(P, dist, i);
      const uint32_t key = __float_as_uint(p);
      if ((key & mask) == prefix) {
        const uint32_t d = (key >> shift) & 15u;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const bool hit = d == static_cast<uint32_t>(j);
          count[j] += hit;
          mass[j] += hit ? static_cast<double>(p) : 0.0;
        }
      }
    }
    block_sum_bins(count, sm.bins_i, sm.total_i);
    block_sum_bins(mass, sm.bins_d, sm.total_d);
    int digit = -1;
    double run = above, digit_above = above;
    for (int d = 15; d >= 0; --d) {
      if (sm.total_i[d] > 0 && (run < top_p || digit < 0)) {
        digit = d;  // the first non-empty bucket is always valid: its largest element has mass above < top_p
        digit_above = run;
      }
      run += sm.total_d[d];
    }
    prefix |= static_cast<uint32_t>(digit < 0 ? 0 : digit) << shift;
    mask |= 15u << shift;
    above = digit_above;
  }
  return __uint_as_float(prefix);
}

// reference.sample_from_probs on the current p: the first index whose cumulative mass exceeds
// u * total, the last index with positive mass if rounding leaves none. Tiles of
// kItems * blockDim.x entries are scanned in order; the walk stops at the first tile that crosses.
__device__ int64_t sample_current(const VerifyParams& P, const NodeDist& d, float u, VerifySmem& sm) {
  constexpr int kItems = 4;
  const int64_t V = P.V;
  double local = 0.0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) local += current_p(P, d, i);
  const double threshold = static_cast<double>(u) * block_reduce(local, Sum(), sm.red_d);
  const int64_t tile = static_cast<int64_t>(blockDim.x) * kItems;
  double running = 0.0;
  int64_t found = V;
  for (int64_t start = 0; start < V; start += tile) {
    const int64_t first = start + static_cast<int64_t>(threadIdx.x) * kItems;
    double vals[kItems];
    double thread_sum = 0.0;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      vals[k] = first + k < V ? current_p(P, d, first + k) : 0.0;
      thread_sum += vals[k];
    }
    double tile_sum;
    double cdf = running + block_exclusive_scan(thread_sum, sm.red_d, &tile_sum);
    int64_t hit = V;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      cdf += vals[k];
      if (hit == V && first + k < V && cdf > threshold && vals[k] > 0.0) hit = first + k;
    }
    hit = block_reduce(hit, Min(), sm.red_l);
    if (hit < V) {
      found = hit;
      break;
    }
    running += tile_sum;
  }
  if (found >= V) {
    int64_t last = -1;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x)
      if (current_p(P, d, i) > 0.0) last = i;
    last = block_reduce(last, Max(), sm.red_l);
    found = last < 0 ? 0 : last;
  }
  return found;
}

__global__ void __launch_bounds__(kMaxThreads) verify_kernel(const VerifyParams P) {
  __shared__ VerifySmem sm;
  NodeDist& dist = sm.dist;
  const int tid = threadIdx.x;
  const int64_t b = blockIdx.x;
  const int N = P.N;
  const int64_t V = P.V;
  for (int i = tid; i < N; i += blockDim.x) {
    sm.parents[i] = P.parents[b * N + i];
    sm.tokens[i] = P.tokens[b * N + i];
    sm.uniform[i] = P.uniform[b * N + i];
    P.accept_index[b * N + i] = -1;
    P.output_token_ids[b * N + i] = -1;
  }
  // The row's sampling parameters (every thread reads the same values).
  const double temperature_d = load_real(P.temperature, b, P.temperature_f64);
  const int64_t top_k = P.top_k[b];
  const double top_p = load_real(P.top_p, b, P.top_p_f64);
  const bool greedy = temperature_d == 0.0;
  const float temperature = static_cast<float>(temperature_d);
  __syncthreads();
  if (tid == 0) {  // a row with a bad parent, token id or parameter is invalid: nothing is read out of bounds
    const double kInfD = static_cast<double>(__uint_as_float(0x7f800000u));
    bool ok = sm.parents[0] == -1;
    ok = ok && temperature_d >= 0.0 && temperature_d < kInfD && top_k >= 0 && top_p > 0.0 && top_p <= 1.0;
    // the row's logit processing
    const double presence_d = P.presence != nullptr ? load_real(P.presence, b, P.presence_f64) : 0.0;
    const double frequency_d = P.frequency != nullptr ? load_real(P.frequency, b, P.frequency_f64) : 0.0;
    const double repetition_d = P.repetition != nullptr ? load_real(P.repetition, b, P.repetition_f64) : 1.0;
    const double min_p_d = P.min_p != nullptr ? load_real(P.min_p, b, P.min_p_f64) : 0.0;
    ok = ok && presence_d >= -2.0 && presence_d <= 2.0 && frequency_d >= -2.0 && frequency_d <= 2.0;
    ok = ok && repetition_d > 0.0 && repetition_d < kInfD && min_p_d >= 0.0 && min_p_d <= 1.0;
    RowProcessing& pr = sm.proc;
    pr.counts = P.counts != nullptr ? P.counts + b * V : nullptr;
    pr.prompt = P.prompt != nullptr ? P.prompt + b * V : nullptr;
    pr.bias = P.bias != nullptr ? P.bias + b * V : nullptr;
    pr.bitmask = P.bitmask != nullptr ? P.bitmask + b * N * P.words : nullptr;
    pr.presence = static_cast<float>(presence_d);
    pr.frequency = static_cast<float>(frequency_d);
    pr.repetition = static_cast<float>(repetition_d);
    const bool active = P.processed != nullptr && (pr.bias != nullptr || pr.bitmask != nullptr ||
                                                   pr.presence != 0.0f || pr.frequency != 0.0f || pr.repetition != 1.0f);
    sm.processed = active ? P.processed + b * V : nullptr;
    sm.min_p = static_cast<float>(min_p_d);
    int num_real = N;  // draft ids: a token in [0, V) or -1 (padding), the padding after the real nodes
    for (int i = 1; i < N; ++i) {
      ok = ok && sm.parents[i] >= 0 && sm.parents[i] < i;
      if (sm.tokens[i] == -1) {
        num_real = num_real < i ? num_real : i;
      } else {
        ok = ok && sm.tokens[i] >= 0 && sm.tokens[i] < V && num_real == N;
      }
    }
    sm.flag = ok;
    sm.num_real = num_real;
    sm.path[0] = 0;
  }
  __syncthreads();
  if (!sm.flag) {
    if (tid == 0) P.accept_len[b] = -1;
    return;
  }
  const int num_real = sm.num_real;
  const float kInf = __uint_as_float(0x7f800000u);
  const int elsize = P.logits_type == kF32 ? 4 : 2;
  const int q_elsize = P.draft_type == kF32 ? 4 : 2;
  int node = 0, n_acc = 0, n_out = 0;
  bool valid = true;
  while (true) {
    const void* row = static_cast<const char*>(P.logits) + (b * P.logits_s0 + node * P.logits_s1) * elsize;
    int row_type = P.logits_type;
    // 1. validity, max and argmax
    int flags = 0;  // bit 0: a NaN or +inf; bit 1: a value other than -inf
    ArgMax best{-kInf, V};
    if (sm.processed != nullptr) {
      // 0. the node's processed logits: every token with its committed count, then each distinct
      // token on the path (root excluded, node included) with its path occurrences added.
      __syncthreads();  // sm.path is complete; the previous node is done with the workspace row
      const RowProcessing& pr = sm.proc;
      float* processed = sm.processed;
      const int32_t* mask_row = pr.bitmask != nullptr ? pr.bitmask + node * P.words : nullptr;
      for (int64_t i = tid; i < V; i += blockDim.x) {
        const float raw = load_float(row, i, row_type);
        if (isnan(raw) || raw == kInf) flags |= 1;  // raw logits that are not valid make the node invalid
        processed[i] = process_one(raw, i, pr.counts != nullptr ? pr.counts[i] : 0, pr, mask_row);
      }
      __syncthreads();
      for (int k = 1 + tid; k <= n_acc; k += blockDim.x) {
        const int64_t t = sm.tokens[sm.path[k]];
        bool first = true;
        for (int j = 1; j < k && first; ++j) first = sm.tokens[sm.path[j]] != t;
        if (!first) continue;
        int64_t extra = 0;
        for (int j = k; j <= n_acc; ++j) extra += sm.tokens[sm.path[j]] == t;
        const int64_t c = (pr.counts != nullptr ? pr.counts[t] : 0) + extra;
        processed[t] = process_one(load_float(row, t, row_type), t, c, pr, mask_row);
      }
      __syncthreads();
      row = processed;
      row_type = kF32;
      for (int64_t i = tid; i < V; i += blockDim.x) stats_update(processed[i], i, flags, best);
    } else if (P.stats != nullptr) {  // the chunks' results from verify_stats_kernel
      const NodeStats* st = P.stats + (b * N + node) * P.splits;
      for (int j = tid; j < P.splits; j += blockDim.x) {
        flags |= st[j].flags;
        best = argmax_op(best, ArgMax{st[j].value, st[j].index});
      }
    } else {
      for (int64_t i = tid; i < V; i += blockDim.x) stats_update(load_float(row, i, row_type), i, flags, best);
    }
    flags = block_reduce(flags, Or(), sm.red_i);
    best = block_argmax(best, sm.red_am);
    if ((flags & 1) || !(flags & 2)) {
      valid = false;
      break;
    }
    // 2. greedy
    if (greedy) {
      if (tid == 0) {
        int next = -1;
        for (int c = node + 1; c < num_real && next < 0; ++c)
          if (sm.parents[c] == node && sm.tokens[c] == best.index) next = c;
        sm.next = next;
        sm.emitted[n_out] = best.index;
        if (next >= 0) sm.path[n_acc + 1] = next;
      }
      __syncthreads();
      const int next = sm.next;
      ++n_out;
      if (next < 0) break;
      ++n_acc;
      node = next;
      continue;
    }
    // 3. sampling: p = logits_to_probs(row, temperature, top_k, top_p). Every thread holds the
    // same node state; thread 0 publishes it to shared memory for the per-element functions.
    const float x_max = best.value / temperature;  // division by t > 0 preserves the order
    float inv_sum0 = 0.0f;
    const float min_p = sm.min_p;
    if (min_p > 0.0f) {  // min_p: the softmax over every token first
      double sum0 = 0.0;
      for (int64_t i = tid; i < V; i += blockDim.x) sum0 += expf(scaled_logit(row, row_type, i, temperature) - x_max);
      inv_sum0 = 1.0f / static_cast<float>(block_reduce(sum0, Sum(), sm.red_d));
    }
    const void* q_row = nullptr;
    if (P.draft_probs != nullptr)
      q_row = static_cast<const char*>(P.draft_probs) + (b * P.draft_s0 + node * P.draft_s1) * q_elsize;
    __syncthreads();  // every thread is done with the previous node's state
    if (tid == 0) {
      dist.row = row;
      dist.type = row_type;
      dist.q_row = q_row;
      dist.temperature = temperature;
      dist.x_max = x_max;
      dist.min_p = min_p > 0.0f;
      dist.inv_sum0 = inv_sum0;
      dist.min_p_threshold = mul_rn(inv_sum0, min_p);  // min_p x the largest probability
      dist.kth = -kInf;
      dist.rejected = 0;
    }
    __syncthreads();
    float kth = -kInf;
    if (top_k > 0 && top_k < V) kth = key_to_float(kth_largest_key(P, dist, top_k, sm));
    double sum = 0.0;
    for (int64_t i = tid; i < V; i += blockDim.x) {
      const float x = filtered_x(dist, i);
      if (x >= kth) sum += expf(x - x_max);
    }
    sum = block_reduce(sum, Sum(), sm.red_d);
    const bool use_top_p = top_p < 1.0;
    __syncthreads();
    if (tid == 0) {
      dist.kth = kth;
      dist.inv_sum1 = 1.0f / static_cast<float>(sum);
      dist.min_kept = 0.0f;
      dist.inv_sum = dist.inv_sum1;
      dist.top_p = false;
    }
    __syncthreads();
    if (use_top_p) {
      const float min_kept = top_p_min_kept(P, dist, top_p, sm);
      double kept = 0.0;
      for (int64_t i = tid; i < V; i += blockDim.x) {
        const float x = filtered_x(dist, i);
        if (x >= kth) {
          const float e = expf(x - x_max);
          if (e * dist.inv_sum1 >= min_kept) kept += e;
        }
      }
      kept = block_reduce(kept, Sum(), sm.red_d);
      if (tid == 0) {
        dist.min_kept = min_kept;
        dist.inv_sum = 1.0f / static_cast<float>(kept);
        dist.top_p = true;
      }
      __syncthreads();
    }
    if (tid == 0) {
      int k = 0;
      for (int c = node + 1; c < num_real; ++c)
        if (sm.parents[c] == node) sm.children[k++] = c;
      sm.num_children = k;
    }
    __syncthreads();
    const int num_children = sm.num_children;
    if (q_row != nullptr && num_children > 0) {  // q must be a distribution: finite and >= 0
      int bad = 0;
      for (int64_t i = tid; i < V; i += blockDim.x) {
        const float q = load_float(q_row, i, P.draft_type);
        if (!(q >= 0.0f && q < kInf)) bad = 1;
      }
      if (block_reduce(bad, Or(), sm.red_i)) {
        valid = false;
        break;
      }
    }
    // Recursive rejection over the children in node order.
    int next = -1;
    for (int k = 0; k < num_children; ++k) {
      const int c = sm.children[k];
      const int64_t x = sm.tokens[c];
      if (tid == 0) {
        double qx;
        const double px = current_p(P, dist, x, &qx);
        sm.flag = static_cast<double>(sm.uniform[c]) * qx < px;
      }
      __syncthreads();
      if (sm.flag) {
        next = c;
        break;
      }
      // Rejected: the residual mass (and the q mass left without x), for the history.
      double rs = 0.0, qs = 0.0;
      for (int64_t i = tid; i < V; i += blockDim.x) {
        double q;
        const double p = current_p(P, dist, i, &q);
        if (q_row == nullptr) {
          if (i != x) rs += p;
        } else {
          rs += fmax(p - q, 0.0);
          if (i != x) qs += q;
        }
      }
      rs = block_reduce(rs, Sum(), sm.red_d);
      if (q_row != nullptr) qs = block_reduce(qs, Sum(), sm.red_d);
      if (tid == 0) {
        const int j = dist.rejected;
        dist.rej_token[j] = x;
        dist.rej_rs[j] = rs;
        dist.rej_qs[j] = qs;
        dist.rejected = j + 1;
      }
      __syncthreads();
    }
    if (next < 0) {  // no child accepted: the recovered (or bonus) token, drawn with uniform[b, 0]
      const int64_t t = sample_current(P, dist, sm.uniform[0], sm);
      if (tid == 0) sm.emitted[n_out] = t;
      ++n_out;
      break;
    }
    if (tid == 0) {
      sm.emitted[n_out] = sm.tokens[next];
      sm.path[n_acc + 1] = next;
    }
    ++n_out;
    ++n_acc;
    node = next;
  }
  __syncthreads();
  if (tid == 0) {
    if (!valid) {
      P.accept_len[b] = -1;
    } else {
      P.accept_len[b] = n_acc;
      for (int j = 0; j <= n_acc; ++j) P.accept_index[b * N + j] = sm.path[j];
      for (int j = 0; j < n_out; ++j) P.output_token_ids[b * N + j] = sm.emitted[j];
    }
  }
}

int float_type(const at::Tensor& t) {
  return t.scalar_type() == c10::kFloat ? kF32 : t.scalar_type() == c10::kHalf ? kF16 : kBF16;
}

void verify_cuda(const at::Tensor& target_logits_in, const at::Tensor& parents_in, const at::Tensor& draft_token_ids_in,
                 const std::optional<at::Tensor>& draft_probs_in, const at::Tensor& uniform_in,
                 const at::Tensor& temperature_in, const at::Tensor& top_k_in, const at::Tensor& top_p_in,
                 const at::Tensor& accept_len, const at::Tensor& accept_index, const at::Tensor& output_token_ids,
                 const std::optional<at::Tensor>& output_counts, const std::optional<at::Tensor>& prompt_mask,
                 const std::optional<at::Tensor>& presence_penalty, const std::optional<at::Tensor>& frequency_penalty,
                 const std::optional<at::Tensor>& repetition_penalty, const std::optional<at::Tensor>& logit_bias,
                 const std::optional<at::Tensor>& min_p, const std::optional<at::Tensor>& token_bitmask) {
  const VerifyDims d = check_verify_args(target_logits_in, parents_in, draft_token_ids_in, draft_probs_in, uniform_in,
                                         temperature_in, top_k_in, top_p_in, accept_len, accept_index,
                                         output_token_ids, TS_KERNEL_DEVICE);
  check_verify_processing(d, target_logits_in, output_counts, prompt_mask, presence_penalty, frequency_penalty,
                          repetition_penalty, logit_bias, min_p, token_bitmask);

  if (d.B == 0) return;
  TS_DEVICE_GUARD(target_logits_in);
  // Inputs are used in place when they already have the layout the kernel reads (the usual case).
  const at::Tensor logits = target_logits_in.stride(2) == 1 ? target_logits_in : target_logits_in.contiguous();
  at::Tensor draft_probs;
  if (draft_probs_in.has_value())
    draft_probs = draft_probs_in->stride(2) == 1 ? *draft_probs_in : draft_probs_in->contiguous();
  const at::Tensor parents = parents_in.contiguous();
  const at::Tensor tokens = draft_token_ids_in.contiguous();
  const at::Tensor uniform = uniform_in.contiguous();
  const at::Tensor temperature = temperature_in.contiguous();
  const at::Tensor top_k = top_k_in.contiguous();
  const at::Tensor top_p = top_p_in.contiguous();
  VerifyParams P{};
  P.logits = logits.data_ptr();
  P.logits_s0 = logits.stride(0);
  P.logits_s1 = logits.stride(1);
  P.logits_type = float_type(logits);
  P.draft_probs = draft_probs.defined() ? draft_probs.data_ptr() : nullptr;
  P.draft_s0 = draft_probs.defined() ? draft_probs.stride(0) : 0;
  P.draft_s1 = draft_probs.defined() ? draft_probs.stride(1) : 0;
  P.draft_type = draft_probs.defined() ? float_type(draft_probs) : kF32;
  P.parents = parents.data_ptr<int64_t>();
  P.tokens = tokens.data_ptr<int64_t>();
  P.uniform = uniform.data_ptr<float>();
  P.accept_len = accept_len.data_ptr<int64_t>();
  P.accept_index = accept_index.data_ptr<int64_t>();
  P.output_token_ids = output_token_ids.data_ptr<int64_t>();
  P.temperature = temperature.data_ptr();
  P.temperature_f64 = temperature.scalar_type() == c10::kDouble;
  P.top_k = top_k.data_ptr<int64_t>();
  P.top_p = top_p.data_ptr();
  P.top_p_f64 = top_p.scalar_type() == c10::kDouble;
  P.N = static_cast<int>(d.N);
  P.V = d.V;
  // Logit processing: the tensors as given when contiguous (the usual case), a workspace row per batch
  // row for the processed logits (from the caching allocator, as the chunk pass's; capture-safe).
  at::Tensor counts, prompt, bias, bitmask, presence, frequency, repetition, min_p_t, processed;
  if (output_counts.has_value()) counts = output_counts->contiguous();
  if (prompt_mask.has_value()) prompt = prompt_mask->contiguous();
  if (logit_bias.has_value()) bias = logit_bias->contiguous();
  if (token_bitmask.has_value()) bitmask = token_bitmask->contiguous();
  if (presence_penalty.has_value()) presence = presence_penalty->contiguous();
  if (frequency_penalty.has_value()) frequency = frequency_penalty->contiguous();
  if (repetition_penalty.has_value()) repetition = repetition_penalty->contiguous();
  if (min_p.has_value()) min_p_t = min_p->contiguous();
  P.counts = counts.defined() ? counts.data_ptr<int32_t>() : nullptr;
  P.prompt = prompt.defined() ? prompt.data_ptr<bool>() : nullptr;
  P.bias = bias.defined() ? bias.data_ptr<float>() : nullptr;
  P.bitmask = bitmask.defined() ? bitmask.data_ptr<int32_t>() : nullptr;
  P.words = (d.V + 31) / 32;
  P.presence = presence.defined() ? presence.data_ptr() : nullptr;
  P.presence_f64 = presence.defined() && presence.scalar_type() == c10::kDouble;
  P.frequency = frequency.defined() ? frequency.data_ptr() : nullptr;
  P.frequency_f64 = frequency.defined() && frequency.scalar_type() == c10::kDouble;
  P.repetition = repetition.defined() ? repetition.data_ptr() : nullptr;
  P.repetition_f64 = repetition.defined() && repetition.scalar_type() == c10::kDouble;
  P.min_p = min_p_t.defined() ? min_p_t.data_ptr() : nullptr;
  P.min_p_f64 = min_p_t.defined() && min_p_t.scalar_type() == c10::kDouble;
  if (bias.defined() || bitmask.defined() || presence.defined() || frequency.defined() || repetition.defined()) {
    processed = at::empty({d.B, d.V}, logits.options().dtype(at::kFloat));
    P.processed = processed.data_ptr<float>();
  }
  // Large vocabularies: every node's validity / max / argmax first, over the whole GPU.
  bool by_chunks = d.V >= kStatsMinVocab;
  int stats_threads = kStatsThreads;
  int64_t chunk = static_cast<int64_t>(kStatsThreads) * kStatsItems;
#ifdef TURBOSPEC_EMULATE
  if (verify_emu_chunk >= 0) by_chunks = verify_emu_chunk > 0;
  if (verify_emu_chunk > 0) chunk = verify_emu_chunk;
  if (::emu::block_threads_override > 0) stats_threads = ::emu::block_threads_override;
#endif
  at::Tensor workspace;
  if (by_chunks) {
    const int64_t splits = (d.V + chunk - 1) / chunk;
    TORCH_CHECK(splits <= 65535, "verify: vocabulary of ", d.V, " logits is too large for the CUDA kernel (at most ",
                65535 * chunk, ")");
    // From the caching allocator (capture-safe: a graph keeps its own pool), 16 bytes per chunk.
    workspace = at::empty({d.B * d.N * splits * 2}, logits.options().dtype(at::kLong));
    StatsParams S{logits.data_ptr(), logits.stride(0), logits.stride(1), P.N, d.V, chunk,
                  static_cast<int>(splits), reinterpret_cast<NodeStats*>(workspace.data_ptr<int64_t>())};
    const dim3 grid(static_cast<unsigned>(d.B * d.N), static_cast<unsigned>(splits));
    if (P.logits_type == kF32) {
      TS_LAUNCH(verify_stats_kernel<kF32>, grid, dim3(stats_threads), S);
    } else if (P.logits_type == kBF16) {
      TS_LAUNCH(verify_stats_kernel<kBF16>, grid, dim3(stats_threads), S);
    } else {
      TS_LAUNCH(verify_stats_kernel<kF16>, grid, dim3(stats_threads), S);
    }
    P.stats = S.out;
    P.splits = S.splits;
  }
  TS_LAUNCH(verify_kernel, dim3(static_cast<unsigned>(d.B)), dim3(row_block_threads(d.V)), P);
}

}  // namespace
}  // namespace gpu
}  // namespace turbospec

#ifndef TURBOSPEC_EMULATE
TORCH_LIBRARY_IMPL(turbospec, CUDA, m) { m.impl("verify", &turbospec::gpu::verify_cuda); }
#endif
