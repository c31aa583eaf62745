// verify, CPU: fused softmax + speculative acceptance over a chain or tree (spec: reference.verify).
//
// Rows run in parallel (at::parallel_for); each row walks its tree from the root exactly as the
// reference does, computing the target distribution only at the nodes it visits:
//   * validity: one pass (NaN / +inf / all -inf -> accept_len = -1, nothing emitted);
//   * greedy (temperature == 0): one argmax pass (first maximal index);
//   * sampling: logits / temperature in float32; top-k by the k-th largest value (a k-heap or
//     nth_element, O(V)); top-p by the value rule of logits_to_probs, sorting only the prefix of
//     the probabilities the cut can reach (nth_element on doubling chunks) with the reference's
//     float64 running sum; softmax in float32 (torch's own kernel from V = 1024 on, see
//     kTorchSoftmaxMinVocab; below, float32 exp with a float64 sum); recursive rejection over the
//     children in node order in float64; inverse-CDF sampling with a float64 cumulative sum.
// No full sort unless top-p has to cut deep into a flat distribution. The integer outputs equal
// the reference's except for decisions within float rounding of a tie.
//
// Each row has its own temperature / top_k / top_p ([B] tensors, read exactly: a float64 value acts
// as the scalar double did, a float32 value as that float) and its own number of real nodes: draft
// id -1 marks a padding node, which must come after the row's real nodes and is never a child (the
// child loops stop at the first padding node), so a padded row gives what it gives alone.
//
// Logit processing (optional; reference.verify / reference.process_logits): a row with a logit bias,
// penalties or a token bitmask has each visited node's logits processed into a float32 scratch row
// first: bias, repetition, frequency, presence (counts = output_counts + the tokens on the path to the
// node, node included, root excluded: the whole row with the committed counts, then the path's
// distinct tokens again with their path counts added), then the node's bitmask; validity is checked
// on the raw and on the processed logits. Every operation is the reference's float32 operation, so
// the processed logits equal the reference's bit for bit. min_p (after temperature, before top-k)
// uses torch's softmax at every vocabulary size, so its cut is the reference's too.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "../checks.h"

