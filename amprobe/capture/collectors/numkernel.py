"""A compiled CPU kernel for the statistics of :mod:`amprobe.capture.collectors.numstats`.

The statistics of a CPU tensor are one pass over its elements that counts each 16-bit magnitude
key (``bits & 0x7FFF`` of fp16/bf16; the upper half of ``|x|`` as fp32, divided by the loss
scale for gradients) and, for fp32, the exact zero, NaN, amax, fp16-overflow and fp16-flush
counts. Eager PyTorch needs several passes for that (an ``abs`` copy, ``bincount``'s min, max
and counting loops, a fresh 32768-bin result added to a row, folded into the table at the end;
for fp32 five more). The C functions here do it in one pass and add the result straight into
the slot's table row, through a *plan*: the 32768 keys of a format (and loss scale) in
segments, runs of keys that land in the same histogram column and count columns (built once
by ``numstats``). A large tensor counts its keys into four uint32 sub-histograms (a scratch the
caller owns, left zeroed; interleaved so that runs of one key, the zeros after a ReLU, do not
serialise on one counter, and a cache line apart so that one key in two of them is not a false
4 KiB store-to-load dependency), then folds them by segment; a small one (below
:data:`SUB_MIN` elements) counts segments directly, a fold of the 32768 keys costing more than
its elements. So no 32768-bin row is kept per slot, zeroed every step or folded at its end.

The loops prefetch 4 KiB ahead: the counter updates keep the hardware prefetcher from
streaming a tensor that is not in cache (a training step's tensors mostly are not). A TinyGPT
bf16 step's 126 tensors (59M 16-bit and 14M fp32 elements) cost about 30 ms on one core of an
Intel Xeon (AMX), against about 75 ms before (no prefetch, a 32768-bin int64 row per slot
folded with torch at the step's end): about 0.35 ns per bf16 element, close to what one core
reads from memory here (about 9 GB/s). The elementwise fp32 loops, the segment fold and the
non-finite count are compiled three times, for AVX-512, AVX2 and the baseline, chosen when
the library loads (GCC's ``target_clones`` on x86-64 Linux with glibc; one baseline version
elsewhere).

Why one thread: a hook pauses the step, but the other cores are seldom idle then. A helper
thread taking half of each large tensor (a pthread prototype, passive waits) cut a TinyGPT
step's kernel time from 57 to 49 ms wall with torch on one thread, and raised it from 55 to
84 ms with torch on two, whose OpenMP workers still spin on the cores after each op. OpenMP
itself, with its default waits, was 10 to 17 times slower on this shared 2-core machine (29
against 41 ms only with ``OMP_WAIT_POLICY=passive``, the user's setting, not ours).

Why not ``torch.compile``: inductor lowers a histogram to atomic scatter-adds (about 1.2 ns per
element here, no faster than ``bincount``), its first compile of the function took about two
minutes on this 2-core machine, and a compile of amprobe's own would show in the run's dynamo
counters and count against the user's recompile limit. This kernel is plain C (no torch
headers): it compiles with the system C compiler in a fraction of a second, in a subprocess
started when the collector attaches (so the compile runs beside the user's first step instead
of inside it), into a per-user cache reused by later runs. Until it is ready, or when there is
no compiler or the build fails, the eager reduction runs instead; both give the same table.

The same library holds the block statistics of
:mod:`~amprobe.capture.collectors.blockstats` (``amprobe_block_amax``, ``amprobe_block_pass``):
one pass over a 2-D operand in 128 x 128 strips for all its format orientations at once, about
0.4 ns per element per format-evaluation on one core of that Xeon (the eager torch reduction:
about 24 to 60 ns); its per-element loop is written in AVX-512 and in AVX2 intrinsics (the
same machine: 0.44 and 0.62 ns), in GCC vector extensions (each clone's ISA, 0.9 ns)
elsewhere. It makes the library's compile about 2.6 s of CPU instead of 0.5 s.

Public surface: :func:`start_build` (non-blocking), :func:`kernel` (the loaded library or
None, never blocking), :func:`status` (``"ready"``, ``"building"``, ``"unavailable: <why>"``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = [
    "SOURCE",
    "NKEYS",
    "SUB_WORDS",
    "SUB_MIN",
    "MAXSEG",
    "PLAN_HEADER",
    "PLAN_FIELDS",
    "SEGMENT_FLAGS",
    "Kernel",
    "kernel",
    "start_build",
    "status",
    "wait",
]

NKEYS = 1 << 15
#: from this many elements a tensor is counted into the sub-histograms, then folded by segment
#: (below: segments counted per element, no pass over the 32768 keys)
SUB_MIN = 1 << 16
_SUB_PAD = 16  # words between two sub-histograms (see PAD in SOURCE)
#: int32 words of the caller's sub-histogram scratch (four uint32 histograms, a gap between)
SUB_WORDS = 4 * (NKEYS + _SUB_PAD)
#: most segments a plan may have (the C side's per-call counters)
MAXSEG = 512
#: int32 words before a plan's segment arrays
PLAN_HEADER = 16
#: a plan's header fields, in order (``P_*`` in :data:`SOURCE`): the segment count, the first
#: key counted as non-finite, whether the maximum comes from the keys, then the row's columns
PLAN_FIELDS: tuple[str, ...] = ("nseg", "bad_from", "amax_from_keys")
PLAN_FIELDS += ("zeros", "nan", "amax", "over", "flush", "lump", "zero_bin", "ncols")
#: a segment's flag bits: the count columns it adds to besides its histogram column
SEGMENT_FLAGS = {"zeros": 1, "nan": 2, "over": 4, "flush": 8}

SOURCE = r"""
#include <stdint.h>
#include <string.h>

#define NK 32768
#define SUB_MIN (1 << 16)      /* from this many elements, count into the four sub-histograms */
#define CHUNK (1LL << 31)      /* elements per sub-histogram fold: no uint32 counter overflows */
#define BLOCK 2048             /* fp32 elements unscaled and classified per block */
#define AHEAD 4096             /* bytes prefetched ahead of the histogram loops */
#define PAD @SUB_PAD@              /* words between sub-histograms: the same key in two of them
                                  is not 4 KiB apart (a false store-to-load dependency) */
#define MAXSEG 512             /* segments of a plan (at most 278 columns + 5 boundaries) */
#define LANES 4                /* interleaved per-segment counters of a small tensor */

/* AVX-512, AVX2 and baseline versions of the elementwise loops (AVX-512: fp32 tensors 0.49 ->
   0.40 ns an element on an AMD EPYC), picked at load time by an ifunc
   (glibc on x86-64 Linux: GCC >= 6, clang >= 14); one baseline version elsewhere */
#if defined(__has_attribute) && defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__)
#if __has_attribute(target_clones)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef CLONES
#define CLONES
#endif

