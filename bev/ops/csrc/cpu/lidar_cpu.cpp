// CPU kernels of the synthetic LiDAR's point cloud (schemas: csrc/ops.cpp; wrappers: bev/synthetic/native.py; the
// numpy reference they equal bit for bit: bev/synthetic/lidar.py).
//
// _lidar_returns: the returns of a scan in firing order, range plus noise along each beam (lidar.point_cloud).
// _lidar_off_faces: two passes moving the returns within BOX_GAP of an annotated box's faces 2 * BOX_GAP off them
//   (lidar._off_faces).
// _lidar_cloud: the .pcd.bin rows (x, y, z, intensity, ring) in the LIDAR_TOP frame, float32, and the ego points a
//   reader gets back from them (lidar.to_ego).
// _lidar_count: the points inside each box, faces included (lidar.points_in_boxes).
// _lidar_intensity: each return's intensity by its material, the ground's read off the map's texel classes
//   (lidar.intensity).
//
// The float64 operations are numpy's elementwise ones in the same order (lidar._to_local, _from_local); the default
// x86-64 target has no FMA, so nothing is contracted. A box looks at the points within its reach as numpy's does
// (x within [cx - reach, cx + reach], |y - cy| <= reach): the points are bucketed by x, and each bucket's points are
// tested with that exact predicate. Single-threaded: a sample's cloud is ~30k points, and the writer's worker
// processes run one thread each.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace bev {
namespace {

constexpr double kBoxGap = 1e-3;  // lidar.BOX_GAP
constexpr double kBucket = 1.0;   // metres of x per bucket

void check(const at::Tensor& t, const char* op, const char* name, at::ScalarType type, at::IntArrayRef shape) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.sizes() == shape && t.is_contiguous(), op, ": ", name,
              " must be contiguous ", type, " ", shape, " on the CPU, got ", t.scalar_type(), " ", t.sizes());
}

// Annotated boxes: centre (B, 3), rotation box -> ego (B, 3, 3) row-major, half extents (B, 3), reach (B,).
struct Boxes {
  const double *c, *R, *h, *reach;
  int64_t n;
};

Boxes boxes_of(const char* op, const at::Tensor& centre, const at::Tensor& R, const at::Tensor& half,
               const at::Tensor& reach) {
  const int64_t B = centre.dim() == 2 ? centre.size(0) : -1;
  TORCH_CHECK(B >= 0, op, ": centre must be (B, 3), got ", centre.sizes());
  check(centre, op, "centre", at::kDouble, {B, 3});
  check(R, op, "R", at::kDouble, {B, 3, 3});
  check(half, op, "half", at::kDouble, {B, 3});
  check(reach, op, "reach", at::kDouble, {B});
  return {centre.data_ptr<double>(), R.data_ptr<double>(), half.data_ptr<double>(), reach.data_ptr<double>(), B};
}

// Rows R^T (p - c): lidar._to_local's float64 operations.
inline void to_local(const double* p, const double* c, const double* R, double* out) {
  const double d0 = p[0] - c[0], d1 = p[1] - c[1], d2 = p[2] - c[2];
  for (int j = 0; j < 3; ++j) out[j] = (d0 * R[j] + d1 * R[3 + j]) + d2 * R[6 + j];
}

// c + R a: lidar._from_local's.
inline void from_local(const double* a, const double* c, const double* R, double* out) {
  for (int i = 0; i < 3; ++i) out[i] = c[i] + ((a[0] * R[3 * i] + a[1] * R[3 * i + 1]) + a[2] * R[3 * i + 2]);
}

