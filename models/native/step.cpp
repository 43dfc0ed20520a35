// The CPU decode step of `LiveSpeech2.step` as one native call (models/native_step.py).
//
// Why: on a CPU the step is a few small matmuls between ~100 small elementwise ops a
// layer, and the elementwise ops, their dispatch and their temporaries cost as much as
// the math (docs/loadtest.md). Here every elementwise part is a loop over a session's
// rows, fused with its neighbours: the embedding sum, the layer norms, the Mamba conv
// and state update with its read-out and gate, and the attention (query rotation,
// scores, softmax, weighted values) for one session and head at a time. The matmuls stay
// with the libraries (MKL's sgemm, fbgemm's int8 GEMM). The attention reads only the
// keys a session sees (its enrollment and the text slots its window shows), only their
// non-zero halves (the layout of `DecodeStateView`: enrollment keys in the first half of
// the last dim, rotated text keys in the second, zeros elsewhere), and one copy of the
// enrollment for the rows that share a voice.
#include <torch/extension.h>
#include <ATen/native/quantized/PackedParams.h>
#include <ATen/record_function.h>
#include <torch/csrc/jit/api/object.h>

#include <vector>

#include "kernels.h"

namespace {

using at::Tensor;
using namespace livespeech_native;

// ---------------------------------------------------------------- the loops

// out [rows, d] = LayerNorm(x) (biased variance, as torch's)
LS_KERNEL void norm_rows(const float* x, float* out, const float* w, const float* b, float eps, int64_t rows,
                         int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * d;
    const float mean = sum(row, d) / d;
    float lane[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= d; i += kLanes)
      for (int j = 0; j < kLanes; ++j) lane[j] += (row[i + j] - mean) * (row[i + j] - mean);
    for (int j = 0; i + j < d; ++j) lane[j] += (row[i + j] - mean) * (row[i + j] - mean);
    const float inv = 1.f / std::sqrt(tree_sum(lane) / d + eps);
    float* o = out + r * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) o[i] = (row[i] - mean) * inv * w[i] + b[i];
  }
}

// Each row of x [rows, n] scaled to a largest magnitude of 1 into out; scales[r] its
// largest magnitude, NaN where the row is not finite (its out row zeros).
LS_KERNEL void scale_rows(const float* x, float* out, float* scales, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * n;
    // the largest magnitude, and x * 0 summed: NaN where any x is NaN or infinite
    float top[kLanes] = {}, zero[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
      for (int j = 0; j < kLanes; ++j) {
        const float a = std::fabs(row[i + j]);
        top[j] = a > top[j] ? a : top[j];
        zero[j] += row[i + j] * 0.f;
      }
    for (int j = 0; i + j < n; ++j) {
      const float a = std::fabs(row[i + j]);
      top[j] = a > top[j] ? a : top[j];
      zero[j] += row[i + j] * 0.f;
    }
    float m = 0.f;
    for (int j = 0; j < kLanes; ++j) m = top[j] > m ? top[j] : m;
    const bool finite = tree_sum(zero) == 0.f;
    scales[r] = finite ? m : std::numeric_limits<float>::quiet_NaN();
    float* o = out + r * n;
    if (!finite) {  // zeros: fbgemm's range of the call must stay finite
      std::memset(o, 0, n * sizeof(float));
      continue;
    }
    const float inv = m > 0.f ? 1.f / m : 0.f;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) o[i] = row[i] * inv;
  }
}

// y [rows, n] = y * scales[r] (+ bias)
LS_KERNEL void unscale_rows(float* y, const float* scales, const float* bias, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = y + r * n;
    const float k = scales[r];
    if (bias) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) row[i] = row[i] * k + bias[i];
    } else {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) row[i] *= k;
    }
  }
}

// A state tensor's rows for one layer: row r's block at data + r * stride, its inner dims
// contiguous (a slice of the state's slots, or a gathered copy).
struct StateRows {
  float* data;
  int64_t stride;
};

