"""Transparent huge pages (THP) for a runtime's weights: what the host allows and how a process asks.

Why: a decode step streams every weight once, so with 4 KiB pages it also
walks a page-table entry (and risks a TLB miss) per 4 KiB of weights; in
2 MiB pages it does not. Measured here on the ~100M model (benchmarks/
gqa_speed.py --huge-pages, 11 interleaved passes): ONNX Runtime's GQA graph
+6% decode at a 32-token prompt and +9% at 512, llama.cpp Q4_K_M -2% and +6%,
all inside this host's spreads.

Two ways in, both plain Linux / glibc:
- `hugetlb_env(env)`: for a process about to start. GLIBC_TUNABLES
  glibc.malloc.hugetlb=1 makes glibc (>= 2.35) madvise(MADV_HUGEPAGE) the
  memory it maps for malloc, so every runtime that reads its weights into
  malloc'ed buffers (ONNX Runtime's prepacked MatMulNBits weights, llama.cpp
  with use_mmap off, PyTorch tensors) gets 2 MiB pages where the kernel has
  them. The benchmark gives every arm's process the same environment: like
  for like.
- `collapse_to_huge_pages(before)`: inside a process already running (the
  deploy profile's sweep, `pipeline generate`): madvise(MADV_COLLAPSE) on the
  anonymous mappings a session created (Linux >= 6.1).

`support()` says whether either can work here: the kernel's THP mode must be
`always` or `madvise` (`never` refuses both) and glibc must know the tunable.
"""

from __future__ import annotations

import ctypes
import os
import platform

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
TUNABLE = "glibc.malloc.hugetlb=1"
MIN_GLIBC = (2, 35)  # glibc.malloc.hugetlb appeared in 2.35
_MADV_HUGEPAGE, _MADV_COLLAPSE, _HUGE = 14, 25, 2 << 20


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The kernel's THP mode (the bracketed word of `always [madvise] never`), or None where unknown."""
    try:
        text = open(path).read()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def glibc_version() -> tuple[int, ...] | None:
    lib, ver = platform.libc_ver()
    if lib != "glibc" or not ver:
        return None
    try:
        return tuple(int(x) for x in ver.split("."))
    except ValueError:
        return None


def support(mode: str | None = None, glibc: tuple[int, ...] | None = None) -> tuple[bool, str]:
    """(usable, why): whether a process here can get transparent huge pages for its malloc'ed memory."""
    mode = thp_mode() if mode is None else mode
    glibc = glibc_version() if glibc is None else glibc
    if mode not in ("always", "madvise"):
        return False, (f"this host's transparent huge pages are {mode!r} ({THP_ENABLED})" if mode
                       else f"this host has no transparent huge pages ({THP_ENABLED} unreadable)")
    if glibc is None or glibc < MIN_GLIBC:
        have = ".".join(map(str, glibc)) if glibc else "no glibc"
        return False, f"{TUNABLE} needs glibc >= {'.'.join(map(str, MIN_GLIBC))} ({have} here)"
    return True, f"THP mode {mode}, glibc {'.'.join(map(str, glibc))}"


