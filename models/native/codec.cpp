// The streaming codec decoder's step, `CodecModel.decode_step` of started streams, as one
// native call (models/step_graph.py `NativeCodecStep`).
//
// Why: the SEANet decoder's packet is a chain of small convolutions, an LSTM run frame by
// frame and ELUs between them; run op by op (ONNX Runtime, TorchScript) its elementwise
// passes and per-frame dispatch cost a large part of the math (docs/loadtest.md). Here
// the activations are channels-last, [sessions, samples, channels], so each convolution
// (and each transposed one, as its polyphase conv) is one sgemm over every session's
// samples, its rows the input windows; the ELU before a convolution is applied in the
// copy that builds those windows; a residual block's shortcut and its last 1x1 conv
// accumulate into one output; the LSTM's gate maths is one loop after each frame's
// recurrent product. The streaming state is the torch decoder's
// (`SEANetDecoder.stream_init`), read and returned in the same order and layout, so a
// packet decoded here continues one decoded there, and decoding in pieces equals decoding
// whole. Each layer records a `codec.*` scope, so torch.profiler's traces
// (loadtest.profile_step --trace) show them.
#include <torch/extension.h>
#include <ATen/record_function.h>

#include <vector>

#include "kernels.h"

namespace {

using at::Tensor;
using namespace livespeech_native;

// ---------------------------------------------------------------- the loops

// dst = src, or ELU(src)
LS_KERNEL void copy_act(const float* src, float* dst, int64_t n, bool elu_on) {
  if (!elu_on) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = elu(src[i]);
}

// One LSTM frame for `rows` sessions: gates [rows, 4H] (row stride g_stride) in the order
// (i, f, o, g); c [rows, H] updated; h [rows, H] and out (row stride out_stride) the new h.
LS_KERNEL void lstm_cells(const float* gates, int64_t g_stride, float* c, float* h, float* out,
                          int64_t out_stride, int64_t rows, int64_t hid) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gates + r * g_stride;
    float* cr = c + r * hid;
    float* hr = h + r * hid;
    float* o = out + r * out_stride;
#pragma omp simd
    for (int64_t i = 0; i < hid; ++i) {
      const float cv = sigmoid(g[hid + i]) * cr[i] + sigmoid(g[i]) * tanh_fast(g[3 * hid + i]);
      const float hv = sigmoid(g[2 * hid + i]) * tanh_fast(cv);
      cr[i] = cv;
      hr[i] = hv;
      o[i] = hv;
    }
  }
}

// y[r] = x[r * x_step : + n] . w + bias: a convolution to one channel, its windows read
// in place (no window rows to build for a 1-column product)
LS_KERNEL void dot_rows(const float* x, int64_t x_step, const float* w, int64_t n, float bias, float* y,
                        int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) y[r] = dot(x + r * x_step, w, n) + bias;
}

// One block of exactly R rows of `narrow_rows`: the R x N sums in R * N / 8 vector
// registers (as plain arrays, GCC kept a single row's on the stack, every k a store and a
// reload on the sums' dependency chain)
template <int N, int R>
LS_INLINE void narrow_block(const float* x, int64_t xs, int64_t K, const float* w, const float* bias, float* y,
                            int64_t ys, bool acc) {
  constexpr int V = N / 8;
  v8 sums[R][V];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < V; ++j) sums[i][j] = load8(acc ? y + i * ys + 8 * j : bias + 8 * j);
  for (int64_t k = 0; k < K; ++k) {
    v8 wk[V];
    for (int j = 0; j < V; ++j) wk[j] = load8(w + k * N + 8 * j);
    for (int i = 0; i < R; ++i) {
      const float s = x[i * xs + k];
      const v8 v = {s, s, s, s, s, s, s, s};  // a broadcast (0 + s would add as well)
      for (int j = 0; j < V; ++j) sums[i][j] += v * wk[j];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < V; ++j) store8(y + i * ys + 8 * j, sums[i][j]);
}

// The last rows (fewer than R + 1) as one block of exactly that many
template <int N, int R>
LS_INLINE void narrow_last(const float* x, int64_t xs, int64_t rows, int64_t K, const float* w, const float* bias,
                           float* y, int64_t ys, bool acc) {
  if constexpr (R >= 1) {
    if (rows == R)
      narrow_block<N, R>(x, xs, K, w, bias, y, ys, acc);
    else
      narrow_last<N, R - 1>(x, xs, rows, K, w, bias, y, ys, acc);
  }
}

