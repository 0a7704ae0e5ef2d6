// 4-bit Llama on a CPU: x @ W.T for a 4-bit weight matrix W (llama.cpp's Q4_0 / Q4_1 codes:
// w = code * scale + min per group of 32 along K), and the decoder layers of a Llama for one
// token per row built on it. Built by q4.py; see there for why it exists and what it measures.
//
// The matmul: x fp32 (optionally RMS-normalised first: the norm that precedes every matrix of a
// Llama layer) rounded to bfloat16, or on the AVX2 path to int8 per group of 32; the output in
// fp32.
//
// Layout (Q4Codes.pack), per block of 16 output rows r and group g of 32 weights (k = 32 g + i):
//   codes   [N / 16, G, 4 p, 32 lanes] int16: lane 2 r + e of vector p holds, at bits
//           4 s .. 4 s + 3, the code of row r, weight i = 2 (p + 4 s) + e;
//   scales  [N / 16, G, 16] fp16: the scale of row r (lane r), as llama.cpp stores it;
//   mins    [N / 16, G, 16] fp16.
// (0x4300 | code) is the bfloat16 128 + code, exactly, so one AVX512-BF16 dot product
// (vdpbf16ps) of that vector with x's pair (i, i + 1) broadcast adds, in fp32 lane r, row r's two
// products plus 128 (x_i + x_i+1); per group, lane r then gets scale * that + offset * sum(x),
// offset = min - 128 scale: the sum over i of (code * scale + min) * x_i. Lanes are output rows,
// so nothing is reduced across lanes, and a block's 16 rows share each x load.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>
#if defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <algorithm>

namespace {

constexpr int64_t kRows = 16;  // output rows per block
constexpr int64_t kGroup = 32;  // weights per scale
constexpr int64_t kRowsOfX = 8;  // rows of x per pass over the weights (both paths)
// Groups prefetched ahead (4 KB of codes): at one row the loop runs near memory bandwidth, which
// the hardware prefetcher alone falls short of.
constexpr int64_t kAhead = 16;

// One matrix in the layout above.
struct Weights {
  const int16_t* codes;
  const at::Half* scales;
  const at::Half* mins;
  int64_t G;  // groups per row: K / 32
  int64_t N;  // output rows, a multiple of 16
};

#if defined(__AVX512BF16__) || defined(__AVX2__)
// The codes of row block b, group g (kRows x kGroup of them), after prefetching those of the
// group kAhead further on, with its scales and mins.
inline const int16_t* group_codes(const Weights& w, int64_t b, int64_t g) {
  const int16_t* codes = w.codes + (b * w.G + g) * 4 * 32;
  for (int line = 0; line < 4; ++line)  // a group's codes are 4 cache lines
    _mm_prefetch((const char*)(codes + kAhead * 128) + 64 * line, _MM_HINT_T0);
  _mm_prefetch((const char*)(w.scales + (b * w.G + g + kAhead) * kRows), _MM_HINT_T0);
  _mm_prefetch((const char*)(w.mins + (b * w.G + g + kAhead) * kRows), _MM_HINT_T0);
  return codes;
}
#endif

#if defined(__AVX512BF16__)
// MB rows of x against row blocks b0 .. b1 - 1. t[m][c] keeps CH independent chains of dot
// products per row of x (the instruction's latency is ~6 cycles, its throughput 1 a cycle): four
// for up to 4 rows, one past that, where the rows' chains are enough and registers are not.
template <int MB, int CH = (MB <= 4 ? 4 : 1)>
void blocks(const at::BFloat16* x, const float* xsum, int64_t K, const Weights& w, int64_t b0,
            int64_t b1, float* out, int64_t N) {
  const int64_t G = w.G;
  const __m512i low4 = _mm512_set1_epi16(0x000F), bf16_128 = _mm512_set1_epi16(0x4300);
  const __m512 minus_128 = _mm512_set1_ps(-128.f);
  const auto* pairs = reinterpret_cast<const int32_t*>(x);  // x's bf16 pairs, one per int32
  for (int64_t b = b0; b < b1; ++b) {
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const int16_t* q_bg = group_codes(w, b, g);
      __m512i q[4];
      for (int p = 0; p < 4; ++p) q[p] = _mm512_loadu_si512(q_bg + p * 32);
      __m512 t[MB][CH];
      for (int m = 0; m < MB; ++m)
        for (int c = 0; c < CH; ++c) t[m][c] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          // (q >> 4 s) & 0xF | 0x4300; 0xEA is the ternary-logic table of A & B | C.
          const __m512i shifted = s ? _mm512_srli_epi16(q[p], 4 * s) : q[p];
          const __m512i codes = _mm512_ternarylogic_epi32(shifted, low4, bf16_128, 0xEA);
          for (int m = 0; m < MB; ++m) {
            const __m512i xi = _mm512_set1_epi32(pairs[(m * K + g * kGroup) / 2 + p + 4 * s]);
            t[m][p % CH] = _mm512_dpbf16_ps(t[m][p % CH], (__m512bh)codes, (__m512bh)xi);
          }
        }
      }
      const int64_t lanes = (b * G + g) * kRows;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w.scales + lanes)));
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w.mins + lanes)));
      const __m512 offset = _mm512_fmadd_ps(minus_128, d, mn);
      for (int m = 0; m < MB; ++m) {
        __m512 dots = t[m][0];
        for (int c = 1; c < CH; ++c) dots = _mm512_add_ps(dots, t[m][c]);
        acc[m] = _mm512_fmadd_ps(d, dots, acc[m]);
        acc[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[m * G + g]), acc[m]);
      }
    }
    for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + m * N + b * kRows, acc[m]);
  }
}

