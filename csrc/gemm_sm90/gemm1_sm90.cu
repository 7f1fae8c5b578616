// GEMM1 + SwiGLU of the serial backend as a Hopper tile: wgmma from shared memory, the weights by
// TMA, the gathered token rows by a producer warp group, a persistent grid fed by the tile queue.
// sm_90a only (wgmma, setmaxnreg); csrc/build.py compiles this file for that target alone. Design,
// floor and prediction: bench/NOTES.md "Issue 12c".
//
// One CTA = 384 threads, one per SM, persistent:
//   warp group 0 (producer, 40 registers): thread 0 takes tiles from the queue (an atomic counter in
//     tile order, rewound to 0 by the last CTA to finish, as GemmConfig.queue: tile t = (row block t / n_tiles, column tile t % n_tiles),
//     blocks of expert E skipped), and per K step of 64 issues the 4 TMA boxes of the weights
//     (gate columns pn*128 + [0, 64), [64, 128), up columns Ir + the same; [64 K rows x 64 columns]
//     each, 128B swizzle) on the stage's `full` barrier with their byte count. All 128 threads copy
//     the gathered A rows (row_token[s]; 8 threads per row, 16 bytes each, 8 rows per thread: 8
//     cp.async per K step) into the 128B-swizzled K-major layout wgmma reads; padding rows
//     (row_token < 0) are zero-filled without reading memory. A thread signals its rows of stage i once they have landed: after
//     stage i + kLag is issued it waits for the group of stage i (cp.async.wait_group kLag), makes
//     the writes visible to the async proxy (fence.proxy.async) and arrives on full[i].
//   warp groups 1 and 2 (consumers, 232 registers): rows 0-63 and 64-127 of the tile; per stage
//     4 k16 steps x (gate, up) wgmma m64n128k16 into two 64-register fp32 accumulators, one wgmma
//     group in flight (wait_group 1) before the previous stage is released (`empty`, one arrive per
//     warp). Epilogue: silu(g) * u in fp32, bf16 pairs stored straight from the registers, only for
//     rows whose row_token >= 0. A tile whose row 64 is padding (a half tail, as split_tail) has no
//     real row in warp group 2: it skips its wgmma and epilogue (waits and releases only).
// The producer ends the stream with a stage whose tile number is -1; the consumers stop on it.
// That is the kBase mainloop; the others (gemm1_sm90.h, Gemm1Variant: one m64n256k16 per k16, rows
// signalled by cp.async.mbarrier.arrive.noinc, 2-CTA clusters multicasting the weights) are
// instances of the same kernel template, chosen per launch (bench/NOTES.md "Issue 12t").

#include "gemm_sm90/gemm1_sm90.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "gemm_sm90/wgmma_m64n128k16.cuh"
#include "gemm_sm90/wgmma_m64n256k16.cuh"