/* A plan says where each of the 32768 keys of one format (and loss scale) lands in a table
   row. The keys form segments, maximal runs of keys that add to the same columns: int32
   header, then start[nseg + 1] (start[nseg] = 32768), col[nseg] (the histogram column) and
   flag[nseg] (F_*: the count columns the segment adds to besides). seg_of[key] is the key's
   segment; fbits[key] the fp32 bits of its (unscaled) value, for the maximum. */
enum {
  P_NSEG, P_BAD_FROM, P_AMAX_FROM_KEYS, P_ZEROS, P_NAN, P_AMAX, P_OVER, P_FLUSH, P_LUMP,
  P_ZERO_BIN, P_NCOLS, P_HEADER = 16
};
enum { F_ZERO = 1, F_NAN = 2, F_OVER = 4, F_FLUSH = 8 };

/* A segment's count into its column and into the special columns its flags name. */
static inline void add_segment(int64_t *row, const int32_t *plan, int32_t col, int32_t flag,
                               int64_t c) {
  row[col] += c;
  if (flag & F_ZERO) row[plan[P_ZEROS]] += c;
  if (flag & F_NAN) row[plan[P_NAN]] += c;
  if (flag & F_OVER) row[plan[P_OVER]] += c;
  if (flag & F_FLUSH) row[plan[P_FLUSH]] += c;
}

/* add per-segment counts (LANES interleaved copies: cnt[segment * LANES + lane]) to the row;
   returns the count of the segments from P_BAD_FROM on */
static int64_t add_segments(int64_t *row, const int32_t *plan, const uint32_t *cnt) {
  int nseg = plan[P_NSEG];
  const int32_t *start = plan + P_HEADER, *col = start + nseg + 1, *flag = col + nseg;
  int64_t bad = 0;
  for (int s = 0; s < nseg; s++) {
    int64_t c = 0;
    for (int l = 0; l < LANES; l++) c += cnt[s * LANES + l];
    if (!c) continue;
    add_segment(row, plan, col[s], flag[s], c);
    if (start[s] >= plan[P_BAD_FROM]) bad += c;
  }
  return bad;
}

static void put_amax(int64_t *row, const int32_t *plan, const uint32_t *fbits, int top) {
  if (plan[P_AMAX_FROM_KEYS] && (int64_t)fbits[top] > row[plan[P_AMAX]])
    row[plan[P_AMAX]] = fbits[top];
}

/* Fold the four uint32 sub-histograms into the row by segment and zero them; returns the
   count from P_BAD_FROM on. */
CLONES
static int64_t fold_sub(int64_t *row, const int32_t *plan, const uint32_t *fbits,
                        uint32_t *sub) {
  int nseg = plan[P_NSEG];
  const int32_t *start = plan + P_HEADER, *col = start + nseg + 1, *flag = col + nseg;
  const uint32_t *s0 = sub, *s1 = s0 + NK + PAD, *s2 = s1 + NK + PAD, *s3 = s2 + NK + PAD;
  int64_t bad = 0;
  int last = -1;
  for (int s = 0; s < nseg; s++) {
    uint32_t c = 0; /* a chunk holds at most 2**31 elements */
    for (int k = start[s]; k < start[s + 1]; k++) c += s0[k] + s1[k] + s2[k] + s3[k];
    if (!c) continue;
    last = s;
    add_segment(row, plan, col[s], flag[s], c);
    if (start[s] >= plan[P_BAD_FROM]) bad += c;
  }
  if (last >= 0) {
    int k = start[last + 1] - 1;
    while (k > start[last] && !(s0[k] | s1[k] | s2[k] | s3[k])) k--;
    put_amax(row, plan, fbits, k);
  }
  memset(sub, 0, 4 * (NK + PAD) * sizeof(uint32_t));
  return bad;
}

static void hist16_sub(const uint16_t *x, int64_t n, uint32_t *sub) {
  uint32_t *s0 = sub, *s1 = s0 + NK + PAD, *s2 = s1 + NK + PAD, *s3 = s2 + NK + PAD;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __builtin_prefetch((const char *)(x + i) + AHEAD);
    for (int j = 0; j < 32; j += 8) {
      uint64_t w, v;
      memcpy(&w, x + i + j, 8);
      memcpy(&v, x + i + j + 4, 8);
      s0[w & 0x7FFF]++;
      s1[(w >> 16) & 0x7FFF]++;
      s2[(w >> 32) & 0x7FFF]++;
      s3[(w >> 48) & 0x7FFF]++;
      s0[v & 0x7FFF]++;
      s1[(v >> 16) & 0x7FFF]++;
      s2[(v >> 32) & 0x7FFF]++;
      s3[(v >> 48) & 0x7FFF]++;
    }
  }
  for (; i < n; i++) s0[x[i] & 0x7FFF]++;
}

/* Add the magnitude keys (bits & 0x7FFF) of n 16-bit floats to a table row through a plan
   (columns, counts and the maximum); sub: scratch, left zeroed. Returns how many keys are
   >= the plan's P_BAD_FROM (the call's inf/NaN count for an unscaled plan). */
static int64_t row16(const uint16_t *x, int64_t n, int64_t *row, uint32_t *sub,
                     const int32_t *plan, const uint16_t *seg_of, const uint32_t *fbits) {
  if (n <= 0) return 0;
  if (n >= SUB_MIN) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i += CHUNK) {
      int64_t m = n - i < CHUNK ? n - i : CHUNK;
      hist16_sub(x + i, m, sub);
      bad += fold_sub(row, plan, fbits, sub);
    }
    return bad;
  }
  /* a small tensor: count segments directly (no pass over the 32768 keys); the lanes keep a
     run of one segment from serialising on one counter */
  uint32_t cnt[LANES * MAXSEG];
  memset(cnt, 0, plan[P_NSEG] * LANES * sizeof(uint32_t));
  unsigned top = 0;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int l = 0; l < LANES; l++) {
      unsigned k = x[i + l] & 0x7FFF;
      cnt[seg_of[k] * LANES + l]++;
      top = k > top ? k : top;
    }
  }
  for (; i < n; i++) {
    unsigned k = x[i] & 0x7FFF;
    cnt[seg_of[k] * LANES]++;
    top = k > top ? k : top;
  }
  put_amax(row, plan, fbits, (int)top);
  return add_segments(row, plan, cnt);
}

/* fp32: v = |x| (divided by scale when divide != 0, an IEEE fp32 division as torch does);
   adds v's upper 16 bits to the row through the plan (histogram columns only) and the exact
   counts: zeros (moved from the lump column to the zero column: key 0 holds both), NaN, the
   largest bit pattern, v >= 65520 (inf included, NaN not), v <= the fp32 value of flush_bits.
   sub: scratch, left zeroed. Returns how many v are inf or NaN. */
