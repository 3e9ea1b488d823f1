// CUDA SGMV, Punica sec. 4 schedule (SIMT, no tensor cores):
//   shrink, x not in 16-byte units: grid (segment, split-K chunk, row tile): each warp owns
//           rank rows of A^T and a tile of up to kRowTile rows of x, so every element of A it
//           loads serves the whole tile; it reduces its partial dot products with warp shuffles and adds them into the
//           float32 v with atomics, so a thin output (r columns) still spreads over many blocks.
//   shrink, x in 16-byte units (every call in practice): grid (segment, rank-row block, row
//           tile of R <= 8 rows); W warps per rank row of A (16-byte loads of A and x; one load
//           of A serves the tile's rows) meet in shared memory and write v, no atomics: v needs
//           no zeroing. R = 1 is the distinct-adapter decode case, a memory-bound
//           matrix-vector product; a hot adapter's many rows spread over row tiles.
//   expand  grid (output column block, segment, slice x row tile): each thread owns an output
//           column of a row tile and streams the r rows of B once for the tile; reads of B are
//           coalesced across the warp.
//   expand, one-row segments: each thread owns 16 bytes of output columns, 16-byte loads of B
//           and of y (the distinct-adapter decode case, and every CUDA-graph decode step).
// Row tiles let one long segment (the identical-adapter case) spread over many blocks instead
// of one block walking all its rows in turn.
// Batch-invariant order (SgmvSegments::fixed_order): a row's sums must not depend on the batch.
// The write-once shrink then takes its W warps per rank row from h_in alone (not from how many
// segments and rows keep the GPU busy), the split-K shrink one K chunk (no split by the block
// count); the row tile R changes only how many rows share a load of A, never the order of a
// row's own additions. Expand needs nothing: each output element is acc += v[i] * B[i][c] over
// i = 0..r-1 then y + acc, alike in its one-row and its tiled kernel.
// Plain CUDA: no torch headers, so `nvcc -c` alone builds it (tests do, for sm_80 and sm_90).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "sgmv.h"