namespace turbospec {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Sampling {
  double temperature;
  int64_t top_k;
  double top_p;
  double min_p;  // 0: off
};

// One row's logit processing (all off by default).
struct Processing {
  const int32_t* counts = nullptr;   // output_counts [V], or none (zeros)
  const bool* prompt = nullptr;      // prompt_mask [V], or none
  const float* bias = nullptr;       // logit_bias [V], or none
  const int32_t* bitmask = nullptr;  // token_bitmask [N, W] of the row, or none
  int64_t words = 0;                 // W
  float presence = 0.0f, frequency = 0.0f, repetition = 1.0f;
  bool active = false;               // anything to do
};

// The penalties of reference.process_logits (after the bias, before the bitmask) for one token with
// output count c (committed + path).
inline float penalize(float x, int64_t c, bool in_prompt, const Processing& pr) {
  if (pr.repetition != 1.0f && (c > 0 || in_prompt)) x = x > 0.0f ? x / pr.repetition : x * pr.repetition;
  if (c > 0) {
    if (pr.frequency != 0.0f) x = x - pr.frequency * static_cast<float>(c);
    if (pr.presence != 0.0f) x = x - pr.presence;
  }
  return x;
}

inline bool allowed(const int32_t* mask_row, int64_t v) {
  return mask_row == nullptr || ((static_cast<uint32_t>(mask_row[v >> 5]) >> (v & 31)) & 1u);
}

// reference.process_logits for one token with output count c.
inline float process_one(float x, int64_t v, int64_t c, const Processing& pr, const int32_t* mask_row) {
  if (pr.bias != nullptr) x = x + pr.bias[v];
  x = penalize(x, c, pr.prompt != nullptr && pr.prompt[v], pr);
  return allowed(mask_row, v) ? x : -std::numeric_limits<float>::infinity();
}

// y <- the processed logits of one node: every token with its committed count, then each distinct
// token on the node's path (path_tokens[0, n_path): the draft tokens of the nodes root -> node,
// root excluded) again with its path occurrences added. The whole row goes in passes (each token's
// operations in process_one's order): widen + bias, the penalties on the tokens seen (most are
// not), the bitmask word by word. Returns false if the raw row holds a NaN or +inf (an all -inf raw
// row leaves the processed row all -inf or NaN, which the caller's scan rejects).
template <typename T>
bool process_node(const T* raw, int64_t V, const Processing& pr, const int32_t* mask_row, const int64_t* path_tokens,
                  int64_t n_path, float* y) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  bool bad = false;
  if (pr.bias != nullptr) {
    for (int64_t v = 0; v < V; ++v) {
      const float r = static_cast<float>(raw[v]);
      bad |= (r != r) | (r == kInf);
      y[v] = r + pr.bias[v];
    }
  } else {
    for (int64_t v = 0; v < V; ++v) {
      const float r = static_cast<float>(raw[v]);
      bad |= (r != r) | (r == kInf);
      y[v] = r;
    }
  }
  if (pr.repetition != 1.0f || pr.frequency != 0.0f || pr.presence != 0.0f) {
    const bool by_prompt = pr.prompt != nullptr && pr.repetition != 1.0f;
    for (int64_t v = 0; v < V; ++v) {
      const int64_t c = pr.counts != nullptr ? pr.counts[v] : 0;
      const bool in_prompt = by_prompt && pr.prompt[v];
      if (c > 0 || in_prompt) y[v] = penalize(y[v], c, in_prompt, pr);
    }
  }
  if (mask_row != nullptr) {
    for (int64_t w = 0; w * 32 < V; ++w) {
      const uint32_t m = static_cast<uint32_t>(mask_row[w]);
      if (m == 0xffffffffu) continue;
      const int64_t end = std::min<int64_t>(V, w * 32 + 32);
      for (int64_t v = w * 32; v < end; ++v)
        if (!((m >> (v & 31)) & 1u)) y[v] = -kInf;
    }
  }
  for (int64_t k = 0; k < n_path; ++k) {
    const int64_t t = path_tokens[k];
    bool first = true;
    for (int64_t j = 0; j < k && first; ++j) first = path_tokens[j] != t;
    if (!first) continue;
    int64_t extra = 0;
    for (int64_t j = k; j < n_path; ++j) extra += path_tokens[j] == t;
    const int64_t c = (pr.counts != nullptr ? pr.counts[t] : 0) + extra;
    y[t] = process_one(static_cast<float>(raw[t]), t, c, pr, mask_row);
  }
  return !bad;
}

// Per-thread buffers, kept across calls (they only grow): allocating and faulting in a few MB per
// call would cost more than a large-vocabulary row itself.
struct Scratch {
  std::vector<float> x, e, probs, sorted, y;
  std::vector<double> p, q, r;
  void reserve(int64_t V, bool top_k_or_p, bool with_q) {
    const size_t n = static_cast<size_t>(V);
    for (auto* v : {&x, &e}) if (v->size() < n) v->resize(n);
    if (p.size() < n) p.resize(n);
    if (r.size() < n) r.resize(n);
    if (probs.size() < n) probs.resize(n);
    if (top_k_or_p && sorted.size() < n) sorted.resize(n);
    if (with_q && q.size() < n) q.resize(n);
  }
  void reserve_processed(int64_t V) {
    if (y.size() < static_cast<size_t>(V)) y.resize(static_cast<size_t>(V));
  }
};

// False when the row cannot define a distribution (any NaN or +inf, or all -inf), as in
// reference.logits_are_valid; otherwise *argmax is the first maximal index.
template <typename T>
bool scan_logits(const T* row, int64_t V, int64_t* argmax) {
  float best = static_cast<float>(row[0]);
  int64_t best_i = 0;
  bool any_finite_or_neg = false;  // some value is not -inf
  for (int64_t i = 0; i < V; ++i) {
    const float v = static_cast<float>(row[i]);
    if (std::isnan(v) || v == std::numeric_limits<float>::infinity()) return false;
    any_finite_or_neg = any_finite_or_neg || v != kNegInf;
    if (v > best) {
      best = v;
      best_i = i;
    }
  }
  *argmax = best_i;
  return any_finite_or_neg;
}