// y[r] = (acc ? y[r] : bias) + x[r * xs : + K] . w, for `rows` rows of N outputs (row
// stride ys); w [K, N]. The windows of a stride-1 conv over a channels-last input overlap,
// row r's starting at input sample r (xs = channels), and are read in place. For the
// decoder's narrow layers (8 to 32 outputs over 8 to 96 inputs: its last two stages),
// where MKL's sgemm ran at a fraction of its speed and its bias broadcast took a pass
// of its own: blocks of R rows share each weight row's loads. Each row's sums are added
// in the same order whatever its block.
template <int N, int R>
LS_INLINE void narrow_rows(const float* x, int64_t xs, int64_t rows, int64_t K, const float* w, const float* bias,
                           float* y, int64_t ys, bool acc) {
  static_assert(N % 8 == 0, "whole vectors of outputs");
  int64_t r = 0;
  for (; r + R <= rows; r += R) narrow_block<N, R>(x + r * xs, xs, K, w, bias, y + r * ys, ys, acc);
  narrow_last<N, R - 1>(x + r * xs, xs, rows - r, K, w, bias, y + r * ys, ys, acc);
}

constexpr bool is_narrow(int64_t n) { return n == 8 || n == 16 || n == 32; }

// A weight [K, N] as N / 16 slabs of 16 columns, each [K, 16] contiguous
// (`slab_gemm_acc`'s layout)
Tensor column_slabs(const Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.size(1) % 16 == 0, "column slabs of a weight [K, 16 n]");
  return w.view({w.size(0), w.size(1) / 16, 16}).permute({1, 0, 2}).contiguous();
}

// y[r] += x[r * xs : + K] . w for `rows` rows (row stride ys), w [K, N] as `column_slabs`.
// For the LSTM's recurrent product, a few sessions' rows against a 1 MB weight, where
// MKL's sgemm repacked the weight on every call (as long at 9 rows as at 16): here each
// slab is read from memory once, then from L1 by every block of 6 rows.
LS_KERNEL void slab_gemm_acc(const float* x, int64_t xs, int64_t rows, int64_t K, const float* slabs, int64_t N,
                             float* y, int64_t ys) {
  for (int64_t n = 0; n < N; n += 16)
    narrow_rows<16, 6>(x, xs, rows, K, slabs + n * K, nullptr, y + n, ys, true);
}

LS_KERNEL void narrow_gemm(const float* x, int64_t xs, int64_t rows, int64_t K, const float* w, const float* bias,
                           float* y, int64_t n, bool acc) {
  switch (n) {
    case 8: narrow_rows<8, 4>(x, xs, rows, K, w, bias, y, n, acc); break;
    case 16: narrow_rows<16, 4>(x, xs, rows, K, w, bias, y, n, acc); break;
    case 32: narrow_rows<32, 2>(x, xs, rows, K, w, bias, y, n, acc); break;
    default: TORCH_CHECK(false, "narrow_gemm: ", n, " outputs");
  }
}

// ---------------------------------------------------------------- the decoder

// A causal convolution of stride 1: weight [k * cin, cout], row j * cin + c the tap j of
// input channel c; its input through ELU first where `elu_in`.
struct Conv {
  Tensor w, bias;
  int64_t k, dilation, cin, cout;
  bool elu_in;
  int64_t context() const { return (k - 1) * dilation; }
};

// A causal transposed convolution as its polyphase convolution over input frames:
// weight [m * cin, stride * cout], column p * cout + o the output channel o of phase p
// (sample j * stride + p); bias [stride * cout].
struct ConvTranspose {
  Tensor w, bias;
  int64_t m, stride, cin, cout;
  bool elu_in;
};

// An LSTM with the input added to its output (SLSTM): per layer W_ih^T [H, 4H],
// W_hh^T [H, 4H] as `column_slabs`, b_ih + b_hh [4H], gates in the order (i, f, o, g).
struct Lstm {
  std::vector<Tensor> w_ih, w_hh, bias;
  int64_t hidden;
};

// ELU -> conv a -> ELU -> 1x1 conv b, plus a 1x1 shortcut (undefined: the identity);
// bias: b's plus the shortcut's.
struct Residual {
  Conv a, b;
  Tensor shortcut, bias;
};

// The state tensors a call reads, in the decoder's order.
struct States {
  const std::vector<Tensor>& in;
  size_t next = 0;
  std::vector<Tensor> out;

