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
"""
SOURCE = SOURCE.replace("@SUB_MIN@", str(SUB_MIN)).replace("@SUB_PAD@", str(_SUB_PAD))

_FLAGS = ("-O3", "-shared", "-fPIC", "-fno-fast-math", "-std=c99")


class Kernel:
    """The loaded library: ``row16``, ``row32``, ``add_row`` and ``nonfinite`` (see
    :data:`SOURCE`)."""

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
