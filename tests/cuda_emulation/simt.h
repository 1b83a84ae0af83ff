// A small SIMT emulation for tests: runs unmodified CUDA kernels on the CPU with CUDA's
// execution semantics, so the device code of bev/ops/csrc/cuda/pool_kernels.cuh is exercised
// on every test run, without a GPU.
//
//  - Every block of the grid runs, one block at a time, blockDim threads per block. Each CUDA
//    thread is a fiber (ucontext) with its own stack; a fiber runs until it reaches
//    __syncthreads(), a warp shuffle or its end, then the next one runs. So all threads of a
//    block are alive at once, and a read of shared memory that some thread has not written
//    yet (a missing __syncthreads) sees the wrong value deterministically rather than by luck.
//  - __syncthreads() releases the block once every thread that has not exited reaches it.
//  - Warps are 32 consecutive linear thread ids (x fastest). A shuffle publishes each lane's
//    value, waits until all 32 lanes of the warp have published, reads the source lane, and
//    waits again before any lane may publish its next value. Lanes that exited or wait at
//    __syncthreads while others shuffle are reported as errors (undefined on a GPU).
//  - __shared__ is `static`: one instance per kernel instantiation, shared by every thread of
//    the running block. Blocks run one at a time (and launches one at a time, under a lock), so
//    that is exactly per-block shared memory. Like on a GPU it is not cleared between blocks.
//  - threadIdx / blockIdx / blockDim / gridDim are the running fiber's and block's values.
//  - Launches are checked against CUDA's limits (block <= 1024 threads, y/z <= 64 / 65535...).
//
// Include after the ATen/torch headers (this file defines CUDA's keywords as macros).
#pragma once

#define BEV_SIMT_EMULATION 1

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

// Device code calls min/max unqualified on integers, as CUDA's math headers allow.
using std::max;
using std::min;