  const Tensor& take(int64_t batch, int64_t d1, int64_t d2) {
    TORCH_CHECK(next < in.size(), "the stream state has too few tensors for this decoder");
    const Tensor& t = in[next++];
    TORCH_CHECK(t.dim() == 3 && t.size(0) == batch && t.size(1) == d1 && t.size(2) == d2 &&
                    t.scalar_type() == at::kFloat,
                "a stream state tensor of another shape or type than this decoder's");
    return t;
  }
};

const at::TensorOptions kFloat = at::TensorOptions().dtype(at::kFloat);

// x [B, T, C] with the `ctx` inputs before it from `state` [B, C, ctx] (the ELU applied to
// x where `elu_on`: the state holds inputs already activated): [B, ctx + T, C]; the last
// ctx rows, the next call's state, appended to `states`.
Tensor with_context(const Tensor& x, int64_t ctx, bool elu_on, States& states) {
  RECORD_FUNCTION("codec.inputs", std::vector<c10::IValue>());
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  const Tensor& state = states.take(B, C, ctx).contiguous();
  Tensor a = at::empty({B, ctx + T, C}, kFloat);
  Tensor next = at::empty({B, C, ctx}, kFloat);
  const float* xs = x.data_ptr<float>();
  const float* ss = state.data_ptr<float>();
  float* as = a.data_ptr<float>();
  float* ns = next.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    float* ab = as + b * (ctx + T) * C;
    for (int64_t j = 0; j < ctx; ++j)
      for (int64_t c = 0; c < C; ++c) ab[j * C + c] = ss[(b * C + c) * ctx + j];
    copy_act(xs + b * T * C, ab + ctx * C, T * C, elu_on);
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < ctx; ++j) ns[(b * C + c) * ctx + j] = ab[(T + j) * C + c];
  }
  states.out.push_back(next);
  return a;
}

// x [B, T, C], activated
Tensor activated(const Tensor& x, bool elu_on) {
  if (!elu_on) return x;
  RECORD_FUNCTION("codec.inputs", std::vector<c10::IValue>());
  Tensor y = at::empty_like(x);
  copy_act(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), true);
  return y;
}

// The windows of a [B, ctx + T, C] with T outputs a session: [B * T, k * C], row (b, t)
// the inputs t, t + d, ..., t + (k - 1) d of session b.
Tensor windows(const Tensor& a, int64_t T, int64_t k, int64_t d) {
  RECORD_FUNCTION("codec.windows", std::vector<c10::IValue>());
  const int64_t B = a.size(0), rows = a.size(1), C = a.size(2);
  Tensor cols = at::empty({B * T, k * C}, kFloat);
  const float* as = a.data_ptr<float>();
  float* cs = cols.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const float* src = as + (b * rows + t) * C;
      float* dst = cs + (b * T + t) * k * C;
      if (d == 1) {
        std::memcpy(dst, src, k * C * sizeof(float));
      } else {
        for (int64_t j = 0; j < k; ++j) std::memcpy(dst + j * C, src + j * d * C, C * sizeof(float));
      }
    }
  return cols;
}

// The product of each output's window of a [B, ctx + T, C] (taps d apart) with w
// [k * C, N], plus bias: [B, T, N]
Tensor windowed(const Tensor& a, int64_t T, int64_t k, int64_t d, const Tensor& w, const Tensor& bias) {
  const int64_t B = a.size(0), C = a.size(2), N = w.size(1), rows = a.size(1);
  if (d == 1 && (N == 1 || is_narrow(N))) {  // the windows read in place
    RECORD_FUNCTION("codec.narrow_gemm", std::vector<c10::IValue>());
    Tensor y = at::empty({B, T, N}, kFloat);
    for (int64_t b = 0; b < B; ++b) {
      const float* ab = a.data_ptr<float>() + b * rows * C;
      float* yb = y.data_ptr<float>() + b * T * N;
      if (N == 1)
        dot_rows(ab, C, w.data_ptr<float>(), k * C, bias.item<float>(), yb, T);
      else
        narrow_gemm(ab, C, T, k * C, w.data_ptr<float>(), bias.data_ptr<float>(), yb, N, false);
    }
    return y;
  }
  const Tensor cols = k == 1 && rows == T ? a.view({B * T, C}) : windows(a, T, k, d);
  return at::addmm(bias, cols, w).view({B, T, N});
}