namespace moe {
namespace sm90 {
namespace {

constexpr int kBoxCols = 64;                                  // weight columns per TMA box (128 bytes)
constexpr int kABytes = kTileRows * kTileDepth * 2;           // 16 KB: A [128 rows x 64 K]
constexpr int kBoxBytes = kTileDepth * kBoxCols * 2;          // 8 KB: one weight box [64 K x 64 columns]
constexpr int kBBytes = 4 * kBoxBytes;                        // 32 KB: gate 2 boxes, then up 2 boxes
constexpr int kStageBytes = kABytes + kBBytes;                // 48 KB
constexpr int kLag = 2;                                       // cp.async groups in flight per producer thread
constexpr int kProducerThreads = 128;
constexpr int kConsumerWarps = 8;
constexpr int kFullArrivals = kProducerThreads + 1;           // every producer thread + the TMA issue
constexpr int kDone = -1;                                     // tile number that ends the stream
constexpr int kIdle = -2;                                     // kMcast: this CTA has no block in the unit
constexpr int kCluster = 2;                                   // kMcast: CTAs per cluster

// The producer's wait for stage it needs stage it - kStages released, which the consumers do only
// after taking stage it - kStages + 1, whose rows the producer signals kLag steps late: so
// kLag <= kStages - 2 (kLag = kStages - 1 deadlocks; found in review).
static_assert(kLag <= kStages - 2, "a lagged arrive must come before the producer waits on that stage again");
static_assert(kStageBytes % 1024 == 0, "stages must keep the 1024-byte alignment of the 128B swizzle");

struct Control {
  uint64_t full[kStages];   // producer -> consumers: A rows landed (128 arrivals) + weight bytes (TMA)
  uint64_t empty[kStages];  // consumers -> producer: one arrival per consumer warp
  int tile[kStages];        // tile number of the stage's data (kDone ends the stream)
  int next[2];              // thread 0 -> producer warp group: the next tile (double-buffered)
};

constexpr size_t kSmemBytes = static_cast<size_t>(kStages) * kStageBytes + sizeof(Control) + 1024;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Waits until the phase with this parity has completed (a fresh barrier: parity 1 passes at once).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int col, int row) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(col), "r"(row)
      : "memory");
}

// 16 bytes global -> shared, L2 only; src_bytes 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// The thread's prior cp.async arrive on `bar` when they complete; the arrival is one of the phase's
// expected count (.noinc), so the thread makes no other arrival for them.
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// kMcast: the weight box lands at the same offset in both CTAs of the cluster (mask 0b11), each
// CTA's barrier at the barrier's offset receiving its bytes.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map, uint32_t bar, int col,
                                                      int row) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(col), "r"(row), "h"(static_cast<uint16_t>(3))
      : "memory");
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// Arrival on the barrier at this shared address in CTA `rank` of the cluster (this CTA included).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(bar), "r"(rank)
      : "memory");
}

__device__ __forceinline__ void producer_sync() { asm volatile("bar.sync 1, 128;" ::: "memory"); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator registers across wgmma issue / wait points.
__device__ __forceinline__ void fence_operands(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The 64-register half of the accumulators (gate: 0, up: 1) that kBase's two m64n128 wgmma write.
__device__ __forceinline__ float (&half_of(float (&d)[128], int h))[64] {
  return *reinterpret_cast<float(*)[64]>(d + 64 * h);
}

// wgmma matrix descriptor, 128-byte swizzle: start address, leading and stride byte offsets (>> 4).
// A, K-major: rows of 128 bytes, 8-row atoms 1024 bytes apart (SBO); LBO unused (16).
// B, MN-major: K rows of 128 bytes (64 columns), 8-row atoms 1024 bytes apart (SBO), the next 64
// columns one TMA box (8 KB, LBO) further.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ float silu_mul(float g, float u) { return __fdividef(g, 1.0f + __expf(-g)) * u; }

__device__ __forceinline__ int next_tile(int32_t* queue, const int32_t* block_expert, int num_tiles, int n_tiles,
                                         int E) {
  while (true) {
    const int tile = atomicAdd(queue, 1);
    if (tile >= num_tiles) return kDone;
    if (block_expert[tile / n_tiles] < E) return tile;
  }
}

// A copy: 8 consecutive threads copy one row's 8 16-byte chunks (128 contiguous bytes per 8
// threads: whole 32-byte sectors per instruction), rows r0, r0 + 16, ..., r0 + 112 of the tile.
struct RowCopy {
  uint32_t chunk, r0, dst0;
  const __nv_bfloat16* src[8];  // this thread's chunk of its 8 rows at K step 0; nullptr: padding row

  __device__ explicit RowCopy(int t)
      : chunk(t & 7), r0(t >> 3), dst0(r0 * 128 + ((chunk ^ (r0 & 7)) << 4)) {}  // 128B swizzle: (r0 + 16 i) & 7 == r0 & 7

  // The rows of `block` (none: every row padding).
  __device__ void point(const Gemm1Args& p, int block, bool none) {
    const __nv_bfloat16* a = static_cast<const __nv_bfloat16*>(p.a);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int s = block * kTileRows + r0 + 16 * i;
      const int token = none ? -1 : p.row_token ? p.row_token[s] : s;
      src[i] = token >= 0 ? a + static_cast<int64_t>(token) * p.H + chunk * 8 : nullptr;
    }
  }

  // K step kk into the stage at `base`; padding rows: zeros, nothing read.
  __device__ void issue(const Gemm1Args& p, uint32_t base, int kk) const {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      cp_async_16(base + dst0 + i * 16 * 128, src[i] ? src[i] + kk * kTileDepth : p.a, src[i] ? 16u : 0u);
    }
  }
};