namespace punica_x {
namespace {

constexpr int kMaxSlices = 4;
constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int kRowTile = 8;  // rows of one segment that one block handles

struct Slices {
  int h_out[kMaxSlices];
};

template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ int rank_sum(const SgmvSegments& p, int s) {
  int r = 0;
  for (int j = 0; j < p.num_slices; ++j) r += p.ranks[s * p.num_slices + j];
  return r;
}

template <typename T>
__global__ void shrink_kernel(float* v, int64_t vs, const T* x, int64_t xs, int h_in,
                              SgmvSegments p, int k_chunk) {
  const int s = blockIdx.x;
  const int64_t wp = p.w_ptr[s];
  if (wp == 0) return;
  const int row0 = p.seg[s] + blockIdx.z * kRowTile;
  const int rows = min(kRowTile, p.seg[s + 1] - row0);
  if (rows <= 0) return;
  const int rank = rank_sum(p, s);
  const int k0 = blockIdx.y * k_chunk;
  const int k1 = min(h_in, k0 + k_chunk);
  const T* a = reinterpret_cast<const T*>(wp) + int64_t(p.layer) * rank * h_in;
  const T* xt = x + int64_t(row0) * xs;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  for (int j = warp; j < rank; j += blockDim.x / kWarp) {
    const T* arow = a + int64_t(j) * h_in;
    float acc[kRowTile] = {};
    for (int k = k0 + lane; k < k1; k += kWarp) {
      const float av = to_f32(arow[k]);
#pragma unroll
      for (int r = 0; r < kRowTile; ++r)
        if (r < rows) acc[r] += to_f32(xt[r * xs + k]) * av;
    }
#pragma unroll
    for (int r = 0; r < kRowTile; ++r) {
      if (r >= rows) break;  // `rows` is the same for the whole warp: the shuffles stay converged
      const float sum = warp_sum(acc[r]);
      if (lane == 0) atomicAdd(v + (row0 + r) * vs + j, sum);
    }
  }
}

// Segments in 16-byte units (every decode step, distinct adapters or not, and prefill): a block
// owns kThreads / kWarp / W rank rows of one segment and a tile of up to R of its rows; W warps
// share a rank row, each walking its W-th of h_in with 16-byte loads: one load of A serves the
// tile's R rows of x (R = 1: the distinct-adapter matrix-vector product, memory-bound; a hot
// adapter's many rows spread over row tiles instead of one block walking them). The W partial
// sums of each (row, rank row) meet in shared memory and one thread writes v[t, j]: no atomics,
// so v needs no zeroing first (sgmv_shrink_accumulates). Requires h_in, x's row stride and x
// to be 16-byte multiples (checked by the launcher); a segment whose A is not 16-byte aligned
// takes the scalar loop.
template <typename T, int W, int R>
__global__ void shrink_rows_kernel(float* v, int64_t vs, const T* x, int64_t xs, int h_in,
                                   SgmvSegments p) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kWarps = kThreads / kWarp, kRanksPerBlock = kWarps / W;
  __shared__ float partial[kWarps][R];
  const int s = blockIdx.x;
  const int64_t wp = p.w_ptr[s];
  const int t0 = p.seg[s] + blockIdx.z * R;
  const int rows = min(R, p.seg[s + 1] - t0);
  if (wp == 0 || rows <= 0) return;  // the whole block returns together
  const int rank = rank_sum(p, s);
  const int j0 = blockIdx.y * kRanksPerBlock;
  if (j0 >= rank) return;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int j = j0 + warp / W;
  float acc[R] = {};
  if (j < rank) {
    const T* arow = reinterpret_cast<const T*>(wp) + (int64_t(p.layer) * rank + j) * h_in;
    const T* xt = x + int64_t(t0) * xs;
    const int step = W * kWarp * kVec;
    int k = ((warp % W) * kWarp + lane) * kVec;
    if (reinterpret_cast<uintptr_t>(arow) % 16 == 0) {
#pragma unroll(R == 1 ? 4 : 2)
      for (; k < h_in; k += step) {
        const uint4 av = *reinterpret_cast<const uint4*>(arow + k);
        const T* ae = reinterpret_cast<const T*>(&av);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (r >= rows) break;
          const uint4 xv = *reinterpret_cast<const uint4*>(xt + r * xs + k);
          const T* xe = reinterpret_cast<const T*>(&xv);
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[r] += to_f32(xe[e]) * to_f32(ae[e]);
        }
      }
    } else {
      for (; k < h_in; k += step)
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (r >= rows) break;
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[r] += to_f32(xt[r * xs + k + e]) * to_f32(arow[k + e]);
        }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float sum = warp_sum(acc[r]);  // every lane takes part: the shuffles stay converged
    if (lane == 0) partial[warp][r] = sum;
  }
  __syncthreads();
  const int jj = threadIdx.x / R, r = threadIdx.x % R;
  if (jj < kRanksPerBlock && j0 + jj < rank && r < rows) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) sum += partial[jj * W + w][r];
    v[int64_t(t0 + r) * vs + j0 + jj] = sum;
  }
}

// Where slice `slice` of a segment starts: in its adapter's B at one layer (b_off; a layer
// holds layer_size values), in v (v_off: the ranks of the slices before it) and in y (y_off).
struct SliceOffsets {
  int64_t layer_size = 0, b_off = 0;
  int v_off = 0, y_off = 0;
};

__device__ __forceinline__ SliceOffsets slice_offsets(const SgmvSegments& p, const int32_t* ranks,
                                                      const Slices& slices, int slice) {
  SliceOffsets o;
  for (int j = 0; j < p.num_slices; ++j) {
    if (j < slice) {
      o.b_off += int64_t(ranks[j]) * slices.h_out[j];
      o.v_off += ranks[j];
      o.y_off += slices.h_out[j];
    }
    o.layer_size += int64_t(ranks[j]) * slices.h_out[j];
  }
  return o;
}