void rows_of_x(int64_t mb, const at::BFloat16* x, const float* xsum, int64_t K, const Weights& w,
               int64_t b0, int64_t b1, float* out, int64_t N) {
  switch (mb) {
    case 1: return blocks<1>(x, xsum, K, w, b0, b1, out, N);
    case 2: return blocks<2>(x, xsum, K, w, b0, b1, out, N);
    case 3: return blocks<3>(x, xsum, K, w, b0, b1, out, N);
    case 4: return blocks<4>(x, xsum, K, w, b0, b1, out, N);
    case 5: return blocks<5>(x, xsum, K, w, b0, b1, out, N);
    case 6: return blocks<6>(x, xsum, K, w, b0, b1, out, N);
    case 7: return blocks<7>(x, xsum, K, w, b0, b1, out, N);
    default: return blocks<8>(x, xsum, K, w, b0, b1, out, N);
  }
}
constexpr const char* kPath = "avx512-bf16";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 (no bfloat16 dot product): x rounded to int8 per group of 32 (scale max |x| / 127, as
// llama.cpp's Q8 activations), and 16-bit integer multiply-adds of codes by x (vpmaddubsw: 32
// bytes, unsigned codes by signed x, summed in pairs), 8 output rows per vector. Read as int32,
// lane r of 8 consecutive int16 pairs holds row r's pair (e = 0, 1): the code of weight
// i = 2 (p + 4 s) + e sits at bits 16 e + 4 s, so a mask (s = 0, 2) and a shift and a mask
// (s = 1, 3) leave a code in each byte; x's int8 values are laid out in the same byte order once
// per matmul (Input::quads), each four a 32-bit word broadcast to the 8 rows. A group's 16
// products per 16-bit lane stay below 2^15 (16 x 15 x 127), so they add up in 16 bits and are
// widened once a group. Integer sums are exact: the result is the dequantised matrix's product
// with the int8-rounded x up to fp32 rounding. Codes are 0..15 here (no +128), so a group's
// offset is its min.
#define Q4_INT8_INPUT

// x prepared for the dot products: per row m and group g, 8 words of x's int8 values in the
// codes' byte order (word 2 p: weights 2p, 2p+16, 2p+1, 2p+17; word 2 p + 1: 2p+8, 2p+24, 2p+9,
// 2p+25), the values' scale, and their dequantised sum (the mins' term).
struct Input {
  std::vector<int32_t> quads;  // [M, G, 8]
  std::vector<float> scale;  // [M, G]
  std::vector<float> sum;  // [M, G]
  int64_t K, G;
};

Input prepare(const std::vector<float>& x, int64_t M, int64_t K) {  // x [M, K] fp32
  const int64_t G = K / kGroup;
  Input in{std::vector<int32_t>(M * G * 8), std::vector<float>(M * G), std::vector<float>(M * G),
           K, G};
  const auto word = [](const int8_t* q, int a, int b, int c, int d) {
    return static_cast<int32_t>(static_cast<uint8_t>(q[a]) | static_cast<uint8_t>(q[b]) << 8 |
                                static_cast<uint8_t>(q[c]) << 16 |
                                static_cast<uint32_t>(static_cast<uint8_t>(q[d])) << 24);
  };
  for (int64_t mg = 0; mg < M * G; ++mg) {
    const float* v = x.data() + mg * kGroup;
    float top = 0.f;
    for (int64_t i = 0; i < kGroup; ++i) top = std::max(top, std::fabs(v[i]));
    const float d = top / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
    int8_t q[kGroup];
    int total = 0;
    for (int64_t i = 0; i < kGroup; ++i) total += q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inverse));
    in.scale[mg] = d;
    in.sum[mg] = d * static_cast<float>(total);
    int32_t* quads = in.quads.data() + mg * 8;
    for (int p = 0; p < 4; ++p) {
      quads[2 * p] = word(q, 2 * p, 2 * p + 16, 2 * p + 1, 2 * p + 17);
      quads[2 * p + 1] = word(q, 2 * p + 8, 2 * p + 24, 2 * p + 9, 2 * p + 25);
    }
  }
  return in;
}