// The depthwise causal conv's step for one row: each channel's window shifted left by
// one with x appended, out = window . weight + bias. K: the window's length where it is
// known when compiled (the default model's 4), 0: `k`, at run time.
template <int K>
inline void conv_row(int64_t k, float* window, const float* x, const float* w, const float* b, float* out,
                     int64_t channels) {
  const int64_t n = K > 0 ? K : k;
  for (int64_t c = 0; c < channels; ++c) {
    float* s = window + c * n;
    const float* wc = w + c * n;
    float acc = b ? b[c] : 0.f;
#pragma GCC unroll 8
    for (int64_t j = 0; j + 1 < n; ++j) s[j] = s[j + 1];
    s[n - 1] = x[c];
#pragma GCC unroll 8
    for (int64_t j = 0; j < n; ++j) acc += s[j] * wc[j];
    out[c] = acc;
  }
}

// ... for every row, then out = silu(out). x [rows, x_stride].
LS_KERNEL void conv_rows(StateRows state, int64_t k, const float* x, int64_t x_stride, const float* w,
                         const float* b, float* out, int64_t rows, int64_t channels) {
  for (int64_t r = 0; r < rows; ++r) {
    float* window = state.data + r * state.stride;
    float* o = out + r * channels;
    if (k == 4)
      conv_row<4>(k, window, x + r * x_stride, w, b, o, channels);
    else
      conv_row<0>(k, window, x + r * x_stride, w, b, o, channels);
#pragma omp simd
    for (int64_t c = 0; c < channels; ++c) o[c] = silu(o[c]);
  }
}

// Mamba's selective-state step for one row: for each channel c, its m states
// state[c] = state[c] * 2^(dt[c] a2[c]) + dt[c] x[c] B; y[c] = state[c] . C + D[c] x[c].
LS_INLINE void ssm_row(int64_t m, float* state, const float* a2, const float* dt, const float* x, const float* bv,
                       const float* cv, const float* d_skip, float* y, int64_t channels) {
  for (int64_t c = 0; c < channels; ++c) {
    float* s = state + c * m;
    const float* a = a2 + c * m;
    const float d = dt[c], dx = d * x[c];
    float lane[kLanes] = {};
    for (int64_t j = 0; j < m; ++j) {
      const float v = s[j] * exp2_fast(d * a[j]) + dx * bv[j];
      s[j] = v;
      lane[j % kLanes] += v * cv[j];
    }
    y[c] = tree_sum(lane) + x[c] * d_skip[c];
  }
}

// ssm_row for 16 states a channel (the default model's), 8 channels at a time (channels a
// multiple of 8): each channel's two vectors of states updated, then the 8 channels' y
// from one transposing reduction (one reduction across lanes a channel had cost more
// than its update).
LS_INLINE void ssm_row16(float* state, const float* a2, const float* dt, const float* x, const float* bv,
                         const float* cv, const float* d_skip, float* y, int64_t channels) {
  const v8 b0 = load8(bv), b1 = load8(bv + 8), c0 = load8(cv), c1 = load8(cv + 8);
  for (int64_t c = 0; c < channels; c += 8) {
    v8 parts[8];
    for (int i = 0; i < 8; ++i) {
      float* s = state + (c + i) * 16;
      const float* a = a2 + (c + i) * 16;
      const float di = dt[c + i], dxi = di * x[c + i];
      const v8 d = {di, di, di, di, di, di, di, di}, dx = {dxi, dxi, dxi, dxi, dxi, dxi, dxi, dxi};
      const v8 s0 = load8(s) * exp2_fast_of<v8, v8i>(d * load8(a)) + dx * b0;
      const v8 s1 = load8(s + 8) * exp2_fast_of<v8, v8i>(d * load8(a + 8)) + dx * b1;
      store8(s, s0);
      store8(s + 8, s1);
      parts[i] = s0 * c0 + s1 * c1;
    }
    store8(y + c, lane_sums8(parts) + load8(x + c) * load8(d_skip + c));
  }
}

