// Allreduce (and reduce-scatter, all-gather) of device memory between the ranks of one host,
// in one kernel per op, with the host out of the data path (issue 36).
//
// Every rank owns a region of plain device memory: a signal pad (the flags below) and a data
// buffer. Each region is exported once and mapped once by every peer, so a kernel reads and
// writes its peers' buffers directly, and ranks meet through flags in those pads instead of
// through the host. Two allreduce kernels, chosen by size:
//
//   one_shot_allreduce  every rank reads every rank's data and reduces all of it into its
//                       own output: one pass, lowest latency, p reads of every byte per rank.
//   two_shot_allreduce  in place: rank r reduces its 1/p slice from every rank's data and
//                       writes the result into that slice of every rank's buffer: about 2p
//                       bytes moved per byte reduced, the large-message choice.
//
// and one kernel each for the reduce-scatter (rank r reduces block r of every rank's data
// into its own output) and the all-gather (every rank copies every rank's data into its
// output, bytes: one kernel for every dtype).
//
// The same algorithm, step by step, is played in numpy by ringcomm/testing/fake_kernels.py
// (same slices, same blocks, same pad slots); tests run that mirror on every CPU machine and
// compare the two on a GPU. A change here is a change there.
//
// Only where every rank's blocks run at once (under MPS, or one GPU per rank) may these
// kernels be launched: a block waits on flags written by another process's kernel, and
// without concurrency that wait never ends. Deciding that is the host's job, not this file's.
//
// The file includes no header (NVRTC compiles it without a CUDA toolkit): float16 and
// bfloat16 are converted with PTX instructions, complex numbers are a struct of their own.

