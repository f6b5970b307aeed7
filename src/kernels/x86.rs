//! Plumbing shared by the x86 SIMD matmuls: the tile driver, the software prefetcher, and the
//! one-row short path's rules (`short_rows`, `check_gather`, `split_gather`).

use super::tiling::{for_row_ranges, Tile};
use super::{DType, MatRef, Split};
use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::thread::LocalKey;

/// Accumulator sets of one matmul chunk's tiles (parked between K chunks), borrowed from the
/// thread's previous ones and given back when dropped. Allocating them per chunk, 32- or 64-byte
/// aligned and zeroed, was about 330 aligned allocations and clears in each one-row forward of the
/// shipped target. A slot is always written (on its tile's first K chunk) before it is read, so a
/// reused buffer needs no clearing; new slots start as zeros.
pub(super) struct Accs<T: 'static> {
    buf: Vec<T>,
    home: &'static LocalKey<Cell<Vec<T>>>,
}

/// Accumulator buffers up to this size go back to their thread.
const ACCS_KEEP_BYTES: usize = 1 << 20;

impl<T: Copy + 'static> Accs<T> {
    /// At least `n` sets; `zero` fills the ones the thread's buffer lacks.
    pub(super) fn take(home: &'static LocalKey<Cell<Vec<T>>>, n: usize, zero: T) -> Self {
        // During thread teardown the buffer may be gone: a fresh one then.
        let mut buf = home.try_with(|c| c.take()).unwrap_or_default();
        if buf.len() < n {
            buf.resize(n, zero);
        }
        Accs { buf, home }
    }
}

impl<T> Deref for Accs<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf
    }
}

impl<T> DerefMut for Accs<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf
    }
}

impl<T: 'static> Drop for Accs<T> {
    fn drop(&mut self) {
        if self.buf.len() * std::mem::size_of::<T>() > ACCS_KEEP_BYTES {
            return;
        }
        let buf = std::mem::take(&mut self.buf);
        // A nested call on this thread may have given a buffer back meanwhile: keep the larger.
        let _ = self.home.try_with(|c| {
            let other = c.take();
            c.set(if other.len() > buf.len() { other } else { buf });
        });
    }
}

/// Whether this is an AMD Zen 4 core (family 0x19 with AVX-512), where one activation row reads
/// weights fastest one weight row at a time, a single stream per core (docs/numerics.md, "One-row
/// bf16 products on Zen 4"; docs/quantization.md, "One quantized row on Zen 4"). Detected once.
pub(super) fn zen4() -> bool {
    use std::arch::x86_64::__cpuid;
    static ZEN4: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ZEN4.get_or_init(|| {
        let (vendor, sig) = (__cpuid(0), __cpuid(1).eax);
        let amd = (vendor.ebx, vendor.edx, vendor.ecx) == (0x6874_7541, 0x6974_6e65, 0x444d_4163);
        // Family as cpuid reports it: the base field, plus the extended one when the base is 0xf.
        let base = (sig >> 8) & 0xf;
        let family = if base == 0xf { base + ((sig >> 20) & 0xff) } else { base };
        amd && family == 0x19
    })
}

/// One activation row against a small bf16 matrix with short rows (a drafter's: K of 128-512, at most
/// 256 KiB) goes through a kernel's `dot_rows` rather than the tile driver: with a few kernel steps
/// per tile, the driver's work per tile (accumulator set-up, prefetch plan, stores) costs as much as
/// the steps. Larger matrices keep the driver, whose prefetching streams them from memory.
pub(super) fn short_rows(m: usize, w: &MatRef) -> bool {
    const SHORT_K: usize = 512;
    const SHORT_BYTES: usize = 256 << 10;
    m == 1 && w.dtype == DType::BF16 && w.cols <= SHORT_K && w.data.len() <= SHORT_BYTES
}

/// `dot_rows`' prefetch, before the group of four rows from `i0` (of `n`): the four rows eight
/// further on, `row_bytes` each, found by `row`.
#[inline(always)]
pub(super) fn prefetch_rows_ahead(i0: usize, n: usize, row_bytes: usize, row: &impl Fn(usize) -> *const u8) {
    const AHEAD: usize = 8;
    for ahead in (i0 + AHEAD..n).take(4) {
        let (mut p, end) = (row(ahead), row(ahead).wrapping_add(row_bytes));
        // A plain pointer loop: `step_by` took several instructions more per line.
        while p < end {
            // SAFETY: a prefetch has no architectural effect and never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) };
            p = p.wrapping_add(64);
        }
    }
}

/// The shapes a `gather` needs: one x row of `w.cols`, one output per id, every id a row of `w`.
pub(super) fn check_gather(x: &[f32], w: &MatRef, ids: &[u32], out: &[f32]) {
    assert_eq!(w.dtype, DType::BF16);
    assert!(x.len() == w.cols && ids.len() == out.len(), "gather shapes");
    assert!(ids.iter().all(|&id| (id as usize) < w.rows), "gather: a row id past the matrix");
}