CLONES
static int64_t row32(const uint32_t *x, int64_t n, int64_t *row, uint32_t *sub,
                     const int32_t *plan, const uint16_t *seg_of, float scale, int32_t divide,
                     uint32_t flush_bits) {
  uint32_t buf[BLOCK];
  uint32_t cnt[LANES * MAXSEG];
  int64_t zeros = 0, nan = 0, over = 0, flush = 0, bad = 0;
  uint32_t top = 0;
  int use_sub = n >= SUB_MIN;
  int64_t since_fold = 0;
  if (!use_sub) memset(cnt, 0, plan[P_NSEG] * LANES * sizeof(uint32_t));
  /* a power-of-two scale whose inverse is a normal number: x * (1 / scale) is the same real
     number as x / scale, so both round to the same fp32 (subnormal results included) */
  uint32_t sbits;
  memcpy(&sbits, &scale, 4);
  uint32_t sexp = (sbits >> 23) & 0xFF;
  int pow2 = (sbits & 0x807FFFFFu) == 0 && sexp >= 2 && sexp <= 252;
  float inv = 1.0f / scale;
  for (int64_t i0 = 0; i0 < n; i0 += BLOCK) {
    int m = n - i0 < BLOCK ? (int)(n - i0) : BLOCK;
    const uint32_t *src = x + i0;
    for (int j = 0; j < m; j += 16) __builtin_prefetch((const char *)(src + j) + AHEAD);
    if (divide && pow2) {
      for (int j = 0; j < m; j++) {
        uint32_t u = src[j] & 0x7FFFFFFFu;
        float f;
        memcpy(&f, &u, 4);
        f = f * inv;
        memcpy(&u, &f, 4);
        buf[j] = u;
      }
    } else if (divide) {
      for (int j = 0; j < m; j++) {
        uint32_t u = src[j] & 0x7FFFFFFFu;
        float f;
        memcpy(&f, &u, 4);
        f = f / scale;
        memcpy(&u, &f, 4);
        buf[j] = u;
      }
    } else {
      for (int j = 0; j < m; j++) buf[j] = src[j] & 0x7FFFFFFFu;
    }
    uint32_t z = 0, nn = 0, ov = 0, fl = 0, bd = 0, mx = 0;
    for (int j = 0; j < m; j++) {
      uint32_t u = buf[j];
      z += u == 0;
      nn += u > 0x7F800000u;
      bd += u >= 0x7F800000u;
      ov += (u >= 0x477FF000u) & (u <= 0x7F800000u);
      fl += u <= flush_bits;
      mx = u > mx ? u : mx;
    }
    zeros += z;
    nan += nn;
    bad += bd;
    over += ov;
    flush += fl;
    top = mx > top ? mx : top;
    if (use_sub) {
      uint32_t *s0 = sub, *s1 = s0 + NK + PAD, *s2 = s1 + NK + PAD, *s3 = s2 + NK + PAD;
      int j = 0;
      for (; j + 4 <= m; j += 4) {
        s0[buf[j] >> 16]++;
        s1[buf[j + 1] >> 16]++;
        s2[buf[j + 2] >> 16]++;
        s3[buf[j + 3] >> 16]++;
      }
      for (; j < m; j++) s0[buf[j] >> 16]++;
      since_fold += m;
      if (since_fold >= CHUNK) {
        fold_sub(row, plan, 0, sub);
        since_fold = 0;
      }
    } else {
      int j = 0;
      for (; j + LANES <= m; j += LANES)
        for (int l = 0; l < LANES; l++) cnt[seg_of[buf[j + l] >> 16] * LANES + l]++;
      for (; j < m; j++) cnt[seg_of[buf[j] >> 16] * LANES]++;
    }
  }
  if (use_sub) {
    if (since_fold) fold_sub(row, plan, 0, sub);
  } else {
    add_segments(row, plan, cnt);
  }
  row[plan[P_ZEROS]] += zeros;
  row[plan[P_LUMP]] -= zeros;
  row[plan[P_ZERO_BIN]] += zeros;
  row[plan[P_NAN]] += nan;
  if ((int64_t)top > row[plan[P_AMAX]]) row[plan[P_AMAX]] = top;
  row[plan[P_OVER]] += over;
  row[plan[P_FLUSH]] += flush;
  return bad;
}

/* Add a tensor's own row (keep) to a slot's row: counts add, the maximum is a maximum. */
void amprobe_add_row(int64_t *row, const int64_t *keep, const int32_t *plan) {
  int a = plan[P_AMAX];
  int64_t top = row[a] > keep[a] ? row[a] : keep[a];
  for (int c = 0; c < plan[P_NCOLS]; c++) row[c] += keep[c];
  row[a] = top;
}

/* The exported passes: the tensor is counted into keep (zeroed by the caller), its own row,
   which the caller keeps so that the same tensor measured again in the step (a Dropout(p=0)
   returns its input; a gradient hooked twice) costs an amprobe_add_row; then keep is added
   to the slot's row. */
int64_t amprobe_row16(const uint16_t *x, int64_t n, int64_t *row, int64_t *keep, uint32_t *sub,
                      const int32_t *plan, const uint16_t *seg_of, const uint32_t *fbits) {
  int64_t bad = row16(x, n, keep, sub, plan, seg_of, fbits);
  amprobe_add_row(row, keep, plan);
  return bad;
}

int64_t amprobe_row32(const uint32_t *x, int64_t n, int64_t *row, int64_t *keep, uint32_t *sub,
                      const int32_t *plan, const uint16_t *seg_of, float scale, int32_t divide,
                      uint32_t flush_bits) {
  int64_t bad = row32(x, n, keep, sub, plan, seg_of, scale, divide, flush_bits);
  amprobe_add_row(row, keep, plan);
  return bad;
}

/* how many of n elements are inf or NaN; kind is numstats' key format (0 fp16, 1 bf16,
   2 fp32); one pass, no copy, counted per block in narrow counters, which vectorize */
#define NF_BLOCK 4096
CLONES
int64_t amprobe_nonfinite(const void *x, int64_t n, int32_t kind) {
  int64_t c = 0;
  for (int64_t i0 = 0; i0 < n; i0 += NF_BLOCK) {
    int m = n - i0 < NF_BLOCK ? (int)(n - i0) : NF_BLOCK;
    if (kind == 2) {
      const uint32_t *u = (const uint32_t *)x + i0;
      uint32_t cc = 0;
      for (int j = 0; j < m; j += 16) __builtin_prefetch((const char *)(u + j) + AHEAD);
      for (int j = 0; j < m; j++) cc += (u[j] & 0x7FFFFFFFu) >= 0x7F800000u;
      c += cc;
    } else {
      const uint16_t *u = (const uint16_t *)x + i0;
      const uint16_t inf = kind == 0 ? 0x7C00 : 0x7F80;
      uint16_t cc = 0;
      for (int j = 0; j < m; j += 32) __builtin_prefetch((const char *)(u + j) + AHEAD);
      for (int j = 0; j < m; j++) cc += (uint16_t)(u[j] & 0x7FFF) >= inf;
      c += cc;
    }
  }
  return c;
}
/* the block statistics need GCC >= 9 or clang (vector extensions, __builtin_convertvector);
   without them the library builds without its amprobe_block_* functions */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 9)
