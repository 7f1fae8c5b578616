// One-launch schedule builder for the gathered MoE layout (docs/CONTRACTS.md, service/moe/tables.py).
//
// Dimension letters: R ranks, C capacity per rank, K top-k, E experts, S rows of the layout,
// BM = 128 rows per block. Global token g = r*C + i is real iff i < counts[r]. Hit h = g*K + k.
//
// Every table is a *stable counting sort* by a key, which is what makes it deterministic:
//   slots       hits h sorted by (expert, h): within an expert by global token, then k.
//   pull_order  tokens sorted by smallest slot = tokens by (e_min, g): a token's smallest slot lies
//               in its smallest expert, and inside one expert rows follow the token index.
//               Padding tokens get key E: last, by index.
//   job_order   the same with the largest expert e_max (largest slot).
//
// How one sort runs (sort_count / column_scan / sort_place below). The n items are cut into 32
// contiguous segments, one per warp, so "earlier in the item order" = "earlier warp, or the same
// warp and an earlier round, or the same round and a lower lane". Each warp keeps a row of 16-bit
// counters per key in shared memory, table[warp][key]:
//   1. count: every item adds 1 to its key's counter of its warp (shared atomics: a sum, so the
//      order of the atomics does not matter).
//   2. column scan: one thread per key turns its column into exclusive prefixes over the warps;
//      the column total is the key's item count; a block scan of the totals gives base[key].
//   3. place: each warp walks its segment again, 32 items a round; __match_any_sync groups the
//      lanes with the same key, the rank inside the group is the popcount of the lower lanes, and
//      the group leader advances table[warp][key]. position = base[key] + table[warp][key] + rank.
// No atomic return value decides a position, so the output is the same on every run.
//
// Why this shape (bench/NOTES.md has the arithmetic): the inputs are 64 KB and the outputs 250 KB,
// ~0.1 us at HBM speed, so the kernel is latency-bound. The previous version placed 1024 items per
// chunk with three __syncthreads per chunk and re-read ids from global memory in every chunk and
// every phase (~60 dependent global round trips, ~100 us at the seed shape). Here the number of
// barriers is fixed (15, whatever the size), every pass issues all its loads before it uses them
// (16 per lane in flight), and nothing runs serially over E, over tokens or over hits in one
// thread. Divisions by K and C use a 16-bit-exact multiply-high (FastDiv).
// Measured (H200, graph replay): 35.7 us at the seed shape against 100-105 us before; ~13 us fixed
// plus ~1.4 us per 1024 hits, more with more distinct experts per warp round: the scattered 4-byte
// row_token stores of one SM (one L2 sector each) are the likely limiter; staging row_token in
// shared memory and writing it out coalesced is the next step (bench/NOTES.md).
//
// One CTA of 1024 threads, one launch, no host sync, graph-capturable (no allocation; the caller
// passes every output). Limits, checked by the host entry (bindings.cpp) before anything runs:
//   E <= kMaxExperts (1023): one thread per key in the scans (E + 1 keys for the token sorts);
//   R*C*K <= kMaxHits (65536): 16-bit counters (a warp's segment holds at most 2048 items, the
//     exclusive prefix of warp 31 at most 31 * 2048) and FastDiv exact below 2^16;
//   S % BM == 0 and S >= ceil((R*C*K + E*(BM-1)) / BM) * BM (the worst case of the layout);
//   ids of real tokens in [0, E): hits outside are dropped (slot -1), which keeps memory safe
//     but breaks the tables; the service validates ids before they get here.
// Dynamic shared memory: build_tables_smem_bytes(E, hits), at most ~81 KB (E = 1023, 65536 hits),
// under the 99 KB of sm_120.
//
// This file includes no torch header: it compiles alone with nvcc (CI checks sm_90 and sm_120),
// the torch glue lives in csrc/bindings.cpp.

#include <cuda_runtime.h>
#include <stdint.h>

#include "schedule_kernel.h"

