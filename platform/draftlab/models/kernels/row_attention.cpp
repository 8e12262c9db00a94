// Row-exact attention on CPU: each verified row computed alone, as a decoding step computes it.
//
// out[r, h] = softmax(q[r, h] . k[idx[r, :cnt[r]]] * scale) @ v[idx[r, :cnt[r]]], for every
// row r and query head h (GQA: head h reads kv head h / (heads / kv_heads), as HF's
// repeat_kv groups them). A row's keys are read in its own order (the context, then its
// tree ancestors and itself) and its arithmetic is a fixed sequence of float32 operations
// on those keys alone: the same bits whatever rows sit beside it, however many threads run,
// and wherever the cache lies in memory. So a decoding step (one row) and a verify block
// (any rows) agree bit for bit, without padding or copying keys per row.
//
// Vectors are GCC vector extensions (64 bytes): AVX-512 where -march=native has it, pairs of
// AVX2 registers elsewhere. Built at first use by `row_kernel.py`.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <vector>

typedef float f16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32)));
typedef int32_t i16v __attribute__((vector_size(64)));

static inline f16v load(const float* p) { f16v x; std::memcpy(&x, p, sizeof(x)); return x; }
static inline f16v load(const at::BFloat16* p) {
#ifdef __AVX512F__
  // One widening move: GCC splits the generic conversion below into four shuffles, which
  // bound the kernel's speed (the same values: 10-20% faster on a Xeon with AVX-512).
  __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
  f16v x; std::memcpy(&x, &w, sizeof(x)); return x;
#else
  h16v h; std::memcpy(&h, p, sizeof(h));
  u16v w = __builtin_convertvector(h, u16v) << 16;
  f16v x; std::memcpy(&x, &w, sizeof(x)); return x;
#endif
}
static inline void store(float* p, f16v x) { std::memcpy(p, &x, sizeof(x)); }
static inline float hsum(f16v a) {
  float r[16]; std::memcpy(r, &a, sizeof(r));
  float b[8], c[4];
  for (int l = 0; l < 8; ++l) b[l] = r[l] + r[l + 8];
  for (int l = 0; l < 4; ++l) c[l] = b[l] + b[l + 4];
  return (c[0] + c[2]) + (c[1] + c[3]);
}
static inline float hmax(f16v a) {
  float r[16]; std::memcpy(r, &a, sizeof(r));
  float m = r[0];
  for (int l = 1; l < 16; ++l) m = r[l] > m ? r[l] : m;
  return m;
}
// Lane sums of 16 vectors: out[l] = sum of a[l]'s lanes, by the same fixed tree for every l.
static inline f16v sum16(f16v* a) {
  const i16v lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const i16v hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const i16v lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const i16v hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const i16v lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const i16v hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const i16v lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const i16v hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  f16v b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo1) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi1);
  for (int i = 0; i < 4; ++i) c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo2) + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi2);
  for (int i = 0; i < 2; ++i) d[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1], lo3) + __builtin_shuffle(c[2 * i], c[2 * i + 1], hi3);
  return __builtin_shuffle(d[0], d[1], lo4) + __builtin_shuffle(d[0], d[1], hi4);
}
// exp(x) for x <= 0 on 16 lanes: the same float operations in every lane.
static inline f16v exp_nonpos(f16v x) {
  const f16v lo = f16v{} - 87.0f;
  x = x < lo ? lo : x;
  f16v t = x * 1.44269504088896341f + 0.5f;
  f16v n = __builtin_convertvector(__builtin_convertvector(t, i16v), f16v);
  n = n > t ? n - 1.0f : n;  // floor
  f16v r = x - n * 0.693359375f + n * 2.12194440e-4f;
  f16v p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  i16v bits = (__builtin_convertvector(n, i16v) + 127) << 23;
  f16v scale; std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// One task = one row and HB query heads of one KV head: the heads share every K and V
// row the task loads and converts; each head's arithmetic is its own fixed sequence.
template <typename T, int C, int HB>
static void rows_kernel(const float* q, const T* k, const T* v, const int64_t* idx, const int64_t* cnt,
                        float* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t keys,
                        int64_t stride, float scale) {
  constexpr int64_t D = 16 * C;
  const int64_t G = heads / kv_heads, chunks = G / HB, per_row = kv_heads * chunks;
  at::parallel_for(0, rows * per_row, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s;
    f16v a[HB][16];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / per_row, g = (task % per_row) / chunks;
      const int64_t h0 = g * G + (task % chunks) * HB;  // first query head of this task
      const int64_t n = cnt[r];
      const int64_t npad = (n + 15) / 16 * 16;
      const int64_t* ix = idx + r * stride;  // stride 0: every row reads one index row
      const T* kb = k + g * keys * D;
      const T* vb = v + g * keys * D;
      f16v qv[HB][C];
      for (int h = 0; h < HB; ++h)
        for (int c = 0; c < C; ++c) qv[h][c] = load(q + (r * heads + h0 + h) * D + c * 16) * scale;
      s.resize(HB * npad);
      f16v mx[HB];
      for (int h = 0; h < HB; ++h) mx[h] = f16v{} - INFINITY;
      for (int64_t j0 = 0; j0 < npad; j0 += 16) {
        for (int l = 0; l < 16; ++l) {
          if (j0 + l < n) {
            const T* kj = kb + ix[j0 + l] * D;
            f16v kc[C];
            for (int c = 0; c < C; ++c) kc[c] = load(kj + c * 16);
            for (int h = 0; h < HB; ++h) {
              f16v x = qv[h][0] * kc[0];
              for (int c = 1; c < C; ++c) x += qv[h][c] * kc[c];
              a[h][l] = x;
            }
          } else {
            for (int h = 0; h < HB; ++h) a[h][l] = f16v{} - INFINITY;  // past the row's keys
          }
        }
        for (int h = 0; h < HB; ++h) {
          const f16v sc = sum16(a[h]);
          store(s.data() + h * npad + j0, sc);
          mx[h] = sc > mx[h] ? sc : mx[h];
        }
      }
      float total[HB];
      for (int h = 0; h < HB; ++h) {
        const float m = hmax(mx[h]);
        f16v tot = {0};
        float* sh = s.data() + h * npad;
        for (int64_t j0 = 0; j0 < npad; j0 += 16) {
          const f16v sc = load(sh + j0);
          f16v e = exp_nonpos(sc - m);
          e = sc == -INFINITY ? f16v{} : e;
          store(sh + j0, e);
          tot += e;
        }
        total[h] = hsum(tot);
      }
      f16v acc[HB][C];
      for (int h = 0; h < HB; ++h)
        for (int c = 0; c < C; ++c) acc[h][c] = f16v{};
      for (int64_t j = 0; j < n; ++j) {
        const T* vj = vb + ix[j] * D;
        f16v vc[C];
        for (int c = 0; c < C; ++c) vc[c] = load(vj + c * 16);
        for (int h = 0; h < HB; ++h) {
          const float p = s[h * npad + j];
          for (int c = 0; c < C; ++c) acc[h][c] += p * vc[c];
        }
      }
      for (int h = 0; h < HB; ++h)
        for (int c = 0; c < C; ++c) store(out + (r * heads + h0 + h) * D + c * 16, acc[h][c] / total[h]);
    }
  });
}

