//! How the SIMD matmuls cut their work: threads over weight-row chunks (`for_row_chunks`), tiles
//! and cache blocks within a chunk (`Plan`, `for_tiles`), activations packed into panels
//! (`pack_panels`). Safe Rust; the SIMD files supply the tile kernels.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use super::{pool, MatRef, Split};
use std::sync::Mutex;

/// Thread chunks are multiples of this many weight rows, so that every tile height the kernels use
/// (1 to 4 rows; AMX's 32, then 16) divides them.
const CHUNK_ROW_MULTIPLE: usize = 48;

/// Chunks of a matrix cut into only a few are multiples of this many rows (AMX's and every other
/// tile height but 3 divide it).
const SMALL_CHUNK_ROW_MULTIPLE: usize = 16;

/// Below this many bytes of weights (and little compute) a matmul runs on the calling thread when
/// only rayon can split it: waking rayon's pool costs ~5 µs here, which a matrix smaller than
/// ~1 MiB does not win back at m = 1 in isolation (`examples/matmul_bench.rs --small`), and in a
/// chain of small matmuls (the drafter's layers) the wake-ups cost more.
const PAR_MIN_BYTES: usize = 4 << 20;
/// ... unless it has this many multiply-adds (prefill on a small matrix is compute-bound).
const PAR_MIN_MACS: usize = 4 << 20;
/// The same two thresholds when the spinning pool (`pool`) takes the call: its helpers start
/// within a microsecond, so only matrices of a few cache lines per thread stay on one.
const POOL_MIN_BYTES: usize = 64 << 10;
const POOL_MIN_MACS: usize = 64 << 10;
/// Chunks per thread when splitting: more than one so a thread slowed by a noisy neighbour hands
/// work to the others (chunks are claimed one at a time).
const CHUNKS_PER_THREAD: usize = 8;
/// But no chunk smaller than this many bytes of weights.
const MIN_CHUNK_BYTES: usize = 64 << 10;

/// Rows per thread chunk of a matrix of `n` rows of `row_bytes` bytes and `k` columns, against `m`
/// activation rows, on `threads` threads (`pooled`: through the spinning pool), or `None` to run on
/// the calling thread.
fn chunk_rows(
    n: usize,
    row_bytes: usize,
    k: usize,
    m: usize,
    split: Split,
    threads: usize,
    pooled: bool,
) -> Option<usize> {
    let rows = match split {
        Split::Rows(r) => r.max(1),
        Split::Auto => {
            let (min_bytes, min_macs) =
                if pooled { (POOL_MIN_BYTES, POOL_MIN_MACS) } else { (PAR_MIN_BYTES, PAR_MIN_MACS) };
            let bytes = n * row_bytes;
            if threads <= 1 || (bytes < min_bytes && m.saturating_mul(n * k) < min_macs) {
                return None;
            }
            let rows = (n / (threads * CHUNKS_PER_THREAD)).max(MIN_CHUNK_BYTES / row_bytes.max(1)).max(1);
            let chunks = n.div_ceil(rows);
            if chunks > 1 && chunks < threads * CHUNKS_PER_THREAD {
                // Few chunks: as many per thread, of equal size (whole 16s), so no thread waits on
                // another's extra chunk.
                let chunks = chunks.div_ceil(threads) * threads;
                let rows = n.div_ceil(chunks).div_ceil(SMALL_CHUNK_ROW_MULTIPLE) * SMALL_CHUNK_ROW_MULTIPLE;
                return (rows < n).then_some(rows);
            }
            rows
        }
    };
    let rows = rows.div_ceil(CHUNK_ROW_MULTIPLE) * CHUNK_ROW_MULTIPLE;
    (rows < n).then_some(rows)
}

/// Run `f(w_chunk, out_chunk)` over contiguous chunks of weight rows, in parallel when worth it.
/// `out_chunk[i]` is the part of output row `i` that belongs to the chunk's weight rows. Each output
/// element is computed by exactly one call, so the result is independent of the split.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn for_row_chunks<F>(w: MatRef, m: usize, out: &mut [f32], split: Split, f: F)
where
    F: Fn(MatRef, &mut [&mut [f32]]) + Sync,
{
    let row_bytes = w.cols * w.dtype.size();
    for_row_ranges(w.rows, row_bytes, w.cols, m, out, split, |r, outs| f(w.slice_rows(r.start, r.len()), outs))
}

