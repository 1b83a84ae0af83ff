// CPU kernel of the synthetic world's ray caster (schema: csrc/ops.cpp; Python wrapper and numpy reference:
// bev/synthetic/native.py, bev/synthetic/raycast.py).
//
// _raycast_zbuffer casts the rays of one camera (or of the LiDAR's panorama) against axis-aligned boxes
// ("parts"), each part against the rays of its own rectangle of the image, and keeps per ray the least z-buffer
// key over the ground and the parts: (float32 depth bits << 32) | (part + 1), the ground's part field 0. It is
// bev.synthetic.raycast's _slab + zbuffer + _front in one pass, with the same float32 operations in the same
// order (no FMA contraction, numpy's fmin/fmax NaN rules), so its keys equal the numpy caster's bit for bit.
// Optionally the entry face of each ray's winning part, and per group of parts (an annotated object) the rays
// any of its parts hits whatever lies in front (raycast._coverage).
//
// Rows of the image are independent: at::parallel_for over rows, each row's z-buffer and coverage stamps owned
// by one thread; parts are visited in group order so that one stamp per ray counts each ray once per group.
//
// _raycast_shade then writes the rays the parts won into the camera's depth, id and colour buffers (raycast._colours
// and render_camera's writes, glass included), again with numpy's float operations. _raycast_rgb8 turns a render
// into the 8-bit pixels its JPEG is encoded from (sensors.camera_jpeg).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <tuple>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace bev {
namespace {

constexpr float kNear = 0.1f;  // raycast.NEAR, compared in float32 as numpy does (float32 array > Python float)
constexpr int64_t kRowBlock = 8;  // rows per block of work: the parts meeting a block are listed once for it

// np.fmin / np.fmax: a NaN operand yields the other one.
inline float nan_min(float a, float b) { return ((a < b) | (b != b)) ? a : b; }
inline float nan_max(float a, float b) { return ((a > b) | (b != b)) ? a : b; }

// int64_t(std::floor(x)) for x within int64's range (NaN: the same INT64_MIN the x86 conversion gives), without
// the libm call the default x86-64 target (no SSE4.1 roundss) makes for std::floor.
inline int64_t floor_int(float x) {
  const int64_t i = int64_t(x);
  return i - int64_t(x < float(i));
}

inline int32_t float_bits(float x) {
  int32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

struct Part {  // per-part values: yaw cos, sin; slab bounds (-half - o, half - o) along the part's axes
  float c, s, near[3], far[3];
};

// One row's z-buffer while it is cast, as int32 planes updated lane by lane: the least key's depth bits and part
// field (the key's two halves), the winner's entry face, and per ray the last coverage group that hit it.
struct Row {
  int32_t *bits, *id, *face, *stamp;
};

// A run of rays: x, y, z components and 1 / z, which is the same for every part (computed once per image row).
struct Rays {
  const float *x, *y, *z, *iz;
};

// The slab test of rays [i0, n) of a run (x, y, z components rx, ry, rz) against part q (part field id, coverage
// group g), folded into the row: a hit nearer than the row's key (or as near with a smaller part field) takes the
// ray; with cover, the rays it hits that its group had not hit yet are counted (the count is returned). The
// float32 operations are numpy's (raycast._slab_chunk) one by one: products and sums round separately (no FMA:
// neither the default x86-64 target nor the AVX2 one below has it), fmin/fmax keep the non-NaN operand.
int64_t slab_scalar(const Part& q, const Rays& ray, int64_t i0, int64_t n, int32_t id, int32_t g, bool cover, Row row) {
  const float *rx = ray.x, *ry = ray.y, *rz = ray.z;
  int64_t counted = 0;
  for (int64_t i = i0; i < n; ++i) {
    const float d0 = rx[i] * q.c + ry[i] * q.s;  // the ray along the part's axes (raycast._directions)
    const float d1 = ry[i] * q.c - rx[i] * q.s;
    const float d2 = rz[i];
    const float v0 = 1.0f / d0, v1 = 1.0f / d1, v2 = ray.iz[i];
    const float a0 = q.near[0] * v0, b0 = q.far[0] * v0;
    const float a1 = q.near[1] * v1, b1 = q.far[1] * v1;
    const float a2 = q.near[2] * v2, b2 = q.far[2] * v2;
    const float lo0 = nan_min(a0, b0), hi0 = nan_max(a0, b0);
    const float lo1 = nan_min(a1, b1), hi1 = nan_max(a1, b1);
    const float lo2 = nan_min(a2, b2), hi2 = nan_max(a2, b2);
    const float tnear = nan_max(nan_max(lo0, lo1), lo2);
    const float tfar = nan_min(nan_min(hi0, hi1), hi2);
    if (!(tnear <= tfar && tnear > kNear)) continue;
    if (cover && row.stamp[i] != g) {
      row.stamp[i] = g;
      ++counted;
    }
    // Keys order by (depth bits, part field); a hit's depth is positive, and positive floats order as their bits.
    const int32_t bits = float_bits(tnear);
    if (bits < row.bits[i] || (bits == row.bits[i] && id < row.id[i])) {
      row.bits[i] = bits;
      row.id[i] = id;
      // The entry face: the axis whose slab was entered last (the last on a tie); + face when travelling to -axis.
      const int32_t f = lo1 == tnear ? 2 + (d1 < 0) : (d0 < 0);
      row.face[i] = lo2 == tnear ? 4 + (d2 < 0) : f;
    }
  }
  return counted;
}

#if defined(__x86_64__)
#define BEV_AVX2 __attribute__((target("avx2"), always_inline)) inline

BEV_AVX2 __m256 fmin8(__m256 a, __m256 b) {  // nan_min: a where a < b or b is NaN
  return _mm256_blendv_ps(b, a, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_LT_OQ), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
}

BEV_AVX2 __m256 fmax8(__m256 a, __m256 b) {  // nan_max
  return _mm256_blendv_ps(b, a, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
}

BEV_AVX2 __m256i negative(__m256 d) {  // 1 where d < 0, else 0
  return _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_LT_OQ)), _mm256_set1_epi32(1));
}