namespace moe {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kHitBatch = 16;   // hits per lane loaded before any is used (the seed shape: all of them)
constexpr int kTokenBatch = 2;  // tokens per lane per batch (each needs K ids; the seed shape: all of them)

static_assert(kMaxHits <= 65536, "16-bit per-warp counters and FastDiv need item indices below 2^16");
static_assert(kMaxExperts + 1 <= kThreads, "one thread per key in the column and block scans");

// x / d for 0 <= x < 2^16 and 1 <= d <= 2^16, exact: with m = ceil(2^32 / d) = (2^32 + e) / d,
// 0 <= e < d, umulhi(x, m) = floor(x/d + x*e / (d*2^32)) and x*e < 2^32, so the error term stays
// below 1/d and never crosses the next integer.
struct FastDiv {
  uint32_t magic;
  int d;
  __device__ __forceinline__ int operator()(int x) const {
    return d == 1 ? x : static_cast<int>(__umulhi(static_cast<uint32_t>(x), magic));
  }
};

FastDiv make_fastdiv(int d) {
  FastDiv f;
  f.d = d;
  f.magic = d == 1 ? 0u : static_cast<uint32_t>(((1ull << 32) + d - 1) / d);
  return f;
}

struct Problem {
  const int32_t* ids;
  const int32_t* counts;
  int C, K, E, T, hits;
  FastDiv divK, divC;
  bool vec4;  // K % 4 == 0 and ids 16-byte aligned: a token's ids load as int4