// Weight boxes b in [first, last) of K step kk, column tile pn, into the stage at `base` (gate pn*128 +
// 0 / 64, up Ir + the same), completing on `full`; kMulticast: into both CTAs of the cluster.
template <bool kMulticast>
__device__ __forceinline__ void load_boxes(const Gemm1Args& p, const CUtensorMap* w_map, uint32_t base, uint32_t full,
                                           int expert, int pn, int kk, int first, int last) {
  const int row = expert * p.H + kk * kTileDepth;
#pragma unroll
  for (int b = first; b < last; ++b) {
    const int col = (b < 2 ? 0 : p.Ir) + pn * kTileCols + (b & 1) * kBoxCols;
    if constexpr (kMulticast) {
      tma_load_2d_multicast(base + kABytes + b * kBoxBytes, w_map, full, col, row);
    } else {
      tma_load_2d(base + kABytes + b * kBoxBytes, w_map, full, col, row);
    }
  }
}

// A producer thread's wait for stage it % kStages to be free (phase it / kStages); thread 0 then
// labels it with `tile` (kDone ends the stream). Returns the stage's shared address.
__device__ __forceinline__ uint32_t acquire_stage(Control* ctl, uint32_t stage0, uint32_t it, int tile) {
  const uint32_t stage = it % kStages;
  mbar_wait(smem_u32(&ctl->empty[stage]), ((it / kStages) & 1) ^ 1);
  if (threadIdx.x == 0) ctl->tile[stage] = tile;
  return stage0 + stage * kStageBytes;
}

// The stage after the last one issued ends the stream: every producer thread's arrival, and thread
// 0's in place of the TMA issue's.
__device__ __forceinline__ void end_stream(Control* ctl, uint32_t stage0, uint32_t it) {
  acquire_stage(ctl, stage0, it, kDone);
  const uint32_t full = smem_u32(&ctl->full[it % kStages]);
  if (threadIdx.x == 0) mbar_arrive(full);
  mbar_arrive(full);
}

