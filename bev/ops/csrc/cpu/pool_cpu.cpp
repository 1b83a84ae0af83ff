// CPU kernels of the bev voxel-pooling ops (schemas: csrc/ops.cpp, CUDA kernels: csrc/cuda/).
//
// Every kernel walks the plan (see bev/ops/_plan.py): voxel v sums the points
// order[offsets[v]:offsets[v+1]] in that fixed order, so results are bitwise reproducible
// without atomics, and each output element is written exactly once. Half types accumulate
// in float (at::opmath_type). Indices are int64 throughout; plan entries are bounds-checked
// so a malformed plan can never make a kernel read or write out of bounds.
//
// Memory traffic is what these kernels cost on a CPU: outputs are written as whole cache
// lines (streamed past the cache when large), grad_out (B, C, S) is transposed in cache, only
// for voxels that hold points, and no (V, C) copy of it is made where a gather suffices.
// Only the ATen headers used here: <torch/extension.h> (the whole C++ frontend and pybind11) and
// <ATen/ATen.h> took most of the build's compile time.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "common.h"

namespace bev {
namespace {

constexpr int64_t kTile = 32;       // consecutive voxels per work item: output rows are written kTile wide
constexpr int64_t kGatherTile = 256; // voxels per backward work item: C runs of 1 KB are read per tile
constexpr int64_t kTileChunk = 32;        // forward tiles per chunk of work (see parallel_chunks)
constexpr int64_t kGatherTileChunk = 4;   // backward tiles per chunk of work
constexpr int64_t kPointChunk = 4096;     // voxel_sum backward points per chunk of work
constexpr int64_t kPixelChunk = 256;      // bev_pool backward feature pixels per chunk of work
constexpr int kLanes = 8;      // fixed-order partial sums for dot products (vectorisable, deterministic)

// Rows are visited in voxel order, i.e. scattered over memory: prefetch a few points ahead so
// the loads overlap instead of stalling one cache miss at a time.
constexpr int64_t kPrefetchDistance = 16;
constexpr int64_t kRowPrefetch = 4;  // bev_pool backward: depth bins ahead

template <int kWrite, typename T>
inline void prefetch_row(const T* row, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < count * int64_t(sizeof(T)); offset += 64) __builtin_prefetch(bytes + offset, kWrite, 1);
}

// Outputs much larger than the last-level cache are written with non-temporal (streaming)
// stores: a plain store first reads the line it writes into the cache (a second memory
// transfer per line), and the kernels write each line of these outputs exactly once.
constexpr int64_t kStreamBytes = int64_t(8) << 20;
constexpr int64_t kLine = 64;

inline bool streams_whole_lines(const void* dst, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(dst) % kLine == 0 && bytes % kLine == 0;
}

// dst[0:bytes] = src[0:bytes], streamed if `stream` and dst spans whole cache lines (a partial
// streamed line would cost a read-modify-write in memory).
inline void write_bytes(void* dst, const void* src, int64_t bytes, bool stream) {
#if defined(__SSE2__)
  if (stream && streams_whole_lines(dst, bytes)) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    for (int64_t i = 0; i < bytes; i += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, bytes);
}

inline void zero_bytes(void* dst, int64_t bytes, bool stream) {
#if defined(__SSE2__)
  if (stream && streams_whole_lines(dst, bytes)) {
    char* d = static_cast<char*>(dst);
    const __m128i zero = _mm_setzero_si128();
    for (int64_t i = 0; i < bytes; i += 16) _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), zero);
    return;
  }
#endif
  (void)stream;
  std::memset(dst, 0, bytes);  // all-zero bytes are +0.0 in every floating type
}

// Streaming stores are weakly ordered: each worker fences before its part counts as done.
inline void end_streaming(bool stream) {
#if defined(__SSE2__)
  if (stream) _mm_sfence();
#else
  (void)stream;
#endif
}