/// [`for_row_chunks`] for any matrix of `n` rows of `row_bytes` bytes and `k` columns: `f` gets the
/// range of weight rows of its chunk. The chunks run through `pool::for_each`: on the spinning pool
/// when it is free, on this thread inside a region, else on rayon's.
pub(crate) fn for_row_ranges<F>(n: usize, row_bytes: usize, k: usize, m: usize, out: &mut [f32], split: Split, f: F)
where
    F: Fn(std::ops::Range<usize>, &mut [&mut [f32]]) + Sync,
{
    if m == 0 || n == 0 {
        return;
    }
    let (threads, pooled) = threads_here();
    let Some(rows) = chunk_rows(n, row_bytes, k, m, split, threads, pooled) else {
        let mut outs: Vec<&mut [f32]> = out.chunks_mut(n).collect();
        f(0..n, &mut outs);
        return;
    };
    let ends = chunk_ends(n, row_bytes, rows, split, threads);
    let mut pieces: Vec<Vec<&mut [f32]>> = ends.iter().map(|_| Vec::with_capacity(m)).collect();
    for row in out.chunks_mut(n) {
        for (p, piece) in pieces.iter_mut().zip(cut_at(row, &ends)) {
            p.push(piece);
        }
    }
    // Each task takes its own piece; the locks are never contended.
    let pieces: Vec<Mutex<Vec<&mut [f32]>>> = pieces.into_iter().map(Mutex::new).collect();
    let task = |c: usize| {
        let mut outs = pieces[c].lock().unwrap_or_else(|e| e.into_inner());
        let start = if c == 0 { 0 } else { ends[c - 1] };
        f(start..ends[c], &mut outs);
    };
    pool::for_each(ends.len(), &task);
}

/// Smallest chunk of a matrix cut in decreasing sizes (`chunk_ends`), which only matrices whose equal
/// chunks would be at least twice this get: on smaller ones the extra calls cost more (the shipped
/// pair's 1.2 MB MLP matrices in 8 decreasing chunks instead of 16 equal ones: a 1-row forward 8 %
/// slower, a 5-row one 20 %).
const GUIDED_MIN_BYTES: usize = 256 << 10;

/// Whether a matrix of `n` rows of `row_bytes`, in chunks of `rows` rows from [`chunk_rows`], is cut
/// in decreasing sizes (`chunk_ends`).
fn guided(n: usize, row_bytes: usize, rows: usize, split: Split, threads: usize) -> bool {
    matches!(split, Split::Auto)
        && n.div_ceil(rows) >= threads * CHUNKS_PER_THREAD
        && rows * row_bytes >= 2 * GUIDED_MIN_BYTES
}

/// Where each chunk of `n` weight rows ends, for chunks of `rows` rows from [`chunk_rows`]. A large
/// matrix cut into many chunks (`guided`) gets them in decreasing sizes instead: each a
/// `2 × threads`-th of the rows left, down to `GUIDED_MIN_BYTES` (whole `CHUNK_ROW_MULTIPLE`s).
/// Chunks are claimed in order, so the threads run out of work within a small chunk of each other:
/// with equal chunks a thread waited for up to one sixteenth of the matrix at its end (an E2B-sized
/// head's 50 MB chunks, a few % of a decode step on two cores).
fn chunk_ends(n: usize, row_bytes: usize, rows: usize, split: Split, threads: usize) -> Vec<usize> {
    if !guided(n, row_bytes, rows, split, threads) {
        return even_ends(n, rows);
    }
    let least = (GUIDED_MIN_BYTES / row_bytes.max(1)).max(1).div_ceil(CHUNK_ROW_MULTIPLE) * CHUNK_ROW_MULTIPLE;
    let mut ends = Vec::new();
    let mut at = 0;
    while at < n {
        let size = (n - at).div_ceil(2 * threads).max(least).div_ceil(CHUNK_ROW_MULTIPLE) * CHUNK_ROW_MULTIPLE;
        at = (at + size).min(n);
        ends.push(at);
    }
    ends
}