def hugetlb_env(env: dict[str, str]) -> dict[str, str]:
    """`env` plus GLIBC_TUNABLES glibc.malloc.hugetlb=1 (appended to any tunables already set)."""
    out = dict(env)
    kept = [t for t in out.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.hugetlb=")]
    out["GLIBC_TUNABLES"] = ":".join(kept + [TUNABLE])
    return out


def _maps():
    """(start, end, perms, file offset, path or None) of each of this process's mappings (Linux; none
    elsewhere), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                yield lo, hi, parts[1], int(parts[2], 16), parts[5].rstrip("\n") if len(parts) == 6 else None
    except OSError:
        return


def anon_mappings() -> dict[int, int]:
    """{start: end} of this process's private anonymous read-write mappings (Linux; {} elsewhere)."""
    return {lo: hi for lo, hi, perms, _, path in _maps()
            if path in (None, "[heap]") and perms.startswith("rw") and perms.endswith("p")}


def collapse_to_huge_pages(before: dict[int, int], min_bytes: int = 4 << 20) -> int:
    """madvise(MADV_COLLAPSE) the 2 MiB-aligned parts of anonymous mappings new or grown since `before`
    (an `anon_mappings()` taken before the runtime loaded). Returns the bytes collapsed: 0 where the
    kernel has no MADV_COLLAPSE (Linux < 6.1) or THP is off; a region the kernel refuses is skipped."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for lo, hi in anon_mappings().items():
        if before.get(lo) == hi or hi - lo < min_bytes:
            continue
        a, b = (lo + _HUGE - 1) & ~(_HUGE - 1), hi & ~(_HUGE - 1)
        if b <= a:
            continue
        libc.madvise(a, b - a, _MADV_HUGEPAGE)
        if libc.madvise(a, b - a, _MADV_COLLAPSE) == 0:
            done += b - a
    return done


def in_use() -> bool:
    """Whether this process was started with the glibc tunable (each benchmark arm's pass records it)."""
    return TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")


# --------------------------------------------------------------------------
# Mapped weights: what a session read at load and no longer needs resident
# --------------------------------------------------------------------------

# MADV_DONTNEED on a private file mapping unmaps the range's pages from this process; the file's pages stay
# in the page cache, so a page read again is a minor fault. (MADV_PAGEOUT, tried first, reclaims them from
# the cache too: every gathered embedding row was then a disk read, 12-13 major faults in the first
# 32-token prefill on Gemma 3 270M, 88 ms against 33.)
_MADV_DONTNEED = 4


def file_mappings(path) -> list[tuple[int, int, int]]:
    """(start, end, file offset) of this process's mappings of the file `path` (Linux; [] elsewhere)."""
    target = os.path.realpath(path)
    return [(lo, hi, off) for lo, hi, _, off, p in _maps() if p == target]


def page_out_file(path) -> int:
    """madvise(MADV_DONTNEED) this process's mappings of `path`, page runs that still hold the file's own
    data only; the bytes advised (0 where the file is not mapped). The pages leave this process's
    resident set, not the page cache.

    Why: ONNX Runtime maps a model's external data file and, prepacking MatMulNBits, reads those
    weights once: their file pages then count as resident although the kernels run on the prepacked
    copies. A page still in use (an embedding row a gather reads) is mapped again from the page cache
    on its next access (a minor fault), as llama.cpp's mapped weights are resident where read.
    Safe by construction: the mapping is private, and a page the process wrote to is its own
    anonymous copy, which MADV_DONTNEED would discard; /proc/self/pagemap says which pages are still
    the file's (bit 61) or absent, and only runs of those are advised."""
    maps = file_mappings(path)
    if not maps:
        return 0
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pagemap = open("/proc/self/pagemap", "rb")
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    done = 0
    with pagemap:
        for lo, hi, _ in maps:
            pagemap.seek(lo // page * 8)
            entries = memoryview(pagemap.read((hi - lo) // page * 8)).cast("Q")
            run = None  # the start of the current run of pages safe to drop
            for i in range(len(entries) + 1):
                safe = i < len(entries) and (not entries[i] >> 63 & 1 or entries[i] >> 61 & 1)
                if safe and run is None:
                    run = i
                elif not safe and run is not None:
                    a, n = lo + run * page, (i - run) * page
                    if libc.madvise(a, n, _MADV_DONTNEED) == 0:
                        done += n
                    run = None
    return done


def release_heap() -> bool:
    """glibc's malloc_trim(0): hand the heap's free pages back to the kernel; False where there is no glibc.

    Why: a batched prefill's workspace (ONNX Runtime's per-op temporaries, the fp16 attention's fp32
    copies) is freed when the run ends, but glibc raises its mmap threshold after large frees and serves
    the next ones from the heap, whose freed pages stay resident. After a 512-token prefill that kept
    ~25 MiB (a ~135M Llama shape: 239.7 MiB resident after 32 decoded tokens, 214.9 trimmed; Gemma 3
    270M ~35 MiB). llama.cpp sizes its compute buffers once; this is the equivalent for a runtime that
    allocates per run. Costs about a millisecond, after a prefill of tenths of a second."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if not _LIBC:
        return False
    _LIBC.malloc_trim(0)
    return True


_LIBC = None


def smaps_rollup_mib() -> dict[str, float]:
    """smaps_rollup fields in MiB (Rss, Anonymous, ...): resident, not allocated."""
    out: dict[str, float] = {}
    try:
        for line in open("/proc/self/smaps_rollup"):
            parts = line.split()
            if len(parts) >= 3 and parts[0].endswith(":") and parts[2] == "kB":
                out[parts[0][:-1]] = int(parts[1]) / 1024
    except OSError:
        pass
    return out