template <typename T, int C>
static void by_group(const float* q, const T* k, const T* v, const int64_t* idx, const int64_t* cnt, float* out,
                     int64_t rows, int64_t heads, int64_t kv_heads, int64_t keys, int64_t stride, float scale) {
  const int64_t G = heads / kv_heads;  // query heads per KV head, shared out in tasks of HB
  if (G % 4 == 0) rows_kernel<T, C, 4>(q, k, v, idx, cnt, out, rows, heads, kv_heads, keys, stride, scale);
  else if (G % 3 == 0) rows_kernel<T, C, 3>(q, k, v, idx, cnt, out, rows, heads, kv_heads, keys, stride, scale);
  else if (G % 2 == 0) rows_kernel<T, C, 2>(q, k, v, idx, cnt, out, rows, heads, kv_heads, keys, stride, scale);
  else rows_kernel<T, C, 1>(q, k, v, idx, cnt, out, rows, heads, kv_heads, keys, stride, scale);
}

template <typename T>
static void dispatch(torch::Tensor& q, torch::Tensor& k, torch::Tensor& v, torch::Tensor& idx, torch::Tensor& cnt, torch::Tensor& out, float scale) {
  const int64_t T_ = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(0), S = k.size(1), W = idx.stride(0);
  auto args = [&](auto kern) {
    kern(q.data_ptr<float>(), (const T*)k.data_ptr(), (const T*)v.data_ptr(), idx.data_ptr<int64_t>(), cnt.data_ptr<int64_t>(),
         out.data_ptr<float>(), T_, H, KV, S, W, scale);
  };
  switch (D) {
    case 16: args(by_group<T, 1>); break;
    case 32: args(by_group<T, 2>); break;
    case 64: args(by_group<T, 4>); break;
    case 128: args(by_group<T, 8>); break;
    default: TORCH_CHECK(false, "row attention supports head sizes 16, 32, 64, 128, got ", D);
  }
}

// q (T, H, D) float32; k, v (KV, S, D) bfloat16 or float32; idx (T or 1, W) int64 key
// indices (a single row: shared by all); cnt (T,) int64 keys per row -> (T, H, D) float32.
// All contiguous (checked by the caller).
torch::Tensor rows_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor idx,
                             torch::Tensor cnt, double scale) {
  TORCH_CHECK(q.size(1) % k.size(0) == 0, "query heads (", q.size(1), ") must be a multiple of KV heads (", k.size(0), ")");
  if (idx.size(0) == 1) idx = idx.expand({q.size(0), idx.size(1)});  // stride 0
  auto out = torch::empty_like(q);
  if (k.scalar_type() == at::kBFloat16) dispatch<at::BFloat16>(q, k, v, idx, cnt, out, (float)scale);
  else dispatch<float>(q, k, v, idx, cnt, out, (float)scale);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rows_attention", &rows_attention, "every row's attention over its own keys (float32 out)");
}