// ... for every row, its dt = softplus(dbc's first `rank` columns . w_dt + b_dt) first
// (w_dt [rank, channels]; fused here, where torch's softplus alone took a third of the
// state update's time), then y *= silu(z). dbc [rows, dbc_stride]: dt's input, then B,
// then C from column `b_at`; z [rows, z_stride]; dt: scratch [channels].
LS_KERNEL void ssm_rows(StateRows state, int64_t n, const float* a2, const float* w_dt, const float* b_dt,
                        int64_t rank, const float* x, const float* dbc, int64_t dbc_stride, int64_t b_at,
                        const float* d_skip, const float* z, int64_t z_stride, float* y, int64_t rows,
                        int64_t channels, float* dt) {
  for (int64_t r = 0; r < rows; ++r) {
    float* st = state.data + r * state.stride;
    const float* dr = dbc + r * dbc_stride;
    std::memcpy(dt, b_dt, channels * sizeof(float));
    for (int64_t k = 0; k < rank; ++k) {
      const float a = dr[k];
      const float* wk = w_dt + k * channels;
#pragma omp simd
      for (int64_t c = 0; c < channels; ++c) dt[c] += a * wk[c];
    }
#pragma omp simd
    for (int64_t c = 0; c < channels; ++c) dt[c] = softplus(dt[c]);
    const float* bv = dr + b_at;
    const float* xr = x + r * channels;
    float* yr = y + r * channels;
    if (n == 16 && channels % 8 == 0)
      ssm_row16(st, a2, dt, xr, bv, bv + n, d_skip, yr, channels);
    else
      ssm_row(n, st, a2, dt, xr, bv, bv + n, d_skip, yr, channels);
    const float* zr = z + r * z_stride;
#pragma omp simd
    for (int64_t c = 0; c < channels; ++c) yr[c] *= silu(zr[c]);
  }
}

// What one layer's attention reads for the batch.
struct Memory {
  const float* k;  // the layer's keys: row r, head h, slot j at k + r * row + h * head + j * 2 hd
  const float* v;  // values: ... + j * hd
  int64_t k_row, k_head, v_row, v_head;
};

// o [rows, heads * hd] = each head's softmax-weighted values over the row's enrollment
// (read from row enroll_row[r]) and its visible text slots: scores of the query against
// the enrollment's unrotated keys and of RoPE(query, t) against the text's rotated keys
// (cos / sin [rows, hd / 2], the query frame's angles).
LS_KERNEL void attend_rows(Memory mem, const float* q, const float* cosv, const float* sinv,
                           const int32_t* visible, const int64_t* visible_at, const int64_t* enroll_row,
                           int64_t n_enroll, int64_t heads, int64_t hd, float* o, int64_t rows, float* scratch) {
  const int64_t half = hd / 2, d = heads * hd;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  float* rot = scratch;  // [hd]
  float* out = scratch + hd;  // [hd]
  float* scores = scratch + 2 * hd;  // [n_enroll + the most visible slots]
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* vis = visible + visible_at[r];
    const int64_t n_text = visible_at[r + 1] - visible_at[r];
    const int64_t m = n_enroll + n_text;
    const float* cs = cosv + r * half;
    const float* sn = sinv + r * half;
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = q + r * d + h * hd;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        rot[i] = qh[i] * cs[i] - qh[i + half] * sn[i];
        rot[i + half] = qh[i + half] * cs[i] + qh[i] * sn[i];
      }
      const float* ktext = mem.k + r * mem.k_row + h * mem.k_head + hd;
      const float* vtext = mem.v + r * mem.v_row + h * mem.v_head;
      const float* kenr = mem.k + enroll_row[r] * mem.k_row + h * mem.k_head;
      const float* venr = mem.v + enroll_row[r] * mem.v_row + h * mem.v_head;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < m; ++j) {
        const bool text = j >= n_enroll;
        const float* k = text ? ktext + vis[j - n_enroll] * 2 * hd : kenr + j * 2 * hd;
        scores[j] = dot(k, text ? rot : qh, hd) * scale;
        mx = scores[j] > mx ? scores[j] : mx;
      }
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) scores[j] = exp2_fast((scores[j] - mx) * kLog2e);
      const float total = sum(scores, m);
      for (int64_t i = 0; i < hd; ++i) out[i] = 0.f;
      for (int64_t j = 0; j < m; ++j) {
        const float* v = j >= n_enroll ? vtext + vis[j - n_enroll] * hd : venr + j * hd;
        const float w = scores[j];
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i) out[i] += w * v[i];
      }
      float* dst = o + r * d + h * hd;
      const float inv = 1.f / total;