/// The threads a product started on this thread now may use, and whether through the spinning pool.
fn threads_here() -> (usize, bool) {
    match pool::width() {
        1 if pool::in_region() => (1, false),
        1 => (rayon::current_num_threads(), false),
        w => (w, true),
    }
}

/// Whether [`for_row_ranges`], called on this thread now, would split a product of `n` weight rows of
/// `row_bytes` bytes and `k` columns against `m` activation rows over threads.
pub(crate) fn would_split(n: usize, row_bytes: usize, k: usize, m: usize) -> bool {
    let (threads, pooled) = threads_here();
    chunk_rows(n, row_bytes, k, m, Split::Auto, threads, pooled).is_some()
}

/// Where the ranges end (each range a task) for a caller that splits a product of `n` weight rows of
/// `row_bytes` bytes and `k` columns against `m` activation rows by those rows itself, or `None`
/// where [`for_row_ranges`], called on this thread now, would not split it. A matrix that
/// `for_row_ranges` cuts in decreasing sizes gets those (`chunk_ends`); a smaller one one range per
/// thread, in whole [`SMALL_CHUNK_ROW_MULTIPLE`]s, so that two threads get equal shares of
/// a drafter's 512 rows.
pub(crate) fn split_rows(n: usize, row_bytes: usize, k: usize, m: usize) -> Option<Vec<usize>> {
    let (threads, pooled) = threads_here();
    let rows = chunk_rows(n, row_bytes, k, m, Split::Auto, threads, pooled)?;
    if guided(n, row_bytes, rows, Split::Auto, threads) {
        return Some(chunk_ends(n, row_bytes, rows, Split::Auto, threads));
    }
    let rows = n.div_ceil(threads).div_ceil(SMALL_CHUNK_ROW_MULTIPLE) * SMALL_CHUNK_ROW_MULTIPLE;
    (rows < n).then(|| even_ends(n, rows))
}

/// The ends of `n` rows cut into chunks of `rows` (the last one shorter).
fn even_ends(n: usize, rows: usize) -> Vec<usize> {
    (1..=n.div_ceil(rows)).map(|c| (c * rows).min(n)).collect()
}

/// `row` cut at the increasing offsets `ends` (the last one `row.len()`): one piece per end.
pub(crate) fn cut_at<'a>(row: &'a mut [f32], ends: &'a [usize]) -> impl Iterator<Item = &'a mut [f32]> {
    let (mut rest, mut at) = (row, 0);
    ends.iter().map(move |&end| {
        let (piece, tail) = std::mem::take(&mut rest).split_at_mut(end - at);
        (rest, at) = (tail, end);
        piece
    })
}

/// x packed by [`pack_panels`]: `data()` starts on a 64-byte boundary.
pub(crate) struct Panels<T: PanelElem> {
    buf: Vec<T>,
    off: usize,
    len: usize,
    /// Padded row length.
    pub kp: usize,
}

impl<T: PanelElem> Panels<T> {
    pub fn data(&self) -> &[T] {
        &self.buf[self.off..self.off + self.len]
    }
}

/// Panel buffers up to this size go back to their thread when dropped, for the next matmul there:
/// a drafter step packs about a hundred small panels, and allocating each zeroed cost 2 % of its
/// instructions. Larger ones (prefill) are freed, so a thread never holds more than this.
const SPARE_MAX_BYTES: usize = 1 << 20;

impl<T: PanelElem> Drop for Panels<T> {
    fn drop(&mut self) {
        if self.buf.capacity() * std::mem::size_of::<T>() <= SPARE_MAX_BYTES {
            let buf = std::mem::take(&mut self.buf);
            // During thread teardown the spare may be gone already; the buffer is then just freed.
            let _ = T::spare().try_with(|s| {
                let mut s = s.borrow_mut();
                if s.capacity() < buf.capacity() {
                    *s = buf;
                }
            });
        }
    }
}

/// An element type of packed panels, with its thread's spare buffer (see `SPARE_MAX_BYTES`).
pub(crate) trait PanelElem: Copy + Default + 'static {
    fn spare() -> &'static std::thread::LocalKey<std::cell::RefCell<Vec<Self>>>;
}