/* ---- block statistics of #36 (amprobe.capture.collectors.blockstats) ----
   One pass over a 2-D tensor in 128 x 128 strips (rows x contiguous columns of memory): each
   strip is read once into |x / divisor| (fp32, non-finite -> 0), and every requested
   (block shape, format) job is reduced from that buffer: 1-D blocks along the columns (1 x b)
   or along the rows (b x 1: the strip is a panel of 128 rows, amax per column), 2-D tiles,
   or one scale per tensor. Blocks of 16/32/64/128 and tiles up to 128 x 128 never straddle
   strips. Arithmetic in GCC vector extensions, 16 fp32 lanes (lowered to what each clone's
   ISA has); all fp32 operations are the IEEE ones the eager torch reduction does (no
   contraction: -std=c99), so counts are identical and float64 sums differ only in order. */
#define BS_R 128
#define BS_C 128
#define BS_VL 16
#define BS_NG (BS_C / BS_VL)
typedef float bs_vf __attribute__((vector_size(64)));
typedef int32_t bs_vi __attribute__((vector_size(64)));
typedef double bs_vd __attribute__((vector_size(64)));   /* 8 doubles: half a bs_vf */
typedef float bs_vf8 __attribute__((vector_size(32)));
typedef int32_t bs_vi8 __attribute__((vector_size(32)));
typedef int32_t bs_vi4 __attribute__((vector_size(16)));
typedef uint16_t bs_vh __attribute__((vector_size(32)));

/* a job: words of one (block shape, format) row */
enum {
  J_GEOM, J_LR, J_LC, J_SCALE, J_MANT, J_MINB, J_MMAX, J_EMAX, J_MAXF, J_CAPF, J_CLIPF,
  J_SMANT, J_SMINB, J_SMAXF, J_SCAPF, J_SCLIPF, J_STDIVF, J_WORDS = 20
};
enum { G_ROWS, G_COLS, G_TILE, G_TENSOR };          /* 1 x b, b x 1, tr x tc, whole tensor */
enum { S_EXACT, S_FLOOR, S_CEIL, S_NVFP4 };
enum { O_FLUSHED, O_CLIPPED, O_UNDER, O_SAT, O_NOISE, O_WORDS };

#define BS_INLINE static inline __attribute__((always_inline))
BS_INLINE bs_vf bs_f(float x) { bs_vf v = {0}; return v + x; }
BS_INLINE bs_vi bs_i(int32_t x) { bs_vi v = {0}; return v + x; }
BS_INLINE bs_vf bs_sel(bs_vi m, bs_vf a, bs_vf b) {
  return (bs_vf)(((bs_vi)a & m) | ((bs_vi)b & ~m));
}
BS_INLINE bs_vi bs_seli(bs_vi m, bs_vi a, bs_vi b) { return (a & m) | (b & ~m); }
BS_INLINE float bs_fl(int32_t bits) { float f; memcpy(&f, &bits, 4); return f; }
/* acc += x**2 in float64, the vector in two halves (a 16-double vector is not kept in
   registers) */
BS_INLINE void bs_sq(bs_vf x, bs_vd *lo, bs_vd *hi) {
  bs_vf8 a, b;
  memcpy(&a, &x, 32);
  memcpy(&b, (const char *)&x + 32, 32);
  bs_vd da = __builtin_convertvector(a, bs_vd), db = __builtin_convertvector(b, bs_vd);
  *lo += da * da;
  *hi += db * db;
}
/* the largest lane of a vector of non-negative ints */
BS_INLINE int32_t bs_hmax(bs_vi v) {
  bs_vi8 a, b;
  memcpy(&a, &v, 32);
  memcpy(&b, (const char *)&v + 32, 32);
  bs_vi8 m8 = (a & (a > b)) | (b & ~(a > b));
  bs_vi4 c, d;
  memcpy(&c, &m8, 16);
  memcpy(&d, (const char *)&m8 + 16, 16);
  bs_vi4 m4 = (c & (c > d)) | (d & ~(c > d));
  int32_t m = m4[0] > m4[1] ? m4[0] : m4[1];
  int32_t n = m4[2] > m4[3] ? m4[2] : m4[3];
  return m > n ? m : n;
}

/* round-to-nearest-even of v >= 0 in an element type (mantissa bits, smallest normal biased
   exponent minb), subnormals kept, saturating at maxf; cap = 2 * maxf keeps the magic in range */
BS_INLINE bs_vf bs_rne(bs_vf v, int32_t mant, int32_t minb, float maxf, float cap) {
  bs_vf vc = bs_sel(v < bs_f(cap), v, bs_f(cap));
  bs_vi eb = (bs_vi)vc >> 23;
  eb = bs_seli(eb > bs_i(minb), eb, bs_i(minb));
  bs_vf magic = (bs_vf)((eb + (23 - mant)) << 23);
  bs_vf q = (vc + magic) - magic;
  return bs_sel(q < bs_f(maxf), q, bs_f(maxf));
}

/* 2**e for integer e in [-127, 127] */
BS_INLINE bs_vf bs_pow2(bs_vi e) {
  return (bs_vf)bs_seli(e >= bs_i(-126), (e + 127) << 23, bs_i(0x00400000));
}

/* Scales of n block maxima (n a multiple of 16, zeros where no block): smul (the scale, 0 for
   an all-zero block) and sdiv (what |x| is divided by: the scale, inf for a zero scale; or,
   for power-of-two scales, multiplied by: 1 / scale). Adds the under/saturated counts. */
BS_INLINE void bs_scales(const int32_t *am, int n, const int32_t *job, float s_t, float *smul,
                      float *sdiv, double *o) {
  bs_vi under = bs_i(0), sat = bs_i(0);
  int kind = job[J_SCALE];
  float maxf = bs_fl(job[J_MAXF]);
  for (int i = 0; i < n; i += BS_VL) {
    bs_vf a = (bs_vf)*(const bs_vi *)(am + i);
    bs_vi pos = a > bs_f(0.0f);
    bs_vf s, d;
    if (kind == S_EXACT) {
      s = a / bs_f(maxf);
      under += (s > bs_f(0.0f)) - pos; /* s > 0 only where amax > 0 */
      sat -= (bs_vi)s == bs_i(0x7F800000);
      d = bs_sel(s > bs_f(0.0f), s, bs_f(__builtin_inff()));
    } else if (kind == S_NVFP4) {
      bs_vf raw = (a / bs_f(maxf)) / bs_f(s_t);
      raw = bs_sel(pos, raw, bs_f(0.0f));
      sat -= raw > bs_f(bs_fl(job[J_SCLIPF]));
      bs_vf sb = bs_rne(raw, job[J_SMANT], job[J_SMINB], bs_fl(job[J_SMAXF]),
                        bs_fl(job[J_SCAPF]));
      under += (sb > bs_f(0.0f)) - pos;
      s = sb * bs_f(s_t);
      d = bs_sel(s > bs_f(0.0f), s, bs_f(__builtin_inff()));
    } else {
      bs_vi bits = (bs_vi)a;
      bs_vi eb = bits >> 23, frac = bits & 0x7FFFFF;
      bs_vi norm = (bs_vi)__builtin_convertvector(frac, bs_vf);
      bs_vi sub = eb == bs_i(0);
      bs_vi e = bs_seli(sub, (norm >> 23) - (127 + 149), eb - 127);
      bs_vi m = bs_seli(sub, norm & 0x7FFFFF, frac);
      e = e - job[J_EMAX];
      if (kind == S_CEIL) e -= m > bs_i(job[J_MMAX]);
      e = bs_seli(pos, e, bs_i(0));
      under -= e < bs_i(-127);
      sat -= e > bs_i(127);
      e = bs_seli(e < bs_i(-127), bs_i(-127), e);
      e = bs_seli(e > bs_i(127), bs_i(127), e);
      s = bs_pow2(e);
      d = bs_pow2(-e);
    }
    *(bs_vf *)(smul + i) = bs_sel(pos, s, bs_f(0.0f));
    *(bs_vf *)(sdiv + i) = d;
  }
  int64_t u = 0, t = 0;
  for (int l = 0; l < BS_VL; l++) { u += under[l]; t += sat[l]; }
  o[O_UNDER] += (double)u;
  o[O_SAT] += (double)t;
}