#pragma omp simd
      for (int64_t i = 0; i < hd; ++i) dst[i] = out[i] * inv;
    }
  }
}

// ---------------------------------------------------------------- the model

// A linear layer as the step runs it (models/derived.py `matmul_t`): a transposed dense
// weight [in, out] (float32 or bfloat16), or fbgemm's packed int8 weight.
struct Linear {
  Tensor w_t;  // undefined with a packed weight
  Tensor bias;  // may be undefined
  c10::intrusive_ptr<LinearPackedParamsBase> packed;
  bool reduce_range = false;

  // y [B, out] = x [B, in] W^T + bias. The int8 path scales each row to a largest
  // magnitude of 1 before fbgemm (which quantises a call with one scale) and back
  // after, so each session gets the whole int8 range and a non-finite row stays its own.
  Tensor operator()(const Tensor& x) const {
    if (packed) {
      const int64_t b = x.size(0);
      Tensor scaled = at::empty_like(x);
      std::vector<float> scales(b);
      scale_rows(x.data_ptr<float>(), scaled.data_ptr<float>(), scales.data(), b, x.size(1));
      Tensor y = packed->apply_dynamic(scaled, reduce_range);
      unscale_rows(y.data_ptr<float>(), scales.data(), bias.defined() ? bias.data_ptr<float>() : nullptr, b,
                   y.size(1));
      return y;
    }
    if (w_t.scalar_type() != x.scalar_type()) {
      Tensor y = at::mm(x.to(w_t.scalar_type()), w_t).to(x.scalar_type());
      return bias.defined() ? y.add_(bias) : y;
    }
    return bias.defined() ? at::addmm(bias, x, w_t) : at::mm(x, w_t);
  }
};

struct Norm {
  Tensor weight, bias;
  float eps;

  void operator()(const Tensor& x, Tensor& out) const {
    norm_rows(x.data_ptr<float>(), out.data_ptr<float>(), weight.data_ptr<float>(), bias.data_ptr<float>(), eps,
              x.size(0), x.size(1));
  }
};

struct Layer {
  Norm norm1, norm2;
  Linear in_proj, out_proj;
  Tensor conv_w;  // [d_inner, d_conv]
  Tensor conv_b;  // [d_inner] or undefined
  Tensor x_proj_t;  // [d_inner, dt_rank + 2 d_state]
  Tensor dt_proj_t, dt_bias;  // [dt_rank, d_inner], [d_inner]
  Tensor a2;  // [d_inner, d_state]: -exp(A_log) * log2(e)
  Tensor d_skip;  // [d_inner]
  Linear q_proj, attn_out;  // the attention's query and output projections, [D, D] each
};

// What every layer of one step reads besides its weights.
struct Batch {
  Tensor conv, ssm, mem_k, mem_v;  // [layers, B, ...]
  std::vector<float> cosv, sinv;  // [B, hd / 2]
  std::vector<int32_t> visible;  // each row's visible text slots (their memory slot), concatenated
  std::vector<int64_t> visible_at;  // [B + 1]: row r's at visible[visible_at[r] .. visible_at[r + 1]]
  std::vector<int64_t> enroll_row;  // [B]: the row whose enrollment memory row r reads
  std::vector<float> scratch;  // the attention's per-head scratch
  std::vector<float> dt;  // a row's dt in the state update [d_inner]
};