// at::parallel_for gives each thread one fixed share of the range: on a shared machine a
// thread that is descheduled then holds up the whole op. Here threads take chunks of `chunk`
// items from a shared counter until none are left. Which thread computes a chunk never
// changes what is computed (every item is independent), so results stay bitwise reproducible.
template <typename F>
void parallel_chunks(int64_t begin, int64_t end, int64_t chunk, const F& f) {
  if (end <= begin) return;
  const int64_t chunks = (end - begin + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), chunks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < chunks;
         k = next.fetch_add(1, std::memory_order_relaxed))
      f(begin + k * chunk, std::min(end, begin + (k + 1) * chunk));
  });
}

// A voxel's run [begin, end) in `order`, clamped to [0, N].
inline void run_bounds(const int64_t* offsets, int64_t v, int64_t N, int64_t& begin, int64_t& end) {
  begin = std::min(std::max(offsets[v], int64_t(0)), N);
  end = std::min(std::max(offsets[v + 1], begin), N);
}

// ------------------------------------------------------------------------------------------
// voxel_keys: flat voxel index per point in one pass (the torch path needs ~15 elementwise ops).
// coords (N, 4) rows (batch, z, x, y) if batch_column, else (B, ..., 3) rows (z, x, y) whose
// batch is the leading index. Points with any coordinate outside the grid get the sentinel V.
// ------------------------------------------------------------------------------------------
at::Tensor voxel_keys_cpu(const at::Tensor& coords_in, at::IntArrayRef grid_shape, bool batch_column) {
  const GridDims g = check_grid(grid_shape);
  TORCH_CHECK(!at::isFloatingType(coords_in.scalar_type()) && coords_in.scalar_type() != at::kBool,
              "coords must be an integer tensor, got ", coords_in.scalar_type());
  const int64_t width = batch_column ? 4 : 3;
  TORCH_CHECK(coords_in.dim() >= 2 && coords_in.size(-1) == width, "coords must have ", width,
              " coordinates per point, got ", coords_in.sizes());
  TORCH_CHECK(batch_column ? coords_in.dim() == 2 : coords_in.size(0) == g.B,
              "coords must be (N, 4), or (B, ..., 3) with B=grid_shape[0]; got ", coords_in.sizes());
  auto coords = coords_in.to(at::kLong).contiguous();
  const int64_t N = coords.numel() / width;
  const int64_t per_batch = batch_column ? 1 : N / g.B;
  auto keys = at::empty({N}, coords.options());
  const int64_t* c = coords.data_ptr<int64_t>();
  int64_t* k = keys.data_ptr<int64_t>();
  const int64_t V = g.voxels();
  at::parallel_for(0, N, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* row = c + i * width;
      const int64_t b = batch_column ? row[0] : i / per_batch;
      const int64_t z = row[width - 3], x = row[width - 2], y = row[width - 1];
      const bool inside = b >= 0 && b < g.B && z >= 0 && z < g.Z && x >= 0 && x < g.X && y >= 0 && y < g.Y;
      k[i] = inside ? ((b * g.Z + z) * g.X + x) * g.Y + y : V;
    }
  });
  return keys;
}

