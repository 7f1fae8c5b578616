// One-launch schedule builder for the gathered MoE layout (docs/CONTRACTS.md, service/moe/tables.py).
//
// Dimension letters: R ranks, C capacity per rank, K top-k, E experts, S rows of the layout,
// BM = 128 rows per block. Global token g = r*C + i is real iff i < counts[r]. Hit h = g*K + k.
//
// Every table is a *stable counting sort* by an expert key, which is what makes it deterministic:
//   slots       hits sorted by (expert, h): within an expert by global token, then k.
//               slot(h) = expert_offsets[e] + #{h' < h : e(h') == e}
//   pull_order  tokens sorted by smallest slot. A token's smallest slot lies in its smallest
//               expert e_min, and inside one expert rows follow the token index, so this is the
//               tokens sorted by (e_min, g). Padding tokens get key E: last, by index.
//   job_order   the same with the largest expert e_max (largest slot).
// Each sort: histogram (shared atomics: the totals do not depend on the order), exclusive scan,
// then the ranks chunk by chunk (1024 items, one per thread): inside a warp, __match_any_sync
// gives the lanes with the same key and the rank among them; across warps, each warp leader
// publishes its group size in a [32][keys] byte table and its bit in present[key], and sums the
// sizes of the lower warps. No atomic return value decides a position, so the output is the
// same on every run.
//
// One CTA of 1024 threads, one launch, no host sync, graph-capturable (no allocation; the
// caller passes every output). Limits, checked by the host entry (bindings.cpp):
//   E <= kMaxExperts (1023): one thread per key in the scans (E + 1 keys for the token sorts);
//   R*C*K <= kMaxHits (65536): not a correctness bound, a latency one (~1 us per 1024 hits);
//   S % BM == 0 and S >= ceil((R*C*K + E*(BM-1)) / BM) * BM (the worst case of the layout);
//   ids of real tokens in [0, E): hits outside are dropped (slot -1), which keeps memory safe
//   but breaks the tables; the service validates ids before they get here.
// Dynamic shared memory: 64 * (E + 1) bytes (65536 B at E = 1023, under the 99 KB of sm_120).
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