template <int V>
__device__ void producer(const Gemm1Args& p, const CUtensorMap* w_map, uint8_t* stages, Control* ctl) {
  const int t = threadIdx.x;  // 0..127
  RowCopy rows(t);
  const int n_tiles = p.Ir / kTileCols;
  const int num_tiles = (p.S / kTileRows) * n_tiles;
  const int k_steps = p.H / kTileDepth;
  const uint32_t stage0 = smem_u32(stages);
  uint32_t it = 0;  // K steps issued so far, over all tiles: stage it % kStages, phase it / kStages
  for (int n = 0;; ++n) {
    if (t == 0) ctl->next[n & 1] = next_tile(p.queue, p.block_expert, num_tiles, n_tiles, p.E);
    producer_sync();
    const int tile = ctl->next[n & 1];
    if (tile == kDone) {
      if (t == 0) {  // the last CTA to take its last number rewinds the queue for the next launch
        __threadfence();  // this CTA's last grab before its count
        if (atomicAdd(p.queue + 1, 1) == static_cast<int>(gridDim.x) - 1) {
          __threadfence();  // every CTA's count is seen before the rewind (acquire side)
          atomicExch(p.queue, 0);
          atomicExch(p.queue + 1, 0);
        }
      }
      break;
    }
    const int block = tile / n_tiles, pn = tile % n_tiles;
    const int expert = p.block_expert[block];
    rows.point(p, block, false);
    for (int kk = 0; kk < k_steps; ++kk, ++it) {
      const uint32_t base = acquire_stage(ctl, stage0, it, tile);
      const uint32_t full = smem_u32(&ctl->full[it % kStages]);
      if (t == 0) {
        mbar_arrive_expect_tx(full, kBBytes);
        load_boxes<false>(p, w_map, base, full, expert, pn, kk, 0, 4);
      }
      rows.issue(p, base, kk);
      if constexpr (V == kNoinc) {
        cp_async_arrive_noinc(full);
        continue;
      }
      cp_async_commit();
      if (it >= kLag) {
        cp_async_wait<kLag>();
        fence_proxy_async();
        mbar_arrive(smem_u32(&ctl->full[(it - kLag) % kStages]));
      }
    }
  }
  // The last kLag stages' rows (kNoinc: signalled by the copies themselves), then the end of the stream.
  if constexpr (V != kNoinc) {
    cp_async_wait<0>();
    fence_proxy_async();
    for (uint32_t i = it >= kLag ? it - kLag : 0; i < it; ++i) mbar_arrive(smem_u32(&ctl->full[i % kStages]));
  }
  end_stream(ctl, stage0, it);
}

// kMcast's producer warp group: units u = cluster, cluster + clusters, ... of (pair q = u / n_tiles,
// column tile u % n_tiles); this CTA (rank r) computes block 2q + r. Both CTAs walk the same units and
// K steps (the release counts both CTAs' consumers per stage), an idle CTA (its block unused or past
// the layout) with empty stages (kIdle). Rows as kNoinc; weights: multicast halves when both blocks
// are one expert's (rank 0 the gate boxes, rank 1 the up boxes, into both CTAs), else its own 4 boxes.
__device__ void producer_mcast(const Gemm1Args& p, const CUtensorMap* w_map, uint8_t* stages, Control* ctl) {
  const int t = threadIdx.x;  // 0..127
  RowCopy rows(t);
  const int n_tiles = p.Ir / kTileCols;
  const int blocks = p.S / kTileRows;
  const int units = (blocks + 1) / 2 * n_tiles;
  const int k_steps = p.H / kTileDepth;
  const int rank = static_cast<int>(cluster_rank());
  const int cluster = blockIdx.x / kCluster, clusters = gridDim.x / kCluster;
  const uint32_t stage0 = smem_u32(stages);
  auto expert_of = [&](int b) { return b < blocks ? p.block_expert[b] : p.E; };  // E: no block
  uint32_t it = 0;
  for (int u = cluster; u < units; u += clusters) {
    const int q = u / n_tiles, pn = u % n_tiles;
    const int e0 = expert_of(2 * q), e1 = expert_of(2 * q + 1);
    if (e0 >= p.E && e1 >= p.E) continue;  // both CTAs skip it alike
    const int block = 2 * q + rank, expert = rank ? e1 : e0;
    const bool mine = expert < p.E, shared = e0 == e1;  // shared: both used (e0 < E here)
    const int tile = mine ? block * n_tiles + pn : kIdle;
    rows.point(p, block, !mine);
    for (int kk = 0; kk < k_steps; ++kk, ++it) {
      const uint32_t base = acquire_stage(ctl, stage0, it, tile);
      const uint32_t full = smem_u32(&ctl->full[it % kStages]);
      if (t == 0) {
        if (mine) {
          mbar_arrive_expect_tx(full, kBBytes);  // 4 boxes, half of them from the partner when shared
          if (shared) {
            load_boxes<true>(p, w_map, base, full, expert, pn, kk, 2 * rank, 2 * rank + 2);
          } else {
            load_boxes<false>(p, w_map, base, full, expert, pn, kk, 0, 4);
          }
        } else {
          mbar_arrive(full);
        }
      }
      if (mine) {
        rows.issue(p, base, kk);
        cp_async_arrive_noinc(full);
      } else {
        mbar_arrive(full);
      }
    }
  }
  end_stream(ctl, stage0, it);  // at the same stage in both CTAs
}