// The slab's near and far distances of eight rays from the six bound products: nan_min / nan_max in slab_scalar's
// order. Without NaN operands those are minps / maxps (x < y ? x : y, in this operand order), so the four-op blends
// run only for blocks where a product is NaN (a slab bound of 0 with the ray parallel to it: rare).
BEV_AVX2 void slab_span(__m256 a0, __m256 b0, __m256 a1, __m256 b1, __m256 a2, __m256 b2, __m256& tnear,
                        __m256& tfar, __m256& lo1, __m256& lo2) {
  const __m256 nan = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(a0, b0, _CMP_UNORD_Q), _mm256_cmp_ps(a1, b1, _CMP_UNORD_Q)),
                                  _mm256_cmp_ps(a2, b2, _CMP_UNORD_Q));
  if (_mm256_testz_ps(nan, nan)) {
    lo1 = _mm256_min_ps(a1, b1), lo2 = _mm256_min_ps(a2, b2);
    tnear = _mm256_max_ps(_mm256_max_ps(_mm256_min_ps(a0, b0), lo1), lo2);
    tfar = _mm256_min_ps(_mm256_min_ps(_mm256_max_ps(a0, b0), _mm256_max_ps(a1, b1)), _mm256_max_ps(a2, b2));
    return;
  }
  lo1 = fmin8(a1, b1), lo2 = fmin8(a2, b2);
  tnear = fmax8(fmax8(fmin8(a0, b0), lo1), lo2);
  tfar = fmin8(fmin8(fmax8(a0, b0), fmax8(a1, b1)), fmax8(a2, b2));
}

// Eight lanes of rays: whole blocks load and store plainly; a run's last partial block (kTail) masks its lanes (they
// load 0 and never hit), so that no ray is left to the scalar loop (rectangles are ~20 rays wide: ~6% of the world's
// slab pairs fell to it, at several times a lane's cost).
template <bool kTail>
BEV_AVX2 __m256 load8(const float* p, __m256i lanes) {
  return kTail ? _mm256_maskload_ps(p, lanes) : _mm256_loadu_ps(p);
}