// MB rows of x (from row m0) against row blocks b0 .. b1 - 1.
template <int MB>
void blocks(const Input& in, int64_t m0, const Weights& w, int64_t b0, int64_t b1, float* out,
            int64_t N) {
  const int64_t G = w.G;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int32_t* quads = in.quads.data() + m0 * G * 8;
  const float* xscale = in.scale.data() + m0 * G;
  const float* xsum = in.sum.data() + m0 * G;
  for (int64_t b = b0; b < b1; ++b) {
    __m256 acc[MB][2];
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const int16_t* q_bg = group_codes(w, b, g);
      __m256i dots[MB][2];
      for (int m = 0; m < MB; ++m) dots[m][0] = dots[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        for (int h = 0; h < 2; ++h) {
          const __m256i q = _mm256_loadu_si256((const __m256i*)(q_bg + p * 32 + 16 * h));
          const __m256i even = _mm256_and_si256(q, low4);  // s = 0, 2
          const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);  // s = 1, 3
          for (int m = 0; m < MB; ++m) {
            const int32_t* xq = quads + (m * G + g) * 8 + 2 * p;
            dots[m][h] = _mm256_add_epi16(
                dots[m][h], _mm256_maddubs_epi16(even, _mm256_set1_epi32(xq[0])));
            dots[m][h] = _mm256_add_epi16(
                dots[m][h], _mm256_maddubs_epi16(odd, _mm256_set1_epi32(xq[1])));
          }
        }
      }
      const int64_t lanes = (b * G + g) * kRows;
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.scales + lanes) + h));
        const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.mins + lanes) + h));
        for (int m = 0; m < MB; ++m) {
          const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(dots[m][h], ones));
          const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xscale[m * G + g]));
          acc[m][h] = _mm256_fmadd_ps(scale, sums, acc[m][h]);
          acc[m][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[m * G + g]), acc[m][h]);
        }
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + m * N + b * kRows + 8 * h, acc[m][h]);
  }
}

void rows_of_x(int64_t mb, const Input& in, int64_t m0, const Weights& w, int64_t b0, int64_t b1,
               float* out, int64_t N) {
  for (int64_t m = m0; m < m0 + mb; m += 4) {  // at most 4 rows of x a pass (registers)
    float* om = out + m * N;
    switch (std::min<int64_t>(4, m0 + mb - m)) {
      case 1: blocks<1>(in, m, w, b0, b1, om, N); break;
      case 2: blocks<2>(in, m, w, b0, b1, om, N); break;
      case 3: blocks<3>(in, m, w, b0, b1, om, N); break;
      default: blocks<4>(in, m, w, b0, b1, om, N); break;
    }
  }
}
constexpr const char* kPath = "avx2";
#else
// Without AVX512-BF16 or AVX2: the bfloat16 path's sums in the same layout, one weight at a time
// (correct everywhere, several times slower).
void rows_of_x(int64_t mb, const at::BFloat16* x, const float* xsum, int64_t K, const Weights& w,
               int64_t b0, int64_t b1, float* out, int64_t N) {
  const int64_t G = w.G;
  for (int64_t m = 0; m < mb; ++m)
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t r = 0; r < kRows; ++r) {
        float acc = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const int16_t* q_bg = w.codes + (b * G + g) * 4 * 32;
          float dots = 0.f;
          for (int64_t i = 0; i < kGroup; ++i) {
            const int64_t pair = i / 2, p = pair % 4, s = pair / 4;
            const int code = (static_cast<uint16_t>(q_bg[p * 32 + 2 * r + i % 2]) >> (4 * s)) & 15;
            dots += (128 + code) * static_cast<float>(x[m * K + g * kGroup + i]);
          }
          const int64_t lane = (b * G + g) * kRows + r;
          const float d = w.scales[lane], offset = std::fma(-128.f, d, float(w.mins[lane]));
          acc += d * dots + offset * xsum[m * G + g];
        }
        out[m * N + b * kRows + r] = acc;
      }
}
constexpr const char* kPath = "portable";
#endif