namespace ringcomm {

// ------------------------------------------------------------------ limits and layout
// Kept equal to ringcomm/core/device/kernel_geometry.py (a test compares the two).
constexpr int kMaxRanks = 8;      // ranks of one communicator this path serves
constexpr int kMaxBlocks = 128;   // blocks per kernel (blocks x ranks <= SMs, set by the host)
constexpr int kMaxThreads = 512;  // threads per block
constexpr int kVectorBytes = 16;  // the widest load a thread makes: one vector load
constexpr int kPhaseStart = 0;    // the pad's phases: where blocks meet before and after
constexpr int kPhaseEnd = 1;      //   the data is touched
constexpr int kPhases = 2;
static_assert(kPhaseStart < kPhases && kPhaseEnd < kPhases, "each phase is a row of the pad");
// After the flags, one word the host sets when it gives up on an op (a peer lost or past the
// deadline): a waiting block stops waiting and its kernel ends without its result. Padded
// to 16 bytes so the data after the pad stays aligned for vector loads.
constexpr int kAbortWord = kPhases * kMaxBlocks * kMaxRanks;
constexpr int kPadWords = kAbortWord + kVectorBytes / 4;

// Where every rank's memory is, as mapped in the launching process (index = rank). The host
// writes one such table into device memory when the buffers are mapped; kernels read it.
struct PeerPointers {
  void* data[kMaxRanks];
  unsigned int* pads[kMaxRanks];
};

// A signal pad is unsigned int[kPhases][kMaxBlocks][kMaxRanks], then the abort word: slot
// (phase, block, r) of rank q's pad is written only by block `block` of rank r, read only by
// rank q. Its value is the number of the last op in which rank r's block reached that phase.
// Op numbers only grow (the host numbers a communicator's ops 1, 2, 3, ... the same on every
// rank), so nothing is ever reset between ops: the op's number is the value a waiting block
// expects.
__device__ __forceinline__ int pad_slot(int phase, int block, int rank) {
  return (phase * kMaxBlocks + block) * kMaxRanks + rank;
}

// ------------------------------------------------------------------ flags
// System scope, because the other side is another process's kernel, possibly on another GPU.
// A release store makes every write this thread has seen (the block's, through the
// __syncthreads before it) visible before the flag; an acquire load orders every later read
// after it. Inline PTX, as vLLM's custom allreduce does: NVRTC needs no header for it.
__device__ __forceinline__ void store_release(unsigned int* flag, unsigned int value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}

__device__ __forceinline__ unsigned int load_acquire(const unsigned int* flag) {
  unsigned int value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

// The abort word, read without ordering: it only ends a wait, and nothing it guards is read
// after it (an aborted kernel returns).
__device__ __forceinline__ unsigned int load_relaxed(const unsigned int* word) {
  unsigned int value;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(word) : "memory");
  return value;
}

// Block `blockIdx.x` of every rank meets here. Thread t < world tells rank t "my block has
// reached `phase` of op `op_number`", then waits until rank t's block says the same to us,
// or until this rank's host sets the abort word. Per block, not per kernel: a block needs
// only its namesakes, so no grid-wide sync is needed. The signed difference keeps the
// comparison right when the counter wraps. Returns whether the op was aborted, the same for
// every thread of the block (so the whole block returns together).
__device__ __forceinline__ bool meet(const PeerPointers& peers, int rank, int world, int phase,
                                     unsigned int op_number) {
  __syncthreads();  // the block's earlier stores come before the release below
  int aborted = 0;
  if (threadIdx.x < world) {
    const int peer = threadIdx.x;
    store_release(peers.pads[peer] + pad_slot(phase, blockIdx.x, rank), op_number);
    const unsigned int* mine = peers.pads[rank] + pad_slot(phase, blockIdx.x, peer);
    const unsigned int* abort = peers.pads[rank] + kAbortWord;
    while (static_cast<int>(load_acquire(mine) - op_number) < 0) {
      if (load_relaxed(abort) != 0) {
        aborted = 1;
        break;
      }
    }
  }
  // the block's later loads come after the acquire above; every thread learns the verdict
  return __syncthreads_or(aborted) != 0;
}

// ------------------------------------------------------------------ element types
// The dtypes of ringcomm/core/dtypes.py, by the C++ type that holds them: float, double,
// Half, BFloat16, signed char, short, int, long long, unsigned char, bool, Complex<float>,
// Complex<double>. Half and BFloat16 are their bits; arithmetic on them goes through float.
struct Half {
  unsigned short bits;
};
struct BFloat16 {
  unsigned short bits;
};
template <class R>
struct Complex {  // numpy's layout: real, then imaginary; aligned as R, as numpy aligns it
  R re, im;
};

// How an element is read into the type it is reduced in (Acc) and written back. float16 and
// bfloat16 accumulate in float32 and are rounded once, at the end (round to nearest even, as
// numpy's astype does): p - 1 roundings in 16 bits would lose what the sum is for.
template <class T>
struct Accumulate {
  using Acc = T;
  __device__ static Acc widen(T x) { return x; }
  __device__ static T narrow(Acc a) { return a; }
};

template <>
struct Accumulate<Half> {
  using Acc = float;
  __device__ static float widen(Half x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
  }
  __device__ static Half narrow(float f) {
    Half x;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(x.bits) : "f"(f));
    return x;
  }
};

template <>
struct Accumulate<BFloat16> {
  using Acc = float;
  __device__ static float widen(BFloat16 x) {  // bfloat16 is float32's upper half: exact
    return __int_as_float(static_cast<int>(x.bits) << 16);
  }
  __device__ static BFloat16 narrow(float f) {  // cvt.rn.bf16.f32 needs sm_80
    BFloat16 x;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(x.bits) : "f"(f));
    return x;
  }
};

// ------------------------------------------------------------------ arithmetic
// Math<A> is what each op does in accumulation type A, with numpy's semantics, so the
// kernel's result equals the host path's. A type lacks what numpy refuses for it (no min or
// max for complex, no bitwise ops for floats, no average for integers): instantiating such a
// kernel fails to compile, as the host path refuses the pair.