// The smallest probability kept by top-p (logits_to_probs): with the probabilities sorted in
// descending order s_0 >= s_1 >= ..., mass_before_k = cumsum_k - s_k in float64, and
// num_kept = max(1, #{k : mass_before_k < top_p}); returns s_{num_kept - 1}. Only the sorted prefix
// the cut can reach is materialised: chunks of doubling size are selected with nth_element.
float top_p_min_kept(const float* probs, int64_t V, double top_p, std::vector<float>& buf) {
  std::copy(probs, probs + V, buf.begin());
  int64_t done = 0, count = 0, chunk = 64;
  double cum = 0.0;
  bool crossed = false;
  while (!crossed && done < V) {
    const int64_t stop = std::min(V, done + chunk);
    std::nth_element(buf.begin() + done, buf.begin() + (stop - 1), buf.begin() + V, std::greater<float>());
    std::sort(buf.begin() + done, buf.begin() + (stop - 1), std::greater<float>());
    for (int64_t k = done; k < stop; ++k) {
      const double s = buf[k];
      cum += s;
      if (cum - s < top_p) {
        ++count;
      } else {
        crossed = true;
      }
    }
    done = stop;
    chunk *= 2;
  }
  return buf[std::max<int64_t>(count, 1) - 1];
}

// The k-th largest of x[0:V] (1 <= k < V), counting repeated values: a min-heap of the k largest
// for small k (one comparison per element for most), nth_element otherwise.
float kth_largest(const float* x, int64_t V, int64_t k, std::vector<float>& buf) {
  if (k <= 4096 && k * 16 <= V) {
    float* heap = buf.data();
    std::copy(x, x + k, heap);
    std::make_heap(heap, heap + k, std::greater<float>());
    for (int64_t i = k; i < V; ++i) {
      if (x[i] > heap[0]) {
        std::pop_heap(heap, heap + k, std::greater<float>());
        heap[k - 1] = x[i];
        std::push_heap(heap, heap + k, std::greater<float>());
      }
    }
    return heap[0];
  }
  std::copy(x, x + V, buf.begin());
  std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.begin() + V, std::greater<float>());
  return buf[k - 1];
}

// From this vocabulary size on, the float32 softmax is torch's own (at::_softmax on the same
// float32 values as the reference, hence bitwise equal to it). Its float32 sum drifts by ~1e-6
// relative at V ~ 1e5, enough to move the top-p cut (a mass compared with top_p) by one token in a
// flat distribution, and the inverse-CDF sample with it. Below, a float64 sum is as close to the
// reference as torch's own rounding, and saves the per-call overhead on the many small rows.
constexpr int64_t kTorchSoftmaxMinVocab = 1024;

void torch_softmax(float* x, float* out, int64_t V) {
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  at::Tensor out_t = at::from_blob(out, {V}, opts);
  at::_softmax_out(out_t, at::from_blob(x, {V}, opts), 0, false);
}

// p <- logits_to_probs(row, temperature, top_k, top_p) as float64 (values rounded to float32).
template <typename T>
void target_probs(const T* row, int64_t V, const Sampling& s, Scratch& w) {
  const float t = static_cast<float>(s.temperature);
  float* x = w.x.data();
  float m = kNegInf;  // the maximum survives top-k, so it is the maximum of the kept logits too
  for (int64_t i = 0; i < V; ++i) {
    x[i] = static_cast<float>(row[i]) / t;
    m = x[i] > m ? x[i] : m;
  }
  if (s.min_p > 0.0) {  // min_p (logits_to_probs): torch's softmax at every V, as the reference
    float* probs = w.probs.data();
    torch_softmax(x, probs, V);
    float pmax = 0.0f;
    for (int64_t i = 0; i < V; ++i) pmax = probs[i] > pmax ? probs[i] : pmax;
    const float threshold = pmax * static_cast<float>(s.min_p);
    for (int64_t i = 0; i < V; ++i)
      if (probs[i] < threshold) x[i] = kNegInf;
  }
  if (s.top_k > 0 && s.top_k < V) {
    const float kth = kth_largest(x, V, s.top_k, w.sorted);
    for (int64_t i = 0; i < V; ++i)
      if (x[i] < kth) x[i] = kNegInf;
  }
  double* p = w.p.data();
  if (V >= kTorchSoftmaxMinVocab) {
    float* probs = w.probs.data();
    torch_softmax(x, probs, V);
    if (s.top_p < 1.0) {
      const float min_kept = top_p_min_kept(probs, V, s.top_p, w.sorted);
      for (int64_t i = 0; i < V; ++i)
        if (probs[i] < min_kept) x[i] = kNegInf;
      torch_softmax(x, probs, V);
    }
    for (int64_t i = 0; i < V; ++i) p[i] = probs[i];
    return;
  }
  float* e = w.e.data();
  double sum = 0.0;
  {
    double acc[4] = {0.0, 0.0, 0.0, 0.0};  // independent chains: the adds overlap
    int64_t i = 0;
    for (; i + 4 <= V; i += 4) {
      for (int k = 0; k < 4; ++k) {
        e[i + k] = std::exp(x[i + k] - m);
        acc[k] += e[i + k];
      }
    }
    for (; i < V; ++i) {
      e[i] = std::exp(x[i] - m);
      acc[0] += e[i];
    }
    sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  }
  if (s.top_p < 1.0) {
    float* probs = w.probs.data();
    const float inv = 1.0f / static_cast<float>(sum);
    for (int64_t i = 0; i < V; ++i) probs[i] = e[i] * inv;
    const float min_kept = top_p_min_kept(probs, V, s.top_p, w.sorted);
    sum = 0.0;
    for (int64_t i = 0; i < V; ++i) {
      if (probs[i] < min_kept) e[i] = 0.0f;
      sum += e[i];
    }
  }
  const float inv = 1.0f / static_cast<float>(sum);
  for (int64_t i = 0; i < V; ++i) p[i] = static_cast<double>(e[i] * inv);
}