macro_rules! panel_elem {
    ($($t:ty),*) => {$(
        impl PanelElem for $t {
            fn spare() -> &'static std::thread::LocalKey<std::cell::RefCell<Vec<$t>>> {
                thread_local!(static SPARE: std::cell::RefCell<Vec<$t>> = const { std::cell::RefCell::new(Vec::new()) });
                &SPARE
            }
        }
    )*};
}
panel_elem!(f32, u16);

/// Lay `x` (`[m, k]`) out as the tile kernels read it: x rows in groups of `group` (the last one may
/// be shorter), each group a panel where K step `s` holds the `step`-element slices of the group's
/// rows one after the other. A kernel then finds row `c` of its group at `panel + kk·C + c·step`:
/// constant offsets from one pointer, and one sequential stream. `convert(src, dst)` fills the
/// `step` elements of `dst` from the ≤ `step` of `src`; when `src` is short, `dst` comes zeroed and
/// only its first `src.len()` need be written (the buffer is reused, so nothing else is zero). Group
/// `g`'s panel starts at `g · group · kp`.
///
/// The panels are 64-byte aligned (with 64-byte steps, every vector load then stays within one
/// cache line): a load split over two lines costs twice, and with 8 x rows per tile that alone made
/// the kernel load-bound, depending on where `malloc` happened to put the buffer.
pub(crate) fn pack_panels<T: PanelElem>(
    x: &[f32],
    m: usize,
    k: usize,
    step: usize,
    group: usize,
    mut convert: impl FnMut(&[f32], &mut [T]),
) -> Panels<T> {
    let step = step.max(1);
    pack_panels_by_row(x, m, k, step, group, |row, panel, stride| {
        for (s, src) in row.chunks(step).enumerate() {
            let dst = &mut panel[s * stride..s * stride + step];
            if src.len() < step {
                dst.fill(T::default());
            }
            convert(src, dst);
        }
    })
}

/// [`pack_panels`] with one `convert_row(row, dst, stride)` call per x row: `dst` starts at the
/// row's first step, and step `s` goes to `dst[s · stride..][..step]`; every element of those steps
/// must be written, zeros past the row's end. A kernel whose per-step conversion cannot be inlined
/// into generic code (a `target_feature` function) packs a whole row per call this way.
pub(crate) fn pack_panels_by_row<T: PanelElem>(
    x: &[f32],
    m: usize,
    k: usize,
    step: usize,
    group: usize,
    mut convert_row: impl FnMut(&[f32], &mut [T], usize),
) -> Panels<T> {
    let (step, group) = (step.max(1), group.max(1));
    let kp = k.div_ceil(step) * step;
    let len = m * kp;
    let slack = 64 / std::mem::size_of::<T>().max(1);
    // The thread's spare buffer when there is one: every element of the panels is written below.
    let mut buf = T::spare().try_with(|s| s.take()).unwrap_or_default();
    if buf.len() < len + slack {
        buf.resize(len + slack, T::default());
    }
    let off = buf.as_ptr().align_offset(64).min(slack);
    let out = &mut buf[off..off + len];
    // With K = 0 there are no steps to convert.
    for g0 in (0..m).step_by(group).filter(|_| kp > 0) {
        let c_n = group.min(m - g0);
        let panel = &mut out[g0 * kp..(g0 + c_n) * kp];
        for c in 0..c_n {
            convert_row(&x[(g0 + c) * k..(g0 + c + 1) * k], &mut panel[c * step..], c_n * step);
        }
    }
    Panels { buf, off, len, kp }
}