// Floats: IEEE operations, each rounded (no contraction into FMA happens: no a * b + c
// appears). min and max are numpy's: a NaN in either operand is the result.
template <class F>
struct FloatMath {
  __device__ static F add(F a, F b) { return a + b; }
  __device__ static F mul(F a, F b) { return a * b; }
  __device__ static F min(F a, F b) { return (a <= b || a != a) ? a : b; }
  __device__ static F max(F a, F b) { return (a >= b || a != a) ? a : b; }
  __device__ static F divide(F a, int n) { return a / static_cast<F>(n); }
};

// Integers wrap on overflow as numpy's do. Signed overflow is undefined in C++, and a
// 16-bit product is computed in int (where 65535 * 65535 overflows), so sums and products
// are computed in an unsigned type at least as wide as int, then cast back (modular).
template <class I, class U>
struct WrappingMath {
  __device__ static I add(I a, I b) { return static_cast<I>(static_cast<U>(a) + static_cast<U>(b)); }
  __device__ static I mul(I a, I b) { return static_cast<I>(static_cast<U>(a) * static_cast<U>(b)); }
  __device__ static I min(I a, I b) { return b < a ? b : a; }
  __device__ static I max(I a, I b) { return a < b ? b : a; }
  __device__ static I bit_and(I a, I b) { return a & b; }
  __device__ static I bit_or(I a, I b) { return a | b; }
  __device__ static I bit_xor(I a, I b) { return a ^ b; }
};

// Complex: a componentwise sum; the product (ac - bd) + (ad + bc)i with every product and
// sum rounded on its own, written with round-to-nearest intrinsics so the compiler cannot
// fuse them into FMAs. numpy's own product is not one formula (its SIMD loops fuse where the
// CPU has FMA), so the kernels fix this one and the mirror computes the same. The average
// is numpy's division by the complex n + 0i (Smith's algorithm), which comes to multiplying
// each part by 1/n.
template <class R>
struct ComplexMath;

template <>
struct ComplexMath<float> {
  using C = Complex<float>;
  __device__ static C add(C a, C b) { return {__fadd_rn(a.re, b.re), __fadd_rn(a.im, b.im)}; }
  __device__ static C mul(C a, C b) {
    return {__fsub_rn(__fmul_rn(a.re, b.re), __fmul_rn(a.im, b.im)),
            __fadd_rn(__fmul_rn(a.re, b.im), __fmul_rn(a.im, b.re))};
  }
  __device__ static C divide(C a, int n) {
    const float scale = static_cast<float>(1) / static_cast<float>(n);
    return {__fmul_rn(a.re, scale), __fmul_rn(a.im, scale)};
  }
};

template <>
struct ComplexMath<double> {
  using C = Complex<double>;
  __device__ static C add(C a, C b) { return {__dadd_rn(a.re, b.re), __dadd_rn(a.im, b.im)}; }
  __device__ static C mul(C a, C b) {
    return {__dsub_rn(__dmul_rn(a.re, b.re), __dmul_rn(a.im, b.im)),
            __dadd_rn(__dmul_rn(a.re, b.im), __dmul_rn(a.im, b.re))};
  }
  __device__ static C divide(C a, int n) {
    const double scale = static_cast<double>(1) / static_cast<double>(n);
    return {__dmul_rn(a.re, scale), __dmul_rn(a.im, scale)};
  }
};

// bool is numpy's: a sum is "any", a product "all", min is "and", max is "or".
struct BoolMath {
  __device__ static bool add(bool a, bool b) { return a || b; }
  __device__ static bool mul(bool a, bool b) { return a && b; }
  __device__ static bool min(bool a, bool b) { return a && b; }
  __device__ static bool max(bool a, bool b) { return a || b; }
  __device__ static bool bit_and(bool a, bool b) { return a && b; }
  __device__ static bool bit_or(bool a, bool b) { return a || b; }
  __device__ static bool bit_xor(bool a, bool b) { return a != b; }
};