// A consumer warp's release of a stage: to its own producers, and with kMcast to both CTAs' (either
// may multicast weight boxes into this CTA's stage).
template <int V>
__device__ __forceinline__ void release(uint32_t empty) {
  if constexpr (V == kMcast) {
    mbar_arrive_cluster(empty, 0);
    mbar_arrive_cluster(empty, 1);
  } else {
    mbar_arrive(empty);
  }
}

template <int V>
__device__ void consumer(const Gemm1Args& p, uint8_t* stages, Control* ctl) {
  const int wg = threadIdx.x / 128 - 1;        // 0: tile rows 0-63, 1: rows 64-127
  const int warp = (threadIdx.x / 32) % 4;     // 16-row slice of the warp group's 64
  const int lane = threadIdx.x % 32;
  const int n_tiles = p.Ir / kTileCols;
  const int k_steps = p.H / kTileDepth;
  const uint32_t stage0 = smem_u32(stages);
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out);
  float acc[128];  // gate: columns 0-127 = registers 0-63, up: 128-255 = 64-127 (fragment layout below)
  uint32_t it = 0;
  while (true) {
    const uint32_t first = it % kStages;
    mbar_wait(smem_u32(&ctl->full[first]), (it / kStages) & 1);
    const int tile = ctl->tile[first];
    if (tile == kDone) break;
    const int block = tile / n_tiles, pn = tile % n_tiles;
    // Warp group 1 of a half tail (row 64 is padding, so are rows 65..127) computes nothing; nor
    // does either warp group of a kMcast CTA without a block in the unit (it keeps its partner's pace).
    const bool live = tile != kIdle && (wg == 0 || p.row_token == nullptr || p.row_token[block * kTileRows + 64] >= 0);
    if (!live) {  // wait for each stage and release it
      for (int kk = 0; kk < k_steps; ++kk, ++it) {
        const uint32_t stage = it % kStages;
        if (kk > 0) mbar_wait(smem_u32(&ctl->full[stage]), (it / kStages) & 1);
        if (lane == 0) release<V>(smem_u32(&ctl->empty[stage]));
      }
      continue;
    }
    uint32_t prev = 0;
    for (int kk = 0; kk < k_steps; ++kk, ++it) {
      const uint32_t stage = it % kStages;
      if (kk > 0) mbar_wait(smem_u32(&ctl->full[stage]), (it / kStages) & 1);
      if constexpr (V >= kNoinc) fence_proxy_async();  // the producers' cp.async rows, for wgmma's proxy
      const uint32_t a0 = stage0 + stage * kStageBytes + wg * 64 * 128;
      const uint32_t b0 = stage0 + stage * kStageBytes + kABytes;
      fence_operands(acc);
      wgmma_fence();
#pragma unroll
      for (uint32_t k16 = 0; k16 < kTileDepth / 16; ++k16) {
        const uint64_t da = smem_desc(a0 + k16 * 32, 16, 1024);
        const uint32_t scale = (kk > 0 || k16 > 0) ? 1u : 0u;
        if constexpr (V == kBase) {
          wgmma_m64n128k16_bf16(half_of(acc, 0), da, smem_desc(b0 + k16 * 2048, kBoxBytes, 1024), scale);
          wgmma_m64n128k16_bf16(half_of(acc, 1), da, smem_desc(b0 + 2 * kBoxBytes + k16 * 2048, kBoxBytes, 1024),
                                scale);
        } else {  // the 4 boxes are kBoxBytes apart: one n256 operand of LBO kBoxBytes spans gate and up
          wgmma_m64n256k16_bf16(acc, da, smem_desc(b0 + k16 * 2048, kBoxBytes, 1024), scale);
        }
      }
      wgmma_commit();
      wgmma_wait<1>();  // the previous stage's group has read its operands
      fence_operands(acc);
      if (kk > 0 && lane == 0) release<V>(smem_u32(&ctl->empty[prev]));
      prev = stage;
    }
    wgmma_wait<0>();
    fence_operands(acc);
    if (lane == 0) release<V>(smem_u32(&ctl->empty[prev]));
    // Accumulator fragment of m64nN: register 4j + 2i + c holds row lane/4 + 8i (of the warp's 16)
    // and column 8j + 2(lane%4) + c.
    const int r0 = block * kTileRows + wg * 64 + warp * 16 + lane / 4;
    const int col = pn * kTileCols + 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = r0 + 8 * i;
      if (p.row_token != nullptr && p.row_token[r] < 0) continue;  // padding: never written
      __nv_bfloat16* row_out = out + static_cast<int64_t>(r) * p.Ir + col;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int q = 4 * j + 2 * i;
        const __nv_bfloat162 v = __floats2bfloat162_rn(silu_mul(acc[q], acc[64 + q]), silu_mul(acc[q + 1], acc[65 + q]));
        *reinterpret_cast<__nv_bfloat162*>(row_out + 8 * j) = v;
      }
    }
  }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <int V>