class NativeStep {
 public:
  NativeStep(int64_t d_model, int64_t n_heads, int64_t d_state, int64_t d_conv, int64_t dt_rank,
             int64_t n_enroll, double rope_base, Tensor embedding, Tensor offsets,
             c10::optional<Tensor> phone_embedding, std::vector<std::vector<int64_t>> group_layers,
             std::vector<int64_t> head_sizes)
      : d_(d_model), heads_(n_heads), hd_(d_model / n_heads), d_state_(d_state), d_conv_(d_conv),
        dt_rank_(dt_rank), n_enroll_(n_enroll), embedding_(embedding.contiguous()),
        offsets_(offsets.to(at::kLong).contiguous()),
        phone_embedding_(phone_embedding ? phone_embedding->contiguous() : Tensor()),
        group_layers_(std::move(group_layers)), head_sizes_(std::move(head_sizes)) {
    TORCH_CHECK(hd_ % 2 == 0 && hd_ * heads_ == d_, "the heads must split the model's width evenly");
    inv_freq_.resize(hd_ / 2);
    for (int64_t i = 0; i < hd_ / 2; ++i)
      inv_freq_[i] = static_cast<float>(std::pow(rope_base, -static_cast<double>(2 * i) / hd_));
  }

  void add_layer(Layer layer) { layers_.push_back(std::move(layer)); }
  void add_group(Norm norm, Linear heads) {
    group_norms_.push_back(std::move(norm));
    group_heads_.push_back(std::move(heads));
  }

  // `LiveSpeech2.step` for B sessions: inputs [B, K] long, frame [B] long, conv [layers,
  // B, d_inner, d_conv], ssm [layers, B, d_inner, d_state] (both updated in place),
  // mem_k [layers, B, H, M, 2 hd], mem_v [layers, B, H, M, hd] (M >= n_enroll + L),
  // text_mask [B, L] bool, phones [B] long (-1: none) or None, voices [B] long (rows with
  // equal values hold one voice's enrollment memory) or None. Returns (graphemes [B, G],
  // acoustic [B, Q, codebook]) in float32.
  std::vector<Tensor> step(const Tensor& inputs, const Tensor& frame, const Tensor& conv, const Tensor& ssm,
                           const Tensor& mem_k, const Tensor& mem_v, const Tensor& text_mask,
                           const c10::optional<Tensor>& phones, const c10::optional<Tensor>& voices) {
    TORCH_CHECK(conv.scalar_type() == at::kFloat && ssm.scalar_type() == at::kFloat &&
                    mem_k.scalar_type() == at::kFloat && mem_v.scalar_type() == at::kFloat,
                "the native step runs a float32 state");
    TORCH_CHECK(conv.size(3) == d_conv_ && conv.stride(3) == 1 && conv.stride(2) == d_conv_ &&
                    ssm.size(3) == d_state_ && ssm.stride(3) == 1 && ssm.stride(2) == d_state_,
                "the native step needs each session's recurrent state contiguous");
    TORCH_CHECK(mem_k.stride(4) == 1 && mem_v.stride(4) == 1 && mem_k.stride(3) == 2 * hd_ &&
                    mem_v.stride(3) == hd_ && mem_k.size(4) == 2 * hd_ && mem_v.size(4) == hd_,
                "the native step needs each memory slot's key and value contiguous");
    const int64_t b = inputs.size(0), n_text = text_mask.size(1);
    TORCH_CHECK(frame.numel() == b && text_mask.size(0) == b && conv.size(1) == b && ssm.size(1) == b &&
                    mem_k.size(1) == b && mem_v.size(1) == b,
                "the native step's arguments disagree on the batch");
    TORCH_CHECK(mem_k.size(3) >= n_enroll_ + n_text && mem_v.size(3) >= n_enroll_ + n_text,
                "the text mask is longer than the memory");
    const auto opts = at::TensorOptions().dtype(at::kFloat);

    Batch batch{conv, ssm, mem_k, mem_v};
    Tensor h = at::empty({b, d_}, opts);
    {
      RECORD_FUNCTION("step.prepare", std::vector<c10::IValue>());
      prepare(batch, frame.contiguous(), text_mask.contiguous(), voices, b);
      embed(inputs.contiguous(), phones, h);
    }
    const int64_t n_shared = static_cast<int64_t>(layers_.size()) - n_group_layers();
    for (int64_t i = 0; i < n_shared; ++i) layer_step(i, h, batch);

    std::vector<Tensor> logits;
    Tensor hg = at::empty({b, d_}, opts);
    for (size_t g = 0; g < group_layers_.size(); ++g) {
      Tensor branch = h.clone();
      for (int64_t i : group_layers_[g]) layer_step(i, branch, batch);
      RECORD_FUNCTION("step.heads", std::vector<c10::IValue>());
      group_norms_[g](branch, hg);
      logits.push_back(group_heads_[g](hg));
    }
    return split_heads(logits, b);
  }

