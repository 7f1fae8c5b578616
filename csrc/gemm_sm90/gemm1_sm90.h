// Host interface of the Hopper (sm_90a) GEMM1 + SwiGLU tile (gemm1_sm90.cu). Plain C++ types only,
// so the binding can include it without the CUDA headers.
//
//   out[s, :] = silu(A[row_token[s]] @ W13[e][:, :Ir]) * (A[row_token[s]] @ W13[e][:, Ir:])
//
// for every row s of a used row block (e = block_expert[s / 128] < E) whose row_token[s] >= 0; rows
// with row_token < 0 (padding) and rows of unused blocks are never written. bf16 in, fp32 accumulate,
// bf16 out. Layout and tables as service/kernels/grouped_gemm.py's gemm1_swiglu (docs/CONTRACTS.md).
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace moe {
namespace sm90 {

constexpr int kTileRows = 128;   // BM: one row block of the gathered layout per tile
constexpr int kTileCols = 128;   // BN: output columns per tile (128 gate + 128 up weight columns)
constexpr int kTileDepth = 64;   // BK: K per pipeline stage (128 bytes of bf16: one 128B-swizzle row)
constexpr int kStages = 4;       // 4 x 48 KB of shared memory
constexpr int kThreads = 384;    // warp group 0 loads, warp groups 1 and 2 compute rows 0-63 / 64-127

// Mainloop variants, one kernel instance each, chosen per launch (Gemm1Args.variant; issue 12t,
// bench/NOTES.md "Issue 12t" has the suspected bubbles they remove and their predictions):
//   kBase   per k16 two wgmma m64n128k16 (gate, up) that each read the warp group's A slice; the
//           producer signals a stage's rows 2 stages late (cp.async.wait_group 2, then an arrive)
//   kN256   per k16 one wgmma m64n256k16 over the 4 weight boxes (gate 0-127, up 128-255): A read
//           once, half the wgmma instructions; the producer as kBase
//   kNoinc  kN256, and each producer thread's rows arrive on the stage's barrier by
//           cp.async.mbarrier.arrive.noinc when they land (no wait_group stall in the producer, no
//           lag); the consumers make them visible to wgmma (fence.proxy.async) after the wait
//   kMcast  kNoinc in clusters of 2 CTAs on the two row blocks 2q, 2q + 1 of one column tile: when
//           both blocks belong to one expert each CTA fetches half of the weight boxes (gate / up)
//           and TMA multicasts them into both CTAs (the L2 -> SM weight stream halves); each stage
//           is released to both CTAs' producers (empty counts both CTAs' consumer warps). Units
//           (pair q, column tile) in a static round-robin over the clusters (no queue: the queue
//           tensor is left untouched at [0, 0]); an even grid of at most the device's co-resident clusters
enum Gemm1Variant : int { kBase = 0, kN256 = 1, kNoinc = 2, kMcast = 3 };
constexpr int kVariants = 4;

struct Gemm1Args {
  const void* a;                // [num_a_rows, H] bf16, rows contiguous (token matrix, or the layout itself)
  const void* w13;              // [E, H, 2*Ir] bf16, contiguous
  void* out;                    // [S, Ir] bf16, contiguous
  const int32_t* block_expert;  // [S / 128]; E marks an unused block
  const int32_t* row_token;     // [S] row of A per output row (-1: padding), or nullptr: row s is A[s]
  int32_t* queue;               // [2] int32, 0 at launch: next tile, CTAs done; the last CTA rewinds both to 0
  int num_a_rows, S, H, Ir, E;
  int num_programs;             // persistent CTAs (<= tiles, one per SM)
  int variant;                  // Gemm1Variant
};

// Dynamic shared memory of one CTA (stages + barriers + 1 KB for the 1024-byte alignment).
size_t gemm1_smem_bytes();

// Checks nothing (the binding has checked shapes, dtypes, alignment and the limits of
// `gemm1_shape_error`); builds the weights' TMA tensor map and enqueues one launch on `stream`.
// Returns 0, a cudaError_t value, or one of the negative codes of `gemm1_error_string`.
int gemm1_launch(const Gemm1Args& args, void* stream);

// Why a shape cannot run (nullptr when it can): H % 64, Ir % 128, sizes past int32 coordinates.
const char* gemm1_shape_error(int64_t H, int64_t Ir, int64_t E, int64_t S, int64_t num_a_rows);

const char* gemm1_error_string(int error);

}  // namespace sm90
}  // namespace moe