/// L1 data cache per core on the x86 cores targeted before Zen 5 (48 KiB there).
pub(super) const L1_BYTES: usize = 32 << 10;
/// Half of L1 (48 KiB on Zen 5): what the blocking below lets the reused operands occupy.
pub(super) const L1_BUDGET: usize = 24 << 10;
/// Packed x bytes per cache block: a block's panels stay in L2 (1 MiB per core on Zen 5) next to
/// the weight tiles.
const X_BLOCK_BYTES: usize = 512 << 10;
/// L1 bytes for k-outer order: the x chunk, which stays, plus the chunk of the weight tile at work
/// and of the next one being prefetched, which stream through.
const K_OUTER_L1_BYTES: usize = 40 << 10;
/// Tiles per panel in k-outer order: the panel's accumulators, parked between K chunks (up to 1.5 KiB
/// a tile), stay in L2. Sweeping every tile of a large matrix per chunk instead parks megabytes of
/// accumulators in memory (the 262,144-row output head took 1.6x the time of one row at m = 5..8).
const K_OUTER_TILES: usize = 128;

/// How a SIMD matmul walks its product (see [`for_tiles`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Plan {
    /// Weight rows per tile (the last `n % rows` rows go one at a time).
    pub rows: usize,
    /// x rows per group: one register tile is `rows × group` accumulators.
    pub group: usize,
    /// x rows per cache block (a multiple of `group`).
    pub block: usize,
    /// K elements per chunk (all of K when there is nothing to reuse across chunks).
    pub kc: usize,
    /// K elements per kernel step.
    pub step: usize,
    /// Chunks outside tiles: see [`for_tiles`].
    pub k_outer: bool,
}

impl Plan {
    /// The plan for `m` x rows of `k` elements (`x_bytes` each once packed) against weights of
    /// `w_bytes` per element, with register tiles of `rows × group` and a kernel step of `step`.
    pub fn new(m: usize, k: usize, rows: usize, group: usize, step: usize, x_bytes: usize, w_bytes: usize) -> Plan {
        let (rows, group, step) = (rows.max(1), group.max(1), step.max(1));
        let kp = k.div_ceil(step) * step;
        // x rows per block: their panels stay in L2 next to the weight tile. Never fewer than 16
        // (decode and verification stream each weight from memory exactly once) and whole groups
        // (groups never straddle blocks, matching `pack_panels`).
        let block = (X_BLOCK_BYTES / (kp * x_bytes).max(1)).max(16) / group * group;
        let single = m <= group;
        let x_panel = group * kp * x_bytes;
        // One group whose x panel does not fit L1 and is re-read for every tile (at least as many
        // x bytes as weight bytes): chunk K so that the x chunk stays in L1 next to the weight
        // chunks streaming through, and sweep all the tiles per chunk. On Zen 5 with K = 6144 that
        // takes m = 5..12 from 1.5-2x the time of m = 1 to 1.1-1.5x.
        let kc_x = K_OUTER_L1_BYTES / (group * x_bytes + 2 * rows * w_bytes);
        let (kc, k_outer) =
            if single && x_panel > L1_BUDGET && rows >= 2 && group * x_bytes >= rows * w_bytes && kp > kc_x {
                (kc_x, true)
            } else if single {
                (kp, false)
            } else {
                // Several groups share each tile: its chunk, plus the x chunks of the group at work
                // and the next, should fit.
                (L1_BUDGET / (2 * group * x_bytes + rows * w_bytes), false)
            };
        let kc = (kc / step).max(1) * step;
        Plan { rows, group, block: block.max(group), kc, step, k_outer }
    }

    /// The same tiles over all of K in one pass per tile (no K chunks, no k-outer order): for a
    /// single group whose x panel fits L1 itself, though not within [`L1_BUDGET`].
    pub fn whole_k(self, k: usize) -> Plan {
        Plan { kc: k.div_ceil(self.step) * self.step, k_outer: false, ..self }
    }

    /// Accumulator sets a thread needs for `n` weight rows.
    pub fn acc_slots(&self, m: usize, n: usize) -> usize {
        if self.k_outer {
            // A panel's tiles; the last panel may end in up to rows - 1 one-row tiles.
            if n > K_OUTER_TILES * self.rows {
                K_OUTER_TILES + self.rows
            } else {
                n / self.rows + n % self.rows
            }
        } else {
            m.min(self.block).div_ceil(self.group)
        }
    }
}