// reference.sample_from_probs: the first token whose float64 cumulative mass exceeds u * total,
// or the last token with positive mass if rounding leaves none.
int64_t sample_from_probs(const double* p, int64_t V, double u) {
  double total = 0.0;
  for (int64_t i = 0; i < V; ++i) total += p[i];
  const double threshold = u * total;
  double cdf = 0.0;
  int64_t t = V;
  for (int64_t i = 0; i < V; ++i) {
    cdf += p[i];
    if (cdf > threshold) {
      t = i;
      break;
    }
  }
  if (t >= V || p[t] <= 0.0) {
    for (t = V - 1; t > 0 && !(p[t] > 0.0); --t) {
    }
  }
  return t;
}

// q <- draft_probs row as float64; false if any entry is non-finite or negative.
bool load_draft_probs(const at::Tensor& draft_probs, int64_t b, int64_t node, int64_t V, double* q) {
  bool ok = true;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, draft_probs.scalar_type(), "verify_draft_probs", [&] {
    const scalar_t* row = draft_probs.data_ptr<scalar_t>() + b * draft_probs.stride(0) + node * draft_probs.stride(1);
    for (int64_t i = 0; i < V; ++i) {
      q[i] = static_cast<double>(static_cast<float>(row[i]));
      ok = ok && std::isfinite(q[i]) && q[i] >= 0.0;
    }
  });
  return ok;
}

struct RowIO {
  const Processing* proc;   // the row's logit processing
  const int64_t* parents;   // [N]
  const int64_t* tokens;    // [N]
  const float* uniform;     // [N]
  int64_t num_real;         // nodes [0, num_real) are real, the rest padding (draft id -1)
  int64_t* accept_len;      // scalar
  int64_t* accept_index;    // [N]
  int64_t* output;          // [N]
};