/* one vector of 16 |x| against its scales: flushed / clipped counts and the noise */
BS_INLINE void bs_quant(bs_vf a, bs_vf s, bs_vf d, int mul, int32_t mant, int32_t minb,
                        float maxf, float cap, float clip, bs_vi *fl, bs_vi *cl, bs_vd *nlo,
                        bs_vd *nhi) {
  bs_vf v = mul ? a * d : a / d;
  *cl -= v > bs_f(clip);
  bs_vf deq = bs_rne(v, mant, minb, maxf, cap) * s;
  *fl -= deq > bs_f(0.0f); /* kept: flushed = nonzero - kept (deq > 0 only where a > 0) */
  bs_sq(a - deq, nlo, nhi); /* a - deq is exact in fp32: deq is 0 or within 2x of a */
}

BS_INLINE void bs_job_quant(const float *buf, int nr, int ng, const int32_t *job,
                            const float *smul, const float *sdiv, int mul, double *o) {
  bs_vi fl = bs_i(0), cl = bs_i(0);
  bs_vd nlo = {0}, nhi = {0};
  int32_t mant = job[J_MANT], minb = job[J_MINB];
  float maxf = bs_fl(job[J_MAXF]), cap = bs_fl(job[J_CAPF]), clip = bs_fl(job[J_CLIPF]);
  int geom = job[J_GEOM], lr = job[J_LR], lc = job[J_LC];
  if (geom == G_COLS) {
    for (int r = 0; r < nr; r++) {
      const float *sm = smul + (r >> lr) * BS_C, *sd = sdiv + (r >> lr) * BS_C;
      for (int g = 0; g < ng; g++)
        bs_quant(*(const bs_vf *)(buf + r * BS_C + g * BS_VL), *(const bs_vf *)(sm + g * BS_VL),
                 *(const bs_vf *)(sd + g * BS_VL), mul, mant, minb, maxf, cap, clip, &fl, &cl,
                 &nlo, &nhi);
    }
  } else {
    int rstride = geom == G_TENSOR ? 0 : BS_NG >> lc;
    for (int r = 0; r < nr; r++) {
      int base = (r >> lr) * rstride;
      for (int g = 0; g < ng; g++) {
        int k = base + (g >> lc);
        bs_quant(*(const bs_vf *)(buf + r * BS_C + g * BS_VL), bs_f(smul[k]), bs_f(sdiv[k]),
                 mul, mant, minb, maxf, cap, clip, &fl, &cl, &nlo, &nhi);
      }
    }
  }
  int64_t f = 0, c = 0;
  double n = 0;
  for (int l = 0; l < BS_VL; l++) { f += fl[l]; c += cl[l]; }
  for (int l = 0; l < 8; l++) n += nlo[l] + nhi[l];
  o[O_FLUSHED] += (double)f;
  o[O_CLIPPED] += (double)c;
  o[O_NOISE] += n;
}

/* The same loop in AVX-512 intrinsics (min/max, masked counts and the fp32 -> fp64 widening
   are one instruction each there; the generic vectors above take two to five): the loop
   every job runs per element, chosen when the CPU has AVX-512F. Same operations, same order,
   so the same results (the float64 sum uses FMA: a different rounding of each square, well
   below the sums' 1e-9 agreement). */