// The points bucketed by their x (as given when built): visit(lo, hi, fn) calls fn(i) for every point i whose x lies in
// [lo, hi], in no particular order (callers use the points near a box as a set, as numpy's any-order argsort does).
class XBuckets {
 public:
  XBuckets(const double* pts, int64_t n) : x_(n) {
    for (int64_t i = 0; i < n; ++i) x_[i] = pts[3 * i];
    if (n == 0) return;
    lo_ = *std::min_element(x_.begin(), x_.end());
    const double hi = *std::max_element(x_.begin(), x_.end());
    buckets_ = std::min<int64_t>(int64_t((hi - lo_) / kBucket) + 1, n);
    start_.assign(buckets_ + 1, 0);
    for (int64_t i = 0; i < n; ++i) ++start_[bucket(x_[i]) + 1];
    for (int64_t k = 0; k < buckets_; ++k) start_[k + 1] += start_[k];
    order_.resize(n);
    std::vector<int64_t> fill(start_.begin(), start_.end() - 1);
    for (int64_t i = 0; i < n; ++i) order_[fill[bucket(x_[i])]++] = i;
  }

  template <class Fn>
  void visit(double lo, double hi, Fn fn) const {
    if (buckets_ == 0 || !(hi >= lo_)) return;
    const int64_t k1 = bucket(hi), k0 = lo <= lo_ ? 0 : bucket(lo);  // (x - lo_) / kBucket is monotone in x
    for (int64_t k = start_[k0]; k < start_[k1 + 1]; ++k) {
      const int64_t i = order_[k];
      if (x_[i] >= lo && x_[i] <= hi) fn(i);
    }
  }

 private:
  int64_t bucket(double x) const {
    const double k = (x - lo_) / kBucket;
    return k >= double(buckets_ - 1) ? buckets_ - 1 : int64_t(k);
  }
  std::vector<double> x_;
  std::vector<int64_t> start_, order_;
  double lo_ = 0;
  int64_t buckets_ = 0;
};

std::tuple<at::Tensor, at::Tensor> lidar_returns_cpu(const at::Tensor& depth, const at::Tensor& rays,
                                                     const at::Tensor& origin, const at::Tensor& jitter) {
  const char* op = "_lidar_returns";
  TORCH_CHECK(depth.dim() == 2, op, ": depth must be (BEAMS, AZIMUTHS), got ", depth.sizes());
  const int64_t rings = depth.size(0), steps = depth.size(1), n = jitter.dim() == 1 ? jitter.size(0) : -1;
  check(depth, op, "depth", at::kFloat, {rings, steps});
  check(rays, op, "rays", at::kFloat, {rings * steps, 3});
  check(origin, op, "origin", at::kDouble, {3});
  check(jitter, op, "jitter", at::kDouble, {n});
  const float *D = depth.data_ptr<float>(), *ray = rays.data_ptr<float>();
  const double *o = origin.data_ptr<double>(), *J = jitter.data_ptr<double>();
  int64_t returns = 0;
  for (int64_t b = 0; b < rings * steps; ++b) returns += std::isfinite(D[b]);
  TORCH_CHECK(returns == n, op, ": jitter must hold one value per finite depth (", returns, "), got ", n);
  at::Tensor points = at::empty({n, 3}, depth.options().dtype(at::kDouble));
  at::Tensor beam = at::empty({n}, depth.options().dtype(at::kLong));
  double* P = points.data_ptr<double>();
  int64_t* Bm = beam.data_ptr<int64_t>();
  int64_t k = 0;
  for (int64_t col = 0; col < steps; ++col)  // firing order: azimuth step by step, the rings of each
    for (int64_t ring = 0; ring < rings; ++ring) {
      const int64_t b = ring * steps + col;
      if (!std::isfinite(D[b])) continue;
      const double r = double(D[b]) + J[k];
      for (int j = 0; j < 3; ++j) P[3 * k + j] = o[j] + r * double(ray[3 * b + j]);
      Bm[k++] = b;
    }
  return {points, beam};
}