template <bool kTail>
BEV_AVX2 __m256i load8(const int32_t* p, __m256i lanes) {
  return kTail ? _mm256_maskload_epi32(p, lanes) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

template <bool kTail>
BEV_AVX2 void store8(int32_t* p, __m256i lanes, __m256i v) {
  if (kTail)
    _mm256_maskstore_epi32(p, lanes, v);
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
}

struct Slab8 {  // a part's values broadcast to eight lanes
  __m256 c, s, near0, near1, near2, far0, far1, far2;
  __m256i ids, group;
};

// slab_scalar on the eight rays from i (the lanes of `lanes` only when kTail); returns the coverage count.
template <bool kTail>
BEV_AVX2 int64_t slab8(const Slab8& k, const Rays& ray, int64_t i, __m256i lanes, bool cover, Row row) {
  const __m256 x = load8<kTail>(ray.x + i, lanes), y = load8<kTail>(ray.y + i, lanes);
  const __m256 v2 = load8<kTail>(ray.iz + i, lanes), one = _mm256_set1_ps(1.0f);
  const __m256 d0 = _mm256_add_ps(_mm256_mul_ps(x, k.c), _mm256_mul_ps(y, k.s));
  const __m256 d1 = _mm256_sub_ps(_mm256_mul_ps(y, k.c), _mm256_mul_ps(x, k.s));
  const __m256 v0 = _mm256_div_ps(one, d0), v1 = _mm256_div_ps(one, d1);
  __m256 tnear, tfar, lo1, lo2;
  slab_span(_mm256_mul_ps(k.near0, v0), _mm256_mul_ps(k.far0, v0), _mm256_mul_ps(k.near1, v1),
            _mm256_mul_ps(k.far1, v1), _mm256_mul_ps(k.near2, v2), _mm256_mul_ps(k.far2, v2), tnear, tfar, lo1, lo2);
  __m256 hit_ps =
      _mm256_and_ps(_mm256_cmp_ps(tnear, tfar, _CMP_LE_OQ), _mm256_cmp_ps(tnear, _mm256_set1_ps(kNear), _CMP_GT_OQ));
  if (kTail) hit_ps = _mm256_and_ps(hit_ps, _mm256_castsi256_ps(lanes));
  if (_mm256_testz_ps(hit_ps, hit_ps)) return 0;  // no lane hits (the sign bits of the masks)
  const __m256i hit = _mm256_castps_si256(hit_ps);
  int64_t counted = 0;
  if (cover) {
    const __m256i old = load8<kTail>(row.stamp + i, lanes);
    const __m256i fresh = _mm256_andnot_si256(_mm256_cmpeq_epi32(old, k.group), hit);
    counted = __builtin_popcount(_mm256_movemask_ps(_mm256_castsi256_ps(fresh)));
    store8<kTail>(row.stamp + i, lanes, _mm256_blendv_epi8(old, k.group, fresh));
  }
  const __m256i bits = _mm256_castps_si256(tnear);
  const __m256i old_bits = load8<kTail>(row.bits + i, lanes), old_id = load8<kTail>(row.id + i, lanes);
  const __m256i nearer = _mm256_or_si256(
      _mm256_cmpgt_epi32(old_bits, bits),
      _mm256_and_si256(_mm256_cmpeq_epi32(old_bits, bits), _mm256_cmpgt_epi32(old_id, k.ids)));
  const __m256i wins = _mm256_and_si256(hit, nearer);
  if (_mm256_testz_si256(wins, wins)) return counted;  // hits, all behind what the rays already show
  store8<kTail>(row.bits + i, lanes, _mm256_blendv_epi8(old_bits, bits, wins));
  store8<kTail>(row.id + i, lanes, _mm256_blendv_epi8(old_id, k.ids, wins));
  // The entry face as in slab_scalar: lo2 == tnear ? 4 + (d2 < 0) : lo1 == tnear ? 2 + (d1 < 0) : (d0 < 0).
  __m256i f = negative(d0);
  f = _mm256_blendv_epi8(f, _mm256_add_epi32(_mm256_set1_epi32(2), negative(d1)),
                         _mm256_castps_si256(_mm256_cmp_ps(lo1, tnear, _CMP_EQ_OQ)));
  f = _mm256_blendv_epi8(f, _mm256_add_epi32(_mm256_set1_epi32(4), negative(load8<kTail>(ray.z + i, lanes))),
                         _mm256_castps_si256(_mm256_cmp_ps(lo2, tnear, _CMP_EQ_OQ)));
  store8<kTail>(row.face + i, lanes, _mm256_blendv_epi8(load8<kTail>(row.face + i, lanes), f, wins));
  return counted;
}

// slab_scalar eight rays at a time (AVX2), the last n % 8 in one masked block.
__attribute__((target("avx2"))) int64_t slab_avx2(const Part& q, const Rays& ray, int64_t n, int32_t id, int32_t g,
                                                  bool cover, Row row) {
  const Slab8 k{_mm256_set1_ps(q.c),       _mm256_set1_ps(q.s),       _mm256_set1_ps(q.near[0]),
                _mm256_set1_ps(q.near[1]), _mm256_set1_ps(q.near[2]), _mm256_set1_ps(q.far[0]),
                _mm256_set1_ps(q.far[1]),  _mm256_set1_ps(q.far[2]),  _mm256_set1_epi32(id),
                _mm256_set1_epi32(g)};
  const __m256i all = _mm256_set1_epi32(-1);
  int64_t counted = 0, i = 0;
  for (; i + 8 <= n; i += 8) counted += slab8<false>(k, ray, i, all, cover, row);
  if (i < n) {  // lanes j < n - i
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(n - i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    counted += slab8<true>(k, ray, i, lanes, cover, row);
  }
  return counted;
}
#endif

using SlabRun = int64_t (*)(const Part&, const Rays&, int64_t, int32_t, int32_t, bool, Row);

int64_t slab_plain(const Part& q, const Rays& ray, int64_t n, int32_t id, int32_t g, bool cover, Row row) {
  return slab_scalar(q, ray, 0, n, id, g, cover, row);
}

// The slab loop this CPU runs: AVX2 where it has it, unless BEV_RAYCAST_SCALAR=1 (the tests compare the two).
SlabRun slab_run() {
#if defined(__x86_64__)
  const char* scalar = std::getenv("BEV_RAYCAST_SCALAR");
  if (__builtin_cpu_supports("avx2") && !(scalar && scalar[0] == '1')) return &slab_avx2;
#endif
  return &slab_plain;
}

// A row's ground keys into the row buffers (depth bits, part field 0); the row buffers hold a key's halves as int32.
void load_ground(const int64_t* ground, int64_t base, int64_t W, Row line) {
  const int64_t* g = ground + base;
  int64_t any = 0;  // the bits set in any key: a part field >= 2**31 sets bit 31 (one test per row)
  for (int64_t x = 0; x < W; ++x) {
    line.bits[x] = int32_t(g[x] >> 32);
    line.id[x] = int32_t(g[x] & 0xFFFFFFFF);
    any |= g[x];
  }
  if (!(any & 0x80000000)) return;
  for (int64_t x = 0; x < W; ++x)
    TORCH_CHECK((g[x] & 0xFFFFFFFF) < (int64_t(1) << 31), "_raycast_zbuffer: ground_key[", base + x, "] = ", g[x],
                " has a part field (low half) >= 2**31");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> raycast_zbuffer_cpu(const at::Tensor& rays, const at::Tensor& parts,
                                                                   const at::Tensor& rects,
                                                                   const at::Tensor& ground_key,
                                                                   const at::Tensor& group, int64_t num_groups,
                                                                   bool faces) {
  TORCH_CHECK(rays.device().is_cpu() && parts.device().is_cpu() && rects.device().is_cpu() &&
                  ground_key.device().is_cpu() && group.device().is_cpu(),
              "_raycast_zbuffer: every tensor must be on the CPU");
  TORCH_CHECK(rays.scalar_type() == at::kFloat && rays.dim() == 3 && rays.size(0) == 3 && rays.is_contiguous(),
              "_raycast_zbuffer: rays must be contiguous float32 (3, H, W) planes, got ", rays.scalar_type(), " ",
              rays.sizes());
  const int64_t H = rays.size(1), W = rays.size(2);
  TORCH_CHECK(parts.scalar_type() == at::kFloat && parts.dim() == 2 && parts.size(1) == 8 && parts.is_contiguous(),
              "_raycast_zbuffer: parts must be contiguous float32 (P, 8) [cos, sin, near xyz, far xyz], got ",
              parts.scalar_type(), " ", parts.sizes());
  const int64_t P = parts.size(0);
  TORCH_CHECK(rects.scalar_type() == at::kLong && rects.dim() == 2 && rects.size(0) == P && rects.size(1) == 4 &&
                  rects.is_contiguous(),
              "_raycast_zbuffer: rects must be contiguous int64 (P, 4) [r0, r1, c0, c1) with P = ", P, ", got ",
              rects.scalar_type(), " ", rects.sizes());
  TORCH_CHECK(ground_key.scalar_type() == at::kLong && ground_key.dim() == 1 && ground_key.size(0) == H * W &&
                  ground_key.is_contiguous(),
              "_raycast_zbuffer: ground_key must be contiguous int64 (H * W) = (", H * W, "), got ",
              ground_key.scalar_type(), " ", ground_key.sizes());
  TORCH_CHECK(group.scalar_type() == at::kLong && group.dim() == 1 && group.size(0) == P && group.is_contiguous(),
              "_raycast_zbuffer: group must be contiguous int64 (P) = (", P, "), got ", group.scalar_type(), " ",
              group.sizes());
  TORCH_CHECK(num_groups >= 0, "_raycast_zbuffer: num_groups must be >= 0, got ", num_groups);
  TORCH_CHECK(P < (int64_t(1) << 31) - 1 && num_groups < (int64_t(1) << 31),
              "_raycast_zbuffer: too many parts or groups: ", P, ", ", num_groups);

  const auto* R = rects.data_ptr<int64_t>();
  const auto* G = group.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) {
    const int64_t* r = R + 4 * p;
    TORCH_CHECK(0 <= r[0] && r[0] <= r[1] && r[1] <= H && 0 <= r[2] && r[2] <= r[3] && r[3] <= W,
                "_raycast_zbuffer: rect ", p, " [", r[0], ", ", r[1], ", ", r[2], ", ", r[3],
                ") is not within the (", H, ", ", W, ") image");
    TORCH_CHECK(G[p] >= -1 && G[p] < num_groups, "_raycast_zbuffer: group[", p, "] = ", G[p],
                " is not in [-1, num_groups = ", num_groups, ")");
  }

  const int64_t* ground = ground_key.data_ptr<int64_t>();  // (its part fields are checked row by row as they load)
  auto key = at::empty({H * W}, rays.options().dtype(at::kLong));
  auto face = at::empty({faces ? H * W : 0}, rays.options().dtype(at::kChar));
  auto coverage = at::zeros({num_groups}, rays.options().dtype(at::kLong));

  // Parts in group order (stable: the ungrouped first), only those whose rectangle holds rays.
  std::vector<int64_t> order;
  order.reserve(P);
  for (int64_t p = 0; p < P; ++p)
    if (R[4 * p + 1] > R[4 * p] && R[4 * p + 3] > R[4 * p + 2]) order.push_back(p);
  std::stable_sort(order.begin(), order.end(), [G](int64_t a, int64_t b) { return G[a] < G[b]; });

  const auto* part = reinterpret_cast<const Part*>(parts.data_ptr<float>());
  const float* rx_all = rays.data_ptr<float>();
  const float* ry_all = rx_all + H * W;
  const float* rz_all = ry_all + H * W;
  int64_t* best_all = key.data_ptr<int64_t>();
  int8_t* face_all = faces ? face.data_ptr<int8_t>() : nullptr;
  int64_t* cover = coverage.data_ptr<int64_t>();
  std::mutex cover_lock;

  const SlabRun run = slab_run();
  at::parallel_for(0, H, kRowBlock, [&](int64_t row0, int64_t row1) {
    std::vector<int64_t> counts(num_groups, 0), active;
    std::vector<int32_t> buffers(4 * W);
    std::vector<float> inverse_z(W);
    const Row line{buffers.data(), buffers.data() + W, buffers.data() + 2 * W, buffers.data() + 3 * W};
    for (int64_t block = row0; block < row1; block += kRowBlock) {
      const int64_t block_end = std::min(block + kRowBlock, row1);
      active.clear();  // the parts whose rectangles meet these rows, still in group order
      for (int64_t p : order)
        if (R[4 * p] < block_end && R[4 * p + 1] > block) active.push_back(p);
      for (int64_t row = block; row < block_end; ++row) {
        const int64_t base = row * W;
        load_ground(ground, base, W, line);
        for (int64_t x = 0; x < W; ++x) inverse_z[x] = 1.0f / rz_all[base + x];
        std::fill(line.face, line.face + W, 0);
        std::fill(line.stamp, line.stamp + W, -1);
        for (int64_t p : active) {
          const int64_t* r = R + 4 * p;
          if (row < r[0] || row >= r[1]) continue;
          const int64_t c0 = r[2], g = G[p];
          const Row at{line.bits + c0, line.id + c0, line.face + c0, line.stamp + c0};
          const Rays ray{rx_all + base + c0, ry_all + base + c0, rz_all + base + c0, inverse_z.data() + c0};
          const int64_t hits = run(part[p], ray, r[3] - c0, int32_t(p + 1), int32_t(g), g >= 0, at);
          if (g >= 0) counts[g] += hits;
        }
        int64_t* best = best_all + base;
        for (int64_t x = 0; x < W; ++x) best[x] = (int64_t(line.bits[x]) << 32) | uint32_t(line.id[x]);
        if (faces)
          for (int64_t x = 0; x < W; ++x) face_all[base + x] = int8_t(line.face[x]);
      }
    }
    if (num_groups > 0) {
      std::lock_guard<std::mutex> hold(cover_lock);
      for (int64_t g = 0; g < num_groups; ++g) cover[g] += counts[g];
    }
  });
  return {key, face, coverage};
}

// fmod(a, b) for b > 0 without libm's call: fmod is exact, and so is |a| - n * b in float64 for n = trunc(|a| / b)
// below 2**24 (24-bit n times 24-bit b, then a difference representable as a float). The rounded quotient can only
// be one too high (remainders within 2**-52 of b): put back. Other operands (inf, NaN, huge): std::fmod.
inline float exact_fmod(float a, float b) {
  const double x = std::fabs(double(a)), y = double(b), q = x / y;
  if (!(b > 0.0f && q < 16777216.0)) return std::fmod(a, b);
  const double n = double(int64_t(q));  // trunc without libm's call (the default x86-64 target has no roundsd)
  double r = x - n * y;
  if (r < 0.0) r += y;
  return std::copysign(float(r), a);
}

// numpy's float32 remainder (npy_divmodf): fmod, moved into the divisor's sign.
inline float py_mod(float a, float b) {
  float m = exact_fmod(a, b);
  if (m != 0.0f && ((b < 0) != (m < 0))) m += b;
  return m;
}

// raycast._colours and render_camera's writes for the rays the parts win (key part field > 0): depth, instance id
// and colour, the side faces of CABIN / WINDOWS parts showing glass (face colours 6-11, raycast._glass) or paint.
// The same float32 / float64 operations as numpy's, so the pixels equal the numpy path's.
void raycast_shade_cpu(const at::Tensor& key, const at::Tensor& face, const at::Tensor& rays, const at::Tensor& parts,
                       const at::Tensor& origin, const at::Tensor& half, const at::Tensor& glass,
                       const at::Tensor& colours, const at::Tensor& label, const at::Tensor& image,
                       const at::Tensor& depth, const at::Tensor& ids) {
  TORCH_CHECK(rays.scalar_type() == at::kFloat && rays.dim() == 3 && rays.size(0) == 3 && rays.is_contiguous(),
              "_raycast_shade: rays must be contiguous float32 (3, H, W), got ", rays.scalar_type(), " ", rays.sizes());
  const int64_t H = rays.size(1), W = rays.size(2), N = H * W;
  TORCH_CHECK(parts.scalar_type() == at::kFloat && parts.dim() == 2 && parts.size(1) == 8 && parts.is_contiguous(),
              "_raycast_shade: parts must be contiguous float32 (P, 8), got ", parts.scalar_type(), " ", parts.sizes());
  const int64_t P = parts.size(0);
  auto check = [&](const at::Tensor& t, const char* name, at::ScalarType type, at::IntArrayRef shape) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.sizes() == shape && t.is_contiguous(),
                "_raycast_shade: ", name, " must be contiguous ", type, " ", shape, " on the CPU, got ",
                t.scalar_type(), " ", t.sizes());
  };
  check(key, "key", at::kLong, {N});
  check(face, "face", at::kChar, {N});
  check(origin, "origin", at::kFloat, {P, 3});
  check(half, "half", at::kDouble, {P, 3});
  check(glass, "glass", at::kChar, {P});
  check(colours, "colours", at::kFloat, {P, 12, 3});
  check(label, "label", at::kInt, {P});
  check(image, "image", at::kFloat, {H, W, 3});
  check(depth, "depth", at::kFloat, {H, W});
  check(ids, "ids", at::kInt, {H, W});
  const int64_t* K = key.data_ptr<int64_t>();
  // Part fields (the keys' low halves) up to P: a vectorised test first, the key named only on failure.
  const uint32_t limit = uint32_t(std::min<int64_t>(P, UINT32_MAX));
  bool bad = false;
  for (int64_t x = 0; x < N; ++x) bad |= uint32_t(K[x]) > limit;
  for (int64_t x = 0; bad && x < N; ++x) {
    const int64_t p = (K[x] & 0xFFFFFFFF) - 1;
    TORCH_CHECK(p < P, "_raycast_shade: key[", x, "] names part ", p, " of ", P);
  }
  const int8_t* F = face.data_ptr<int8_t>();
  const float *rx = rays.data_ptr<float>(), *ry = rx + N, *rz = ry + N;
  const auto* part = reinterpret_cast<const Part*>(parts.data_ptr<float>());
  const float* O = origin.data_ptr<float>();
  const double* half_p = half.data_ptr<double>();
  const int8_t* kind = glass.data_ptr<int8_t>();
  const float* C = colours.data_ptr<float>();
  const int32_t* L = label.data_ptr<int32_t>();
  float* img = image.data_ptr<float>();
  float* Z = depth.data_ptr<float>();
  int32_t* I = ids.data_ptr<int32_t>();
  at::parallel_for(0, N, 4096, [&](int64_t x0, int64_t x1) {
    for (int64_t x = x0; x < x1; ++x) {
      const int64_t p = (K[x] & 0xFFFFFFFF) - 1;
      if (p < 0) continue;  // the ground or the sky
      const int32_t bits = int32_t(K[x] >> 32);
      float tn;
      std::memcpy(&tn, &bits, sizeof tn);
      Z[x] = tn;
      I[x] = L[p];
      int64_t f = F[x];
      if (kind[p] != 0) {  // 1: CABIN, 2: WINDOWS (raycast._glass)
        const Part& q = part[p];
        const float d0 = rx[x] * q.c + ry[x] * q.s, d1 = ry[x] * q.c - rx[x] * q.s, d2 = rz[x];
        const float h0 = O[3 * p] + tn * d0, h1 = O[3 * p + 1] + tn * d1, h2 = O[3 * p + 2] + tn * d2;
        const double* hf = half_p + 3 * p;
        const bool cabin = kind[p] == 1;
        const float along = f < 2 ? h1 : h0;
        const double half_along = f < 2 ? hf[1] : hf[0];
        const bool z_ok = std::fabs(h2) < float(hf[2] - 0.06);
        const bool inside = double(std::fabs(along)) < half_along - (cabin ? 0.14 : 0.25);
        const bool mullion = py_mod(along, 1.6f) < 0.16f;
        f += 6 * int64_t(f < 4 && z_ok && inside && (cabin || !mullion));
      }
      const float* c = C + (p * 12 + f) * 3;
      img[3 * x] = c[0], img[3 * x + 1] = c[1], img[3 * x + 2] = c[2];
    }
  });
}