__global__ void __launch_bounds__(kThreads, 1) gemm1_kernel(const Gemm1Args args, const __grid_constant__ CUtensorMap w_map) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  // The 128B swizzle (TMA and wgmma) is a function of shared-memory address bits 4-9: stages start 1024-aligned.
  uint8_t* stages = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  Control* ctl = reinterpret_cast<Control*>(stages + kStages * kStageBytes);
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(smem_u32(&ctl->full[i]), kFullArrivals);
      mbar_init(smem_u32(&ctl->empty[i]), kConsumerWarps * (V == kMcast ? kCluster : 1));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&w_map)) : "memory");
  }
  if constexpr (V == kMcast) {
    cluster_sync();  // the partner's barriers exist before any multicast or release reaches them
  } else {
    __syncthreads();
  }
  if (threadIdx.x < kProducerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if constexpr (V == kMcast) {
      producer_mcast(args, &w_map, stages, ctl);
    } else {
      producer<V>(args, &w_map, stages, ctl);
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    consumer<V>(args, stages, ctl);
  }
  if constexpr (V == kMcast) cluster_sync();  // no CTA leaves while its partner may still release into it
#else
  __trap();  // built for sm_90a only (csrc/build.py)
#endif
}

enum Error : int {
  kNoEntryPoint = -1,   // the driver's cuTensorMapEncodeTiled was not found
  kEncodeFailed = -2,   // cuTensorMapEncodeTiled refused the weights' map
  kNoVariant = -3,      // Gemm1Args.variant is not a Gemm1Variant
  kNoCluster = -4,      // kMcast: no cluster of 2 CTAs of this size fits the device
};

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      ptr = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

}  // namespace

size_t gemm1_smem_bytes() { return kSmemBytes; }

const char* gemm1_shape_error(int64_t H, int64_t Ir, int64_t E, int64_t S, int64_t num_a_rows) {
  if (H <= 0 || H % kTileDepth) return "H must be a positive multiple of 64 (K steps of 64, TMA boxes within an expert)";
  if (Ir <= 0 || Ir % kTileCols) return "Ir must be a positive multiple of 128 (the tile's output columns)";
  if (S <= 0 || S % kTileRows) return "S must be a positive multiple of 128 (row blocks)";
  if (E < 1 || E * H > INT32_MAX || 2 * Ir > INT32_MAX) return "E*H and 2*Ir must fit int32 TMA coordinates";
  if (S > INT32_MAX || num_a_rows < 1 || num_a_rows * H > (int64_t{1} << 40)) return "S or the token matrix is too large";
  if ((S / kTileRows) * (Ir / kTileCols) > INT32_MAX) return "too many tiles for the int32 queue";
  return nullptr;
}