template <class A>
struct Math;
template <> struct Math<float> : FloatMath<float> {};
template <> struct Math<double> : FloatMath<double> {};
template <> struct Math<signed char> : WrappingMath<signed char, unsigned int> {};
template <> struct Math<short> : WrappingMath<short, unsigned int> {};
template <> struct Math<int> : WrappingMath<int, unsigned int> {};
template <> struct Math<long long> : WrappingMath<long long, unsigned long long> {};
template <> struct Math<unsigned char> : WrappingMath<unsigned char, unsigned int> {};
template <> struct Math<bool> : BoolMath {};
template <> struct Math<Complex<float>> : ComplexMath<float> {};
template <> struct Math<Complex<double>> : ComplexMath<double> {};

// ------------------------------------------------------------------ ops
// The reductions of ringcomm/core/dtypes.py's REDUCE_OPS. avg is a sum and one division by
// the world size at the end (kAverage), as the host path's finish_reduction does.
#define RINGCOMM_OP(Name, method, average)                                          \
  struct Name {                                                                     \
    static constexpr bool kAverage = average;                                       \
    template <class A>                                                              \
    __device__ static A combine(A a, A b) { return Math<A>::method(a, b); }         \
  };
RINGCOMM_OP(Sum, add, false)
RINGCOMM_OP(Prod, mul, false)
RINGCOMM_OP(Min, min, false)
RINGCOMM_OP(Max, max, false)
RINGCOMM_OP(Avg, add, true)
RINGCOMM_OP(BitAnd, bit_and, false)
RINGCOMM_OP(BitOr, bit_or, false)
RINGCOMM_OP(BitXor, bit_xor, false)
#undef RINGCOMM_OP

// ------------------------------------------------------------------ one unit
// A unit is what one thread loads from each rank at once: a Vector (16 bytes, one vector
// load) where every pointer involved is 16-byte aligned, else a Scalar (one element, aligned
// only as its type is, as numpy aligns it).
template <class T>
__host__ __device__ constexpr int vector_width() {
  return sizeof(T) >= kVectorBytes ? 1 : kVectorBytes / static_cast<int>(sizeof(T));
}

template <class T, int N, int Alignment>
struct alignas(Alignment) Pack {
  using Element = T;
  static constexpr int kWidth = N;
  T v[N];
};
template <class T>
using Vector = Pack<T, vector_width<T>(), kVectorBytes>;
template <class T>
using Scalar = Pack<T, 1, alignof(T)>;

__device__ __forceinline__ bool aligned(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) % kVectorBytes) == 0;
}

__device__ __forceinline__ bool data_aligned(const PeerPointers& peers, int world) {
  bool all = true;
  for (int q = 0; q < world; ++q) all = all && aligned(peers.data[q]);
  return all;
}

// Unit u reduced over every rank's data, rank 0 first: every rank combines in the same
// order, so every rank gets the same bits.
// `shift` bytes into every rank's data: where the reduce-scatter's block of this rank starts.
template <class Op, class P>
__device__ __forceinline__ P reduce_unit(const PeerPointers& peers, int world,
                                         unsigned long long u, unsigned long long shift = 0) {
  using T = typename P::Element;
  using A = typename Accumulate<T>::Acc;
  A acc[P::kWidth];
  const P first = reinterpret_cast<const P*>(static_cast<const char*>(peers.data[0]) + shift)[u];
#pragma unroll
  for (int i = 0; i < P::kWidth; ++i) acc[i] = Accumulate<T>::widen(first.v[i]);
  for (int q = 1; q < world; ++q) {
    const P x = reinterpret_cast<const P*>(static_cast<const char*>(peers.data[q]) + shift)[u];
#pragma unroll
    for (int i = 0; i < P::kWidth; ++i) acc[i] = Op::combine(acc[i], Accumulate<T>::widen(x.v[i]));
  }
  P result;
#pragma unroll
  for (int i = 0; i < P::kWidth; ++i) {
    if constexpr (Op::kAverage) acc[i] = Math<A>::divide(acc[i], world);
    result.v[i] = Accumulate<T>::narrow(acc[i]);
  }
  return result;
}