// ------------------------------------------------------------------------------------------
// sort_keys: stable counting sort of flat voxel keys in [0, V] (V = sentinel for ignored points)
// ------------------------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> sort_keys_cpu(const at::Tensor& keys_in, int64_t num_voxels) {
  TORCH_CHECK(keys_in.scalar_type() == at::kLong && keys_in.dim() == 1, "keys must be a 1-D int64 tensor");
  TORCH_CHECK(num_voxels >= 0, "num_voxels must be non-negative");
  auto keys = keys_in.contiguous();
  const int64_t N = keys.numel();
  auto order = at::empty({N}, keys.options());
  auto offsets = at::empty({num_voxels + 1}, keys.options());
  const int64_t* k = keys.data_ptr<int64_t>();
  int64_t* off = offsets.data_ptr<int64_t>();
  int64_t* ord = order.data_ptr<int64_t>();
  // Keys outside [0, V) count as ignored (bucket V). offsets doubles as the write cursors (no
  // second per-voxel array: the plan's memory is 8 bytes per voxel): off[b + 1] counts bucket
  // b, the prefix sum makes off[b] its start, the scatter advances off[b] to the start of
  // b + 1, and a shift by one restores the starts. Ignored points take their own cursor.
  auto bucket = [&](int64_t i) { return (k[i] >= 0 && k[i] < num_voxels) ? k[i] : num_voxels; };
  std::fill(off, off + num_voxels + 1, int64_t(0));
  for (int64_t i = 0; i < N; ++i)
    if (bucket(i) < num_voxels) ++off[bucket(i) + 1];
  for (int64_t b = 0; b < num_voxels; ++b) off[b + 1] += off[b];
  int64_t ignored = off[num_voxels];
  for (int64_t i = 0; i < N; ++i) {  // ascending i: stable
    const int64_t b = bucket(i);
    ord[b < num_voxels ? off[b]++ : ignored++] = i;
  }
  for (int64_t b = num_voxels - 1; b > 0; --b) off[b] = off[b - 1];
  if (num_voxels > 0) off[0] = 0;
  return {order, offsets};
}

// ------------------------------------------------------------------------------------------
// forward: one work item = kTile consecutive voxels of one sample x all channels. Each voxel
// sums its run into a voxel-major row of `acc` (contiguous, vectorisable adds); the tile is
// then transposed in cache into channel-major rows and written to out (B, C, S) as C
// contiguous runs of kTile values, streamed when out is large. Tiles without points write
// zeros straight away.
// ------------------------------------------------------------------------------------------
template <typename scalar_t, bool kFused>
void pool_forward_cpu(const scalar_t* feats, const scalar_t* depth, const int64_t* order, const int64_t* offsets,
                      scalar_t* out, const GridDims g, int64_t N, int64_t C, int64_t D, int64_t HW) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t S = g.per_batch();
  const int64_t tiles_per_batch = (S + kTile - 1) / kTile;
  const bool stream = g.voxels() * C * int64_t(sizeof(scalar_t)) >= kStreamBytes;
  parallel_chunks(0, g.B * tiles_per_batch, kTileChunk, [&](int64_t tile_begin, int64_t tile_end) {
    std::vector<acc_t> acc(C);
    std::vector<scalar_t> staged(C * kTile);  // the tile's output, channel-major
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      const int64_t b = t / tiles_per_batch;
      const int64_t s0 = (t % tiles_per_batch) * kTile;
      const int64_t width = std::min(kTile, S - s0);
      const int64_t v0 = b * S + s0;
      const int64_t row_bytes = width * int64_t(sizeof(scalar_t));
      bool any = false;
      for (int64_t j = 0; j < width; ++j) {
        int64_t begin, end;
        run_bounds(offsets, v0 + j, N, begin, end);
        if (begin == end) continue;
        if (!any) std::fill(staged.begin(), staged.end(), scalar_t(0));
        any = true;
        acc_t* __restrict__ a = acc.data();
        std::fill(a, a + C, acc_t(0));
        for (int64_t i = begin; i < end; ++i) {
          if (i + kPrefetchDistance < N) {
            const int64_t q = order[i + kPrefetchDistance];
            if (q >= 0 && q < N) {
              if constexpr (kFused) __builtin_prefetch(depth + q, 0, 1);
              else prefetch_row<0>(feats + q * C, C);
            }
          }
          const int64_t p = order[i];
          if (p < 0 || p >= N) continue;
          if constexpr (kFused) {
            const acc_t w = static_cast<acc_t>(depth[p]);
            const scalar_t* __restrict__ row = feats + ((p / (D * HW)) * HW + p % HW) * C;
            for (int64_t c = 0; c < C; ++c) a[c] += w * static_cast<acc_t>(row[c]);
          } else {
            const scalar_t* __restrict__ row = feats + p * C;
            for (int64_t c = 0; c < C; ++c) a[c] += static_cast<acc_t>(row[c]);
          }
        }
        // Transpose in cache: only occupied voxels (a minority on real rigs) need it.
        scalar_t* __restrict__ col = staged.data() + j;
        for (int64_t c = 0; c < C; ++c) col[c * kTile] = static_cast<scalar_t>(a[c]);
      }
      scalar_t* dst = out + b * C * S + s0;
      if (any) {
        for (int64_t c = 0; c < C; ++c) write_bytes(dst + c * S, staged.data() + c * kTile, row_bytes, stream);
      } else {
        for (int64_t c = 0; c < C; ++c) zero_bytes(dst + c * S, row_bytes, stream);
      }
    }
    end_streaming(stream);
  });
}