int gemm1_launch(const Gemm1Args& args, void* stream) {
  if (args.variant < 0 || args.variant >= kVariants) return kNoVariant;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_fn();
  if (encode == nullptr) return kNoEntryPoint;
  // W13 [E, H, 2*Ir] as the 2-D [E*H rows, 2*Ir columns] row-major matrix; dimension 0 is the inner one.
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(2 * args.Ir), static_cast<cuuint64_t>(args.E) * args.H};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(2 * args.Ir) * 2};  // bytes between rows
  const cuuint32_t box[2] = {kBoxCols, kTileDepth};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult res = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(args.w13), dims, strides,
                              box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) return kEncodeFailed;
  // The opt-in shared memory is an attribute of the function (each variant's instance) in each
  // device's context: the first launch on each device sets it (normally a warm-up, before any graph capture).
  constexpr int kMaxDevices = 64;
  static bool attribute_set[kVariants][kMaxDevices] = {};
  static void (*const kernels[kVariants])(const Gemm1Args, const CUtensorMap) = {
      gemm1_kernel<kBase>, gemm1_kernel<kN256>, gemm1_kernel<kNoinc>, gemm1_kernel<kMcast>};
  const auto kernel = kernels[args.variant];
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return static_cast<int>(err);
  if (device < 0 || device >= kMaxDevices || !attribute_set[args.variant][device]) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBytes));
    if (err != cudaSuccess) return static_cast<int>(err);
    if (device >= 0 && device < kMaxDevices) attribute_set[args.variant][device] = true;
  }
  if (args.variant != kMcast) {
    kernel<<<args.num_programs, kThreads, kSmemBytes, static_cast<cudaStream_t>(stream)>>>(args, map);
    return static_cast<int>(cudaGetLastError());
  }
  // kMcast: clusters of 2, an even grid of at most the clusters that fit at once (num_programs / 2
  // rounded down, at least 1; its static schedule needs no more, and a smaller grid is still correct).
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute cluster = {};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kCluster;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = static_cast<cudaStream_t>(stream);
  config.attrs = &cluster;
  config.numAttrs = 1;
  static int max_clusters[kMaxDevices] = {};
  int fit = device >= 0 && device < kMaxDevices ? max_clusters[device] : 0;
  if (fit == 0) {
    config.gridDim = dim3(kCluster * 66);
    if (const cudaError_t err = cudaOccupancyMaxActiveClusters(&fit, kernel, &config); err != cudaSuccess)
      return static_cast<int>(err);
    if (fit < 1) return kNoCluster;
    if (device >= 0 && device < kMaxDevices) max_clusters[device] = fit;
  }
  const int clusters = args.num_programs / kCluster < 1 ? 1 : args.num_programs / kCluster;
  config.gridDim = dim3(kCluster * (clusters < fit ? clusters : fit));
  return static_cast<int>(cudaLaunchKernelEx(&config, kernel, args, map));
}

const char* gemm1_error_string(int error) {
  switch (error) {
    case kNoEntryPoint:
      return "the driver has no cuTensorMapEncodeTiled (CUDA driver older than 12.0?)";
    case kEncodeFailed:
      return "cuTensorMapEncodeTiled refused the W13 tensor map (alignment or size)";
    case kNoVariant:
      return "no such tile variant (Gemm1Variant)";
    case kNoCluster:
      return "no cluster of 2 tile CTAs fits this device (cudaOccupancyMaxActiveClusters = 0)";
    default:
      return cudaGetErrorString(static_cast<cudaError_t>(error));
  }
}

}  // namespace sm90
}  // namespace moe