#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 7)
#include <immintrin.h>
#define BS_HAS_512 1 /* and AVX2 */
__attribute__((target("avx512f"))) static void bs_job_quant512(
    const float *buf, int nr, int ng, const int32_t *job, const float *smul, const float *sdiv,
    int mul, double *o) {
  __m512i fl = _mm512_setzero_si512(), cl = _mm512_setzero_si512(), one = _mm512_set1_epi32(1);
  __m512d nlo = _mm512_setzero_pd(), nhi = _mm512_setzero_pd();
  const __m512i minb = _mm512_set1_epi32(job[J_MINB]);
  const __m512i shift = _mm512_set1_epi32(23 - job[J_MANT]);
  const __m512 maxf = _mm512_set1_ps(bs_fl(job[J_MAXF])), cap = _mm512_set1_ps(bs_fl(job[J_CAPF]));
  const __m512 clip = _mm512_set1_ps(bs_fl(job[J_CLIPF])), zero = _mm512_setzero_ps();
  int geom = job[J_GEOM], lr = job[J_LR], lc = job[J_LC];
  int rstride = geom == G_TENSOR ? 0 : BS_NG >> lc;
  for (int r = 0; r < nr; r++) {
    for (int g = 0; g < ng; g++) {
      __m512 a = _mm512_load_ps(buf + r * BS_C + g * BS_VL), s, d;
      if (geom == G_COLS) {
        s = _mm512_load_ps(smul + (r >> lr) * BS_C + g * BS_VL);
        d = _mm512_load_ps(sdiv + (r >> lr) * BS_C + g * BS_VL);
      } else {
        int k = (r >> lr) * rstride + (g >> lc);
        s = _mm512_set1_ps(smul[k]);
        d = _mm512_set1_ps(sdiv[k]);
      }
      __m512 v = mul ? _mm512_mul_ps(a, d) : _mm512_div_ps(a, d);
      cl = _mm512_mask_add_epi32(cl, _mm512_cmp_ps_mask(v, clip, _CMP_GT_OQ), cl, one);
      __m512 vc = _mm512_min_ps(v, cap);
      __m512i eb = _mm512_max_epi32(_mm512_srli_epi32(_mm512_castps_si512(vc), 23), minb);
      __m512 magic = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(eb, shift), 23));
      __m512 q = _mm512_min_ps(_mm512_sub_ps(_mm512_add_ps(vc, magic), magic), maxf);
      __m512 deq = _mm512_mul_ps(q, s);
      fl = _mm512_mask_add_epi32(fl, _mm512_cmp_ps_mask(deq, zero, _CMP_GT_OQ), fl, one);
      __m512 e = _mm512_sub_ps(a, deq);
      __m512d elo = _mm512_cvtps_pd(_mm512_castps512_ps256(e));
      __m512d ehi = _mm512_cvtps_pd(
          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
      nlo = _mm512_fmadd_pd(elo, elo, nlo);
      nhi = _mm512_fmadd_pd(ehi, ehi, nhi);
    }
  }
  int32_t f[16], c[16];
  double n[8], m[8];
  _mm512_storeu_si512(f, fl);
  _mm512_storeu_si512(c, cl);
  _mm512_storeu_pd(n, nlo);
  _mm512_storeu_pd(m, nhi);
  int64_t ft = 0, ct = 0;
  double nt = 0;
  for (int l = 0; l < 16; l++) { ft += f[l]; ct += c[l]; }
  for (int l = 0; l < 8; l++) nt += n[l] + m[l];
  o[O_FLUSHED] += (double)ft;
  o[O_CLIPPED] += (double)ct;
  o[O_NOISE] += nt;
}
/* AVX2 (no FMA needed): the same loop on two 8-lane halves of each 16-value vector */
__attribute__((target("avx2"))) static void bs_job_quant256(
    const float *buf, int nr, int ng, const int32_t *job, const float *smul, const float *sdiv,
    int mul, double *o) {
  __m256i fl = _mm256_setzero_si256(), cl = _mm256_setzero_si256();
  __m256d n0 = _mm256_setzero_pd(), n1 = _mm256_setzero_pd();
  const __m256i minb = _mm256_set1_epi32(job[J_MINB]);
  const __m256i shift = _mm256_set1_epi32(23 - job[J_MANT]);
  const __m256 maxf = _mm256_set1_ps(bs_fl(job[J_MAXF])), cap = _mm256_set1_ps(bs_fl(job[J_CAPF]));
  const __m256 clip = _mm256_set1_ps(bs_fl(job[J_CLIPF])), zero = _mm256_setzero_ps();
  int geom = job[J_GEOM], lr = job[J_LR], lc = job[J_LC];
  int rstride = geom == G_TENSOR ? 0 : BS_NG >> lc;
  for (int r = 0; r < nr; r++) {
    for (int g = 0; g < ng; g++) {
      for (int h = 0; h < BS_VL; h += 8) {
        __m256 a = _mm256_load_ps(buf + r * BS_C + g * BS_VL + h), s, d;
        if (geom == G_COLS) {
          s = _mm256_load_ps(smul + (r >> lr) * BS_C + g * BS_VL + h);
          d = _mm256_load_ps(sdiv + (r >> lr) * BS_C + g * BS_VL + h);
        } else {
          int k = (r >> lr) * rstride + (g >> lc);
          s = _mm256_set1_ps(smul[k]);
          d = _mm256_set1_ps(sdiv[k]);
        }
        __m256 v = mul ? _mm256_mul_ps(a, d) : _mm256_div_ps(a, d);
        cl = _mm256_sub_epi32(cl, _mm256_castps_si256(_mm256_cmp_ps(v, clip, _CMP_GT_OQ)));
        __m256 vc = _mm256_min_ps(v, cap);
        __m256i eb = _mm256_max_epi32(_mm256_srli_epi32(_mm256_castps_si256(vc), 23), minb);
        __m256 magic = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(eb, shift), 23));
        __m256 q = _mm256_min_ps(_mm256_sub_ps(_mm256_add_ps(vc, magic), magic), maxf);
        __m256 deq = _mm256_mul_ps(q, s);
        fl = _mm256_sub_epi32(fl, _mm256_castps_si256(_mm256_cmp_ps(deq, zero, _CMP_GT_OQ)));
        __m256 e = _mm256_sub_ps(a, deq);
        __m256d e0 = _mm256_cvtps_pd(_mm256_castps256_ps128(e));
        __m256d e1 = _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1));
        n0 = _mm256_add_pd(n0, _mm256_mul_pd(e0, e0));
        n1 = _mm256_add_pd(n1, _mm256_mul_pd(e1, e1));
      }
    }
  }
  int32_t f[8], c[8];
  double n[4], m[4];
  _mm256_storeu_si256((__m256i *)f, fl);
  _mm256_storeu_si256((__m256i *)c, cl);
  _mm256_storeu_pd(n, n0);
  _mm256_storeu_pd(m, n1);
  int64_t ft = 0, ct = 0;
  double nt = 0;
  for (int l = 0; l < 8; l++) { ft += f[l]; ct += c[l]; }
  for (int l = 0; l < 4; l++) nt += n[l] + m[l];
  o[O_FLUSHED] += (double)ft;
  o[O_CLIPPED] += (double)ct;
  o[O_NOISE] += nt;
}
/* 2: AVX-512, 1: AVX2, 0: the generic vectors; -1: not chosen yet */
static int bs_simd = -1;
static int bs_best_simd(void) {
  return __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
}
#endif

/* which per-element loop runs: 2 AVX-512, 1 AVX2 (each where the CPU has it), 0 the generic
   vectors (the clone's ISA), -1 the best the CPU has; returns the choice in force (tests run
   each) */
int32_t amprobe_block_simd(int32_t level) {
#ifdef BS_HAS_512
  int best = bs_best_simd();
  bs_simd = level < 0 || level > best ? best : level;
  return bs_simd;
#else
  (void)level;
  return 0;
#endif
}

/* |x / divisor| of n (<= 16) elements at p as a vector, non-finite -> 0 (a tail zero-filled);
   dmode 0: no divisor, 1: multiply by dv (1 / a power-of-two divisor), 2: divide by dv */
BS_INLINE bs_vf bs_load(const void *p, int kind, int n, int dmode, float dv, bs_vi *bad) {
  bs_vf f;
  if (kind == 2) {
    bs_vi u = {0};
    if (n == BS_VL) memcpy(&u, p, 64);
    else memcpy(&u, p, n * 4);
    f = (bs_vf)(u & 0x7FFFFFFF);
  } else {
    bs_vh h = {0};
    if (n == BS_VL) memcpy(&h, p, 32);
    else memcpy(&h, p, n * 2);
    bs_vi u = __builtin_convertvector(h, bs_vi) & 0x7FFF;
    if (kind == 1) {
      f = (bs_vf)(u << 16);
    } else {
      /* fp16 -> fp32: the bits moved into place, rescaled by 2**112 (exact, subnormals
         included); inf/NaN keep an all-ones exponent */
      bs_vf g = (bs_vf)(u << 13) * bs_f(0x1p112f);
      f = bs_sel(u >= bs_i(0x7C00), (bs_vf)((u << 13) | 0x7F800000), g);
    }
  }
  if (dmode == 1) f = f * bs_f(dv);
  else if (dmode == 2) f = f / bs_f(dv);
  bs_vi fin = (bs_vi)f < bs_i(0x7F800000);
  *bad -= ~fin;
  return bs_sel(fin, f, bs_f(0.0f));
}