// x [B, T, cin] -> [B, T, cout]
Tensor run_conv(const Conv& L, const Tensor& x, States& states) {
  RECORD_FUNCTION("codec.conv", std::vector<c10::IValue>());
  const int64_t B = x.size(0), T = x.size(1), ctx = L.context();
  TORCH_CHECK(x.size(2) == L.cin, "a codec convolution's input of another width");
  if (ctx == 0) return windowed(activated(x, L.elu_in), T, 1, 1, L.w, L.bias);
  const Tensor a = with_context(x, ctx, L.elu_in, states);
  return windowed(a, T, L.k, L.dilation, L.w, L.bias);
}

// x [B, n, cin] -> [B, n * stride, cout]
Tensor run_conv_transpose(const ConvTranspose& L, const Tensor& x, States& states) {
  RECORD_FUNCTION("codec.conv_transpose", std::vector<c10::IValue>());
  const int64_t B = x.size(0), n = x.size(1);
  TORCH_CHECK(x.size(2) == L.cin, "a codec transposed convolution's input of another width");
  const Tensor a = with_context(x, L.m - 1, L.elu_in, states);
  return windowed(a, n, L.m, 1, L.w, L.bias).view({B, n * L.stride, L.cout});
}

// x [B, T, H] -> LSTM(x) + x
Tensor run_lstm(const Lstm& L, const Tensor& x, States& states) {
  RECORD_FUNCTION("codec.lstm", std::vector<c10::IValue>());
  const int64_t B = x.size(0), T = x.size(1), H = L.hidden, layers = L.w_ih.size();
  TORCH_CHECK(x.size(2) == H, "the codec LSTM's input of another width");
  Tensor h = states.take(B, layers, H).clone(at::MemoryFormat::Contiguous);
  Tensor c = states.take(B, layers, H).clone(at::MemoryFormat::Contiguous);
  Tensor hl = at::empty({B, H}, kFloat), cl = at::empty({B, H}, kFloat);
  Tensor seq = x;
  for (int64_t l = 0; l < layers; ++l) {
    Tensor gates = at::addmm(L.bias[l], seq.reshape({B * T, H}), L.w_ih[l]).view({B, T, 4 * H});
    hl.copy_(h.select(1, l));
    cl.copy_(c.select(1, l));
    Tensor y = at::empty({B, T, H}, kFloat);
    for (int64_t t = 0; t < T; ++t) {
      float* g = gates.data_ptr<float>() + t * 4 * H;  // [B, 4H], rows T * 4H apart
      slab_gemm_acc(hl.data_ptr<float>(), H, B, H, L.w_hh[l].data_ptr<float>(), 4 * H, g, T * 4 * H);
      lstm_cells(g, T * 4 * H, cl.data_ptr<float>(), hl.data_ptr<float>(), y.data_ptr<float>() + t * H, T * H, B, H);
    }
    h.select(1, l).copy_(hl);
    c.select(1, l).copy_(cl);
    seq = y;
  }
  states.out.push_back(h);
  states.out.push_back(c);
  return seq.add_(x);
}

// x [B, T, C] -> shortcut(x) + b(ELU(a(ELU(x))))
Tensor run_residual(const Residual& R, const Tensor& x, States& states) {
  RECORD_FUNCTION("codec.residual", std::vector<c10::IValue>());
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  Tensor h = run_conv(R.a, x, states);
  const Tensor hb = activated(h, R.b.elu_in);  // conv b is 1x1: no state, nothing of h kept
  const int64_t hidden = R.b.cin;
  if (!is_narrow(C)) {
    Tensor y = R.shortcut.defined() ? at::addmm(R.bias, x.view({B * T, C}), R.shortcut)
                                    : at::add(x.view({B * T, C}), R.bias);
    return y.addmm_(hb.view({B * T, hidden}), R.b.w).view({B, T, C});
  }
  Tensor y = R.shortcut.defined() ? at::empty({B, T, C}, kFloat) : at::add(x, R.bias);
  if (R.shortcut.defined())
    narrow_gemm(x.data_ptr<float>(), C, B * T, C, R.shortcut.data_ptr<float>(), R.bias.data_ptr<float>(),
                y.data_ptr<float>(), C, false);
  narrow_gemm(hb.data_ptr<float>(), hidden, B * T, hidden, R.b.w.data_ptr<float>(), nullptr, y.data_ptr<float>(), C,
              true);
  return y;
}