template <typename T>
__global__ void expand_kernel(T* y, int64_t ys, const float* v, int64_t vs, SgmvSegments p,
                              Slices slices) {
  const int s = blockIdx.y;
  const int slice = blockIdx.z % p.num_slices, tile = blockIdx.z / p.num_slices;
  const int64_t wp = p.w_ptr[s];
  if (wp == 0) return;
  const int row0 = p.seg[s] + tile * kRowTile;
  const int rows = min(kRowTile, p.seg[s + 1] - row0);
  const int32_t* ranks = p.ranks + s * p.num_slices;
  const int r = ranks[slice];
  const int h_out = slices.h_out[slice];
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (rows <= 0 || r == 0 || c >= h_out) return;
  const SliceOffsets o = slice_offsets(p, ranks, slices, slice);
  const T* b = reinterpret_cast<const T*>(wp) + p.layer * o.layer_size + o.b_off + c;
  const float* vt = v + int64_t(row0) * vs + o.v_off;
  float acc[kRowTile] = {};
  for (int i = 0; i < r; ++i) {
    const float bv = to_f32(b[int64_t(i) * h_out]);
#pragma unroll
    for (int t = 0; t < kRowTile; ++t)
      if (t < rows) acc[t] += vt[t * vs + i] * bv;
  }
#pragma unroll
  for (int t = 0; t < kRowTile; ++t) {
    if (t >= rows) break;
    T* out = y + (row0 + t) * ys + o.y_off + c;
    *out = from_f32<T>(to_f32(*out) + acc[t]);
  }
}

// One-row segments (the distinct-adapter decode case): each thread owns kVec consecutive
// output columns of one slice, reads them from each of the r rows of B with one 16-byte load
// and updates y with one 16-byte load and store: ~kVec times fewer threads and loads than
// expand_kernel, whose one column per thread left a warp reading 64 bytes of B a row.
// Requires every h_out, the y offsets and y's row stride to be multiples of kVec (checked by
// the launcher); a segment whose B is not 16-byte aligned takes the scalar loop.
template <typename T>
__global__ void expand_one_row_kernel(T* y, int64_t ys, const float* v, int64_t vs,
                                      SgmvSegments p, Slices slices) {
  constexpr int kVec = 16 / sizeof(T);
  const int s = blockIdx.y, slice = blockIdx.z;
  const int64_t wp = p.w_ptr[s];
  if (wp == 0 || p.seg[s + 1] == p.seg[s]) return;
  const int t = p.seg[s];
  const int32_t* ranks = p.ranks + s * p.num_slices;
  const int r = ranks[slice];
  const int h_out = slices.h_out[slice];
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * kVec;
  if (r == 0 || c >= h_out) return;
  const SliceOffsets o = slice_offsets(p, ranks, slices, slice);
  const T* b = reinterpret_cast<const T*>(wp) + p.layer * o.layer_size + o.b_off + c;
  const float* vt = v + int64_t(t) * vs + o.v_off;
  float acc[kVec] = {};
  if (reinterpret_cast<uintptr_t>(b) % 16 == 0) {
#pragma unroll 4
    for (int i = 0; i < r; ++i) {
      const uint4 bv = *reinterpret_cast<const uint4*>(b + int64_t(i) * h_out);
      const T* be = reinterpret_cast<const T*>(&bv);
      const float vi = vt[i];
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] += vi * to_f32(be[e]);
    }
  } else {
    for (int i = 0; i < r; ++i) {
      const float vi = vt[i];
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] += vi * to_f32(b[int64_t(i) * h_out + e]);
    }
  }
  T* out = y + int64_t(t) * ys + o.y_off + c;
  uint4 yv = *reinterpret_cast<const uint4*>(out);
  T* ye = reinterpret_cast<T*>(&yv);