at::Tensor voxel_sum_cpu(const at::Tensor& feats_in, const at::Tensor& keys, const at::Tensor& order,
                         const at::Tensor& offsets, at::IntArrayRef grid_shape) {
  check_float(feats_in, "feats");
  TORCH_CHECK(feats_in.dim() == 2, "feats must be (N, C), got ", feats_in.sizes());
  const GridDims g = check_grid(grid_shape);
  auto feats = feats_in.contiguous();
  const int64_t N = feats.size(0), C = feats.size(1);
  check_index(keys, "keys", N, feats);
  check_index(order, "order", N, feats);
  check_index(offsets, "offsets", g.voxels() + 1, feats);
  auto out = at::empty({g.B, C, g.Z, g.X, g.Y}, feats.options());
  auto ord = order.contiguous(), off = offsets.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, feats.scalar_type(), "voxel_sum_cpu", [&] {
    pool_forward_cpu<scalar_t, false>(feats.data_ptr<scalar_t>(), nullptr, ord.data_ptr<int64_t>(),
                                      off.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), g, N, C, 1, 1);
  });
  return out;
}

at::Tensor bev_pool_cpu(const at::Tensor& depth_in, const at::Tensor& feats_in, const at::Tensor& keys,
                        const at::Tensor& order, const at::Tensor& offsets, at::IntArrayRef grid_shape) {
  const FrustumDims f = check_frustum(depth_in, feats_in);
  const GridDims g = check_grid(grid_shape);
  auto depth = depth_in.contiguous(), feats = feats_in.contiguous();
  const int64_t N = f.points();
  check_index(keys, "keys", N, feats);
  check_index(order, "order", N, feats);
  check_index(offsets, "offsets", g.voxels() + 1, feats);
  auto out = at::empty({g.B, f.C, g.Z, g.X, g.Y}, feats.options());
  auto ord = order.contiguous(), off = offsets.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, feats.scalar_type(), "bev_pool_cpu", [&] {
    pool_forward_cpu<scalar_t, true>(feats.data_ptr<scalar_t>(), depth.data_ptr<scalar_t>(), ord.data_ptr<int64_t>(),
                                     off.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), g, N, f.C, f.D, f.HW);
  });
  return out;
}

// ------------------------------------------------------------------------------------------
// grad_out for the backward passes, read through its strides as (B, C, S) (GradView): the
// expanded, stride-0 gradient of out.sum().backward() is never materialised (that copy alone
// wrote a tensor the size of the output). Only voxels that hold points (a minority on real
// rigs) are read. bev_pool's backward reads a voxel's row once per point, so it first gathers
// the occupied rows into an (R, C) table, small enough to stay in cache:
//  - occupied_ranks numbers those voxels in voxel order: rank (V+1), voxel v is occupied iff
//    rank[v+1] > rank[v], and its row is rank[v] (O(V), from the plan's offsets);
//  - compact_rows copies their rows into the table (a transpose in cache, tile by tile).
// A key whose voxel is not occupied (only in a malformed plan) reads as a zero gradient.
// ------------------------------------------------------------------------------------------
at::Tensor occupied_ranks(const at::Tensor& offsets, int64_t V) {
  auto rank = at::empty({V + 1}, offsets.options());
  const int64_t* off = offsets.data_ptr<int64_t>();
  int64_t* r = rank.data_ptr<int64_t>();
  r[0] = 0;
  for (int64_t v = 0; v < V; ++v) r[v + 1] = r[v] + (off[v + 1] != off[v] ? 1 : 0);
  return rank;
}