class CodecDecoder {
 public:
  // codebooks [K, size, D]: the quantizer's codeword tables, level by level
  explicit CodecDecoder(Tensor codebooks) : codebooks_(codebooks.contiguous()) {
    TORCH_CHECK(codebooks_.dim() == 3 && codebooks_.scalar_type() == at::kFloat, "codebooks: float32 [K, size, D]");
  }

  void add_conv(Tensor w, Tensor bias, int64_t k, int64_t dilation, bool elu_in) {
    ops_.push_back({kConv, convs_.size()});
    convs_.push_back(conv(w, bias, k, dilation, elu_in));
  }

  void add_conv_transpose(Tensor w, Tensor bias, int64_t m, int64_t stride, bool elu_in) {
    TORCH_CHECK(w.dim() == 2 && w.size(0) % m == 0 && w.size(1) % stride == 0 && bias.numel() == w.size(1),
                "a transposed convolution's polyphase weight: [m * cin, stride * cout], bias [stride * cout]");
    ops_.push_back({kConvTranspose, convts_.size()});
    convts_.push_back({w.contiguous(), bias.contiguous(), m, stride, w.size(0) / m, w.size(1) / stride, elu_in});
  }

  void add_lstm(std::vector<Tensor> w_ih, std::vector<Tensor> w_hh, std::vector<Tensor> bias) {
    TORCH_CHECK(!w_ih.empty() && w_ih.size() == w_hh.size() && w_ih.size() == bias.size(), "LSTM layers");
    Lstm L{{}, {}, {}, w_ih[0].size(0)};
    for (size_t l = 0; l < w_ih.size(); ++l) {
      TORCH_CHECK(w_ih[l].size(0) == L.hidden && w_ih[l].size(1) == 4 * L.hidden && w_hh[l].sizes() == w_ih[l].sizes(),
                  "an LSTM layer's weights: [H, 4H]");
      L.w_ih.push_back(w_ih[l].contiguous());
      L.w_hh.push_back(column_slabs(w_hh[l].contiguous()));
      L.bias.push_back(bias[l].contiguous());
    }
    ops_.push_back({kLstm, lstms_.size()});
    lstms_.push_back(std::move(L));
  }

  // conv a (k_a taps, dilation), then the 1x1 conv b; shortcut: a 1x1 weight [C, C] or None
  void add_residual(Tensor w_a, Tensor bias_a, int64_t k_a, int64_t dilation, Tensor w_b, Tensor bias_b,
                    c10::optional<Tensor> shortcut, c10::optional<Tensor> shortcut_bias) {
    Residual R{conv(w_a, bias_a, k_a, dilation, true), conv(w_b, bias_b, 1, 1, true), Tensor(), bias_b.contiguous()};
    TORCH_CHECK(R.b.cin == R.a.cout && R.b.cout == R.a.cin, "a residual block's convolutions must chain");
    if (shortcut) {
      R.shortcut = shortcut->contiguous();
      R.bias = (bias_b + *shortcut_bias).contiguous();
    }
    ops_.push_back({kResidual, residuals_.size()});
    residuals_.push_back(std::move(R));
  }