namespace simt {

constexpr int kWarpSize = 32;
constexpr size_t kStackBytes = 256 * 1024;

enum class State { kReady, kAtSync, kAtShuffle, kDone, kFaulted };

struct Fiber {
  ucontext_t context;
  char* stack = nullptr;  // kStackBytes plus a guard page below
  dim3 thread_idx;
  int linear = 0;
  State state = State::kReady;
};

struct Block {
  dim3 grid_dim, block_dim, block_idx;
  std::vector<Fiber> fibers;
  std::vector<std::array<unsigned char, 16>> lane_values;  // one shuffle slot per thread
  ucontext_t scheduler;
  Fiber* current = nullptr;
  std::function<void()> body;
  std::string error;
};

inline thread_local Block* running = nullptr;

inline Block& block() { return *running; }
inline Fiber& fiber() { return *running->current; }

inline void yield_as(State state) {
  Fiber& f = fiber();
  f.state = state;
  swapcontext(&f.context, &block().scheduler);
}

// Stops the calling thread for good; the launch then throws `message`.
inline void fault(const std::string& message) {
  if (block().error.empty()) block().error = message;
  yield_as(State::kFaulted);
}

inline void fiber_entry() {
  block().body();
  fiber().state = State::kDone;
}  // returns to the scheduler through uc_link

inline char* allocate_stack() {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  void* p = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error("simt: cannot allocate a fiber stack");
  mprotect(p, page, PROT_NONE);  // a stack overflow faults instead of corrupting memory
  return static_cast<char*>(p);
}

inline void free_stack(char* stack) { munmap(stack, kStackBytes + size_t(sysconf(_SC_PAGESIZE))); }

inline std::string describe(const dim3& d) {
  return "(" + std::to_string(d.x) + ", " + std::to_string(d.y) + ", " + std::to_string(d.z) + ")";
}

// Releases waiting threads; false if none could be released (a deadlock).
inline bool release(Block& b) {
  bool released = false;
  const int threads = int(b.fibers.size());
  for (int w = 0; w < threads; w += kWarpSize) {
    const int end = std::min(threads, w + kWarpSize);
    int shuffling = 0;
    for (int i = w; i < end; ++i) shuffling += b.fibers[i].state == State::kAtShuffle;
    if (shuffling == 0) continue;
    if (shuffling != kWarpSize) {
      b.error = "warp " + std::to_string(w / kWarpSize) + " of block " + describe(b.block_idx) +
                ": a full-warp shuffle was reached by " + std::to_string(shuffling) +
                " of 32 lanes (the others exited, wait at __syncthreads, or do not exist)";
      return false;
    }
    for (int i = w; i < end; ++i) b.fibers[i].state = State::kReady;
    released = true;
  }
  if (released) return true;
  bool any_waiting = false;
  for (const Fiber& f : b.fibers) {
    if (f.state == State::kAtSync) any_waiting = true;
    else if (f.state != State::kDone) return false;
  }
  // Every thread that has not exited is at the barrier: release the block.
  for (Fiber& f : b.fibers)
    if (f.state == State::kAtSync) f.state = State::kReady;
  return any_waiting;
}

inline void run_block(Block& b) {
  for (Fiber& f : b.fibers) {
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack + sysconf(_SC_PAGESIZE);
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &b.scheduler;
    makecontext(&f.context, fiber_entry, 0);
    f.state = State::kReady;
  }
  for (;;) {
    for (Fiber& f : b.fibers) {
      if (f.state != State::kReady) continue;
      b.current = &f;
      swapcontext(&b.scheduler, &f.context);
      if (f.state == State::kFaulted) break;
    }
    b.current = nullptr;
    if (!b.error.empty()) return;
    if (std::all_of(b.fibers.begin(), b.fibers.end(), [](const Fiber& f) { return f.state == State::kDone; })) return;
    if (!release(b)) {
      if (b.error.empty()) b.error = "deadlock in block " + describe(b.block_idx) + ": threads wait at different barriers";
      return;
    }
  }
}

inline std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

// kernel<<<grid, block>>>() with the kernel call wrapped in `body`; synchronous. Throws
// std::runtime_error for a launch CUDA would refuse or a kernel that breaks SIMT rules.
inline void launch(dim3 grid, dim3 block_dim, std::function<void()> body) {
  const uint64_t threads = uint64_t(block_dim.x) * block_dim.y * block_dim.z;
  if (threads == 0 || threads > 1024 || block_dim.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535)
    throw std::runtime_error("simt: invalid launch configuration: grid " + describe(grid) + ", block " +
                             describe(block_dim));
  std::lock_guard<std::mutex> lock(launch_mutex());
  Block b;
  b.grid_dim = grid;
  b.block_dim = block_dim;
  b.body = std::move(body);
  b.fibers.resize(threads);
  b.lane_values.resize(threads);
  int linear = 0;
  for (unsigned z = 0; z < block_dim.z; ++z)
    for (unsigned y = 0; y < block_dim.y; ++y)
      for (unsigned x = 0; x < block_dim.x; ++x, ++linear) {
        b.fibers[linear].thread_idx = dim3(x, y, z);
        b.fibers[linear].linear = linear;
        b.fibers[linear].stack = allocate_stack();
      }
  Block* outer = running;
  running = &b;
  for (unsigned z = 0; z < grid.z && b.error.empty(); ++z)
    for (unsigned y = 0; y < grid.y && b.error.empty(); ++y)
      for (unsigned x = 0; x < grid.x && b.error.empty(); ++x) {
        b.block_idx = dim3(x, y, z);
        run_block(b);
      }
  running = outer;
  for (Fiber& f : b.fibers) free_stack(f.stack);
  if (!b.error.empty()) throw std::runtime_error("simt: " + b.error);
}

// One warp-wide exchange: lane i publishes `value` and receives the value of lane src(i)
// (its own where src(i) is outside the warp).
template <typename T, typename Source>
T shuffle(unsigned mask, T value, int width, Source src) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 16, "simt: unsupported shuffle type");
  if (mask != 0xffffffffu || width != kWarpSize) fault("only full-warp shuffles (mask 0xffffffff, width 32) are emulated");
  Block& b = block();
  const int linear = fiber().linear, lane = linear % kWarpSize;
  std::memcpy(b.lane_values[linear].data(), &value, sizeof(T));
  yield_as(State::kAtShuffle);  // every lane has published
  const int from = src(lane);
  T out = value;
  if (from >= 0 && from < kWarpSize) std::memcpy(&out, b.lane_values[linear - lane + from].data(), sizeof(T));
  yield_as(State::kAtShuffle);  // every lane has read: the slots may be reused
  return out;
}

}  // namespace simt

#define threadIdx (::simt::fiber().thread_idx)
#define blockIdx (::simt::block().block_idx)
#define blockDim (::simt::block().block_dim)
#define gridDim (::simt::block().grid_dim)

inline void __syncthreads() { ::simt::yield_as(::simt::State::kAtSync); }

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  return ::simt::shuffle(mask, value, width, [&](int lane) { return lane ^ lane_mask; });
}

template <typename T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  return ::simt::shuffle(mask, value, width, [&](int lane) { return lane + int(delta); });
}

template <typename T>
T __shfl_sync(unsigned mask, T value, int src_lane, int width = 32) {
  return ::simt::shuffle(mask, value, width, [&](int) { return src_lane; });
}