#pragma unroll
  for (int e = 0; e < kVec; ++e) ye[e] = from_f32<T>(to_f32(ye[e]) + acc[e]);
  *reinterpret_cast<uint4*>(out) = yv;
}

int row_tiles(int max_rows) { return (max_rows + kRowTile - 1) / kRowTile; }

// K chunks per (segment, row tile): enough blocks for two per SM, each chunk >= 256 wide.
int multiprocessors();

int split_k(int h_in, int blocks) {
  const int sms = multiprocessors();
  const int want = (2 * sms + blocks - 1) / blocks;
  const int most = h_in / 256 > 0 ? h_in / 256 : 1;
  return want < 1 ? 1 : (want > most ? most : want);
}

// The write-once shrink (shrink_rows_kernel) needs x in 16-byte units: h_in, its row stride
// and its address; otherwise the split-K kernel adds into a zeroed v.
bool vector_shrink(int h_in, const void* x, int64_t xs, int elem_size) {
  const int vec = 16 / elem_size;
  return h_in % vec == 0 && xs % vec == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
}

int multiprocessors() {
  int device = 0, sms = 108;
  if (cudaGetDevice(&device) == cudaSuccess)
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms;
}

template <typename T, int R>
void launch_shrink_rows_w(int w, dim3 grid, cudaStream_t stream, float* v, int64_t vs, const T* x,
                          int64_t xs, int h_in, const SgmvSegments& p) {
  switch (w) {
    case 1: shrink_rows_kernel<T, 1, R><<<grid, kThreads, 0, stream>>>(v, vs, x, xs, h_in, p); break;
    case 2: shrink_rows_kernel<T, 2, R><<<grid, kThreads, 0, stream>>>(v, vs, x, xs, h_in, p); break;
    case 4: shrink_rows_kernel<T, 4, R><<<grid, kThreads, 0, stream>>>(v, vs, x, xs, h_in, p); break;
    default: shrink_rows_kernel<T, 8, R><<<grid, kThreads, 0, stream>>>(v, vs, x, xs, h_in, p);
  }
}

// Row tile R: the fewest of 1, 2, 4, 8 that holds a segment's rows (8 for longer segments,
// spread over several tiles). W warps per rank row: the fewest (1, 2, 4 or 8) that put 16
// warps on each multiprocessor, while each warp still has 16-byte loads to make
// (W * 32 * kVec <= h_in).
template <typename T>
void launch_shrink_rows(float* v, int64_t vs, const T* x, int64_t xs, int h_in,
                        const SgmvSegments& p, int max_rows, int max_rank, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  int r = 1;
  while (r < kRowTile && r < max_rows) r *= 2;
  const int tiles = (max_rows + r - 1) / r;
  const int64_t units = int64_t(p.num_segments) * tiles * max_rank;
  const int64_t want = p.fixed_order ? INT64_MAX : int64_t(multiprocessors()) * 16;
  int w = 1;
  while (w < 8 && units * w < want && 2 * w * kWarp * kVec <= h_in) w *= 2;
  const int per_block = kThreads / kWarp / w;
  const dim3 grid(p.num_segments, (max_rank + per_block - 1) / per_block, tiles);
  switch (r) {
    case 1: launch_shrink_rows_w<T, 1>(w, grid, stream, v, vs, x, xs, h_in, p); break;
    case 2: launch_shrink_rows_w<T, 2>(w, grid, stream, v, vs, x, xs, h_in, p); break;
    case 4: launch_shrink_rows_w<T, 4>(w, grid, stream, v, vs, x, xs, h_in, p); break;
    default: launch_shrink_rows_w<T, kRowTile>(w, grid, stream, v, vs, x, xs, h_in, p);
  }
}