  // codes [B, K, F] int64 and the streams' state tensors -> (wav [B, channels, F * hop],
  // the next state tensors)
  std::tuple<Tensor, std::vector<Tensor>> decode(const Tensor& codes, const std::vector<Tensor>& state) {
    TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kLong && codes.size(0) >= 1, "codes: int64 [B, K, F]");
    TORCH_CHECK(codes.size(1) >= 1 && codes.size(1) <= codebooks_.size(0), "more codebooks than the codec has");
    at::NoGradGuard no_grad;
    States states{state};
    Tensor x = latent(codes.contiguous());
    const size_t tail = tail_start();
    for (size_t i = 0; i < tail; ++i) x = run(ops_[i], x, states);
    if (tail < ops_.size()) x = run_tail(tail, x, states);
    TORCH_CHECK(states.next == state.size(), "the stream state has more tensors than this decoder");
    // channels-last [B, T, C] -> [B, C, T] (one channel: the same memory)
    return {x.size(2) == 1 ? x.view({x.size(0), 1, x.size(1)}) : x.transpose(1, 2).contiguous(),
            std::move(states.out)};
  }

 private:
  enum Kind { kConv, kConvTranspose, kLstm, kResidual };
  struct Op {
    Kind kind;
    size_t index;
  };

  Tensor run(const Op& op, const Tensor& x, States& states) const {
    switch (op.kind) {
      case kConv: return run_conv(convs_[op.index], x, states);
      case kConvTranspose: return run_conv_transpose(convts_[op.index], x, states);
      case kLstm: return run_lstm(lstms_[op.index], x, states);
      case kResidual: return run_residual(residuals_[op.index], x, states);
    }
    TORCH_CHECK(false, "unknown codec op");
  }

  // Where the last stages start: the transposed convolution whose output runs at half
  // the hop or more (the default codec's last two of four upsamplings and what follows).
  size_t tail_start() const {
    int64_t hop = 1, rate = 1;
    for (const Op& op : ops_)
      if (op.kind == kConvTranspose) hop *= convts_[op.index].stride;
    for (size_t i = 0; i < ops_.size(); ++i)
      if (ops_[i].kind == kConvTranspose && 2 * (rate *= convts_[ops_[i].index].stride) >= hop) return i;
    return ops_.size();
  }

  // The ops from `tail` on, a session at a time: their activations, the widest (16
  // sessions x 6 frames: 2 MB a tensor), then stay in the core's cache instead of
  // streaming through the shared one at every layer.
  Tensor run_tail(size_t tail, const Tensor& x, States& states) const {
    const int64_t B = x.size(0);
    const std::vector<Tensor> rest(states.in.begin() + states.next, states.in.end());
    std::vector<Tensor> wavs;
    std::vector<std::vector<Tensor>> next(rest.size());
    for (int64_t b = 0; b < B; ++b) {
      std::vector<Tensor> mine;
      for (const Tensor& t : rest) mine.push_back(t.narrow(0, b, 1));
      States own{mine};
      Tensor y = x.narrow(0, b, 1);
      for (size_t i = tail; i < ops_.size(); ++i) y = run(ops_[i], y, own);
      TORCH_CHECK(own.next == mine.size() && own.out.size() == rest.size(),
                  "the stream state has more tensors than this decoder");
      wavs.push_back(y);
      for (size_t j = 0; j < rest.size(); ++j) next[j].push_back(own.out[j]);
    }
    for (const auto& parts : next) states.out.push_back(at::cat(parts, 0));
    states.next = states.in.size();
    return at::cat(wavs, 0);
  }

  static Conv conv(const Tensor& w, const Tensor& bias, int64_t k, int64_t dilation, bool elu_in) {
    TORCH_CHECK(w.dim() == 2 && w.size(0) % k == 0 && bias.numel() == w.size(1),
                "a convolution's weight: [k * cin, cout], bias [cout]");
    return {w.contiguous(), bias.contiguous(), k, dilation, w.size(0) / k, w.size(1), elu_in};
  }

  // [B, F, D]: the sum of each frame's codewords
  Tensor latent(const Tensor& codes) const {
    RECORD_FUNCTION("codec.codewords", std::vector<c10::IValue>());
    const int64_t B = codes.size(0), K = codes.size(1), F = codes.size(2);
    const int64_t size = codebooks_.size(1), D = codebooks_.size(2);
    Tensor x = at::zeros({B, F, D}, kFloat);
    const int64_t* cs = codes.data_ptr<int64_t>();
    const float* table = codebooks_.data_ptr<float>();
    float* xs = x.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t f = 0; f < F; ++f) {
          const int64_t id = cs[(b * K + k) * F + f];
          TORCH_CHECK(id >= 0 && id < size, "a code outside its codebook");
          add_rows(xs + (b * F + f) * D, table + (k * size + id) * D, D);
        }
    return x;
  }

  Tensor codebooks_;
  std::vector<Op> ops_;
  std::vector<Conv> convs_;
  std::vector<ConvTranspose> convts_;
  std::vector<Lstm> lstms_;
  std::vector<Residual> residuals_;
};

}  // namespace

void register_codec(pybind11::module_& m) {
  pybind11::class_<CodecDecoder>(m, "CodecDecoder")
      .def(pybind11::init<Tensor>())
      .def("add_conv", &CodecDecoder::add_conv)
      .def("add_conv_transpose", &CodecDecoder::add_conv_transpose)
      .def("add_lstm", &CodecDecoder::add_lstm)
      .def("add_residual", &CodecDecoder::add_residual)
      .def("decode", &CodecDecoder::decode, pybind11::call_guard<pybind11::gil_scoped_release>());
}