 private:
  int64_t n_group_layers() const {
    int64_t n = 0;
    for (const auto& g : group_layers_) n += static_cast<int64_t>(g.size());
    return n;
  }

  void prepare(Batch& batch, const Tensor& frame, const Tensor& mask, const c10::optional<Tensor>& voices,
               int64_t b) const {
    const int64_t half = hd_ / 2, n_text = mask.size(1);
    batch.cosv.resize(b * half);
    batch.sinv.resize(b * half);
    const int64_t* fp = frame.data_ptr<int64_t>();
    for (int64_t r = 0; r < b; ++r)
      for (int64_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(fp[r]) * inv_freq_[i];
        batch.cosv[r * half + i] = std::cos(angle);
        batch.sinv[r * half + i] = std::sin(angle);
      }
    const bool* mp = mask.data_ptr<bool>();
    batch.visible_at.assign(1, 0);
    int64_t most = 0;
    for (int64_t r = 0; r < b; ++r) {
      for (int64_t j = 0; j < n_text; ++j)
        if (mp[r * n_text + j]) batch.visible.push_back(static_cast<int32_t>(n_enroll_ + j));
      batch.visible_at.push_back(static_cast<int64_t>(batch.visible.size()));
      most = std::max(most, batch.visible_at[r + 1] - batch.visible_at[r]);
    }
    // the row whose enrollment memory each row reads: the first of the batch with its
    // voice (the same numbers, `DecodeState.reset_slot`), read once from DRAM and then
    // from the cache by every session speaking in it
    batch.enroll_row.resize(b);
    for (int64_t r = 0; r < b; ++r) batch.enroll_row[r] = r;
    if (voices.has_value()) {
      const Tensor v = voices->contiguous();
      TORCH_CHECK(v.scalar_type() == at::kLong && v.numel() == b, "voices: one int64 a row");
      const int64_t* vp = v.data_ptr<int64_t>();
      for (int64_t r = 0; r < b; ++r)
        for (int64_t q = 0; q < r; ++q)
          if (vp[q] == vp[r]) {
            batch.enroll_row[r] = q;
            break;
          }
    }
    batch.scratch.resize(2 * hd_ + n_enroll_ + most);
  }

  void embed(const Tensor& in, const c10::optional<Tensor>& phones, Tensor& h) const {
    const int64_t b = in.size(0), k = in.size(1);
    const int64_t* ip = in.data_ptr<int64_t>();
    const int64_t* off = offsets_.data_ptr<int64_t>();
    const int64_t rows = embedding_.size(0);
    const float* table = embedding_.data_ptr<float>();
    float* hp = h.data_ptr<float>();
    for (int64_t r = 0; r < b; ++r)
      for (int64_t c = 0; c < k; ++c) {
        const int64_t id = ip[r * k + c] + off[c];
        TORCH_CHECK(id >= 0 && id < rows, "an input token outside its codebook");
        const float* e = table + id * d_;
        if (c == 0)
          std::memcpy(hp + r * d_, e, d_ * sizeof(float));
        else
          add_rows(hp + r * d_, e, d_);
      }
    if (phones.has_value() && phone_embedding_.defined()) {
      const Tensor ph = phones->contiguous();
      const int64_t* pp = ph.data_ptr<int64_t>();
      const int64_t none = phone_embedding_.size(0) - 1;
      const float* pt = phone_embedding_.data_ptr<float>();
      for (int64_t r = 0; r < b; ++r) {
        TORCH_CHECK(pp[r] < none, "a phone outside the phone table");
        add_rows(hp + r * d_, pt + (pp[r] >= 0 ? pp[r] : none) * d_, d_);
      }
    }
  }