/// A gather's candidates in contiguous runs of ids, over the pool as a matmul's rows are split
/// (`for_row_ranges`): `dot(ids, out)` for each run. An E2B-sized drafter's centroid head reads 4,096
/// scattered rows (2 MB) per sequence and draft step; on Zen 3, two threads cut a four-sequence E2B
/// draft step by 15-35 %. Under `SPLIT_MIN_BYTES` (the shipped drafter's 512 rows, 384 KB) `Split::Auto`
/// stays on the calling thread: split, it was no faster there. Each row is one `dot_rows` result
/// either way, so the bits are the same.
pub(super) fn split_gather(
    w: &MatRef,
    ids: &[u32],
    out: &mut [f32],
    split: Split,
    dot: impl Fn(&[u32], &mut [f32]) + Sync,
) {
    const SPLIT_MIN_BYTES: usize = 1 << 20;
    let row_bytes = w.cols * 2;
    if matches!(split, Split::Auto) && ids.len() * row_bytes < SPLIT_MIN_BYTES {
        return dot(ids, out);
    }
    for_row_ranges(ids.len(), row_bytes, w.cols, 1, out, split, |r, outs| dot(&ids[r], &mut *outs[0]));
}

/// The body of a kernel's `gather` (the caller has checked the CPU's features): check the shapes,
/// pack x as `$pack_row` does for `$dot_rows`, and run `$dot_rows` over runs of ids (`split_gather`).
macro_rules! gather {
    ($pack_row:ident, $dot_rows:ident, $x:expr, $w:expr, $ids:expr, $out:expr, $split:expr) => {{
        let (x, w, ids, out): (&[f32], MatRef, &[u32], &mut [f32]) = ($x, $w, $ids, $out);
        $crate::kernels::x86::check_gather(x, &w, ids, out);
        let xp = $pack_row(x, w.cols);
        let (xs, k, data) = (xp.data(), w.cols, w.data);
        $crate::kernels::x86::split_gather(&w, ids, out, $split, |ids, out| {
            let base = data.as_ptr();
            // SAFETY: the CPU has the kernel's features (checked by the caller); `xs` holds x rounded
            // up to whole steps, and every id is a row of `w` (checked above).
            unsafe { $dot_rows(xs.as_ptr(), k, ids.len(), |i| base.add(ids[i] as usize * k * 2), out) }
        });
    }};
}
pub(super) use gather;

/// Issues a tile call's share of the next tile's prefetch (a `Pf`), `per` cache lines per
/// kernel step.
pub(super) struct Prefetch {
    /// Start of the current piece, offset within it, and the pieces left after it. A single piece
    /// (whole weight rows, one contiguous range: every call at decode sizes) takes the short path in
    /// `step`, a pointer running to `end`.
    row: *const u8,
    off: usize,
    rows_left: usize,
    piece: usize,
    stride: usize,
    per: usize,
    end: *const u8,
}

impl Prefetch {
    #[inline(always)]
    pub(super) fn new(t: &Tile) -> Self {
        let pf = t.pf;
        let rows_left = if pf.piece == 0 { 0 } else { pf.rows };
        let row = pf.span.as_ptr();
        let end = if rows_left == 1 { row.wrapping_add(pf.piece) } else { row };
        Prefetch { row, off: 0, rows_left, piece: pf.piece, stride: pf.stride, per: pf.per, end }
    }

    #[inline(always)]
    pub(super) fn step(&mut self) {
        if self.rows_left == 1 {
            let mut n = self.per;
            while n > 0 && self.row < self.end {
                // SAFETY: a prefetch has no architectural effect and never faults; the address is
                // inside the `Pf`'s span anyway.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(self.row as *const i8) };
                self.row = self.row.wrapping_add(64);
                n -= 1;
            }
            return;
        }
        for _ in 0..self.per {
            if self.rows_left == 0 {
                return;
            }
            // SAFETY: as above.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(self.row.wrapping_add(self.off) as *const i8) };
            self.off += 64;
            if self.off >= self.piece {
                self.off = 0;
                self.row = self.row.wrapping_add(self.stride);
                self.rows_left -= 1;
            }
        }
    }
}

/// Run tile kernel `$kern` over a product: split by weight rows over threads (`for_row_chunks`),
/// walk the tiles (`for_tiles`), call the const-generic instance for each tile's shape and store
/// its results. `$xp` holds the x `Panels`, `$accs(n)` makes `n` accumulator
/// sets, and the list names every `(rows, x rows)` shape the plan can produce.
///
/// The caller must have checked that the CPU has `$kern`'s features.
macro_rules! drive {
    ($kern:ident, $accs:path, $xp:expr, $m:expr, $w:expr, $out:expr, $split:expr, $plan:expr,
     [$(($r:literal, $c:literal)),* $(,)?]) => {{
        let (xp, kp, m, plan) = ($xp.data(), $xp.kp, $m, $plan);
        let ws = $w.cols * $w.dtype.size();
        $crate::kernels::tiling::for_row_chunks($w, m, $out, $split, |wc, outs| {
            let mut accs = $accs(plan.acc_slots(m, wc.rows));
            $crate::kernels::tiling::for_tiles(m, wc, plan, |t| {
                let (x, w, acc) = (xp[t.i * kp..].as_ptr(), wc.data[t.j * ws..].as_ptr(), &mut accs[t.slot]);
                match (t.r, t.c) {
                    $(($r, $c) => {
                        // SAFETY: the CPU has the kernel's features (checked by the caller); the
                        // group's panel holds `c` rows of `kp` elements from `x`, and weight rows
                        // j..j+r of `wc` start at `w` (for_tiles stays in bounds).
                        let res = unsafe { $kern::<$r, $c>(x, w, ws, t, acc) };
                        if t.last {
                            $crate::kernels::tiling::store_tile(&res, outs, t.i, t.j, $r);
                        }
                    })*
                    _ => unreachable!("tile shape"),
                }
            })
        });
    }};
}
pub(super) use drive;
