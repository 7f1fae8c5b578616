// Host interface of the one-launch schedule builder (schedule_kernel.cu). Plain C++ types only,
// so csrc/bindings.cpp can include it without the CUDA headers.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace moe {

constexpr int kBlockRows = 128;     // BM: rows per block of the gathered layout (service.config.BM)
constexpr int kMaxExperts = 1023;   // E + 1 keys must fit the 1024 threads of the scans
constexpr int kMaxHits = 65536;     // R*C*K: 16-bit per-warp counters and the 16-bit fast division

// Dynamic shared memory of one launch for E experts and R*C*K hits (under 96 KB at the limits).
size_t build_tables_smem_bytes(int E, int hits);

// Enqueues the single launch on `stream` (a cudaStream_t). Inputs: ids [R*C*K] int32, counts [R]
// int32. Outputs (int32): expert_offsets [E+1], block_expert [S/BM], slots [R*C*K],
// row_token [S], pull_order [R*C], job_order [R*C]. Returns a cudaError_t value.
// The caller (bindings.cpp) has checked every limit above; this function only launches.
int build_tables_launch(const int32_t* ids, const int32_t* counts, int R, int C, int K, int E, int S,
                        int32_t* expert_offsets, int32_t* block_expert, int32_t* slots, int32_t* row_token,
                        int32_t* pull_order, int32_t* job_order, void* stream);

// The message of a value returned by build_tables_launch.
const char* error_string(int error);

}  // namespace moe