// Matrix w's codes etc., checked against an input of K features.
Weights weights_of(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                   int64_t K) {
  const int64_t G = K / kGroup, NB = codes.size(0);
  TORCH_CHECK(K % kGroup == 0 && codes.dim() == 3 && codes.size(1) == G &&
                  codes.size(2) == 4 * 32 && codes.scalar_type() == at::kShort &&
                  codes.is_contiguous(),
              "q4: codes of shape ", codes.sizes(), " do not fit x of ", K, " features",
              " (expected [N / 16, ", G, ", 128] int16, from Q4Codes.pack)");
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->sizes() == at::IntArrayRef({NB, G, kRows}) &&
                    t->scalar_type() == at::kHalf && t->is_contiguous(),
                "q4: scales and mins must be contiguous [", NB, ", ", G, ", 16] fp16");
  return {codes.data_ptr<int16_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(), G,
          NB * kRows};
}

#ifndef Q4_INT8_INPUT
// x prepared for the bfloat16 dot products: x rounded to bfloat16, and its sums per group for
// the offsets.
struct Input {
  std::vector<at::BFloat16> x;  // [M, K]
  std::vector<float> sum;  // [M, G]
  int64_t K, G;
};

Input prepare(const std::vector<float>& x, int64_t M, int64_t K) {  // x [M, K] fp32
  Input in{std::vector<at::BFloat16>(M * K), std::vector<float>(M * (K / kGroup), 0.f), K,
           K / kGroup};
  for (int64_t i = 0; i < M * K; ++i) {
    in.x[i] = at::BFloat16(x[i]);
    in.sum[i / kGroup] += static_cast<float>(in.x[i]);
  }
  return in;
}

void rows_of_x(int64_t mb, const Input& in, int64_t m0, const Weights& w, int64_t b0, int64_t b1,
               float* out, int64_t N) {
  rows_of_x(mb, in.x.data() + m0 * in.K, in.sum.data() + m0 * in.G, in.K, w, b0, b1,
            out + m0 * N, N);
}
#endif

// out [M, w.N] = x [M, K] (RMS-normalised with norm [K] first, unless null) @ W.T
void matmul(const float* x, int64_t M, int64_t K, const Weights& w, const float* norm, float eps,
            float* out) {
  std::vector<float> xn(x, x + M * K);
  if (norm) {
    for (int64_t m = 0; m < M; ++m) {
      float* row = xn.data() + m * K;
      float squares = 0.f;
      for (int64_t k = 0; k < K; ++k) squares += row[k] * row[k];
      const float scale = 1.f / std::sqrt(squares / K + eps);
      for (int64_t k = 0; k < K; ++k) row[k] = row[k] * scale * norm[k];
    }
  }
  const Input in = prepare(xn, M, K);
  for (int64_t m0 = 0; m0 < M; m0 += kRowsOfX) {  // these rows of x share each weight load
    at::parallel_for(0, w.N / kRows, 16, [&](int64_t b0, int64_t b1) {
      rows_of_x(std::min<int64_t>(kRowsOfX, M - m0), in, m0, w, b0, b1, out, w.N);
    });
  }
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& mins, const std::optional<at::Tensor>& norm, double eps) {
  // x [M, K] fp32, codes [N / 16, G, 128] int16, scales / mins [N / 16, G, 16] fp16,
  // norm [K] fp32 or none -> [M, N] fp32
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "q4_matmul: x must be an [M, K] fp32 matrix, got ", x.sizes(), " ",
              x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1);
  const Weights w = weights_of(codes, scales, mins, K);
  TORCH_CHECK(!norm || (norm->sizes() == at::IntArrayRef({K}) &&
                        norm->scalar_type() == at::kFloat && norm->is_contiguous()),
              "q4_matmul: the norm's weight must be a contiguous [", K, "] fp32 vector");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, w.N}, x.options());
  matmul(xc.data_ptr<float>(), M, K, w, norm ? norm->data_ptr<float>() : nullptr,
         static_cast<float>(eps), out.data_ptr<float>());
  return out;
}