  // h += Mamba(norm1(h)); h += CrossAttention(norm2(h), memory) for layer li. The
  // `step.*` scopes show in torch.profiler's traces (loadtest/profile_step.py --trace).
  void layer_step(int64_t li, Tensor& h, Batch& batch) const {
    const Layer& L = layers_[li];
    const int64_t b = h.size(0), di = L.d_skip.size(0);
    const auto opts = h.options();
    Tensor xn = at::empty_like(h), x = at::empty({b, di}, opts), y = at::empty({b, di}, opts);
    Tensor xz, dbc, q, o;
    {
      RECORD_FUNCTION("step.in_proj", std::vector<c10::IValue>());
      L.norm1(h, xn);
      xz = L.in_proj(xn);  // [B, 2 di]: x, then z
    }
    const float* xzp = xz.data_ptr<float>();
    {
      RECORD_FUNCTION("step.conv", std::vector<c10::IValue>());
      conv_rows(StateRows{batch.conv.data_ptr<float>() + li * batch.conv.stride(0), batch.conv.stride(1)}, d_conv_,
                xzp, 2 * di, L.conv_w.data_ptr<float>(), L.conv_b.defined() ? L.conv_b.data_ptr<float>() : nullptr,
                x.data_ptr<float>(), b, di);
    }
    {
      RECORD_FUNCTION("step.x_proj", std::vector<c10::IValue>());
      dbc = at::mm(x, L.x_proj_t);  // [B, dt_rank + 2 d_state]
    }
    {
      RECORD_FUNCTION("step.ssm", std::vector<c10::IValue>());
      batch.dt.resize(di);
      ssm_rows(StateRows{batch.ssm.data_ptr<float>() + li * batch.ssm.stride(0), batch.ssm.stride(1)}, d_state_,
               L.a2.data_ptr<float>(), L.dt_proj_t.data_ptr<float>(), L.dt_bias.data_ptr<float>(), dt_rank_,
               x.data_ptr<float>(), dbc.data_ptr<float>(), dbc.size(1), dt_rank_, L.d_skip.data_ptr<float>(),
               xzp + di, 2 * di, y.data_ptr<float>(), b, di, batch.dt.data());
    }
    {
      RECORD_FUNCTION("step.out_proj", std::vector<c10::IValue>());
      add_rows(h.data_ptr<float>(), L.out_proj(y).data_ptr<float>(), b * d_);
    }
    {
      RECORD_FUNCTION("step.q_proj", std::vector<c10::IValue>());
      L.norm2(h, xn);
      q = L.q_proj(xn);
    }
    o = at::empty_like(h);
    const Tensor& k = batch.mem_k;
    const Tensor& v = batch.mem_v;
    {
      RECORD_FUNCTION("step.attend", std::vector<c10::IValue>());
      attend_rows(Memory{k.data_ptr<float>() + li * k.stride(0), v.data_ptr<float>() + li * v.stride(0), k.stride(1),
                         k.stride(2), v.stride(1), v.stride(2)},
                  q.data_ptr<float>(), batch.cosv.data(), batch.sinv.data(), batch.visible.data(),
                  batch.visible_at.data(), batch.enroll_row.data(), n_enroll_, heads_, hd_, o.data_ptr<float>(), b,
                  batch.scratch.data());
    }
    RECORD_FUNCTION("step.attn_out", std::vector<c10::IValue>());
    add_rows(h.data_ptr<float>(), L.attn_out(o).data_ptr<float>(), b * d_);
  }

