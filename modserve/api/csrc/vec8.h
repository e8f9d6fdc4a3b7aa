// Eight- and sixteen-float vectors for the C++ CPU kernels (GCC/Clang vector extensions):
// loads (of float32 or bf16), stores, a horizontal sum and e^x, shared by the decode
// attention kernel, the native decode step and the LoRA op.

#pragma once

#include <cstdint>
#include <cstring>

namespace modserve {

// Eight floats, one AVX register where the build has them (GCC/Clang vector extension).
typedef float v8 __attribute__((vector_size(32)));
// Sixteen floats: one AVX-512 register, or two (four) narrower ones where the build lacks it.
typedef float v16 __attribute__((vector_size(64)));

inline v8 load8(const float* p) {
  v8 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

// Eight bfloat16 values (their raw 16-bit patterns) widened to float32, exactly: a bf16 is
// the top half of a float32. The overload lets a kernel read a float32 or a bf16 cache alike.
inline v8 load8(const uint16_t* p) {
  typedef uint16_t u16x8 __attribute__((vector_size(16)));
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  const u32x8 w = __builtin_convertvector(h, u32x8) << 16;
  v8 r;
  std::memcpy(&r, &w, sizeof r);
  return r;
}

// Sixteen bfloat16 values widened to float32, exactly, as load8.
inline v16 load16(const uint16_t* p) {
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  v16 r;
  std::memcpy(&r, &w, sizeof r);
  return r;
}

// float32 -> bfloat16's bit pattern, rounded to nearest even as torch rounds (NaN stays NaN).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float hsum(v8 v) {  // a tree, not a chain of seven dependent adds
  const v8 a = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  const v8 b = a + __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5);
  return b[0] + b[1];
}

typedef int32_t i8 __attribute__((vector_size(32)));

inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

// e^x lane by lane, for a vector of any width: x = n ln2 + r with |r| <= ln2 / 2, e^r by its
// Taylor series to r^7 / 7! (relative error below 2e-7 there), times 2^n built in the exponent bits.
// Inputs below -87 (where 2^n would be subnormal) give e^-87, about 1.6e-38.
template <class V, class I>  // V: a vector of floats, I: of int32s, as many lanes
inline V exp_lanes(V x) {
  const V lo = V{} - 87.0f, hi = V{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const V magic = V{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (x * 1.44269504088896341f + magic) - magic;
  const V r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;  // ln2 in two parts
  V p = V{} + 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline v8 exp8(v8 x) { return exp_lanes<v8, i8>(x); }

}  // namespace modserve