template <typename T>
void launch_shrink(float* v, int64_t vs, const T* x, int64_t xs, int h_in, const SgmvSegments& p,
                   int max_rows, int max_rank, cudaStream_t stream) {
  if (vector_shrink(h_in, x, xs, sizeof(T))) {
    launch_shrink_rows(v, vs, x, xs, h_in, p, max_rows, max_rank, stream);
    return;
  }
  const int tiles = row_tiles(max_rows);
  const int splits = p.fixed_order ? 1 : split_k(h_in, p.num_segments * tiles);
  const int k_chunk = (h_in + splits - 1) / splits;
  const dim3 grid(p.num_segments, splits, tiles);
  shrink_kernel<T><<<grid, kThreads, 0, stream>>>(v, vs, x, xs, h_in, p, k_chunk);
}

template <typename T>
void launch_expand(T* y, int64_t ys, const float* v, int64_t vs, const int32_t* h_out,
                   const SgmvSegments& p, int max_rows, cudaStream_t stream) {
  Slices slices{};
  int widest = 0;
  for (int j = 0; j < p.num_slices; ++j) {
    slices.h_out[j] = h_out[j];
    widest = h_out[j] > widest ? h_out[j] : widest;
  }
  constexpr int kVec = 16 / sizeof(T);
  bool vectorizable = ys % kVec == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0;
  for (int j = 0; j < p.num_slices; ++j) vectorizable = vectorizable && h_out[j] % kVec == 0;
  if (max_rows == 1 && vectorizable) {
    constexpr int kVecThreads = 128;
    const int per_block = kVecThreads * kVec;
    const dim3 grid((widest + per_block - 1) / per_block, p.num_segments, p.num_slices);
    expand_one_row_kernel<T><<<grid, kVecThreads, 0, stream>>>(y, ys, v, vs, p, slices);
    return;
  }
  const dim3 grid((widest + kThreads - 1) / kThreads, p.num_segments,
                  p.num_slices * row_tiles(max_rows));
  expand_kernel<T><<<grid, kThreads, 0, stream>>>(y, ys, v, vs, p, slices);
}

}  // namespace

bool sgmv_shrink_accumulates(DType dtype, int max_rows, int h_in, const void* x,
                             int64_t x_stride) {
  const int elem = dtype == DType::kFloat32 ? 4 : 2;
  return !vector_shrink(h_in, x, x_stride, elem);
}

bool sgmv_shrink_cuda(DType dtype, float* v, int64_t v_stride, const void* x, int64_t x_stride,
                      int h_in, const SgmvSegments& p, int max_rows, int max_rank, void* stream) {
  if (p.num_segments == 0 || max_rows == 0 || max_rank == 0) return true;
  auto st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32:
      launch_shrink(v, v_stride, static_cast<const float*>(x), x_stride, h_in, p, max_rows,
                    max_rank, st);
      return true;
    case DType::kFloat16:
      launch_shrink(v, v_stride, static_cast<const __half*>(x), x_stride, h_in, p, max_rows,
                    max_rank, st);
      return true;
    case DType::kBFloat16:
      launch_shrink(v, v_stride, static_cast<const __nv_bfloat16*>(x), x_stride, h_in, p,
                    max_rows, max_rank, st);
      return true;
  }
  return false;
}

bool sgmv_expand_cuda(DType dtype, void* y, int64_t y_stride, const float* v, int64_t v_stride,
                      const int32_t* h_out_host, const SgmvSegments& p, int max_rows,
                      void* stream) {
  if (p.num_segments == 0 || max_rows == 0) return true;
  auto st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32:
      launch_expand(static_cast<float*>(y), y_stride, v, v_stride, h_out_host, p, max_rows, st);
      return true;
    case DType::kFloat16:
      launch_expand(static_cast<__half*>(y), y_stride, v, v_stride, h_out_host, p, max_rows, st);
      return true;
    case DType::kBFloat16:
      launch_expand(static_cast<__nv_bfloat16*>(y), y_stride, v, v_stride, h_out_host, p, max_rows, st);
      return true;
  }
  return false;
}

}  // namespace punica_x