// Units [first, end) in a grid-stride loop: unit first + i belongs to block
// (i / blockDim.x) % gridDim.x, thread i % blockDim.x. The mirror walks the same way.
__device__ __forceinline__ unsigned long long thread_index() {
  return static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ unsigned long long grid_threads() {
  return static_cast<unsigned long long>(gridDim.x) * blockDim.x;
}

// ------------------------------------------------------------------ one-shot
// out[i] = data[0][i] (op) data[1][i] (op) ... for all `count` elements, on every rank.
// `out` is this rank's own memory and never a rank's data buffer (peers read those while
// this kernel writes). Blocks meet twice: at the start, so no block reads a peer's data
// before that peer's kernel has begun (its data was written before it, in its stream's
// order); at the end, so no rank returns and overwrites its data (the next op's input)
// while a peer still reads it.
template <class Op, class P>
__device__ void one_shot_units(const PeerPointers& peers, void* out, unsigned long long first,
                               unsigned long long end, int world) {
  for (unsigned long long u = first + thread_index(); u < end; u += grid_threads())
    static_cast<P*>(out)[u] = reduce_unit<Op, P>(peers, world, u);
}

template <class T, class Op>
__global__ void __launch_bounds__(kMaxThreads)
    one_shot_allreduce(const PeerPointers* table, T* out, unsigned long long count, int rank,
                       int world, unsigned int op_number) {
  __shared__ PeerPointers peers;
  if (threadIdx.x == 0) peers = *table;  // meet's first __syncthreads shares it
  if (meet(peers, rank, world, kPhaseStart, op_number)) return;
  unsigned long long scalars_from = 0;
  if (data_aligned(peers, world) && aligned(out)) {
    constexpr int N = Vector<T>::kWidth;
    one_shot_units<Op, Vector<T>>(peers, out, 0, count / N, world);
    scalars_from = count / N * N;  // the tail shorter than a vector: one element at a time
  }
  one_shot_units<Op, Scalar<T>>(peers, out, scalars_from, count, world);
  meet(peers, rank, world, kPhaseEnd, op_number);
}

// ------------------------------------------------------------------ two-shot
// In place: rank r owns units [r * per, (r + 1) * per) (per = ceil(units / world)), reduces
// them from every rank's buffer and stores the result into every rank's buffer; the elements
// after the last whole vector belong to the last rank. No other rank reads or writes a
// rank's slice, so between the two meetings no flag is needed. The unit width depends on the
// data pointers only, which every rank sees at the same offsets, so all ranks cut the same
// slices. Blocks meet at the start (every rank's input is in its buffer before anyone reads
// or overwrites it) and at the end (every slice of this rank's buffer is written before the
// rank returns and reads it).
template <class Op, class P>
__device__ void two_shot_units(const PeerPointers& peers, unsigned long long first,
                               unsigned long long end, int world) {
  for (unsigned long long u = first + thread_index(); u < end; u += grid_threads()) {
    const P result = reduce_unit<Op, P>(peers, world, u);
    for (int q = 0; q < world; ++q) static_cast<P*>(peers.data[q])[u] = result;
  }
}

// Rank `rank`'s units of `units`: [lo, hi).
__device__ __forceinline__ void slice_of(unsigned long long units, int rank, int world,
                                         unsigned long long& lo, unsigned long long& hi) {
  const unsigned long long per = (units + world - 1) / world;
  lo = per * rank < units ? per * rank : units;
  hi = lo + per < units ? lo + per : units;
}

template <class T, class Op>
__global__ void __launch_bounds__(kMaxThreads)
    two_shot_allreduce(const PeerPointers* table, unsigned long long count, int rank, int world,
                       unsigned int op_number) {
  __shared__ PeerPointers peers;
  if (threadIdx.x == 0) peers = *table;
  if (meet(peers, rank, world, kPhaseStart, op_number)) return;
  unsigned long long lo, hi, scalars_from;
  if (data_aligned(peers, world)) {
    constexpr int N = Vector<T>::kWidth;
    slice_of(count / N, rank, world, lo, hi);
    two_shot_units<Op, Vector<T>>(peers, lo, hi, world);
    scalars_from = count / N * N;
  } else {
    slice_of(count, rank, world, lo, hi);
    two_shot_units<Op, Scalar<T>>(peers, lo, hi, world);
    scalars_from = count;
  }
  if (rank == world - 1) two_shot_units<Op, Scalar<T>>(peers, scalars_from, count, world);
  meet(peers, rank, world, kPhaseEnd, op_number);
}

// ------------------------------------------------------------------ reduce-scatter
// Every rank's data holds its whole input, `world` blocks of `count` elements; rank r reduces
// block r from every rank's data into its own `out` (its memory, never a data buffer): one
// pass, each rank reading 1/p of every peer's input. Meetings as the one-shot's: at the start
// (every input written), at the end (no rank overwrites its data while a peer reads it).
// Vector loads where every data buffer and `out` are aligned and a block is a whole number of
// vectors (so every rank's block starts aligned).
template <class Op, class P>
__device__ void reduce_scatter_units(const PeerPointers& peers, void* out,
                                     unsigned long long first, unsigned long long end, int world,
                                     unsigned long long shift) {
  for (unsigned long long u = first + thread_index(); u < end; u += grid_threads())
    static_cast<P*>(out)[u] = reduce_unit<Op, P>(peers, world, u, shift);
}

template <class T, class Op>
__global__ void __launch_bounds__(kMaxThreads)
    reduce_scatter(const PeerPointers* table, T* out, unsigned long long count, int rank,
                   int world, unsigned int op_number) {
  __shared__ PeerPointers peers;
  if (threadIdx.x == 0) peers = *table;
  if (meet(peers, rank, world, kPhaseStart, op_number)) return;
  const unsigned long long shift = static_cast<unsigned long long>(rank) * count * sizeof(T);
  unsigned long long scalars_from = 0;
  if (data_aligned(peers, world) && aligned(out) && (count * sizeof(T)) % kVectorBytes == 0) {
    constexpr int N = Vector<T>::kWidth;
    reduce_scatter_units<Op, Vector<T>>(peers, out, 0, count / N, world, shift);
    scalars_from = count / N * N;
  }
  reduce_scatter_units<Op, Scalar<T>>(peers, out, scalars_from, count, world, shift);
  meet(peers, rank, world, kPhaseEnd, op_number);
}

// ------------------------------------------------------------------ all-gather
// Every rank's data holds its `nbytes` of input; every rank copies rank q's into its own
// `out` at q * stride (bytes), for every q: bytes, since a copy needs no element type (16 of
// them at a time where every data buffer, `out` and `stride` allow). Meetings as above.
template <class P>
__device__ void all_gather_units(const PeerPointers& peers, char* out, unsigned long long first,
                                 unsigned long long end, int world, unsigned long long stride) {
  for (unsigned long long u = first + thread_index(); u < end; u += grid_threads()) {
    for (int q = 0; q < world; ++q)
      reinterpret_cast<P*>(out + q * stride)[u] = static_cast<const P*>(peers.data[q])[u];
  }
}

__global__ void __launch_bounds__(kMaxThreads)
    all_gather(const PeerPointers* table, char* out, unsigned long long nbytes,
               unsigned long long stride, int rank, int world, unsigned int op_number) {
  __shared__ PeerPointers peers;
  if (threadIdx.x == 0) peers = *table;
  if (meet(peers, rank, world, kPhaseStart, op_number)) return;
  unsigned long long scalars_from = 0;
  if (data_aligned(peers, world) && aligned(out) && stride % kVectorBytes == 0) {
    using V = Pack<unsigned char, kVectorBytes, kVectorBytes>;
    all_gather_units<V>(peers, out, 0, nbytes / kVectorBytes, world, stride);
    scalars_from = nbytes / kVectorBytes * kVectorBytes;
  }
  all_gather_units<Scalar<unsigned char>>(peers, out, scalars_from, nbytes, world, stride);
  meet(peers, rank, world, kPhaseEnd, op_number);
}

}  // namespace ringcomm
