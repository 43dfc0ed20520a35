// A decode step's sampling on the CPU as one native call (models/cpu_sampler.py): the
// grapheme's guided top-k draw and the acoustic codes' top-k draws of every session;
// and the commit of the sampled tokens to the decode state (models/inference.py).
//
// Why: as tensor ops (guidance.py `_step_scores`, TorchScript) a 16-session step's
// sampling ran ~20 small ops on [16, 40] and [128, 1,024] tensors, 0.9 ms of the step on
// a 2-core VM, most of it dispatch. The draw is `guidance._sample_rows`' (the top k sorted,
// ties in index order, the first token whose CDF reaches u times the total) found without
// sorting a row: a row's k-th largest score is at least the k-th largest maximum of its
// 32-score groups, so only the few scores at or above that bound (~30 of 1,024 on the
// default model's logits) are sorted, and only 8-score blocks whose maximum reaches it
// are read a second time.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "kernels.h"

namespace {

using at::Tensor;
using namespace livespeech_native;

constexpr int64_t kBlock = 8;  // scores a block: read again only if its maximum reaches the bound
constexpr int64_t kGroup = 4;  // blocks a group: the bound is the k-th largest group maximum
constexpr float kInf = std::numeric_limits<float>::infinity();

// A candidate token: its score and index.
struct Candidate {
  float score;
  int32_t index;
};

// What one draw needs besides its row, sized for rows of `v` scores (reused row to row).
struct DrawScratch {
  std::vector<float> block_max, group_max, cdf;
  std::vector<Candidate> candidates;
  explicit DrawScratch(int64_t v)
      : block_max((v + kBlock - 1) / kBlock), group_max((block_max.size() + kGroup - 1) / kGroup), cdf(v),
        candidates(v) {}
};

// The inverse-CDF draw at u from the top k of row [v]: the top k sorted (ties in index
// order), the first j whose CDF reaches u times the total. A row whose scores are all
// -inf gets its first index; a row with NaN a token inside the vocabulary.
LS_KERNEL int64_t draw(const float* row, int64_t v, int64_t k, float u, DrawScratch& s) {
  const int64_t kr = std::min(std::max<int64_t>(k, 1), v);
  const int64_t nb = static_cast<int64_t>(s.block_max.size()), full = v / kBlock;
  const int64_t ng = static_cast<int64_t>(s.group_max.size());
  // each block's maximum as a tree of independent maxima; a NaN is not taken
  static_assert(kBlock == 8, "the block maximum's tree is written for 8 scores");
  for (int64_t b = 0; b < full; ++b) {
    const float* x = row + b * kBlock;
    s.block_max[b] = std::max(std::max(std::max(x[0], x[1]), std::max(x[2], x[3])),
                              std::max(std::max(x[4], x[5]), std::max(x[6], x[7])));
  }
  if (full < nb) {  // a last, partial block
    float m = -kInf;
    for (int64_t i = full * kBlock; i < v; ++i) m = std::max(m, row[i]);
    s.block_max[full] = m;
  }
  for (int64_t g = 0; g < ng; ++g) {
    float m = -kInf;
    for (int64_t b = g * kGroup; b < std::min(nb, g * kGroup + kGroup); ++b) m = std::max(m, s.block_max[b]);
    s.group_max[g] = m;
  }
  // the bound: the kr-th largest group maximum (at least kr scores reach it); past ng
  // groups every score is a candidate
  float bound = -kInf;
  if (kr <= ng) {
    for (float& m : s.group_max) m = m == m ? m : -kInf;  // a NaN group as none (a strict order)
    std::nth_element(s.group_max.begin(), s.group_max.begin() + (kr - 1), s.group_max.end(), std::greater<float>());
    bound = s.group_max[kr - 1];
  }
  // the scores reaching the bound, from the blocks whose maximum does; written whether
  // or not they count, which keeps the loop free of branches the scores decide
  Candidate* cand = s.candidates.data();
  int64_t c = 0;
  for (int64_t b = 0; b < nb; ++b) {
    if (!(s.block_max[b] >= bound)) continue;
    for (int64_t i = b * kBlock; i < std::min(v, b * kBlock + kBlock); ++i) {
      cand[c] = Candidate{row[i], static_cast<int32_t>(i)};
      c += row[i] >= bound;
    }
  }
  const int64_t kk = std::min(kr, c);
  if (kk == 0) return 0;  // only NaNs reached the bound
  // higher scores first, a tie by the earlier index (NaN is never a candidate)
  std::partial_sort(cand, cand + kk, cand + c, [](const Candidate& a, const Candidate& b) {
    return a.score > b.score || (a.score == b.score && a.index < b.index);
  });
  const float top = cand[0].score;
  if (top == -kInf) return cand[0].index;
  float total = 0.f;
  for (int64_t j = 0; j < kk; ++j) {
    total += std::exp(cand[j].score - top);
    s.cdf[j] = total;
  }
  const float x = u * total;
  int64_t j = 0;
  for (int64_t t = 0; t < kk; ++t) j += s.cdf[t] < x;
  return cand[std::min(j, kk - 1)].index;
}

// whether x [n] and y [m] are all finite: their sum is non-finite iff one of them is
// (finite logits are far from overflowing it)
LS_KERNEL bool all_finite(const float* x, int64_t n, const float* y, int64_t m) {
  return std::isfinite(sum(x, n) + sum(y, m));
}

// out [n] = (x + bias) * t (bias may be null: none)
LS_KERNEL void biased_scaled_copy(const float* x, const float* bias, float t, float* out, int64_t n) {
  if (bias) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = (x[i] + bias[i]) * t;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * t;
  }
}