// One pass of lidar._off_faces_pass over the boxes in order, moving points in place. (numpy's second pass skips the
// boxes no moved point reaches; those would find nothing to move, so a full pass moves the same points.)
void off_faces_pass(double* P, int64_t n, const Boxes& bx) {
  const XBuckets near(P, n);
  for (int64_t b = 0; b < bx.n; ++b) {
    const double *c = bx.c + 3 * b, *R = bx.R + 9 * b, *h = bx.h + 3 * b, reach = bx.reach[b];
    near.visit(c[0] - reach, c[0] + reach, [&](int64_t i) {
      double* p = P + 3 * i;
      if (!(std::fabs(p[1] - c[1]) <= reach)) return;
      double a[3], off[3];
      to_local(p, c, R, a);
      bool inside = true, close = false;
      for (int j = 0; j < 3; ++j) {
        off[j] = std::fabs(a[j]) - h[j];  // > 0 outside that face pair
        inside &= off[j] <= kBoxGap;
        close |= std::fabs(off[j]) < kBoxGap;
      }
      if (!(inside && close)) return;
      for (int j = 0; j < 3; ++j)
        if (std::fabs(off[j]) < kBoxGap) {
          const double sign = double((a[j] > 0) - (a[j] < 0));
          a[j] = sign * (h[j] + (off[j] >= 0 ? 2.0 : -2.0) * kBoxGap);
        }
      from_local(a, c, R, p);
    });
  }
}

void lidar_off_faces_cpu(const at::Tensor& points, const at::Tensor& centre, const at::Tensor& R,
                         const at::Tensor& half, const at::Tensor& reach) {
  const char* op = "_lidar_off_faces";
  TORCH_CHECK(points.dim() == 2, op, ": points must be (N, 3), got ", points.sizes());
  check(points, op, "points", at::kDouble, {points.size(0), 3});
  const Boxes bx = boxes_of(op, centre, R, half, reach);
  for (int pass = 0; pass < 2; ++pass) off_faces_pass(points.data_ptr<double>(), points.size(0), bx);
}

std::tuple<at::Tensor, at::Tensor> lidar_cloud_cpu(const at::Tensor& points, const at::Tensor& value,
                                                   const at::Tensor& ring, const at::Tensor& rotation,
                                                   const at::Tensor& translation) {
  const char* op = "_lidar_cloud";
  TORCH_CHECK(points.dim() == 2, op, ": points must be (N, 3), got ", points.sizes());
  const int64_t n = points.size(0);
  check(points, op, "points", at::kDouble, {n, 3});
  check(value, op, "value", at::kDouble, {n});
  check(ring, op, "ring", at::kLong, {n});
  check(rotation, op, "rotation", at::kDouble, {3, 3});
  check(translation, op, "translation", at::kDouble, {3});
  at::Tensor cloud = at::empty({n, 5}, points.options().dtype(at::kFloat));
  at::Tensor ego = at::empty({n, 3}, points.options());
  const double *P = points.data_ptr<double>(), *V = value.data_ptr<double>();
  const double *Rm = rotation.data_ptr<double>(), *t = translation.data_ptr<double>();
  const int64_t* ring_of = ring.data_ptr<int64_t>();
  float* C = cloud.data_ptr<float>();
  double* E = ego.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    double local[3], back[3];
    to_local(P + 3 * i, t, Rm, local);  // ego -> LIDAR_TOP
    float* row = C + 5 * i;
    for (int j = 0; j < 3; ++j) row[j] = float(local[j]), back[j] = double(row[j]);
    row[3] = float(V[i]), row[4] = float(double(ring_of[i]));
    from_local(back, t, Rm, E + 3 * i);  // what a reader gets back (lidar.to_ego)
  }
  return {cloud, ego};
}