/// One call of a tile kernel (see [`for_tiles`]).
pub(crate) struct Tile<'w> {
    /// x rows `i..i+c`.
    pub i: usize,
    pub c: usize,
    /// Weight rows `j..j+r`.
    pub j: usize,
    pub r: usize,
    /// Which accumulator set to use.
    pub slot: usize,
    /// K range of this call; all but the last chunk are whole kernel steps.
    pub k0: usize,
    pub k1: usize,
    /// First call for these accumulators (start from zero) / last one (reduce and store).
    pub first: bool,
    pub last: bool,
    /// What to prefetch during the call.
    pub pf: Pf<'w>,
}

/// A strided byte range to prefetch: `rows` pieces of `piece` bytes, `stride` apart, from the
/// start of `span`; `per` cache lines per kernel step.
#[derive(Clone, Copy)]
pub(crate) struct Pf<'w> {
    pub span: &'w [u8],
    pub piece: usize,
    pub stride: usize,
    pub rows: usize,
    pub per: usize,
}

impl Pf<'_> {
    const NONE: Pf<'static> = Pf { span: &[], piece: 0, stride: 0, rows: 0, per: 0 };
}

impl Tile<'static> {
    /// A call over all of K for `c` x rows from row 0 and `r` weight rows from `j`, without prefetch:
    /// for kernels that walk a small matrix's tiles themselves (the AVX2 `short_tiles` path).
    pub fn whole(c: usize, j: usize, r: usize, k: usize) -> Tile<'static> {
        Tile { i: 0, c, j, r, slot: 0, k0: 0, k1: k, first: true, last: true, pf: Pf::NONE }
    }
}

/// Walk the tiles of an `[m, k] · [n, k]ᵀ` product in cache-friendly order. By default:
///
/// - x rows in blocks of `plan.block` rows (sized for L2) — one block when m ≤ 16;
/// - per block, tiles of `plan.rows` weight rows: each tile is read from memory once per block;
/// - per tile, K in about equal chunks of at most `plan.kc`;
/// - per chunk, every group of ≤ `plan.group` x rows, so the tile's chunk is reused from L1.
///
/// Decode and verification sizes are planned as a single group, so the weights stream past exactly
/// once with all the compute riding on that stream. (With several groups, the passes after the first
/// hit only L1 and their compute adds to the memory time instead of hiding under it.) When that
/// single group's x panel is too big for L1 (`plan.k_outer`), the chunk loop goes outside the tile
/// loop instead, so the x chunk stays in L1 while every tile's chunk streams past once.
///
/// Each call prefetches a share of the next tile (of the same chunk), split evenly over the calls
/// on this one: a steady stream of DRAM reads ahead of the demand loads, which the hardware
/// prefetchers alone do not keep up once there are a few x rows of work per weight byte.
pub(crate) fn for_tiles<'w>(m: usize, w: MatRef<'w>, plan: Plan, mut f: impl FnMut(&Tile<'w>)) {
    let (n, k, size) = (w.rows, w.cols, w.dtype.size());
    let row_bytes = k * size;
    let (rows, group, step) = (plan.rows.max(1), plan.group.max(1), plan.step.max(1));
    // K in chunks of at most `kc_max`, about equal, whole steps (but the last): (chunk, count).
    let split_k = |kc_max: usize| {
        let kc = k.div_ceil(k.div_ceil(kc_max.max(step)).max(1)).div_ceil(step).max(1) * step;
        (kc, k.div_ceil(kc).max(1))
    };
    // Prefetch of weight rows `j..j+rows`, K range `k0..k1` (k-outer order: one call per tile and
    // chunk, so no share to split).
    let prefetch = |j: usize, k0: usize, k1: usize, steps: usize| -> Pf<'w> {
        if j + rows > n || k1 <= k0 {
            return Pf::NONE;
        }
        let piece = (k1 - k0) * size;
        let span = &w.data[j * row_bytes + k0 * size..(j + rows - 1) * row_bytes + k1 * size];
        Pf { span, piece, stride: row_bytes, rows, per: (rows * piece.div_ceil(64)).div_ceil(steps.max(1)) }
    };
    if plan.k_outer {
        let (kc, chunks) = split_k(plan.kc);
        let panel = K_OUTER_TILES * rows;
        for p0 in (0..n).step_by(panel) {
            let p1 = n.min(p0 + panel);
            for ch in 0..chunks {
                let (k0, k1) = (ch * kc, k.min((ch + 1) * kc));
                let (mut j, mut slot) = (p0, 0);
                while j < p1 {
                    let r = if p1 - j >= rows { rows } else { 1 };
                    let pf = if r == rows { prefetch(j + rows, k0, k1, (k1 - k0).div_ceil(step)) } else { Pf::NONE };
                    f(&Tile { i: 0, c: m, j, r, slot, k0, k1, first: ch == 0, last: ch + 1 == chunks, pf });
                    j += r;
                    slot += 1;
                }
            }
        }
        return;
    }
    let block = plan.block.max(group);
    for i0 in (0..m).step_by(block) {
        let i1 = m.min(i0 + block);
        let groups = (i1 - i0).div_ceil(group);
        let (kc, chunks) = if groups == 1 { (k, 1) } else { split_k(plan.kc) };
        // Steps of the shortest call, so every call finishes its share of the prefetch.
        let steps = (k - (chunks - 1) * kc).div_ceil(step).max(1);
        // Each call's share of the next tile's whole rows (the same for every tile), worked out once:
        // a tile of a drafter's matrix is a few kernel steps, and the divisions cost as much.
        let shares = Shares::new(rows * row_bytes, groups * chunks, steps);
        let mut j = 0;
        while j < n {
            let r = if n - j >= rows { rows } else { 1 };
            // The next tile's rows, if it is a whole one.
            let next = w.data.get((j + rows) * row_bytes..(j + 2 * rows) * row_bytes).filter(|_| r == rows);
            let mut call = 0;
            for ch in 0..chunks {
                let (k0, k1) = (ch * kc, k.min((ch + 1) * kc));
                for g in 0..groups {
                    let i = i0 + g * group;
                    let pf = match next {
                        Some(all) => {
                            let (at, len, per) = shares.get(call);
                            Pf { span: &all[at..at + len], piece: len, stride: 0, rows: 1, per }
                        }
                        None => Pf::NONE,
                    };
                    f(&Tile {
                        i,
                        c: group.min(i1 - i),
                        j,
                        r,
                        slot: g,
                        k0,
                        k1,
                        first: ch == 0,
                        last: ch + 1 == chunks,
                        pf,
                    });
                    call += 1;
                }
            }
            j += r;
        }
    }
}