// [N] tokens: row r's draw from the top k[r] of scores [N, V] at u[r].
Tensor draw_rows(const Tensor& scores, const Tensor& k, const Tensor& u) {
  TORCH_CHECK(scores.dim() == 2 && k.numel() == scores.size(0) && u.numel() == scores.size(0),
              "draw_rows: scores [N, V], k [N], u [N]");
  const Tensor s = scores.to(at::kFloat).contiguous(), kk = k.to(at::kLong).contiguous(),
               uu = u.to(at::kFloat).contiguous();
  const int64_t n = s.size(0), v = s.size(1);
  TORCH_CHECK(v > 0, "draw_rows: rows of no scores");
  Tensor out = at::empty({n}, at::kLong);
  DrawScratch scratch(v);
  const float* sp = s.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r)
    out.data_ptr<int64_t>()[r] = draw(sp + r * v, v, kk.data_ptr<int64_t>()[r], uu.data_ptr<float>()[r], scratch);
  return out;
}

// `guidance.SamplingRows.sample`: (tokens [B, 1 + Q] int64, grapheme first; bad [B]
// bool, the rows whose logits are not finite). g_logits [B, G], a_logits [B, Q, V];
// eos_barred, hard [B] bool; guide [B, G] bool; bonus [B]; k_g, k_a [B] int64; u [B, 1 + Q];
// inv_t [B, 3] (1 / temperature of grapheme, codebook 1, codebooks 2..Q) and greedy
// [B, 3] bool, read when `scaled`; first_code_table [P, V] and first_code_rows [B] int64
// (-1: none), or both None: a row of the table added to a row's codebook 1 first
// (guidance.py `FirstCodeBias`). A bad row's grapheme is drawn from zeros, its codes
// from its logits as they are (each stays in its vocabulary; the row fails anyway).
std::vector<Tensor> sample_step(const Tensor& g_logits, const Tensor& a_logits, const Tensor& eos_barred,
                                const Tensor& guide, const Tensor& bonus, const Tensor& hard, const Tensor& k_g,
                                const Tensor& k_a, const Tensor& u, int64_t eos, const Tensor& inv_t,
                                const Tensor& greedy, bool scaled, const c10::optional<Tensor>& first_code_table,
                                const c10::optional<Tensor>& first_code_rows) {
  TORCH_CHECK(g_logits.dim() == 2 && a_logits.dim() == 3 && a_logits.size(0) == g_logits.size(0),
              "sample_step: g_logits [B, G], a_logits [B, Q, V]");
  const int64_t b = g_logits.size(0), ng = g_logits.size(1), q = a_logits.size(1), v = a_logits.size(2);
  TORCH_CHECK(eos >= 0 && eos < ng && v > 0, "sample_step: EOS outside the graphemes, or no codes");
  TORCH_CHECK(u.dim() == 2 && u.size(0) == b && u.size(1) == 1 + q, "sample_step: u [B, 1 + Q]");
  const Tensor g = g_logits.to(at::kFloat).contiguous(), a = a_logits.to(at::kFloat).contiguous();
  const Tensor barred = eos_barred.to(at::kBool).contiguous(), gd = guide.to(at::kBool).contiguous(),
               hd = hard.to(at::kBool).contiguous(), gr = greedy.to(at::kBool).contiguous();
  const Tensor bn = bonus.to(at::kFloat).contiguous(), it = inv_t.to(at::kFloat).contiguous(),
               uu = u.to(at::kFloat).contiguous();
  const Tensor kg = k_g.to(at::kLong).contiguous(), ka = k_a.to(at::kLong).contiguous();
  TORCH_CHECK(gd.size(0) == b && gd.size(1) == ng && barred.numel() == b && hd.numel() == b && bn.numel() == b &&
                  kg.numel() == b && ka.numel() == b && it.numel() == 3 * b && gr.numel() == 3 * b,
              "sample_step: the rows' settings disagree with the logits");
  TORCH_CHECK(first_code_table.has_value() == first_code_rows.has_value(),
              "sample_step: the first code's bias needs its table and rows");
  Tensor bias_table, bias_rows;
  if (first_code_table.has_value()) {
    bias_table = first_code_table->to(at::kFloat).contiguous();
    bias_rows = first_code_rows->to(at::kLong).contiguous();
    TORCH_CHECK(bias_table.dim() == 2 && bias_table.size(1) == v && bias_rows.numel() == b,
                "sample_step: the first code's bias [P, V] and its rows [B]");
  }
  Tensor tokens = at::empty({b, 1 + q}, at::kLong), bad = at::empty({b}, at::kBool);
  int64_t* tp = tokens.data_ptr<int64_t>();
  const float *gp = g.data_ptr<float>(), *ap = a.data_ptr<float>(), *up = uu.data_ptr<float>();
  const float *bp = bn.data_ptr<float>(), *tp3 = it.data_ptr<float>();
  const bool *guided = gd.data_ptr<bool>(), *greedy3 = gr.data_ptr<bool>();
  DrawScratch g_scratch(ng), a_scratch(v);
  std::vector<float> scores(std::max(ng, v));
  for (int64_t r = 0; r < b; ++r) {
    const float* gr_row = gp + r * ng;
    const float* ar = ap + r * q * v;
    const bool is_bad = !all_finite(gr_row, ng, ar, q * v);
    bad.data_ptr<bool>()[r] = is_bad;
    const float* temps = tp3 + 3 * r;
    const bool* greedy_row = greedy3 + 3 * r;
    const float t_g = scaled ? temps[0] : 1.f;
    for (int64_t j = 0; j < ng; ++j) scores[j] = (is_bad ? 0.f : gr_row[j]) * t_g;
    if (barred.data_ptr<bool>()[r]) scores[eos] = -kInf;
    // Algorithm 1's reweighting in log space: the guiding graphemes + log(1 + lambda); a
    // hard row (lambda inf) keeps only them, unless none is finite
    const bool* guide_row = guided + r * ng;
    bool any = false;
    for (int64_t j = 0; j < ng; ++j) any |= guide_row[j] && scores[j] != -kInf;
    const bool hard_row = hd.data_ptr<bool>()[r] && any;
    for (int64_t j = 0; j < ng; ++j)
      scores[j] = guide_row[j] ? scores[j] + bp[r] : (hard_row ? -kInf : scores[j]);
    const int64_t k_row = scaled && greedy_row[0] ? 1 : kg.data_ptr<int64_t>()[r];
    tp[r * (1 + q)] = draw(scores.data(), ng, k_row, up[r * (1 + q)], g_scratch);
    for (int64_t c = 0; c < q; ++c) {
      const float* row = ar + c * v;
      const int64_t which = c == 0 ? 1 : 2;  // codebook 1's temperature, or the others'
      int64_t k = ka.data_ptr<int64_t>()[r];
      const int64_t bias_row = c == 0 && bias_rows.defined() ? bias_rows.data_ptr<int64_t>()[r] : -1;
      TORCH_CHECK(bias_row < (bias_table.defined() ? bias_table.size(0) : 0),
                  "sample_step: a bias row past its table");
      if (scaled || bias_row >= 0) {
        biased_scaled_copy(row, bias_row >= 0 ? bias_table.data_ptr<float>() + bias_row * v : nullptr,
                           scaled ? temps[which] : 1.f, scores.data(), v);
        row = scores.data();
      }
      if (scaled) k = greedy_row[which] ? 1 : k;
      tp[r * (1 + q) + 1 + c] = draw(row, v, k, up[r * (1 + q) + 1 + c], a_scratch);
    }
  }
  return {tokens, bad};
}