static int bs_dmode(const float *div, float *dv) {
  if (!div) return 0;
  float d = *div < 0 ? -*div : *div;
  uint32_t b;
  memcpy(&b, &d, 4);
  uint32_t e = (b >> 23) & 0xFF;
  if ((b & 0x7FFFFF) == 0 && e >= 2 && e <= 252) {
    *dv = 1.0f / d; /* a normal power of two: x * (1 / d) is x / d, rounded once */
    return 1;
  }
  *dv = d;
  return 2;
}

#define BS_ESIZE(kind) ((kind) == 2 ? 4 : 2)

/* the largest finite |x / divisor| */
CLONES
float amprobe_block_amax(const void *x, int32_t kind, int64_t rows, int64_t cols, int64_t ld,
                         const float *div) {
  float dv = 1.0f;
  int dmode = bs_dmode(div, &dv);
  bs_vi top = bs_i(0), bad = bs_i(0);
  int es = BS_ESIZE(kind);
  for (int64_t r = 0; r < rows; r++) {
    const char *row = (const char *)x + r * ld * es;
    for (int64_t c = 0; c < cols; c += BS_VL) {
      int n = cols - c < BS_VL ? (int)(cols - c) : BS_VL;
      if ((c & 127) == 0) __builtin_prefetch(row + (c + 256) * es);
      bs_vi a = (bs_vi)bs_load(row + c * es, kind, n, dmode, dv, &bad);
      top = bs_seli(a > top, a, top);
    }
  }
  int32_t m = 0;
  for (int l = 0; l < BS_VL; l++) m = top[l] > m ? top[l] : m;
  return bs_fl(m);
}

/* The strip pass: stats[0..2] += non-finite, nonzero, sum x**2; out[job * O_WORDS + ...] +=
   flushed, clipped, scale_under, scale_sat, noise of each job. */
CLONES
void amprobe_block_pass(const void *x, int32_t kind, int64_t rows, int64_t cols, int64_t ld,
                        const float *div, float amax_t, int32_t njobs, const int32_t *jobs,
                        double *out, double *stats) {
  float buf[BS_R * BS_C] __attribute__((aligned(64)));
  int32_t rmax[BS_R * BS_NG] __attribute__((aligned(64)));
  int32_t cmax[(BS_R / 16) * BS_C] __attribute__((aligned(64)));
  int32_t am[BS_R * BS_NG] __attribute__((aligned(64)));
  float smul[BS_R * BS_NG] __attribute__((aligned(64)));
  float sdiv[BS_R * BS_NG] __attribute__((aligned(64)));
  float dv = 1.0f;
  int dmode = bs_dmode(div, &dv);
  int es = BS_ESIZE(kind);
  int need_r = 0, need_c = 0;
  for (int j = 0; j < njobs; j++) {
    int g = jobs[j * J_WORDS + J_GEOM];
    need_r |= g == G_ROWS || g == G_TILE;
    need_c |= g == G_COLS;
  }
  float s_t = amax_t / 2688.0f;
#ifdef BS_HAS_512
  if (bs_simd < 0) bs_simd = bs_best_simd();
  int simd = bs_simd;
#endif
  bs_vi bad = bs_i(0), nzc = bs_i(0);
  bs_vd slo = {0}, shi = {0};
  for (int64_t r0 = 0; r0 < rows; r0 += BS_R) {
    int nr = rows - r0 < BS_R ? (int)(rows - r0) : BS_R;
    for (int64_t c0 = 0; c0 < cols; c0 += BS_C) {
      int nc = cols - c0 < BS_C ? (int)(cols - c0) : BS_C;
      int ng = (nc + BS_VL - 1) / BS_VL;
      for (int r = 0; r < nr; r++) {
        const char *row = (const char *)x + ((r0 + r) * ld + c0) * es;
        if (c0 + BS_C < cols)
          for (int b = 0; b < BS_C * es; b += 64) __builtin_prefetch(row + BS_C * es + b);
        for (int g = 0; g < ng; g++) {
          int n = nc - g * BS_VL < BS_VL ? nc - g * BS_VL : BS_VL;
          bs_vf a = bs_load(row + g * BS_VL * es, kind, n, dmode, dv, &bad);
          *(bs_vf *)(buf + r * BS_C + g * BS_VL) = a;
          nzc -= a > bs_f(0.0f);
          bs_sq(a, &slo, &shi);
          if (need_r) rmax[r * BS_NG + g] = bs_hmax((bs_vi)a);
        }
      }
      if (need_c) {
        for (int rg = 0; rg * 16 < nr; rg++) {
          int hi = nr < rg * 16 + 16 ? nr : rg * 16 + 16;
          for (int g = 0; g < ng; g++) {
            bs_vi m = bs_i(0);
            for (int r = rg * 16; r < hi; r++) {
              bs_vi a = (bs_vi)*(const bs_vf *)(buf + r * BS_C + g * BS_VL);
              m = bs_seli(a > m, a, m);
            }
            *(bs_vi *)(cmax + rg * BS_C + g * BS_VL) = m;
          }
        }
      }
      for (int j = 0; j < njobs; j++) {
        const int32_t *job = jobs + j * J_WORDS;
        int geom = job[J_GEOM], lr = job[J_LR], lc = job[J_LC];
        int n;
        double spare[O_WORDS] = {0};
        /* one scale per tensor: its under/saturated count once, at the first strip */
        double *o = geom == G_TENSOR && (r0 || c0) ? spare : out + j * O_WORDS;
        if (geom == G_TENSOR) {
          for (int i = 0; i < BS_VL; i++) am[i] = 0;
          memcpy(am, &amax_t, 4);
          n = BS_VL;
        } else {
          if (geom == G_COLS) {
            int nb = ((nr - 1) >> lr) + 1, per = (1 << lr) / 16;
            n = nb * BS_C;
            for (int b = 0; b < nb; b++)
              for (int c = 0; c < BS_C; c += BS_VL) {
                bs_vi m = bs_i(0);
                for (int k = 0; k < per && (b * per + k) * 16 < nr; k++) {
                  bs_vi v = *(const bs_vi *)(cmax + (b * per + k) * BS_C + c);
                  m = bs_seli(v > m, v, m);
                }
                if (c >= ng * BS_VL) m = bs_i(0);
                *(bs_vi *)(am + b * BS_C + c) = m;
              }
          } else {
            int rstride = BS_NG >> lc, nb = ((nr - 1) >> lr) + 1;
            n = nb * rstride;
            n = (n + BS_VL - 1) / BS_VL * BS_VL;
            for (int i = 0; i < n; i++) am[i] = 0;
            int32_t *ami = am;
            for (int r = 0; r < nr; r++)
              for (int g = 0; g < ng; g++) {
                int k = (r >> lr) * rstride + (g >> lc);
                ami[k] = rmax[r * BS_NG + g] > ami[k] ? rmax[r * BS_NG + g] : ami[k];
              }
          }
        }
        bs_scales(am, n, job, s_t, smul, sdiv, o);
        int mul = job[J_SCALE] == S_FLOOR || job[J_SCALE] == S_CEIL;
#ifdef BS_HAS_512
        if (simd == 2) {
          bs_job_quant512(buf, nr, ng, job, smul, sdiv, mul, out + j * O_WORDS);
          continue;
        }
        if (simd == 1) {
          bs_job_quant256(buf, nr, ng, job, smul, sdiv, mul, out + j * O_WORDS);
          continue;
        }
#endif
        bs_job_quant(buf, nr, ng, job, smul, sdiv, mul, out + j * O_WORDS);
      }
    }
  }
  int64_t b = 0, z = 0;
  double s = 0;
  for (int l = 0; l < BS_VL; l++) { b += bad[l]; z += nzc[l]; }
  for (int l = 0; l < 8; l++) s += slo[l] + shi[l];
  for (int j = 0; j < njobs; j++) out[j * O_WORDS + O_FLUSHED] = (double)z - out[j * O_WORDS + O_FLUSHED];
  stats[0] += (double)b;
  stats[1] += (double)z;
  stats[2] += s;
}
#endif
"""
SOURCE = SOURCE.replace("@SUB_MIN@", str(SUB_MIN)).replace("@SUB_PAD@", str(_SUB_PAD))

_FLAGS = ("-O3", "-shared", "-fPIC", "-fno-fast-math", "-std=c99")


class Kernel:
    """The loaded library: ``row16``, ``row32``, ``add_row`` and ``nonfinite`` (see
    :data:`SOURCE`), and ``block_amax`` / ``block_pass`` for
    :mod:`~amprobe.capture.collectors.blockstats`."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self.row16 = lib.amprobe_row16
        self.row16.argtypes = [p, i64, p, p, p, p, p, p]
        self.row16.restype = i64
        f32, i32, u32 = ctypes.c_float, ctypes.c_int32, ctypes.c_uint32
        self.row32 = lib.amprobe_row32
        self.row32.argtypes = [p, i64, p, p, p, p, p, f32, i32, u32]
        self.row32.restype = i64
        self.add_row = lib.amprobe_add_row
        self.add_row.argtypes = [p, p, p]
        self.add_row.restype = None
        self.nonfinite = lib.amprobe_nonfinite
        self.nonfinite.argtypes = [p, i64, ctypes.c_int32]
        self.nonfinite.restype = i64
        # block statistics (amprobe.capture.collectors.blockstats); absent where the compiler
        # lacks vector extensions (``has_blocks`` False: blockstats runs its eager reduction)
        self.has_blocks = hasattr(lib, "amprobe_block_pass")
        if self.has_blocks:
            self.block_amax = lib.amprobe_block_amax
            self.block_amax.argtypes = [p, i32, i64, i64, i64, p]
            self.block_amax.restype = f32
            self.block_pass = lib.amprobe_block_pass
            self.block_pass.argtypes = [p, i32, i64, i64, i64, p, f32, i32, p, p, p]
            self.block_pass.restype = None
            self.block_simd = lib.amprobe_block_simd
            self.block_simd.argtypes = [i32]
            self.block_simd.restype = i32
        self.path = path


