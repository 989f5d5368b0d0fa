// The quantized weight formats of the CPU matmul and their packed layout (the constants every
// other quant_*.h header reads); quant_tiles.h has the loops that consume them.
//
// y = x @ W on CPU for W in a GGUF block format (Q8_0, or 4-bit: Q4_0 / Q4_1), with integer dot
// products: as llama.cpp does, each row of x is quantized once per call to 8 bits per block of
// 32 inputs (xq = round(x / dx), dx = max|x| / 127, an fp32 scale per block), and each block's
// sum of x[k] * q[k] becomes an int32 dot product of bytes (AVX512-VNNI / AVX-VNNI vpdpbusd;
// AVX2 and AVX-512BW: vpmaddubsw + vpmaddwd).
//
// Each 32 consecutive inputs k of one output column n form a block with an fp16 scale d (and,
// for 4-bit, an fp16 offset m): W[k, n] = d * q (Q8_0, q int8) or d * q + m (4-bit, q 0..15;
// Q4_0 is the 4-bit layout with m = -8 d, exact in fp16). Per block:
//     y[n] += d * dx * sum_k xq[k] q[k]  +  m * sum_k x[k]
// The integer sum is exact; the offset's factor sum_k x[k] is the fp32 sum of the unquantized
// x. The only approximation is x ~ dx * xq: |x - dx * xq| <= dx / 2 = max|x| / 254 per input
// (tests/kernels/test_cpu_quant_linear.py bounds y's error by it). With exact = true the kernel
// keeps x in fp32 instead (each byte widened to fp32 and multiplied-added; several times the
// arithmetic): the products are then those of dequantize-then-matmul, summed in another order.
//
// Packed layout (kernels/quant_cpu.py repacks the file's blocks once at load): panels of kLanes
// output columns, as in linear.cpp; panel p is [num_blocks, block_bytes] contiguous bytes, and
// one block of a panel is
//     4-bit: d [kLanes] fp16 | m [kLanes] fp16 | qs [4][kLanes][4] u8    (20 * kLanes bytes)
//     Q8_0:  d [kLanes] fp16 | qs [8][kLanes][4] i8                      (34 * kLanes bytes)
//     5-bit: the 4-bit block, then one word per lane of fifth bits        (24 * kLanes bytes)
//     Q4_K:  d [kLanes] fp16 | dmin [kLanes] fp16 | sc [8][kLanes] u8 | mn [8][kLanes] u8 |
//            8 x qs [4][kLanes][4] u8 (one per sub-block of 32)          (148 * kLanes bytes)
//     Q6_K:  d [kLanes] fp16 | sc [16][kLanes] i8 (per 16 inputs) | 8 x (low 4 bits of 32 inputs
//            as 4-bit qs [4][kLanes][4] u8, their high 2 bits [2][kLanes][4] u8: block_sums_q6k)
//                                                                         (210 * kLanes bytes)
// qs[g][c][t] is column c's file byte 4 g + t: one 32-bit lane per column holding 4 consecutive
// inputs, what a 4-byte dot product instruction consumes. For 4-bit, the low nibble is input
// 4 g + t and the high nibble input 16 + 4 g + t (the file's nibble order; Q4_K's nibbles are
// reordered to it at load, and its 6-bit scales and mins unpacked to a byte each). The bytes per
// weight are the file's own (20 or 34 per 32, 148 for Q4_K's 144 per 256, Q6_K's 210), so a decode step
// streams the file's bytes once. A Q4_K sub-block s is a 4-bit block whose scale is
// d * sc[s] and offset -dmin * mn[s] (both exact in fp32); a Q6_K value is d * sc * (q - 32)
// with q the 6-bit code (exact in fp32 too).
//
// Everything here is in an anonymous namespace on purpose: each library is built for one ISA and
// several are loaded side by side (tests compare them), so no symbol of this code may be shared.
#pragma once

#include <cstdint>

#include "vec.h"

namespace pdserve {
namespace {

constexpr int kBlock = 32;   // inputs per block, both formats
constexpr int kPanels = 2;   // panels per work item (the unit threads split)
#ifdef __AVX512F__
constexpr int kRows = 4;     // 32 zmm: 2 * 4 * 2 int sums + 4 * 2 fp32 sums + weights
#else
constexpr int kRows = 2;     // 16 ymm
#endif
enum Format : int64_t { kQ8_0 = 0, kQ4 = 1, kQ4K = 2, kQ6K = 3, kQ5 = 4 };

template <int F>
constexpr int64_t block_bytes() {
  return F == kQ4 ? 20 * kLanes : F == kQ5 ? 24 * kLanes : F == kQ4K ? 148 * kLanes : F == kQ6K ? 210 * kLanes
                                                                                                : 34 * kLanes;
}

// Inputs per block of a format (the K-quants: super-blocks of 256).
inline int64_t block_inputs(int64_t format) { return format == kQ4K || format == kQ6K ? 256 : 32; }

inline int64_t format_block_bytes(int64_t format) {
  return format == kQ4    ? block_bytes<kQ4>()
         : format == kQ5  ? block_bytes<kQ5>()
         : format == kQ4K ? block_bytes<kQ4K>()
         : format == kQ6K ? block_bytes<kQ6K>()
                          : block_bytes<kQ8_0>();
}

}  // namespace
}  // namespace pdserve