// Python's floor modulo (a frame before the first wraps to the ring's end, as torch's %)
inline int64_t floor_mod(int64_t a, int64_t n) { return ((a % n) + n) % n; }

// `DecodeState.commit` (inference.py `_commit`, the same work row by row): step,
// eos_frame [B], ring [B, R, K], inputs [B, K] int64, updated in place; delays, none [K];
// sampled [B, K]. Returns (frames [B, K], the frame index [B], has frame [B], done [B]).
std::vector<Tensor> commit(Tensor step, Tensor eos_frame, Tensor ring, Tensor inputs, const Tensor& delays,
                           const Tensor& none, const Tensor& sampled, int64_t eos, int64_t no_eos) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&step, &eos_frame, &ring, &inputs, &delays, &none,
                                                              &sampled})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->device().is_cpu(), "commit: int64 CPU tensors");
  const int64_t b = sampled.size(0), k = sampled.size(1), r = ring.size(1);
  TORCH_CHECK(step.numel() == b && eos_frame.numel() == b && ring.size(0) == b && ring.size(2) == k &&
                  inputs.size(0) == b && inputs.size(1) == k && delays.numel() == k && none.numel() == k,
              "commit: the decode state disagrees with the sampled tokens");
  auto st = step.accessor<int64_t, 1>(), ef = eos_frame.accessor<int64_t, 1>();
  auto rg = ring.accessor<int64_t, 3>();
  auto in = inputs.accessor<int64_t, 2>();
  auto dl = delays.accessor<int64_t, 1>(), nn = none.accessor<int64_t, 1>();
  auto sp = sampled.accessor<int64_t, 2>();
  Tensor frames = at::empty({b, k}, at::kLong), index = at::empty({b}, at::kLong);
  Tensor has = at::empty({b}, at::kBool), done = at::empty({b}, at::kBool);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t s = st[i];
    if (sp[i][0] == eos && ef[i] == no_eos) ef[i] = s;
    const int64_t e = ef[i];
    for (int64_t c = 0; c < k; ++c) {
      const int64_t f = s - dl[c], last = c == 0 ? e : e - 1;
      const bool valid = f >= 0 && f <= last;
      const int64_t token = valid ? sp[i][c] : nn[c];
      if (valid) rg[i][floor_mod(f, r)][c] = token;
      in[i][c] = token;
    }
    const int64_t d = s - dl[k - 1];
    for (int64_t c = 0; c < k; ++c) frames.data_ptr<int64_t>()[i * k + c] = rg[i][floor_mod(d, r)][c];
    index.data_ptr<int64_t>()[i] = d;
    has.data_ptr<bool>()[i] = d >= 0 && d <= e - 1;
    done.data_ptr<bool>()[i] = d >= e - 1;
    st[i] = s + 1;
  }
  return {frames, index, has, done};
}

}  // namespace

void register_sampler(pybind11::module_& m) {
  m.def("draw_rows", &draw_rows, py::arg("scores"), py::arg("k"), py::arg("u"),
        py::call_guard<py::gil_scoped_release>());
  m.def("sample_step", &sample_step, py::arg("g_logits"), py::arg("a_logits"), py::arg("eos_barred"),
        py::arg("guide"), py::arg("bonus"), py::arg("hard"), py::arg("k_g"), py::arg("k_a"), py::arg("u"),
        py::arg("eos"), py::arg("inv_t"), py::arg("greedy"), py::arg("scaled"), py::arg("first_code_table"),
        py::arg("first_code_rows"), py::call_guard<py::gil_scoped_release>());
  m.def("commit", &commit, py::arg("step"), py::arg("eos_frame"), py::arg("ring"), py::arg("inputs"),
        py::arg("delays"), py::arg("none"), py::arg("sampled"), py::arg("eos"), py::arg("no_eos"),
        py::call_guard<py::gil_scoped_release>());
}