template <typename T>
void verify_row(const T* logits, int64_t s0, int64_t s1, const at::Tensor* draft_probs, int64_t b, int64_t N,
                int64_t V, bool greedy, const Sampling& s, const RowIO& io, Scratch& w) {
  int64_t node = 0, n_acc = 0, n_out = 0;
  int64_t path[kMaxTreeNodes], emitted[kMaxTreeNodes];
  path[0] = 0;
  bool valid = true;
  const Processing& pr = *io.proc;
  int64_t path_tokens[kMaxTreeNodes];
  while (true) {
    const T* raw = logits + b * s0 + node * s1;
    int64_t argmax = 0;
    if (pr.active) {  // this node's processed logits replace the raw ones from here on
      for (int64_t k = 1; k <= n_acc; ++k) path_tokens[k - 1] = io.tokens[path[k]];
      const int32_t* mask_row = pr.bitmask != nullptr ? pr.bitmask + node * pr.words : nullptr;
      if (!process_node(raw, V, pr, mask_row, path_tokens, n_acc, w.y.data()) ||
          !scan_logits(w.y.data(), V, &argmax)) {
        valid = false;
        break;
      }
    } else if (!scan_logits(raw, V, &argmax)) {
      valid = false;
      break;
    }
    if (greedy) {
      int64_t next = -1;
      for (int64_t c = node + 1; c < io.num_real && next < 0; ++c)
        if (io.parents[c] == node && io.tokens[c] == argmax) next = c;
      emitted[n_out++] = argmax;
      if (next < 0) break;
      path[++n_acc] = next;
      node = next;
      continue;
    }
    if (pr.active) {
      target_probs(w.y.data(), V, s, w);
    } else {
      target_probs(raw, V, s, w);
    }
    double* p = w.p.data();
    bool has_children = false;
    for (int64_t c = node + 1; c < io.num_real; ++c) has_children = has_children || io.parents[c] == node;
    double* q = nullptr;
    if (draft_probs != nullptr && has_children) {
      q = w.q.data();
      if (!load_draft_probs(*draft_probs, b, node, V, q)) {
        valid = false;
        break;
      }
    }
    int64_t next = -1;
    for (int64_t c = node + 1; c < io.num_real; ++c) {
      if (io.parents[c] != node) continue;
      const int64_t x = io.tokens[c];
      const double qx = q == nullptr ? 1.0 : q[x];
      if (static_cast<double>(io.uniform[c]) * qx < p[x]) {
        next = c;
        break;
      }
      // Rejected: p <- normalise(max(0, p - q)) (point mass: p(x) <- 0), kept if no mass is left.
      double* r = w.r.data();
      double rs = 0.0;
      if (q == nullptr) {
        for (int64_t i = 0; i < V; ++i) {
          r[i] = i == x ? 0.0 : p[i];
          rs += r[i];
        }
      } else {
        for (int64_t i = 0; i < V; ++i) {
          r[i] = std::max(p[i] - q[i], 0.0);
          rs += r[i];
        }
        q[x] = 0.0;  // siblings are drawn without replacement: remove x from q and renormalise
        double qs = 0.0;
        for (int64_t i = 0; i < V; ++i) qs += q[i];
        if (qs > 0.0)
          for (int64_t i = 0; i < V; ++i) q[i] /= qs;
      }
      if (rs > 0.0)
        for (int64_t i = 0; i < V; ++i) p[i] = r[i] / rs;
    }
    if (next < 0) {
      emitted[n_out++] = sample_from_probs(p, V, static_cast<double>(io.uniform[0]));
      break;
    }
    emitted[n_out++] = io.tokens[next];
    path[++n_acc] = next;
    node = next;
  }
  for (int64_t i = 0; i < N; ++i) {
    io.accept_index[i] = -1;
    io.output[i] = -1;
  }
  if (!valid) {
    *io.accept_len = -1;
    return;
  }
  *io.accept_len = n_acc;
  for (int64_t i = 0; i <= n_acc; ++i) io.accept_index[i] = path[i];
  for (int64_t i = 0; i < n_out; ++i) io.output[i] = emitted[i];
}

// Row b of a float32 or float64 [B] tensor, exactly.
double real_at(const at::Tensor& t, int64_t b) {
  return t.scalar_type() == c10::kDouble ? t.data_ptr<double>()[b * t.stride(0)]
                                         : static_cast<double>(t.data_ptr<float>()[b * t.stride(0)]);
}

// Each row's sampling parameters from the checked tensors; raises on a bad value, naming the row.
std::vector<Sampling> row_sampling(const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                                   const std::optional<at::Tensor>& min_p, int64_t B) {
  std::vector<Sampling> rows(static_cast<size_t>(B));
  const int64_t* k = top_k.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    Sampling& s = rows[static_cast<size_t>(b)];
    s.temperature = real_at(temperature, b);
    s.top_k = k[b * top_k.stride(0)];
    s.top_p = real_at(top_p, b);
    TORCH_CHECK(std::isfinite(s.temperature) && s.temperature >= 0.0,
                "verify: temperature must be a finite number >= 0 (0 = greedy), got ", s.temperature,
                " at temperature[", b, "]");
    TORCH_CHECK(s.top_k >= 0, "verify: top_k must be >= 0 (0 disables top-k), got ", s.top_k, " at top_k[", b, "]");
    TORCH_CHECK(s.top_p > 0.0 && s.top_p <= 1.0, "verify: top_p must be in (0, 1] (1 disables top-p), got ", s.top_p,
                " at top_p[", b, "]");
    s.min_p = min_p.has_value() ? real_at(*min_p, b) : 0.0;
    TORCH_CHECK(s.min_p >= 0.0 && s.min_p <= 1.0, "verify: min_p must be in [0, 1] (0 = off), got ", s.min_p,
                " at min_p[", b, "]");
  }
  return rows;
}

