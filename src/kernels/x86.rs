//! Plumbing shared by the x86 SIMD matmuls: the tile driver and the software prefetcher.

use super::Tile;
use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};

/// Issues a tile call's share of the next tile's prefetch, `pf_per` cache lines per kernel step.
pub(super) struct Prefetch {
    p: *const u8,
    end: *const u8,
    per: usize,
}

impl Prefetch {
    #[inline(always)]
    pub(super) fn new(t: &Tile) -> Self {
        let p = t.pf.as_ptr();
        Prefetch { p, end: p.wrapping_add(t.pf.len()), per: t.pf_per }
    }

    #[inline(always)]
    pub(super) fn step(&mut self) {
        if self.p < self.end {
            for _ in 0..self.per {
                // SAFETY: a prefetch has no architectural effect and never faults; the address is
                // within `pf` or at most `per` lines past it.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(self.p as *const i8) };
                self.p = self.p.wrapping_add(64);
            }
        }
    }
}

/// Run tile kernel `$kern` over a product: split by weight rows over threads (`for_row_chunks`),
/// walk the tiles (`for_tiles`), call the const-generic instance for each tile's shape and store
/// its results. `$xp` holds the x panels (row length `$kp`), `$accs(m, &plan)` makes a thread's
/// accumulator storage, and the list names every `(rows, x rows)` shape the plan can produce.
///
/// The caller must have checked that the CPU has `$kern`'s features.
macro_rules! drive {
    ($kern:ident, $accs:path, $xp:expr, $kp:expr, $m:expr, $w:expr, $out:expr, $split:expr, $plan:expr,
     [$(($r:literal, $c:literal)),* $(,)?]) => {{
        let (xp, kp, m, plan) = (&$xp, $kp, $m, $plan);
        let ws = $w.cols * $w.dtype.size();
        $crate::kernels::for_row_chunks($w, m, $out, $split, |wc, outs| {
            let mut accs = $accs(m, &plan);
            $crate::kernels::for_tiles(m, wc, plan, |t| {
                let (x, w, acc) = (xp[t.i * kp..].as_ptr(), wc.data[t.j * ws..].as_ptr(), &mut accs[t.g]);
                match (t.r, t.c) {
                    $(($r, $c) => {
                        // SAFETY: the CPU has the kernel's features (checked by the caller); the
                        // group's panel holds `c` rows of `kp` elements from `x`, and weight rows
                        // j..j+r of `wc` start at `w` (for_tiles stays in bounds).
                        let res = unsafe { $kern::<$r, $c>(x, w, ws, t, acc) };
                        if t.last {
                            $crate::kernels::store_tile(&res, outs, t.i, t.j, $r);
                        }
                    })*
                    _ => unreachable!("tile shape"),
                }
            })
        });
    }};
}
pub(super) use drive;