// grad_out (B, C, Z, X, Y) as (B, C, S) with one stride per dim: a view (no copy) whenever
// the spatial dims flatten, as they do for contiguous and for expanded gradients.
struct GradView {
  at::Tensor t;
  int64_t sb, sc, ss;
};

inline GradView grad_view(const at::Tensor& grad, const GridDims g) {
  auto t = grad.reshape({g.B, grad.size(1), g.per_batch()});
  return {t, t.stride(0), t.stride(1), t.stride(2)};
}

// grad_out in work items of kGatherTile consecutive voxels of one sample. While a tile is
// read, the C channel runs of the next one are prefetched (C short streams are too many for
// the hardware prefetcher).
template <typename scalar_t>
struct GradTiles {
  const GradView& gv;
  const GridDims g;
  const int64_t per_batch;
  GradTiles(const GradView& view, const GridDims dims)
      : gv(view), g(dims), per_batch((dims.per_batch() + kGatherTile - 1) / kGatherTile) {}
  int64_t count() const { return g.B * per_batch; }
  // Tile t: its first voxel v0, its width, and grad_out at (b, channel 0, first voxel).
  const scalar_t* origin(int64_t t, int64_t& v0, int64_t& width) const {
    const int64_t b = t / per_batch, s0 = (t % per_batch) * kGatherTile;
    width = std::min(kGatherTile, g.per_batch() - s0);
    v0 = b * g.per_batch() + s0;
    return gv.t.data_ptr<scalar_t>() + b * gv.sb + s0 * gv.ss;
  }
  void prefetch(int64_t t, int64_t C) const {
    if (gv.ss != 1) return;
    int64_t v0, width;
    const scalar_t* src = origin(t, v0, width);
    for (int64_t c = 0; c < C; ++c) prefetch_row<0>(src + c * gv.sc, width);
  }
};

template <typename scalar_t>
void compact_rows(const GradView& gv, const int64_t* rank, scalar_t* table, const GridDims g, int64_t C) {
  const GradTiles<scalar_t> tiles(gv, g);
  parallel_chunks(0, tiles.count(), kGatherTileChunk, [&](int64_t tile_begin, int64_t tile_end) {
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      int64_t v0, width;
      const scalar_t* src = tiles.origin(t, v0, width);
      if (rank[v0] == rank[v0 + width]) continue;  // no points in this tile
      if (t + 1 < tile_end) tiles.prefetch(t + 1, C);
      for (int64_t j = 0; j < width; ++j) {
        if (rank[v0 + j] == rank[v0 + j + 1]) continue;
        scalar_t* __restrict__ row = table + rank[v0 + j] * C;
        for (int64_t c = 0; c < C; ++c) row[c] = src[j * gv.ss + c * gv.sc];
      }
    }
  });
}

// The table row of key k, or -1 for an ignored point.
inline int64_t table_row(const int64_t* rank, int64_t k, int64_t V) {
  return (k >= 0 && k < V && rank[k + 1] > rank[k]) ? rank[k] : -1;
}