// raycast._part_rects: per part (corners (P, 8, 3), camera->ego rotation R and translation t, intrinsics K and the
// render-resolution post_rot / post_tran, float64) the pixel rectangle [r0, r1, c0, c1) bounding its projection,
// clipped at the near plane (camera depth `near`; empty behind it) and padded: floor(min) - 1, ceil(max) + 2. The
// float64 sums may round differently from numpy's matrix products in the last bit; the padding keeps every pixel
// whose ray can meet the part inside (tests/test_raycast_native.py compares the renders).
at::Tensor raycast_rects_cpu(const at::Tensor& corners, const at::Tensor& rotation, const at::Tensor& translation,
                             const at::Tensor& intrinsic, const at::Tensor& post_rot, const at::Tensor& post_tran,
                             int64_t H, int64_t W, double near) {
  auto check = [](const at::Tensor& t, const char* name, at::IntArrayRef shape) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kDouble && t.sizes() == shape && t.is_contiguous(),
                "_raycast_rects: ", name, " must be contiguous float64 ", shape, " on the CPU, got ", t.scalar_type(),
                " ", t.sizes());
  };
  TORCH_CHECK(corners.dim() == 3, "_raycast_rects: corners must be (P, 8, 3), got ", corners.sizes());
  const int64_t P = corners.size(0);
  check(corners, "corners", {P, 8, 3});
  check(rotation, "rotation", {3, 3});
  check(translation, "translation", {3});
  check(intrinsic, "intrinsic", {3, 3});
  check(post_rot, "post_rot", {3, 3});
  check(post_tran, "post_tran", {3});
  TORCH_CHECK(H > 0 && W > 0, "_raycast_rects: the image must have pixels, got ", H, " x ", W);
  auto rects = at::zeros({P, 4}, corners.options().dtype(at::kLong));
  const double *C = corners.data_ptr<double>(), *R = rotation.data_ptr<double>(), *T = translation.data_ptr<double>();
  const double *K = intrinsic.data_ptr<double>(), *Q = post_rot.data_ptr<double>(), *U = post_tran.data_ptr<double>();
  int64_t* out = rects.data_ptr<int64_t>();
  constexpr double kBig = 1e9;
  at::parallel_for(0, P, 256, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const double* c = C + 24 * p;
      double depth[8];
      bool front = false;
      for (int k = 0; k < 8; ++k) {
        const double* x = c + 3 * k;
        depth[k] = (x[0] - T[0]) * R[2] + (x[1] - T[1]) * R[5] + (x[2] - T[2]) * R[8];
        front |= depth[k] > near;
      }
      if (!front) continue;
      double umin = kBig, umax = -kBig, vmin = kBig, vmax = -kBig;
      auto add = [&](const double* x) {  // Camera.project_uv
        double cam[3], pix[3];
        for (int j = 0; j < 3; ++j) cam[j] = (x[0] - T[0]) * R[j] + (x[1] - T[1]) * R[3 + j] + (x[2] - T[2]) * R[6 + j];
        for (int j = 0; j < 3; ++j) pix[j] = cam[0] * K[3 * j] + cam[1] * K[3 * j + 1] + cam[2] * K[3 * j + 2];
        const double uvd[3] = {pix[0] / cam[2], pix[1] / cam[2], cam[2]};
        const double u = uvd[0] * Q[0] + uvd[1] * Q[1] + uvd[2] * Q[2] + U[0];
        const double v = uvd[0] * Q[3] + uvd[1] * Q[4] + uvd[2] * Q[5] + U[1];
        umin = std::fmin(umin, u), umax = std::fmax(umax, u), vmin = std::fmin(vmin, v), vmax = std::fmax(vmax, v);
      };
      for (int k = 0; k < 8; ++k)
        if (depth[k] > near) add(c + 3 * k);
      for (int a = 0; a < 8; ++a)  // edges: corners whose signs differ on one axis (raycast._EDGES)
        for (int bit = 1; bit < 8; bit <<= 1) {
          const int b = a ^ bit;
          if (b < a || !((depth[a] - near) * (depth[b] - near) < 0)) continue;  // crosses the near plane: cut there
          const double f = std::clamp((near - depth[a]) / (depth[b] - depth[a]), 0.0, 1.0);
          double x[3];
          for (int j = 0; j < 3; ++j) x[j] = c[3 * a + j] + f * (c[3 * b + j] - c[3 * a + j]);
          add(x);
        }
      const double r[4] = {std::floor(vmin) - 1, std::ceil(vmax) + 2, std::floor(umin) - 1, std::ceil(umax) + 2};
      const int64_t limit[4] = {H, H, W, W};
      for (int j = 0; j < 4; ++j) {
        const double x = std::isnan(r[j]) ? 0.0 : std::clamp(r[j], -1.0, kBig);
        out[4 * p + j] = std::clamp(int64_t(x), int64_t(0), limit[j]);
      }
    }
  });
  return rects;
}

