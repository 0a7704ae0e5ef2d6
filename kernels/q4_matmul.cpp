// x @ W.T for a 4-bit weight matrix W (llama.cpp's Q4_0 / Q4_1 codes: w = code * scale + min per
// group of 32 along K), x fp32 rounded to bfloat16 (optionally RMS-normalised first: the norm
// that precedes every matrix of a Llama layer, fused here because as separate ops it cost more
// than the products), the output in fp32. Built by q4_matmul.py; see there for why it exists
// and what it measures.
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
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 16;  // output rows per block
constexpr int64_t kGroup = 32;  // weights per scale
// Groups prefetched ahead (4 KB of codes): at one row the loop runs near memory bandwidth and the
// hardware prefetcher alone leaves it ~25% short (SmolLM2's layers: 4.9 vs 6.1-7.1 ms, medians).
constexpr int64_t kAhead = 16;

// One matrix in the layout above.
struct Weights {
  const int16_t* codes;
  const at::Half* scales;
  const at::Half* mins;
  int64_t G;  // groups per row: K / 32
};

#if defined(__AVX512BF16__)
// MB rows of x against row blocks b0 .. b1 - 1. t[m][p] keeps four independent chains of dot
// products per row of x (the instruction's latency is ~6 cycles, its throughput 1 a cycle).
template <int MB>
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
      const int16_t* q_bg = w.codes + (b * G + g) * 4 * 32;
      for (int line = 0; line < 4; ++line)  // a group's codes are 4 cache lines
        _mm_prefetch((const char*)(q_bg + kAhead * 128) + 64 * line, _MM_HINT_T0);
      _mm_prefetch((const char*)(w.scales + (b * G + g + kAhead) * kRows), _MM_HINT_T0);
      _mm_prefetch((const char*)(w.mins + (b * G + g + kAhead) * kRows), _MM_HINT_T0);
      __m512i q[4];
      for (int p = 0; p < 4; ++p) q[p] = _mm512_loadu_si512(q_bg + p * 32);
      __m512 t[MB][4];
      for (int m = 0; m < MB; ++m)
        for (int p = 0; p < 4; ++p) t[m][p] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          // (q >> 4 s) & 0xF | 0x4300; 0xEA is the ternary-logic table of A & B | C.
          const __m512i shifted = s ? _mm512_srli_epi16(q[p], 4 * s) : q[p];
          const __m512i codes = _mm512_ternarylogic_epi32(shifted, low4, bf16_128, 0xEA);
          for (int m = 0; m < MB; ++m) {
            const __m512i xi = _mm512_set1_epi32(pairs[(m * K + g * kGroup) / 2 + p + 4 * s]);
            t[m][p] = _mm512_dpbf16_ps(t[m][p], (__m512bh)codes, (__m512bh)xi);
          }
        }
      }
      const int64_t lanes = (b * G + g) * kRows;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w.scales + lanes)));
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w.mins + lanes)));
      const __m512 offset = _mm512_fmadd_ps(minus_128, d, mn);
      for (int m = 0; m < MB; ++m) {
        const __m512 dots =
            _mm512_add_ps(_mm512_add_ps(t[m][0], t[m][1]), _mm512_add_ps(t[m][2], t[m][3]));
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
    default: return blocks<4>(x, xsum, K, w, b0, b1, out, N);
  }
}
constexpr bool kVectorized = true;
#else
// Without AVX512-BF16: the same sums in the same layout, one weight at a time (correct
// everywhere, several times slower).
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
constexpr bool kVectorized = false;
#endif

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& mins, const std::optional<at::Tensor>& norm, double eps) {
  // x [M, K] fp32, codes [N / 16, G, 128] int16, scales / mins [N / 16, G, 16] fp16,
  // norm [K] fp32 or none -> [M, N] fp32
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "q4_matmul: x must be an [M, K] fp32 matrix, got ", x.sizes(), " ",
              x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup, NB = codes.size(0), N = NB * kRows;
  TORCH_CHECK(K % kGroup == 0 && codes.dim() == 3 && codes.size(1) == G &&
                  codes.size(2) == 4 * 32 && codes.scalar_type() == at::kShort &&
                  codes.is_contiguous(),
              "q4_matmul: codes of shape ", codes.sizes(), " do not fit x of shape ", x.sizes(),
              " (expected [N / 16, ", G, ", 128] int16, from Q4Codes.pack)");
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->sizes() == at::IntArrayRef({NB, G, kRows}) &&
                    t->scalar_type() == at::kHalf && t->is_contiguous(),
                "q4_matmul: scales and mins must be contiguous [", NB, ", ", G, ", 16] fp16");
  TORCH_CHECK(!norm || (norm->sizes() == at::IntArrayRef({K}) &&
                        norm->scalar_type() == at::kFloat && norm->is_contiguous()),
              "q4_matmul: the norm's weight must be a contiguous [", K, "] fp32 vector");
  // x in bfloat16 (after the RMS norm), and its sums per group for the offsets: [M, K], [M, G]
  const at::Tensor x32 = x.contiguous();
  std::vector<at::BFloat16> xb(M * K);
  std::vector<float> xsum(M * G, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x32.data_ptr<float>() + m * K;
    float scale = 1.f;
    if (norm) {
      float squares = 0.f;
      for (int64_t k = 0; k < K; ++k) squares += row[k] * row[k];
      scale = 1.f / std::sqrt(squares / K + static_cast<float>(eps));
    }
    for (int64_t k = 0; k < K; ++k) {
      const float v = norm ? row[k] * scale * norm->data_ptr<float>()[k] : row[k];
      xb[m * K + k] = at::BFloat16(v);
      xsum[m * G + k / kGroup] += static_cast<float>(xb[m * K + k]);
    }
  }
  at::Tensor out = at::empty({M, N}, x.options());
  const Weights w{codes.data_ptr<int16_t>(), scales.data_ptr<at::Half>(),
                  mins.data_ptr<at::Half>(), G};
  for (int64_t m0 = 0; m0 < M; m0 += 4) {  // 4 rows of x at a time share each weight load
    at::parallel_for(0, NB, 16, [&](int64_t b0, int64_t b1) {
      rows_of_x(std::min<int64_t>(4, M - m0), xb.data() + m0 * K, xsum.data() + m0 * G, K, w,
                b0, b1, out.data_ptr<float>() + m0 * N, N);
    });
  }
  return out;
}

bool q4_matmul_vectorized() { return kVectorized; }

}  // namespace

TORCH_LIBRARY(genrec_spec, m) {
  m.def(
      "q4_matmul(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? norm=None, "
      "float eps=0.0) -> Tensor",
      &q4_matmul);
  m.def("q4_matmul_vectorized() -> bool", &q4_matmul_vectorized);
}