// ------------------------------------------------------------------------------------------
// voxel_sum backward: grad_feats[p] = grad_out[key(p)], zero for ignored points. The plan's
// runs are walked tile by tile (GradTiles): each occupied voxel's gradient column is read once
// into a row in cache and written to every point of its run, streamed when large. Ignored
// points (the run after offsets[V]) get zero rows. Every row of grad_feats is written exactly
// once and nothing of the size of grad_out or of grad_feats is read besides grad_out's
// occupied tiles: no (V, C) copy, no table of rows (what gathering by key would need).
// ------------------------------------------------------------------------------------------
template <typename scalar_t>
void scatter_runs(const GradView& gv, const int64_t* order, const int64_t* offsets, scalar_t* grad_feats,
                  const GridDims g, int64_t N, int64_t C) {
  const GradTiles<scalar_t> tiles(gv, g);
  const int64_t row_bytes = C * int64_t(sizeof(scalar_t));
  const bool stream = N * row_bytes >= kStreamBytes;
  parallel_chunks(0, tiles.count(), kGatherTileChunk, [&](int64_t tile_begin, int64_t tile_end) {
    std::vector<scalar_t> row(C);
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      int64_t v0, width;
      const scalar_t* src = tiles.origin(t, v0, width);
      if (offsets[v0] == offsets[v0 + width]) continue;  // no points in this tile
      if (t + 1 < tile_end) tiles.prefetch(t + 1, C);
      for (int64_t j = 0; j < width; ++j) {
        int64_t begin, end;
        run_bounds(offsets, v0 + j, N, begin, end);
        if (begin == end) continue;
        for (int64_t c = 0; c < C; ++c) row[c] = src[j * gv.ss + c * gv.sc];
        for (int64_t i = begin; i < end; ++i) {
          const int64_t p = order[i];
          if (p >= 0 && p < N) write_bytes(grad_feats + p * C, row.data(), row_bytes, stream);
        }
      }
    }
    end_streaming(stream);
  });
  const int64_t ignored = std::min(std::max(offsets[g.voxels()], int64_t(0)), N);
  parallel_chunks(ignored, N, kPointChunk, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = order[i];
      if (p >= 0 && p < N) zero_bytes(grad_feats + p * C, row_bytes, stream);
    }
    end_streaming(stream);
  });
}

at::Tensor voxel_sum_backward_cpu(const at::Tensor& grad_in, const at::Tensor& keys, const at::Tensor& order,
                                  const at::Tensor& offsets) {
  check_float(grad_in, "grad_out");
  TORCH_CHECK(grad_in.dim() == 5, "grad_out must be (B, C, Z, X, Y), got ", grad_in.sizes());
  const GridDims g{grad_in.size(0), grad_in.size(2), grad_in.size(3), grad_in.size(4)};
  const int64_t N = keys.numel(), C = grad_in.size(1);
  check_index(keys, "keys", N, grad_in);
  check_index(order, "order", N, grad_in);
  check_index(offsets, "offsets", g.voxels() + 1, grad_in);
  auto grad_feats = at::empty({N, C}, grad_in.options());
  if (N == 0 || C == 0) return grad_feats;
  const GradView grad = grad_view(grad_in, g);
  auto ord = order.contiguous(), off = offsets.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_in.scalar_type(), "voxel_sum_backward_cpu", [&] {
    scatter_runs<scalar_t>(grad, ord.data_ptr<int64_t>(), off.data_ptr<int64_t>(), grad_feats.data_ptr<scalar_t>(), g, N, C);
  });
  return grad_feats;
}