at::Tensor lidar_count_cpu(const at::Tensor& points, const at::Tensor& centre, const at::Tensor& R,
                           const at::Tensor& half, const at::Tensor& reach) {
  const char* op = "_lidar_count";
  TORCH_CHECK(points.dim() == 2, op, ": points must be (N, 3), got ", points.sizes());
  check(points, op, "points", at::kDouble, {points.size(0), 3});
  const Boxes bx = boxes_of(op, centre, R, half, reach);
  const double* P = points.data_ptr<double>();
  const XBuckets near(P, points.size(0));
  at::Tensor counts = at::zeros({bx.n}, points.options().dtype(at::kLong));
  int64_t* out = counts.data_ptr<int64_t>();
  for (int64_t b = 0; b < bx.n; ++b) {
    const double *c = bx.c + 3 * b, *Rb = bx.R + 9 * b, *h = bx.h + 3 * b, reach_b = bx.reach[b];
    near.visit(c[0] - reach_b, c[0] + reach_b, [&](int64_t i) {
      const double* p = P + 3 * i;
      if (!(std::fabs(p[1] - c[1]) <= reach_b)) return;
      double a[3];
      to_local(p, c, Rb, a);
      out[b] += std::fabs(a[0]) <= h[0] && std::fabs(a[1]) <= h[1] && std::fabs(a[2]) <= h[2];
    });
  }
  return counts;
}

at::Tensor lidar_intensity_cpu(const at::Tensor& points, const at::Tensor& part, const at::Tensor& part_value,
                               const at::Tensor& spread, const at::Tensor& ground_value, const at::Tensor& labels,
                               double e0, double e1, double m00, double m01, double m10, double m11, double scale,
                               int64_t col0, int64_t row0, int64_t size, int64_t side) {
  const char* op = "_lidar_intensity";
  TORCH_CHECK(points.dim() == 2, op, ": points must be (N, 3), got ", points.sizes());
  const int64_t n = points.size(0), P = part_value.dim() == 1 ? part_value.size(0) : -1;
  const int64_t G = ground_value.dim() == 1 ? ground_value.size(0) : -1;
  check(points, op, "points", at::kDouble, {n, 3});
  check(part, op, "part", at::kLong, {n});
  check(part_value, op, "part_value", at::kDouble, {P});
  check(spread, op, "spread", at::kDouble, {n});
  check(ground_value, op, "ground_value", at::kDouble, {G});
  TORCH_CHECK(side > 0 && (side & (side - 1)) == 0, op, ": side must be a power of two, got ", side);
  check(labels, op, "labels", at::kByte, {side * side});
  const double *X = points.data_ptr<double>(), *PV = part_value.data_ptr<double>();
  const double *S = spread.data_ptr<double>(), *GV = ground_value.data_ptr<double>();
  const int64_t* Q = part.data_ptr<int64_t>();
  const uint8_t* L = labels.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(Q[i] < P, op, ": part[", i, "] = ", Q[i], " names no part of ", P);
  at::Tensor value = at::empty({n}, points.options());
  double* V = value.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    double base;
    if (Q[i] >= 0) {
      base = PV[Q[i]];
    } else {  // the map texel under the point (lidar._ground_intensity, raycast.ground_class)
      const double* p = X + 3 * i;
      const double x = (p[0] * m00 + p[1] * m01) + e0, y = (p[0] * m10 + p[1] * m11) + e1;
      const int64_t col = int64_t(std::floor(x * scale)), row = int64_t(std::floor(y * scale));
      if (uint64_t(col - col0) >= uint64_t(size) || uint64_t(row - row0) >= uint64_t(size)) {
        V[i] = std::nan("");  // beyond the ring's window: the caller's
        continue;
      }
      const int64_t k = (row & (side - 1)) * side + (col & (side - 1));
      TORCH_CHECK(L[k] < G, op, ": labels[", k, "] = ", int(L[k]), " names no ground class of ", G);
      base = GV[L[k]];
    }
    const double v = std::nearbyint(base * S[i]);  // np.rint: half to even
    V[i] = v < 0 ? 0.0 : (v > 255 ? 255.0 : v);
  }
  return value;
}

}  // namespace

TORCH_LIBRARY_IMPL(bev, CPU, m) {
  m.impl("_lidar_returns", &lidar_returns_cpu);
  m.impl("_lidar_off_faces", &lidar_off_faces_cpu);
  m.impl("_lidar_cloud", &lidar_cloud_cpu);
  m.impl("_lidar_count", &lidar_count_cpu);
  m.impl("_lidar_intensity", &lidar_intensity_cpu);
}

}  // namespace bev