/// Where each of `parts` calls finds its share of a `bytes`-long prefetch, in whole cache lines.
#[derive(Clone, Copy)]
struct Shares {
    bytes: usize,
    /// Bytes per share (whole lines), and lines per kernel step for a whole share.
    share: usize,
    per: usize,
    /// Lines per step for the one share cut short by the end of the range, if any.
    per_short: usize,
}

impl Shares {
    /// Not inlined: inlined, the compiler recomputed `share`'s divisions at every `get`.
    #[inline(never)]
    fn new(bytes: usize, parts: usize, steps: usize) -> Shares {
        let (share, steps) = (bytes.div_ceil(64).div_ceil(parts.max(1)) * 64, steps.max(1));
        let short = if share == 0 { 0 } else { bytes % share };
        Shares { bytes, share, per: (share / 64).div_ceil(steps), per_short: short.div_ceil(64).div_ceil(steps) }
    }

    /// Call `p`'s share: offset, length, and the lines to issue per kernel step so that a call of
    /// `steps` steps covers it. No division: this runs once per tile call, and on Zen 3 the divisions
    /// it used to do for a short share (which the compiler hoisted onto every call) drew about 1 % of a
    /// 5-row forward's `perf` samples.
    #[inline]
    fn get(&self, p: usize) -> (usize, usize, usize) {
        let (a, b) = ((p * self.share).min(self.bytes), ((p + 1) * self.share).min(self.bytes));
        let per = if b - a == self.share {
            self.per
        } else if b > a {
            self.per_short
        } else {
            0
        };
        (a, b - a, per)
    }
}

/// Store the `c × r` results of one tile into the per-row output slices.
#[inline(always)]
pub(crate) fn store_tile<const C: usize>(res: &[[f32; 4]; C], out: &mut [&mut [f32]], i: usize, j: usize, r: usize) {
    for (c, v) in res.iter().enumerate() {
        out[i + c][j..j + r].copy_from_slice(&v[..r]);
    }
}