// raycast._ground_render's ground (the sky is already in `image`): per ground ray i, its ego-frame point (gx, gy)
// to the map frame (ego translation e0, e1 and yaw cos c, sin s, in float32 as numpy computes it), the map texel
// under it (`scale` texels a metre) from the ring of tiles `texels` (side x side x 3 uint8; the window of tiles from
// texel (col0, row0), `size` texels wide: outside it `grass`), times `unit`; the first clear.size(0) rays hazed
// (colour * clear + fog); written to flat pixel pixels[i] of image (H, W, 3).
void raycast_ground_cpu(const at::Tensor& gx, const at::Tensor& gy, const at::Tensor& pixels, const at::Tensor& clear,
                        const at::Tensor& fog, const at::Tensor& texels, const at::Tensor& grass,
                        const at::Tensor& image, double e0, double e1, double c, double s, double scale, double unit,
                        int64_t col0, int64_t row0, int64_t size, int64_t side) {
  const int64_t n = gx.numel(), k = clear.numel();
  auto check = [](const at::Tensor& t, const char* name, at::ScalarType type, at::IntArrayRef shape) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.sizes() == shape && t.is_contiguous(),
                "_raycast_ground: ", name, " must be contiguous ", type, " ", shape, " on the CPU, got ",
                t.scalar_type(), " ", t.sizes());
  };
  check(gx, "gx", at::kFloat, {n});
  check(gy, "gy", at::kFloat, {n});
  check(pixels, "pixels", at::kLong, {n});
  TORCH_CHECK(k <= n, "_raycast_ground: more hazed rays (", k, ") than rays (", n, ")");
  check(clear, "clear", at::kFloat, {k});
  check(fog, "fog", at::kFloat, {k, 3});
  TORCH_CHECK(side > 0 && (side & (side - 1)) == 0, "_raycast_ground: side must be a power of two, got ", side);
  check(texels, "texels", at::kByte, {side * side, 3});
  check(grass, "grass", at::kFloat, {3});
  TORCH_CHECK(image.dim() == 3, "_raycast_ground: image must be (H, W, 3), got ", image.sizes());
  check(image, "image", at::kFloat, {image.size(0), image.size(1), 3});
  const int64_t N = image.size(0) * image.size(1);
  const int64_t* P = pixels.data_ptr<int64_t>();
  bool bad = false;  // a vectorised test first, the index only on failure
  for (int64_t i = 0; i < n; ++i) bad |= uint64_t(P[i]) >= uint64_t(N);
  for (int64_t i = 0; bad && i < n; ++i)
    TORCH_CHECK(P[i] >= 0 && P[i] < N, "_raycast_ground: pixels[", i, "] = ", P[i], " is not in the image");
  const float *X = gx.data_ptr<float>(), *Y = gy.data_ptr<float>(), *A = clear.data_ptr<float>();
  const float *B = fog.data_ptr<float>(), *G = grass.data_ptr<float>();
  const uint8_t* tex = texels.data_ptr<uint8_t>();
  float* img = image.data_ptr<float>();
  const float fe0 = float(e0), fe1 = float(e1), fc = float(c), fs = float(s);
  const float fscale = float(scale), funit = float(unit);
  // Blocks of rays in two passes: their texels' offsets first (-1: grass), each prefetched, so that the far
  // ground's scattered texels (one cache line each, from the 50 MB ring) load side by side before the second pass.
  constexpr int64_t kBlock = 64;
  at::parallel_for(0, n, 4096, [&](int64_t i0, int64_t i1) {
    int64_t offset[kBlock];
    for (int64_t b0 = i0; b0 < i1; b0 += kBlock) {
      const int64_t m = std::min(kBlock, i1 - b0);
      for (int64_t j = 0; j < m; ++j) {
        const int64_t i = b0 + j;
        const float x = (fe0 + fc * X[i]) - fs * Y[i];  // ego -> map: numpy's float32 order
        const float y = (fe1 + fs * X[i]) + fc * Y[i];
        const int64_t col = floor_int(x * fscale), row = floor_int(y * fscale);
        const bool off = uint64_t(col - col0) >= uint64_t(size) || uint64_t(row - row0) >= uint64_t(size);
        offset[j] = off ? -1 : 3 * ((row & (side - 1)) * side + (col & (side - 1)));
        __builtin_prefetch(tex + (off ? 0 : offset[j]));
      }
      for (int64_t j = 0; j < m; ++j) {
        const int64_t i = b0 + j;
        float rgb[3];
        if (offset[j] < 0) {
          rgb[0] = G[0], rgb[1] = G[1], rgb[2] = G[2];
        } else {
          const uint8_t* t = tex + offset[j];
          rgb[0] = float(t[0]) * funit, rgb[1] = float(t[1]) * funit, rgb[2] = float(t[2]) * funit;
        }
        if (i < k)
          for (int c = 0; c < 3; ++c) rgb[c] = rgb[c] * A[i] + B[3 * i + c];
        float* out = img + 3 * P[i];
        out[0] = rgb[0], out[1] = rgb[1], out[2] = rgb[2];
      }
    }
  });
}

