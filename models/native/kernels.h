// What the native CPU loops share (models/native/step.cpp, models/native/codec.cpp).
//
// The loops (`LS_KERNEL`) are compiled for AVX-512, for AVX2 + FMA and for baseline
// x86-64, and the CPU picks at load time: one build runs on any x86-64 machine, so it
// can be built where a compiler is and run where none is.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LS_KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LS_KERNEL
#endif

namespace livespeech_native {

// 8 floats (or int32s) in a vector register (a pair of SSE registers in the baseline
// build), for loops the compiler would not vectorise as wanted on its own. A function
// using them is inlined into its caller's per-CPU clone (LS_INLINE): one left out of line
// is compiled once, for the baseline target, its vectors as SSE pairs (out of line, the
// state update's vector loop cost 2.5 ms more a 16-session step). A broadcast is written in place as {s, s, ...}:
// returned from a helper, GCC built it lane by lane.
#define LS_INLINE __attribute__((always_inline)) inline
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

LS_INLINE v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

LS_INLINE void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

// 2^x for x in [-126, 126] (a relative error ~2e-7), for a float (I: int32_t) or a v8
// (I: v8i) alike: Cephes' polynomial on [-0.5, 0.5] and the exponent's bits, rounded by
// the float adder (1.5 * 2^23), so that the compiler vectorises it (libm's exp2f stays a
// scalar call).
template <class F, class I>
LS_INLINE F exp2_in_range_of(F x) {
  const F shifted = x + 12582912.f;
  const F f = x - (shifted - 12582912.f);
  I n;
  std::memcpy(&n, &shifted, sizeof n);
  n -= 0x4B400000;
  F p = f * 1.535336188319500e-4f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const I bits = (n + 127) << 23;
  F scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline float exp2_in_range(float x) { return exp2_in_range_of<float, int32_t>(x); }

#if defined(__clang__)
#define LS_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define LS_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, v8i{__VA_ARGS__})
#endif

// r[i] = the sum of a[i]'s lanes, i < 8: pairs, then fours, then halves, each a shuffle of
// two vectors and an add (one reduction across lanes each would cost 8 times the shuffles)
LS_INLINE v8 lane_sums8(const v8* a) {
  v8 h[4], q[2];
  for (int i = 0; i < 4; ++i)
    h[i] = LS_SHUFFLE(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           LS_SHUFFLE(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int i = 0; i < 2; ++i)
    q[i] = LS_SHUFFLE(h[2 * i], h[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           LS_SHUFFLE(h[2 * i], h[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return LS_SHUFFLE(q[0], q[1], 0, 1, 2, 3, 8, 9, 10, 11) + LS_SHUFFLE(q[0], q[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// 2^x for x <= 126; below -126 it gives 2^-126 rather than a denormal or zero; NaN stays
// NaN. For a float (I: int32_t) or a v8 (I: v8i) alike.
template <class F, class I>
LS_INLINE F exp2_fast_of(F x) {
  const F lowest = F{} - 126.f, highest = F{} + 126.f;
  x = x < lowest ? lowest : x;
  x = x > highest ? highest : x;
  return exp2_in_range_of<F, I>(x);
}

inline float exp2_fast(float x) { return exp2_fast_of<float, int32_t>(x); }

constexpr float kLog2e = 1.4426950408889634f;

inline float silu(float x) { return x / (1.f + exp2_fast(-x * kLog2e)); }

// Sums kept in 16 lanes and added as a tree in vector registers (two 8-float halves,
// then halves of halves): a reduction the compiler keeps in vector registers, where a
// loop's own reduction (without -ffast-math) ends in 16 dependent scalar adds, in order,
// and a plain tree over an array was left to 16 scalar loads and adds from the stack
// (~40 % of the Mamba state update's loop).
constexpr int kLanes = 16;

inline float tree_sum(const float* lane) {
  typedef float v4 __attribute__((vector_size(16)));
  v8 a, b;
  std::memcpy(&a, lane, sizeof a);
  std::memcpy(&b, lane + 8, sizeof b);
  const v8 s8 = a + b;
  v4 lo, hi;  // the halves by copies (GCC before 12 has no __builtin_shufflevector)
  std::memcpy(&lo, &s8, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&s8) + sizeof lo, sizeof hi);
  const v4 s4 = lo + hi;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// sum of a[i] * b[i], i < n
inline float dot(const float* a, const float* b, int64_t n) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] += a[i + j] * b[i + j];
  for (int j = 0; i + j < n; ++j) lane[j] += a[i + j] * b[i + j];
  return tree_sum(lane);
}

// sum of x[i], i < n
inline float sum(const float* x, int64_t n) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] += x[i + j];
  for (int j = 0; i + j < n; ++j) lane[j] += x[i + j];
  return tree_sum(lane);
}

// log(1 + t) for t in [0, 1] (a relative error ~2e-7): Cephes' logf polynomial for
// log(1 + t) rounded, corrected by t / ((1 + t) - 1) for what the rounding lost (which
// keeps a tiny t's log1p ~t rather than 0); branch-free, so that it vectorises.
inline float log1p_unit(float t) {
  const float u = 1.f + t;
  const bool high = u > 1.41421356f;
  const float m = high ? 0.5f * u : u;
  const float e = high ? 1.f : 0.f;
  const float x = m - 1.f, z = x * x;
  float p = 7.0376836292e-2f;
  p = p * x - 1.1514610310e-1f;
  p = p * x + 1.1676998740e-1f;
  p = p * x - 1.2420140846e-1f;
  p = p * x + 1.4249322787e-1f;
  p = p * x - 1.6668057665e-1f;
  p = p * x + 2.0000714765e-1f;
  p = p * x - 2.4999993993e-1f;
  p = p * x + 3.3333331174e-1f;
  const float log_u = x + (p * x * z - 2.12194440e-4f * e - 0.5f * z) + 0.693359375f * e;
  const float lost = u - 1.f;
  return lost == 0.f ? t : log_u * (t / lost);
}

// torch's softplus (beta 1, threshold 20): x above 20, else max(x, 0) + log1p(e^-|x|);
// NaN stays NaN
inline float softplus(float x) {
  const float pos = x > 0.f ? x : 0.f;
  const float y = pos + log1p_unit(exp2_fast(-std::fabs(x) * kLog2e));
  return x > 20.f ? x : (x != x ? x : y);
}

// 1 / (1 + e^-x)
inline float sigmoid(float x) { return 1.f / (1.f + exp2_fast(-x * kLog2e)); }

// tanh(x) = 2 sigmoid(2x) - 1 (an absolute error ~1e-7)
inline float tanh_fast(float x) { return 2.f * sigmoid(2.f * x) - 1.f; }

// ELU with alpha 1: e^x - 1 below zero, from e^max(x, -20) (below, e^x - 1 rounds to
// -1 in float32) without exp2_fast's clamps, which made it twice the instructions; NaN
// stays NaN.
inline float elu(float x) {
  float t = x < 0.f ? x : 0.f;
  t = t > -20.f ? t : -20.f;
  const float e = exp2_in_range(t * kLog2e) - 1.f;
  return x <= 0.f ? e : x;
}

// dst[i] += src[i], i < n (static: each source file keeps its own clones)
static LS_KERNEL void add_rows(float* dst, const float* src, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

}  // namespace livespeech_native

// the codec decoder's classes and calls (models/native/codec.cpp) and the sampler's
// (models/native/sampler.cpp), on the one module
void register_codec(pybind11::module_& m);
void register_sampler(pybind11::module_& m);