#[cfg(test)]
mod tests {
    use super::{chunk_ends, chunk_rows, guided, pack_panels, Shares, Split};
    use super::{CHUNK_ROW_MULTIPLE, GUIDED_MIN_BYTES, SMALL_CHUNK_ROW_MULTIPLE};

    #[test]
    fn reused_panel_buffers_are_padded_with_zeros() {
        // A panel buffer goes back to its thread and is reused: what a wider x left in it must not
        // show in a narrower x's padding (NaN there would poison the zero weights it meets).
        let copy = |src: &[f32], dst: &mut [f32]| dst[..src.len()].copy_from_slice(src);
        drop(pack_panels(&[f32::NAN; 3 * 32], 3, 32, 8, 2, copy));
        let x: Vec<f32> = (0..3 * 13).map(|i| i as f32).collect();
        let p = pack_panels(&x, 3, 13, 8, 2, copy);
        assert_eq!(p.kp, 16);
        // Group 0 (rows 0, 1) then group 1 (row 2); each step holds 8 elements of each row in turn.
        let mut want = Vec::new();
        for (g0, c_n) in [(0, 2), (2, 1)] {
            for s in 0..2 {
                for c in 0..c_n {
                    want.extend((0..8).map(|e| if s * 8 + e < 13 { x[(g0 + c) * 13 + s * 8 + e] } else { 0.0 }));
                }
            }
        }
        assert_eq!(
            p.data().iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn prefetch_shares_cover_the_range_once_in_whole_lines() {
        for bytes in [0, 64, 100, 3072, 12288, 12290] {
            for parts in [1, 2, 3, 7, 300] {
                for steps in [1, 8, 96] {
                    let shares = Shares::new(bytes, parts, steps);
                    let mut at = 0;
                    for (a, len, per) in (0..parts).map(|p| shares.get(p)) {
                        assert_eq!(a, at, "{bytes} {parts} {steps}");
                        assert!(a % 64 == 0 || len == 0);
                        assert!(per * steps * 64 >= len, "{bytes} {parts} {steps}: {per} lines a step");
                        at += len;
                    }
                    assert_eq!(at, bytes);
                }
            }
        }
    }

    #[test]
    fn chunks_cover_the_rows_once_in_whole_tiles_and_shrink_when_many() {
        // (rows, bytes a row): an E2B-sized head and MLP, the shipped pair's MLP, a drafter's,
        // an odd count.
        for (n, row_bytes) in [(262_144, 3072), (6144, 3072), (1536, 768), (512, 256), (1031, 5200), (100, 64)] {
            for threads in [2, 3, 8] {
                let Some(rows) = chunk_rows(n, row_bytes, row_bytes / 2, 1, Split::Auto, threads, true) else {
                    continue;
                };
                let ends = chunk_ends(n, row_bytes, rows, Split::Auto, threads);
                assert_eq!(ends.last(), Some(&n), "{n} rows");
                let sizes: Vec<usize> = ends.iter().scan(0, |at, &e| Some(e - std::mem::replace(at, e))).collect();
                assert!(sizes.iter().all(|&s| s > 0));
                for (i, &s) in sizes[..sizes.len() - 1].iter().enumerate() {
                    assert_eq!(s % SMALL_CHUNK_ROW_MULTIPLE, 0, "{n} rows, chunk {i}: {s}");
                }
                if guided(n, row_bytes, rows, Split::Auto, threads) {
                    // Decreasing, the last one no bigger than GUIDED_MIN_BYTES (or a tile's rows).
                    assert!(sizes.windows(2).all(|w| w[0] >= w[1]), "{sizes:?}");
                    let last = sizes[sizes.len() - 1] * row_bytes;
                    assert!(last <= 2 * GUIDED_MIN_BYTES.max(CHUNK_ROW_MULTIPLE * row_bytes), "{sizes:?}");
                    assert!(sizes[0] <= n.div_ceil(2 * threads) + CHUNK_ROW_MULTIPLE);
                } else {
                    assert!(sizes[..sizes.len() - 1].iter().all(|&s| s == rows));
                }
            }
        }
    }
}