  // the groups' head outputs [B, their codebooks' sizes summed] -> graphemes [B, G] and
  // acoustic [B, Q, codebook]
  std::vector<Tensor> split_heads(const std::vector<Tensor>& logits, int64_t b) const {
    const int64_t g = head_sizes_[0], cb = head_sizes_.back();
    const int64_t q = static_cast<int64_t>(head_sizes_.size()) - 1;
    Tensor graphemes = at::empty({b, g}, logits[0].options());
    Tensor acoustic = at::empty({b, q, cb}, logits[0].options());
    float* gp = graphemes.data_ptr<float>();
    float* ap = acoustic.data_ptr<float>();
    int64_t k = 0;  // the codebook, over all heads
    for (const Tensor& l : logits) {
      const int64_t w = l.size(1);
      const float* lp = l.data_ptr<float>();
      for (int64_t col = 0; col < w; col += head_sizes_[k], ++k)
        for (int64_t r = 0; r < b; ++r)
          std::memcpy(k == 0 ? gp + r * g : ap + (r * q + k - 1) * cb, lp + r * w + col,
                      head_sizes_[k] * sizeof(float));
    }
    return {graphemes, acoustic};
  }

  int64_t d_, heads_, hd_, d_state_, d_conv_, dt_rank_, n_enroll_;
  Tensor embedding_, offsets_, phone_embedding_;
  std::vector<std::vector<int64_t>> group_layers_;
  std::vector<int64_t> head_sizes_;
  std::vector<float> inv_freq_;
  std::vector<Layer> layers_;
  std::vector<Norm> group_norms_;
  std::vector<Linear> group_heads_;
};

Linear make_linear(c10::optional<Tensor> w_t, c10::optional<Tensor> bias, py::object packed, bool reduce_range) {
  Linear l;
  if (w_t) l.w_t = w_t->contiguous();
  if (bias) l.bias = bias->contiguous();
  if (!packed.is_none()) {
    // a `torch.ScriptObject` holding fbgemm's packed weight: its C++ object in slot 0
    auto obj = py::cast<torch::jit::Object>(packed);
    l.packed = c10::static_intrusive_pointer_cast<LinearPackedParamsBase>(obj._ivalue()->getSlot(0).toCapsule());
  }
  l.reduce_range = reduce_range;
  TORCH_CHECK(l.w_t.defined() || l.packed, "a linear layer needs a weight");
  return l;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_codec(m);
  register_sampler(m);
  py::class_<Linear>(m, "Linear");
  py::class_<Norm>(m, "Norm");
  py::class_<Layer>(m, "Layer");
  m.def("linear", &make_linear, py::arg("w_t"), py::arg("bias"), py::arg("packed"), py::arg("reduce_range"));
  m.def("norm", [](Tensor w, Tensor b, double eps) { return Norm{w.contiguous(), b.contiguous(), static_cast<float>(eps)}; });
  m.def("layer", [](Norm n1, Norm n2, Linear in_proj, Linear out_proj, Tensor conv_w, c10::optional<Tensor> conv_b,
                    Tensor x_proj_t, Tensor dt_proj_t, Tensor dt_bias, Tensor a2, Tensor d_skip, Linear q_proj,
                    Linear attn_out) {
    return Layer{n1, n2, in_proj, out_proj, conv_w.contiguous(), conv_b ? conv_b->contiguous() : Tensor(),
                 x_proj_t.contiguous(), dt_proj_t.contiguous(), dt_bias.contiguous(), a2.contiguous(),
                 d_skip.contiguous(), q_proj, attn_out};
  });
  py::class_<NativeStep>(m, "NativeStep")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, Tensor, Tensor,
                    c10::optional<Tensor>, std::vector<std::vector<int64_t>>, std::vector<int64_t>>())
      .def("add_layer", &NativeStep::add_layer)
      .def("add_group", &NativeStep::add_group)
      .def("step", &NativeStep::step, py::call_guard<py::gil_scoped_release>());
}