// Each row's logit processing from the checked tensors (contiguous, kept alive by the caller);
// raises on a bad value, naming the row (or the entry of output_counts).
std::vector<Processing> row_processing(const at::Tensor* counts, const at::Tensor* prompt, const at::Tensor* bias,
                                       const at::Tensor* bitmask, const std::optional<at::Tensor>& presence,
                                       const std::optional<at::Tensor>& frequency,
                                       const std::optional<at::Tensor>& repetition, int64_t B, int64_t N, int64_t V) {
  std::vector<Processing> rows(static_cast<size_t>(B));
  const int64_t W = (V + 31) / 32;
  for (int64_t b = 0; b < B; ++b) {
    Processing& pr = rows[static_cast<size_t>(b)];
    if (counts != nullptr) {
      pr.counts = counts->data_ptr<int32_t>() + b * V;
      for (int64_t v = 0; v < V; ++v)
        TORCH_CHECK(pr.counts[v] >= 0, "verify: output_counts must be >= 0 (how often each token was generated), got ",
                    pr.counts[v], " at output_counts[", b, ", ", v, "]");
    }
    if (prompt != nullptr) pr.prompt = prompt->data_ptr<bool>() + b * V;
    if (bias != nullptr) pr.bias = bias->data_ptr<float>() + b * V;
    if (bitmask != nullptr) {
      pr.bitmask = bitmask->data_ptr<int32_t>() + b * N * W;
      pr.words = W;
    }
    if (presence.has_value()) {
      const double p = real_at(*presence, b);
      TORCH_CHECK(p >= -2.0 && p <= 2.0, "verify: presence_penalty must be in [-2, 2] (0 = off), got ", p,
                  " at presence_penalty[", b, "]");
      pr.presence = static_cast<float>(p);
    }
    if (frequency.has_value()) {
      const double f = real_at(*frequency, b);
      TORCH_CHECK(f >= -2.0 && f <= 2.0, "verify: frequency_penalty must be in [-2, 2] (0 = off), got ", f,
                  " at frequency_penalty[", b, "]");
      pr.frequency = static_cast<float>(f);
    }
    if (repetition.has_value()) {
      const double r = real_at(*repetition, b);
      TORCH_CHECK(std::isfinite(r) && r > 0.0, "verify: repetition_penalty must be a finite number > 0 (1 = off), got ",
                  r, " at repetition_penalty[", b, "]");
      pr.repetition = static_cast<float>(r);
    }
    pr.active = pr.bias != nullptr || pr.bitmask != nullptr || pr.presence != 0.0f || pr.frequency != 0.0f ||
                pr.repetition != 1.0f;
  }
  return rows;
}