// ------------------------------------------------------------------------------------------
// bev_pool backward, one work item per feature pixel f, which owns exactly its D points:
//   grad_depth[p] = <G[key(p)], feats[f]>,  grad_feats[f] = sum_d depth[p_d] * G[key(p_d)]
// with G = grad_out's occupied rows (compact_rows). No point or pixel is written by two work
// items.
// ------------------------------------------------------------------------------------------
template <typename scalar_t>
void bev_pool_backward_cpu_kernel(const scalar_t* G, const int64_t* rank, const scalar_t* depth, const scalar_t* feats,
                                  const int64_t* keys, scalar_t* grad_depth, scalar_t* grad_feats,
                                  const FrustumDims f, int64_t V) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = f.C;
  parallel_chunks(0, f.pixels(), kPixelChunk, [&](int64_t pix_begin, int64_t pix_end) {
    std::vector<acc_t> acc(C);
    for (int64_t pix = pix_begin; pix < pix_end; ++pix) {
      const int64_t bn = pix / f.HW, hw = pix % f.HW;
      const scalar_t* __restrict__ frow = feats + pix * C;
      std::fill(acc.begin(), acc.end(), acc_t(0));
      for (int64_t d = 0; d < f.D; ++d) {
        const int64_t p = (bn * f.D + d) * f.HW + hw;
        if (d + kRowPrefetch < f.D) {
          const int64_t q = table_row(rank, keys[p + kRowPrefetch * f.HW], V);
          if (q >= 0) prefetch_row<0>(G + q * C, C);
        }
        const int64_t r = table_row(rank, keys[p], V);
        if (r < 0) {
          grad_depth[p] = scalar_t(0);
          continue;
        }
        const scalar_t* __restrict__ grow = G + r * C;
        acc_t lanes[kLanes] = {};
        int64_t c = 0;
        for (; c + kLanes <= C; c += kLanes)
          for (int l = 0; l < kLanes; ++l) lanes[l] += static_cast<acc_t>(grow[c + l]) * static_cast<acc_t>(frow[c + l]);
        for (int l = 0; c < C; ++c, ++l) lanes[l] += static_cast<acc_t>(grow[c]) * static_cast<acc_t>(frow[c]);
        acc_t dot = 0;
        for (int l = 0; l < kLanes; ++l) dot += lanes[l];
        grad_depth[p] = static_cast<scalar_t>(dot);
        const acc_t w = static_cast<acc_t>(depth[p]);
        acc_t* __restrict__ a = acc.data();
        for (c = 0; c < C; ++c) a[c] += w * static_cast<acc_t>(grow[c]);
      }
      for (int64_t c = 0; c < C; ++c) grad_feats[pix * C + c] = static_cast<scalar_t>(acc[c]);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> bev_pool_backward_cpu(const at::Tensor& grad_in, const at::Tensor& depth_in,
                                                         const at::Tensor& feats_in, const at::Tensor& keys,
                                                         const at::Tensor& offsets) {
  const FrustumDims f = check_frustum(depth_in, feats_in);
  TORCH_CHECK(grad_in.dim() == 5 && grad_in.size(1) == f.C, "grad_out must be (B, C, Z, X, Y) with C=", f.C,
              ", got ", grad_in.sizes());
  TORCH_CHECK(grad_in.scalar_type() == feats_in.scalar_type(), "grad_out must have the dtype of feats");
  check_index(keys, "keys", f.points(), feats_in);
  const GridDims g{grad_in.size(0), grad_in.size(2), grad_in.size(3), grad_in.size(4)};
  const int64_t V = g.voxels();
  check_index(offsets, "offsets", V + 1, feats_in);
  const GradView grad = grad_view(grad_in, g);
  auto off = offsets.contiguous();
  auto rank = occupied_ranks(off, V);
  const int64_t* r = rank.data_ptr<int64_t>();
  auto G = at::empty({r[V], f.C}, grad_in.options());
  auto depth = depth_in.contiguous(), feats = feats_in.contiguous(), k = keys.contiguous();
  auto grad_depth = at::empty_like(depth), grad_feats = at::empty_like(feats);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, feats.scalar_type(), "bev_pool_backward_cpu", [&] {
    compact_rows<scalar_t>(grad, r, G.data_ptr<scalar_t>(), g, f.C);
    bev_pool_backward_cpu_kernel<scalar_t>(G.data_ptr<scalar_t>(), r, depth.data_ptr<scalar_t>(),
                                           feats.data_ptr<scalar_t>(), k.data_ptr<int64_t>(),
                                           grad_depth.data_ptr<scalar_t>(), grad_feats.data_ptr<scalar_t>(), f, V);
  });
  return {grad_depth, grad_feats};
}

}  // namespace

TORCH_LIBRARY_IMPL(bev, CPU, m) {
  m.impl("voxel_sum", &voxel_sum_cpu);
  m.impl("bev_pool", &bev_pool_cpu);
  m.impl("_voxel_keys", &voxel_keys_cpu);
  m.impl("_sort_keys", &sort_keys_cpu);
  m.impl("_voxel_sum_backward", &voxel_sum_backward_cpu);
  m.impl("_bev_pool_backward", &bev_pool_backward_cpu);
}

}  // namespace bev