  __device__ __forceinline__ bool is_real(int g) const {
    const int r = divC(g);
    return g - r * C < __ldg(&counts[r]);
  }
  // Expert of hit h, or -1 (padding token, or an id outside [0, E): dropped, see the header).
  __device__ __forceinline__ int hit_key(int h) const {
    const int e = __ldg(&ids[h]);
    return is_real(divK(h)) && e >= 0 && e < E ? e : -1;
  }
  // e_min (largest = false) or e_max of token g; E for padding tokens (and tokens with no valid id).
  template <bool kLargest>
  __device__ __forceinline__ int token_key(int g) const {
    int best = kLargest ? -1 : E;
    auto take = [&](int e) {
      if (e >= 0 && e < E) best = kLargest ? max(best, e) : min(best, e);
    };
    if (vec4) {
      const int4* row = reinterpret_cast<const int4*>(ids) + g * (K >> 2);
#pragma unroll 4
      for (int q = 0; q < (K >> 2); ++q) {
        const int4 v = __ldg(&row[q]);
        take(v.x), take(v.y), take(v.z), take(v.w);
      }
    } else {
#pragma unroll 8
      for (int k = 0; k < K; ++k) take(__ldg(&ids[g * K + k]));
    }
    return is_real(g) && best >= 0 && best < E ? best : E;
  }
};

struct Segment {  // this warp's items [begin, end): 32 contiguous segments in warp order
  int begin, end;
};

__device__ __forceinline__ Segment warp_segment(int n) {
  const int per = (n + kWarps - 1) / kWarps;
  const int begin = min(n, (threadIdx.x >> 5) * per);
  return {begin, min(n, begin + per)};
}

// Exclusive scan of one int per thread over the CTA; `total` gets the sum. warp_sums: [33].
// Three barriers; the first one also publishes every shared write made before the call.
__device__ int block_exclusive_scan(int value, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inclusive = value;
  for (int d = 1; d < 32; d <<= 1) {
    const int up = __shfl_up_sync(kFull, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int s = warp_sums[lane];
    int incl = s;
    for (int d = 1; d < 32; d <<= 1) {
      const int up = __shfl_up_sync(kFull, incl, d);
      if (lane >= d) incl += up;
    }
    warp_sums[lane] = incl - s;  // exclusive prefix of the warp totals
    if (lane == 31) warp_sums[32] = incl;
  }
  __syncthreads();
  const int result = warp_sums[warp] + inclusive - value;
  *total = warp_sums[32];
  __syncthreads();  // warp_sums is reused by the next scan
  return result;
}

// Zero this warp's counter row (stride u16 = stride/2 words; stride is even).
__device__ __forceinline__ void zero_row(uint16_t* row, int stride) {
  uint32_t* words = reinterpret_cast<uint32_t*>(row);
  for (int i = threadIdx.x & 31; i < stride / 2; i += 32) words[i] = 0u;
  __syncwarp();
}

// Pass 1 of a sort: row[key] += items of this warp's segment with that key. The u16 counter of
// key e is half (e & 1) of word e >> 1 (little-endian); a segment holds at most 2048 items, so
// the low half never carries into the high one.
template <int kBatch, class KeyOf>
__device__ __forceinline__ void sort_count(Segment seg, uint16_t* row, KeyOf key_of) {
  const int lane = threadIdx.x & 31;
  uint32_t* words = reinterpret_cast<uint32_t*>(row);
  for (int base = seg.begin; base < seg.end; base += 32 * kBatch) {
    int key[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {  // all loads first: one memory latency per batch
      const int i = base + j * 32 + lane;
      key[j] = i < seg.end ? key_of(i) : -1;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      if (key[j] >= 0) atomicAdd(&words[key[j] >> 1], 1u << (16 * (key[j] & 1)));
  }
  __syncwarp();
}

// Pass 2 (one thread per key, after a barrier): column `key` of the table becomes the exclusive
// prefix over warps; returns the column total (the key's item count).
__device__ __forceinline__ int column_scan(uint16_t* table, int stride, int keys) {
  const int key = threadIdx.x;
  if (key >= keys) return 0;
  int acc = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int v = table[w * stride + key];
    table[w * stride + key] = static_cast<uint16_t>(acc);  // < 31 * 2048 + 2048: fits 16 bits
    acc += v;
  }
  return acc;
}

// Pass 3: emit(item, key, position) for every item of this warp's segment, position =
// base[key] + items of the key in lower warps + earlier rounds + lower lanes. Key -1: no position.
template <int kBatch, class KeyOf, class Emit>
__device__ __forceinline__ void sort_place(Segment seg, uint16_t* row, const int* base, KeyOf key_of, Emit emit) {
  const int lane = threadIdx.x & 31;
  const unsigned lower_lanes = (1u << lane) - 1u;
  for (int b0 = seg.begin; b0 < seg.end; b0 += 32 * kBatch) {  // warp-uniform trip count
    int key[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = b0 + j * 32 + lane;
      key[j] = i < seg.end ? key_of(i) : -1;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const unsigned match = __match_any_sync(kFull, key[j]);  // lanes with the same key this round
      const int leader = __ffs(match) - 1;
      int start = 0;
      if (key[j] >= 0 && lane == leader) {  // only the leader touches the counter this round
        start = row[key[j]];
        row[key[j]] = static_cast<uint16_t>(start + __popc(match));
      }
      start = __shfl_sync(kFull, start, leader);
      __syncwarp();  // the next round's leader (maybe another lane) must see this update
      const int i = b0 + j * 32 + lane;
      if (i < seg.end) emit(i, key[j], key[j] >= 0 ? base[key[j]] + start + __popc(match & lower_lanes) : -1);
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1)
build_tables_kernel(Problem p, int S, int stride, int32_t* __restrict__ expert_offsets,
                    int32_t* __restrict__ block_expert, int32_t* __restrict__ slots, int32_t* __restrict__ row_token,
                    int32_t* __restrict__ pull_order, int32_t* __restrict__ job_order) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int E = p.E, keys = E + 1;                                 // experts, plus E = "padding token"
  uint16_t* table = reinterpret_cast<uint16_t*>(smem_raw);         // [32][stride] per-warp counters
  int* off = reinterpret_cast<int*>(table + kWarps * stride);      // [keys] padded offsets, off[E] = used rows
  int* hits_of = off + keys;                                       // [keys] real hits per expert
  int* base = hits_of + keys;                                      // [keys] token-sort starts
  uint16_t* used_expert = reinterpret_cast<uint16_t*>(base + keys);  // [used blocks] expert of a used block
  __shared__ int warp_sums[33];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint16_t* row = table + warp * stride;
  const Segment hit_seg = warp_segment(p.hits), token_seg = warp_segment(p.T);
  const int blocks = S / kBlockRows;
  auto hit_key = [&](int h) { return p.hit_key(h); };
  auto min_key = [&](int g) { return p.token_key<false>(g); };
  auto max_key = [&](int g) { return p.token_key<true>(g); };

  // Phase 1: count hits per (warp, expert).
  zero_row(row, stride);
  sort_count<kHitBatch>(hit_seg, row, hit_key);
  __syncthreads();

  // Phase 2: per-expert totals and warp prefixes; offsets = exclusive scan of the padded runs.
  {
    const int k = threadIdx.x;
    const int n = column_scan(table, stride, keys);
    const int padded = k < E ? (n + kBlockRows - 1) / kBlockRows * kBlockRows : 0;
    int used;
    const int o = block_exclusive_scan(padded, warp_sums, &used);
    if (k < keys) {
      off[k] = o;  // k == E: the used rows
      hits_of[k] = n;
      expert_offsets[k] = o;
    }
  }
  __syncthreads();

  // Phase 3: block table; slots and the real rows of row_token; count tokens by e_min.
  const int used_rows = off[E];
  for (int b = threadIdx.x; b < blocks; b += kThreads) {
    const int row0 = b * kBlockRows;
    int e = E;
    if (row0 < used_rows) {
      int lo = 0, hi = E - 1;  // last e with off[e] <= row0 (empty experts share offsets: take the last)
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (off[mid] <= row0) lo = mid; else hi = mid - 1;
      }
      e = lo;
      used_expert[b] = static_cast<uint16_t>(e);
    }
    block_expert[b] = e;
  }
  sort_place<kHitBatch>(hit_seg, row, off, hit_key, [&](int h, int key, int pos) {
    slots[h] = pos;  // -1 for hits of padding tokens
    if (key >= 0) row_token[pos] = p.divK(h);
  });
  zero_row(row, stride);
  sort_count<kTokenBatch>(token_seg, row, min_key);
  __syncthreads();

  // Phase 4: padding rows of row_token (the tail of each run, and unused blocks), one warp per
  // block; starts of the e_min sort.
  for (int b = warp; b < blocks; b += kWarps) {
    const int row0 = b * kBlockRows;
    int pad_from = row0;  // unused block: every row is padding
    if (row0 < used_rows) {
      const int e = used_expert[b];
      pad_from = max(row0, off[e] + hits_of[e]);
    }
    for (int r = row0 + lane; r < row0 + kBlockRows; r += 32)
      if (r >= pad_from) row_token[r] = -1;
  }
  {
    const int n = column_scan(table, stride, keys);
    int total;
    const int start = block_exclusive_scan(n, warp_sums, &total);
    if (threadIdx.x < keys) base[threadIdx.x] = start;
  }
  __syncthreads();

  // Phase 5: pull_order; count tokens by e_max.
  sort_place<kTokenBatch>(token_seg, row, base, min_key, [&](int g, int, int pos) { pull_order[pos] = g; });
  zero_row(row, stride);
  sort_count<kTokenBatch>(token_seg, row, max_key);
  __syncthreads();

  // Phase 6: starts of the e_max sort (base[] is free again: phase 5 is behind the barrier).
  {
    const int n = column_scan(table, stride, keys);
    int total;
    const int start = block_exclusive_scan(n, warp_sums, &total);
    if (threadIdx.x < keys) base[threadIdx.x] = start;
  }
  __syncthreads();

  // Phase 7: job_order.
  sort_place<kTokenBatch>(token_seg, row, base, max_key, [&](int g, int, int pos) { job_order[pos] = g; });
}

int row_stride(int E) { return (E + 2) & ~1; }  // keys = E + 1 rounded up to even (u32 words)

int max_used_blocks(int E, int hits) { return (hits + E * (kBlockRows - 1) + kBlockRows - 1) / kBlockRows; }

}  // namespace

size_t build_tables_smem_bytes(int E, int hits) {
  const size_t table = static_cast<size_t>(kWarps) * row_stride(E) * sizeof(uint16_t);
  const size_t per_key = 3 * static_cast<size_t>(E + 1) * sizeof(int);
  return table + per_key + static_cast<size_t>(max_used_blocks(E, hits)) * sizeof(uint16_t);
}

int build_tables_launch(const int32_t* ids, const int32_t* counts, int R, int C, int K, int E, int S,
                        int32_t* expert_offsets, int32_t* block_expert, int32_t* slots, int32_t* row_token,
                        int32_t* pull_order, int32_t* job_order, void* stream) {
  const int T = R * C, hits = T * K;
  const size_t smem = build_tables_smem_bytes(E, hits);
  if (smem > 48 * 1024) {  // above the default: opt in (no stream work, fine during graph capture)
    const cudaError_t err = cudaFuncSetAttribute(build_tables_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem));
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  Problem p;
  p.ids = ids;
  p.counts = counts;
  p.C = C;
  p.K = K;
  p.E = E;
  p.T = T;
  p.hits = hits;
  p.divK = make_fastdiv(K);
  p.divC = make_fastdiv(C);
  p.vec4 = K % 4 == 0 && reinterpret_cast<uintptr_t>(ids) % 16 == 0;
  build_tables_kernel<<<1, kThreads, smem, static_cast<cudaStream_t>(stream)>>>(
      p, S, row_stride(E), expert_offsets, block_expert, slots, row_token, pull_order, job_order);
  return static_cast<int>(cudaGetLastError());
}

const char* error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace moe