void verify_cpu(const at::Tensor& target_logits_in, const at::Tensor& parents_in, const at::Tensor& draft_token_ids_in,
                const std::optional<at::Tensor>& draft_probs_in, const at::Tensor& uniform_in,
                const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                const at::Tensor& accept_len, const at::Tensor& accept_index, const at::Tensor& output_token_ids,
                const std::optional<at::Tensor>& output_counts, const std::optional<at::Tensor>& prompt_mask,
                const std::optional<at::Tensor>& presence_penalty, const std::optional<at::Tensor>& frequency_penalty,
                const std::optional<at::Tensor>& repetition_penalty, const std::optional<at::Tensor>& logit_bias,
                const std::optional<at::Tensor>& min_p, const std::optional<at::Tensor>& token_bitmask) {
  const VerifyDims d = check_verify_args(target_logits_in, parents_in, draft_token_ids_in, draft_probs_in, uniform_in,
                                         temperature, top_k, top_p, accept_len, accept_index, output_token_ids,
                                         c10::DeviceType::CPU);
  check_verify_processing(d, target_logits_in, output_counts, prompt_mask, presence_penalty, frequency_penalty,
                          repetition_penalty, logit_bias, min_p, token_bitmask);
  const int64_t B = d.B, N = d.N, V = d.V;
  if (B == 0) return;
  // Rows only need a contiguous vocab dim; other strides are used as given.
  const at::Tensor target_logits = target_logits_in.stride(2) == 1 ? target_logits_in : target_logits_in.contiguous();
  std::optional<at::Tensor> draft_probs;
  if (draft_probs_in.has_value())
    draft_probs = draft_probs_in->stride(2) == 1 ? *draft_probs_in : draft_probs_in->contiguous();
  const at::Tensor parents = parents_in.contiguous();
  const at::Tensor tokens = draft_token_ids_in.contiguous();
  const at::Tensor uniform = uniform_in.contiguous();
  const int64_t* par = parents.data_ptr<int64_t>();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  check_parents_host("verify", par, B, N);
  // Draft ids: a token in [0, V) or -1 (padding), the padding after the row's real nodes.
  std::vector<int64_t> num_real(static_cast<size_t>(B), N);
  for (int64_t b = 0; b < B; ++b) {
    int64_t first_pad = N;
    for (int64_t i = 1; i < N; ++i) {
      const int64_t t = tok[b * N + i];
      if (t == -1) {
        first_pad = std::min(first_pad, i);
        continue;
      }
      TORCH_CHECK(t >= 0 && t < V, "verify: draft_token_ids[", b, ", ", i, "] = ", t,
                  " is not a token id in [0, V = ", V, ") (or -1: padding)");
      TORCH_CHECK(first_pad == N, "verify: draft_token_ids[", b, ", ", first_pad,
                  "] = -1 (padding) comes before the real token draft_token_ids[", b, ", ", i, "] = ", t,
                  ": a row's padding nodes must come after its real nodes");
    }
    num_real[static_cast<size_t>(b)] = first_pad;
  }
  const std::vector<Sampling> rows = row_sampling(temperature, top_k, top_p, min_p, B);
  // Logit processing: contiguous copies only where the caller's tensors are not (the usual case: none).
  at::Tensor counts_c, prompt_c, bias_c, bitmask_c;
  if (output_counts.has_value()) counts_c = output_counts->contiguous();
  if (prompt_mask.has_value()) prompt_c = prompt_mask->contiguous();
  if (logit_bias.has_value()) bias_c = logit_bias->contiguous();
  if (token_bitmask.has_value()) bitmask_c = token_bitmask->contiguous();
  const std::vector<Processing> procs = row_processing(
      counts_c.defined() ? &counts_c : nullptr, prompt_c.defined() ? &prompt_c : nullptr,
      bias_c.defined() ? &bias_c : nullptr, bitmask_c.defined() ? &bitmask_c : nullptr, presence_penalty,
      frequency_penalty, repetition_penalty, B, N, V);
  const float* uni = uniform.data_ptr<float>();
  int64_t* alen = accept_len.data_ptr<int64_t>();
  int64_t* aidx = accept_index.data_ptr<int64_t>();
  int64_t* out = output_token_ids.data_ptr<int64_t>();
  const at::Tensor* dp = draft_probs.has_value() ? &*draft_probs : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, target_logits.scalar_type(), "verify_cpu", [&] {
    const scalar_t* logits = target_logits.data_ptr<scalar_t>();
    const int64_t s0 = target_logits.stride(0), s1 = target_logits.stride(1);
    // A row costs O(V) per visited node: parallelise over rows, several per task when V is small.
    const int64_t grain = std::max<int64_t>(1, 4096 / V);
    at::parallel_for(0, B, grain, [&](int64_t begin, int64_t end) {
      static thread_local Scratch w;
      for (int64_t b = begin; b < end; ++b) {
        const Sampling& s = rows[static_cast<size_t>(b)];
        const Processing& pr = procs[static_cast<size_t>(b)];
        const bool greedy = s.temperature == 0.0;
        if (!greedy) w.reserve(V, s.top_k > 0 || s.top_p < 1.0, dp != nullptr);
        if (pr.active) w.reserve_processed(V);
        const RowIO io{&pr, par + b * N, tok + b * N, uni + b * N, num_real[static_cast<size_t>(b)], alen + b,
                       aidx + b * N, out + b * N};
        verify_row(logits, s0, s1, dp, b, N, V, greedy, s, io, w);
      }
    });
  });
}

}  // namespace
}  // namespace turbospec

TORCH_LIBRARY_IMPL(turbospec, CPU, m) { m.impl("verify", &turbospec::verify_cpu); }