// sum of a[i] b[i], in 16 partial sums the compiler keeps in one vector register
float dot(const float* a, const float* b, int64_t n) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += a[i + j] * b[i + j];
  float sum = 0.f;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (int j = 0; j < 16; ++j) sum += part[j];
  return sum;
}

// One query against keys / values 0 .. n - 1 ([S, D] each, row-major): out [D].
void attend(const float* q, const float* keys, const float* values, int64_t n, int64_t D,
            float* scores, float* out) {
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  float top = -INFINITY;
  for (int64_t t = 0; t < n; ++t) top = std::max(top, scores[t] = dot(q, keys + t * D, D) * scale);
  float total = 0.f;
  for (int64_t t = 0; t < n; ++t) total += scores[t] = std::exp(scores[t] - top);
  std::fill(out, out + D, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const float p = scores[t] / total;
    for (int64_t d = 0; d < D; ++d) out[d] += p * values[t * D + d];
  }
}

// Every decoder layer of a Llama for one token per row, at 4 bits (the draft of
// models/quantized_draft.py): x [B, dim] fp32 the token embeddings; cos / sin [B, D] the RoPE
// tables (llama.rope_tables: [cos, cos], [-sin, sin]) at each row's position; the target's cache
// k / v [L, B, Hkv, S, D] fp32, where each layer's K / V of the token are written at positions[b]
// and row b attends to keys 0 .. positions[b]; weights: per layer, for qkv (fused), wo, gate_up
// (fused) and down, Q4Weight's codes, scales, mins; norms: per layer the attention and FFN norms'
// weights. Returns the last layer's output [B, dim]. One op for the whole stack: as ~30 separate
// small ops a layer, dispatching them cost about as much as the 4-bit products.
at::Tensor q4_decode_layers(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                            at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& positions,
                            at::TensorList weights, at::TensorList norms, int64_t n_heads,
                            int64_t n_kv_heads, double eps) {
  const int64_t L = norms.size() / 2, B = x_in.size(0), dim = x_in.size(1), D = cos.size(1);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "q4_decode_layers: x must be [B, dim] fp32");
  TORCH_CHECK(weights.size() == 12 * L && norms.size() == 2 * L,
              "q4_decode_layers: 12 weight tensors (4 matrices) and 2 norms per layer expected");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->sizes() == at::IntArrayRef({B, D}) && t->scalar_type() == at::kFloat,
                "q4_decode_layers: cos and sin must be [B, head_dim] fp32");
  for (at::Tensor* t : {&k_cache, &v_cache})
    TORCH_CHECK(t->dim() == 5 && t->size(0) == L && t->size(1) == B && t->size(2) == n_kv_heads &&
                    t->size(4) == D && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "q4_decode_layers: the cache must be contiguous [", L, ", ", B, ", ", n_kv_heads,
                ", S, ", D, "] fp32 (the draft runs on an fp32 target's cache), got ",
                t->sizes(), " ", t->scalar_type());
  const int64_t S = k_cache.size(3), Hq = n_heads, Hkv = n_kv_heads, group = Hq / Hkv;
  TORCH_CHECK(positions.sizes() == at::IntArrayRef({B}) && positions.scalar_type() == at::kLong,
              "q4_decode_layers: positions must be [B] int64");
  const at::Tensor pos_c = positions.contiguous();
  const int64_t* pos = pos_c.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(pos[b] >= 0 && pos[b] < S, "q4_decode_layers: position ", pos[b],
                " is outside the cache's ", S, " slots");
  std::vector<Weights> w;
  for (int64_t j = 0; j < 4 * L; ++j) {
    const int64_t K = j % 4 == 1 ? Hq * D : (j % 4 == 3 ? weights[3 * j].size(1) * kGroup : dim);
    w.push_back(weights_of(weights[3 * j], weights[3 * j + 1], weights[3 * j + 2], K));
  }
  for (const at::Tensor& norm : norms)
    TORCH_CHECK(norm.sizes() == at::IntArrayRef({dim}) && norm.scalar_type() == at::kFloat &&
                    norm.is_contiguous(),
                "q4_decode_layers: each norm's weight must be a contiguous [", dim, "] fp32 vector");
  const int64_t hidden = w[3].G * kGroup;  // down's input features
  for (int64_t i = 0; i < L; ++i)  // the buffers below are sized by layer 0's matrices
    TORCH_CHECK(w[4 * i].N == w[0].N && w[4 * i].N >= (Hq + 2 * Hkv) * D &&
                    w[4 * i + 1].N == w[1].N && w[4 * i + 1].N >= dim &&
                    w[4 * i + 2].N == w[2].N && w[4 * i + 2].N >= 2 * hidden &&
                    w[4 * i + 3].N == w[3].N && w[4 * i + 3].N >= dim &&
                    w[4 * i + 3].G * kGroup == hidden,
                "q4_decode_layers: layer ", i, "'s matrices do not fit a Llama of dim ", dim,
                ", ", Hq, " / ", Hkv, " heads of ", D, " and FFN ", hidden,
                " (expected per layer: qkv, wo, gate_up, down, as QuantizedDraft packs them)");
  at::Tensor x = x_in.contiguous().clone();  // the residual stream
  float* xp = x.data_ptr<float>();
  const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous();
  std::vector<float> qkv(B * w[0].N), attn(B * Hq * D), proj(B * w[1].N), ffn(B * w[2].N),
      act(B * hidden), rotated(D);
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, pos[b] + 1);
  for (int64_t i = 0; i < L; ++i) {
    const float* norm_attn = norms[2 * i].data_ptr<float>();
    const float* norm_ffn = norms[2 * i + 1].data_ptr<float>();
    matmul(xp, B, dim, w[4 * i], norm_attn, eps, qkv.data());
    float* k_layer = k_cache.data_ptr<float>() + i * B * Hkv * S * D;
    float* v_layer = v_cache.data_ptr<float>() + i * B * Hkv * S * D;
    for (int64_t b = 0; b < B; ++b) {
      float* heads = qkv.data() + b * w[0].N;  // q (Hq heads), k (Hkv), v (Hkv), each D
      const float* c = cos_c.data_ptr<float>() + b * D;
      const float* s = sin_c.data_ptr<float>() + b * D;
      for (int64_t h = 0; h < Hq + Hkv; ++h) {  // rotate-half RoPE on q and k
        float* v = heads + h * D;
        for (int64_t d = 0; d < D; ++d) rotated[d] = v[d] * c[d] + v[(d + D / 2) % D] * s[d];
        std::copy(rotated.begin(), rotated.end(), v);
      }
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t slot = ((b * Hkv + h) * S + pos[b]) * D;
        std::copy_n(heads + (Hq + h) * D, D, k_layer + slot);
        std::copy_n(heads + (Hq + Hkv + h) * D, D, v_layer + slot);
      }
    }
    at::parallel_for(0, B * Hq, 1, [&](int64_t r0, int64_t r1) {
      std::vector<float> scores(longest);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / Hq, h = r % Hq, cache_row = (b * Hkv + h / group) * S * D;
        attend(qkv.data() + b * w[0].N + h * D, k_layer + cache_row, v_layer + cache_row,
               pos[b] + 1, D, scores.data(), attn.data() + r * D);
      }
    });
    matmul(attn.data(), B, Hq * D, w[4 * i + 1], nullptr, 0.f, proj.data());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t d = 0; d < dim; ++d) xp[b * dim + d] += proj[b * w[1].N + d];
    matmul(xp, B, dim, w[4 * i + 2], norm_ffn, eps, ffn.data());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t d = 0; d < hidden; ++d) {
        const float gate = ffn[b * w[2].N + d], up = ffn[b * w[2].N + hidden + d];
        act[b * hidden + d] = gate / (1.f + std::exp(-gate)) * up;  // silu(gate) * up
      }
    matmul(act.data(), B, hidden, w[4 * i + 3], nullptr, 0.f, proj.data());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t d = 0; d < dim; ++d) xp[b * dim + d] += proj[b * w[3].N + d];
  }
  return x;
}

std::string q4_matmul_path() { return kPath; }

}  // namespace

TORCH_LIBRARY(genrec_spec, m) {
  m.def(
      "q4_matmul(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? norm=None, "
      "float eps=0.0) -> Tensor",
      &q4_matmul);
  m.def(
      "q4_decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor positions, Tensor[] weights, Tensor[] norms, int n_heads, int n_kv_heads, "
      "float eps) -> Tensor",
      &q4_decode_layers);
  m.def("q4_matmul_path() -> str", &q4_matmul_path);
}