class _Build:
    """The one build of this process: a compiler subprocess, then the loaded library."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmp: Path | None = None
        self.target: Path | None = None
        self.kernel: Kernel | None = None
        self.reason: str | None = None  # why there is no kernel (set once, final)
        self.started = False


_BUILD = _Build()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cache_dir() -> Path:
    base = os.environ.get("AMPROBE_KERNEL_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = Path(xdg) if xdg else Path.home() / ".cache"
    return root / "amprobe" / "kernels"


def _target(compiler: str) -> Path:
    key = "\0".join((SOURCE, " ".join(_FLAGS), compiler, platform.machine(), sys.platform))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return _cache_dir() / f"numstats-{digest}.so"


#: a build's leftovers older than this are a killed process's (a build takes seconds)
STALE_BUILD_S = 3600.0


def _remove_stale_builds(cache: Path) -> None:
    """Remove the temporary files of builds that never finished (a process killed while its
    compiler ran leaves ``.build-*.so``/``.c`` behind); a build running now is younger."""
    now = time.time()
    for leftover in cache.glob(".build-*"):
        try:
            if now - leftover.stat().st_mtime > STALE_BUILD_S:
                leftover.unlink()
        except OSError:
            pass


def start_build() -> None:
    """Load the kernel from the cache, or start compiling it in a subprocess (never blocks on
    the compiler; safe to call many times: one build per process). No output on any path."""
    b = _BUILD
    with b.lock:
        if b.started:
            return
        b.started = True
        try:
            if os.environ.get("AMPROBE_NO_KERNEL"):
                b.reason = "disabled by AMPROBE_NO_KERNEL"
                return
            compiler = _compiler()
            if compiler is None:
                b.reason = "no C compiler (cc, gcc, clang) on PATH"
                return
            target = _target(compiler)
            if target.exists():
                b.kernel = Kernel(target)
                return
            target.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_builds(target.parent)
            fd, tmp = tempfile.mkstemp(suffix=".so", prefix=".build-", dir=target.parent)
            os.close(fd)
            src = Path(tmp).with_suffix(".c")
            src.write_text(SOURCE)
            b.tmp, b.target = Path(tmp), target
            b.proc = subprocess.Popen(
                [compiler, *_FLAGS, "-o", tmp, str(src)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        except Exception as exc:  # no cache dir, no fork, a bad library: the eager path
            b.reason = f"{type(exc).__name__}: {exc}"


def _finish(block: bool) -> None:
    b = _BUILD
    proc = b.proc
    if proc is None or (not block and proc.poll() is None):
        return
    b.proc = None
    assert b.tmp is not None and b.target is not None
    try:
        _, err = proc.communicate()
        if proc.returncode != 0:
            text = err.decode(errors="replace").strip().splitlines()
            b.reason = f"compiler exit {proc.returncode}: {text[-1] if text else ''}"[:300]
            return
        os.replace(b.tmp, b.target)  # atomic: concurrent ranks build the same file
        b.kernel = Kernel(b.target)
    except Exception as exc:
        b.reason = f"{type(exc).__name__}: {exc}"
    finally:
        for leftover in (b.tmp, b.tmp.with_suffix(".c")):
            try:
                leftover.unlink()
            except OSError:
                pass


def kernel() -> Kernel | None:
    """The loaded kernel, or None while it builds or when it is unavailable (never blocks)."""
    b = _BUILD
    if b.kernel is not None or b.proc is None:
        return b.kernel
    with b.lock:
        _finish(block=False)
    return b.kernel


def wait() -> Kernel | None:
    """Start the build if needed and wait for it (tests, benchmarks)."""
    start_build()
    with _BUILD.lock:
        _finish(block=True)
    return _BUILD.kernel


def status() -> str:
    """``ready``, ``building``, ``not started`` or ``unavailable: <why>``."""
    if kernel() is not None:
        return "ready"
    b = _BUILD
    if b.reason is not None:
        return f"unavailable: {b.reason}"
    return "building" if b.started else "not started"