#if defined(__x86_64__)
// raycast_rgb8_cpu's loop 32 values at a time (the compiler's SSE2 version packs byte by byte): maxps(0, v) and
// minps(255, v) keep a NaN v as the ternaries do, its conversion's INT32_MIN packs to 0 as its low byte is.
// Returns the values done (a multiple of 32).
__attribute__((target("avx2"))) int64_t rgb8_avx2(const float* in, uint8_t* rgb, int64_t n) {
  const __m256 scale = _mm256_set1_ps(255.0f), half = _mm256_set1_ps(0.5f), zero = _mm256_setzero_ps();
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' per-128-bit-lane order
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256i q[4];
    for (int j = 0; j < 4; ++j) {
      const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(in + i + 8 * j), scale), half);
      q[j] = _mm256_cvttps_epi32(_mm256_min_ps(scale, _mm256_max_ps(zero, v)));
    }
    const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]), _mm256_packus_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rgb + i), _mm256_permutevar8x32_epi32(bytes, order));
  }
  return i;
}
#endif

// A render's 8-bit pixels for the JPEG encoder: sensors.camera_jpeg's (image * 255.0 + 0.5).clip(0, 255)
// .astype(uint8) in float32 (NaN kept by the clip, then the x86 conversion numpy's cast makes). One flat loop the
// compiler vectorises (max/min in this operand order are maxps/minps, NaN-preserving as the ternaries).
at::Tensor raycast_rgb8_cpu(const at::Tensor& image) {
  TORCH_CHECK(image.device().is_cpu() && image.scalar_type() == at::kFloat && image.dim() == 3 && image.size(2) == 3 &&
                  image.is_contiguous(),
              "_raycast_rgb8: image must be contiguous float32 (H, W, 3) on the CPU, got ", image.scalar_type(), " ",
              image.sizes());
  at::Tensor out = at::empty(image.sizes(), image.options().dtype(at::kByte));
  const float* in = image.data_ptr<float>();
  uint8_t* rgb = out.data_ptr<uint8_t>();
  const int64_t n = image.numel();
  int64_t i = 0;
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2")) i = rgb8_avx2(in, rgb, n);
#endif
  for (; i < n; ++i) {
    float v = in[i] * 255.0f + 0.5f;
    v = v < 0.0f ? 0.0f : v;
    v = v > 255.0f ? 255.0f : v;
    rgb[i] = uint8_t(int32_t(v));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(bev, CPU, m) {
  m.impl("_raycast_zbuffer", &raycast_zbuffer_cpu);
  m.impl("_raycast_shade", &raycast_shade_cpu);
  m.impl("_raycast_rects", &raycast_rects_cpu);
  m.impl("_raycast_ground", &raycast_ground_cpu);
  m.impl("_raycast_rgb8", &raycast_rgb8_cpu);
}

}  // namespace bev