// Exclusive scan of one int per thread over the CTA; `total` gets the sum. warp_sums: [32].
__device__ int block_exclusive_scan(int value, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inclusive = value;
  for (int d = 1; d < 32; d <<= 1) {
    int up = __shfl_up_sync(kFull, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int s = warp_sums[lane];
    int incl = s;
    for (int d = 1; d < 32; d <<= 1) {
      int up = __shfl_up_sync(kFull, incl, d);
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

// Warp-aggregated histogram increment: one shared atomic per distinct key in the warp.
__device__ void histogram_add(int* hist, int key) {
  const unsigned match = __match_any_sync(kFull, key);
  const int lane = threadIdx.x & 31;
  if (key >= 0 && lane == __ffs(match) - 1) atomicAdd(&hist[key], __popc(match));
}

struct Smem {
  int* base;         // [keys] first position of each key (exclusive scan)
  int* running;      // [keys] items of each key placed by earlier chunks
  unsigned* present; // [keys] bit w: warp w of this chunk holds the key
  uint8_t* count8;   // [32][keys] group size of (warp, key) in this chunk (<= 32)
};

// Stable counting-sort placement: emit(item, position) for every item with key >= 0, in
// position order base[key] + #{earlier items with the same key}. Every thread must call it.
template <class KeyOf, class Emit>
__device__ void stable_place(int n, int keys, Smem s, KeyOf key_of, Emit emit) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int k = threadIdx.x; k < keys; k += kThreads) {
    s.running[k] = 0;
    s.present[k] = 0;
  }
  __syncthreads();
  for (int chunk = 0; chunk < n; chunk += kThreads) {
    const int item = chunk + threadIdx.x;
    const int key = item < n ? key_of(item) : -1;  // -1: nothing to place
    const unsigned match = __match_any_sync(kFull, key);  // lanes of this warp with the same key
    const int leader = __ffs(match) - 1;
    const int lane_rank = __popc(match & ((1u << lane) - 1u));
    const bool lead = key >= 0 && lane == leader;
    if (lead) {
      s.count8[warp * keys + key] = static_cast<uint8_t>(__popc(match));
      atomicOr(&s.present[key], 1u << warp);
    }
    __syncthreads();  // every warp's group sizes and bits are in
    int before = 0;   // items of this key in lower warps of the chunk
    bool last = false;
    if (lead) {
      const unsigned p = s.present[key];
      for (unsigned lower = p & ((1u << warp) - 1u); lower; lower &= lower - 1u)
        before += s.count8[(__ffs(lower) - 1) * keys + key];
      last = (p >> warp) == 1u;  // no higher warp holds the key: this leader advances running
    }
    before = __shfl_sync(kFull, before, leader);
    const int placed = key >= 0 ? s.running[key] : 0;
    if (key >= 0) emit(item, s.base[key] + placed + before + lane_rank);
    __syncthreads();  // everyone has read running[] and present[]
    if (lead && last) s.running[key] = placed + before + __popc(match);
    for (int k = threadIdx.x; k < keys; k += kThreads) s.present[k] = 0;
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kThreads, 1)
build_tables_kernel(const int32_t* __restrict__ ids, const int32_t* __restrict__ counts, int R, int C, int K,
                    int E, int S, int32_t* __restrict__ expert_offsets, int32_t* __restrict__ block_expert,
                    int32_t* __restrict__ slots, int32_t* __restrict__ row_token, int32_t* __restrict__ pull_order,
                    int32_t* __restrict__ job_order, int32_t* __restrict__ slack) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int keys = E + 1;  // experts, plus E = "padding token" for the token sorts
  int* hist = reinterpret_cast<int*>(smem_raw);  // [keys] real hits per expert
  int* hmin = hist + keys;                       // [keys] tokens per smallest expert
  int* hmax = hmin + keys;                       // [keys] tokens per largest expert
  int* off = hmax + keys;                        // [keys] padded offsets, off[E] = used rows
  int* bmin = off + keys;                        // [keys] pull_order start per key
  int* bmax = bmin + keys;                       // [keys] job_order start per key
  int* running = bmax + keys;                    // [keys]
  unsigned* present = reinterpret_cast<unsigned*>(running + keys);  // [keys]
  uint8_t* count8 = reinterpret_cast<uint8_t*>(present + keys);     // [32][keys]
  __shared__ int warp_sums[33];

  const int T = R * C;      // tokens at capacity
  const int hits = T * K;
  const int blocks = S / kBlockRows;

  auto is_real = [&](int g) { return (g % C) < __ldg(&counts[g / C]); };
  auto hit_expert = [&](int h) {  // expert of hit h, or -1 (padding token or invalid id)
    if (!is_real(h / K)) return -1;
    const int e = __ldg(&ids[h]);
    return (e >= 0 && e < E) ? e : -1;
  };
  auto token_key = [&](int g, bool largest) {  // e_min / e_max of a real token, E otherwise
    int best = -1;
    if (is_real(g)) {
      for (int k = 0; k < K; ++k) {
        const int e = __ldg(&ids[g * K + k]);
        if (e < 0 || e >= E) continue;
        if (best < 0 || (largest ? e > best : e < best)) best = e;
      }
    }
    return best < 0 ? E : best;
  };

  for (int k = threadIdx.x; k < keys; k += kThreads) hist[k] = hmin[k] = hmax[k] = 0;
  __syncthreads();

  // Histograms. Loop bounds are rounded up to whole warps: __match_any_sync needs every lane.
  for (int base = 0; base < hits; base += kThreads) {
    const int h = base + threadIdx.x;
    histogram_add(hist, h < hits ? hit_expert(h) : -1);
  }
  for (int base = 0; base < T; base += kThreads) {
    const int g = base + threadIdx.x;
    histogram_add(hmin, g < T ? token_key(g, false) : -1);
    histogram_add(hmax, g < T ? token_key(g, true) : -1);
  }
  __syncthreads();

  // Offsets: expert runs padded to BM; token-sort starts. keys <= kThreads (checked by the host).
  {
    const int k = threadIdx.x;
    int total;
    const int padded = k < E ? (hist[k] + kBlockRows - 1) / kBlockRows * kBlockRows : 0;
    const int o = block_exclusive_scan(padded, warp_sums, &total);
    const int m = block_exclusive_scan(k < keys ? hmin[k] : 0, warp_sums, &total);
    const int x = block_exclusive_scan(k < keys ? hmax[k] : 0, warp_sums, &total);
    if (k < keys) {
      off[k] = o;  // k == E: the used rows, off[E]
      bmin[k] = m;
      bmax[k] = x;
      expert_offsets[k] = o;
    }
  }
  __syncthreads();

  // Per block: its expert (binary search in off[]) and its padding rows; padding rows of the
  // layout get row_token = -1 (real rows are written by the hit placement below).
  const int used_rows = off[E];
  for (int b = threadIdx.x; b < blocks; b += kThreads) {
    const int row0 = b * kBlockRows;
    int e = E, real = 0;
    if (row0 < used_rows) {
      int lo = 0, hi = E - 1;  // last e with off[e] <= row0 (empty experts share offsets: take the last)
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (off[mid] <= row0) lo = mid; else hi = mid - 1;
      }
      e = lo;
      real = min(max(off[e] + hist[e] - row0, 0), kBlockRows);
    }
    block_expert[b] = e;
    slack[b] = kBlockRows - real;
  }
  for (int row = threadIdx.x; row < S; row += kThreads) {
    if (row >= used_rows) {
      row_token[row] = -1;
      continue;
    }
    int lo = 0, hi = E - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (off[mid] <= row) lo = mid; else hi = mid - 1;
    }
    if (row >= off[lo] + hist[lo]) row_token[row] = -1;
  }

  Smem s{off, running, present, count8};
  // Slots (hits of padding tokens: -1) and the row -> token map.
  for (int h = threadIdx.x; h < hits; h += kThreads) {
    if (hit_expert(h) < 0) slots[h] = -1;
  }
  stable_place(hits, keys, s, hit_expert, [&](int h, int pos) {
    slots[h] = pos;
    row_token[pos] = h / K;
  });
  s.base = bmin;
  stable_place(T, keys, s, [&](int g) { return token_key(g, false); }, [&](int g, int pos) { pull_order[pos] = g; });
  s.base = bmax;
  stable_place(T, keys, s, [&](int g) { return token_key(g, true); }, [&](int g, int pos) { job_order[pos] = g; });
}

}  // namespace

size_t build_tables_smem_bytes(int E) { return static_cast<size_t>(E + 1) * (8 * sizeof(int) + kWarps); }

int build_tables_launch(const int32_t* ids, const int32_t* counts, int R, int C, int K, int E, int S,
                        int32_t* expert_offsets, int32_t* block_expert, int32_t* slots, int32_t* row_token,
                        int32_t* pull_order, int32_t* job_order, int32_t* slack, void* stream) {
  const size_t smem = build_tables_smem_bytes(E);
  if (smem > 48 * 1024) {  // above the default: opt in (no stream work, fine during graph capture)
    cudaError_t err =
        cudaFuncSetAttribute(build_tables_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  build_tables_kernel<<<1, kThreads, smem, static_cast<cudaStream_t>(stream)>>>(
      ids, counts, R, C, K, E, S, expert_offsets, block_expert, slots, row_token, pull_order, job_order, slack);
  return static_cast<int>(cudaGetLastError());
}

const char* error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace moe
