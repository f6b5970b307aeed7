//! Every SIMD path this CPU can run against the scalar reference.

use super::*;

/// splitmix64: small, seeded, good enough for test data.
pub(super) struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32() * scale).collect()
    }
}

pub(super) fn simd_isas() -> Vec<Isa> {
    Isa::available().into_iter().filter(|&i| i != Isa::Scalar).collect()
}

/// A weight matrix stored 2 bytes past a 4-byte boundary, as a memory-mapped tensor can be.
struct Weights {
    buf: Vec<u8>,
    off: usize,
    dtype: DType,
    rows: usize,
    cols: usize,
}

impl Weights {
    fn new(dtype: DType, rows: usize, cols: usize, vals: &[f32]) -> Self {
        let mut bytes = Vec::with_capacity(vals.len() * dtype.size());
        for &v in vals {
            match dtype {
                DType::F32 => bytes.extend_from_slice(&v.to_le_bytes()),
                DType::BF16 => bytes.extend_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes()),
                DType::F16 => bytes.extend_from_slice(&f16::from_f32(v).to_bits().to_le_bytes()),
            }
        }
        let mut buf = vec![0u8; bytes.len() + 8];
        let off = (0..4).find(|o| (buf.as_ptr() as usize + o) % 4 == 2).unwrap_or(2);
        buf[off..off + bytes.len()].copy_from_slice(&bytes);
        Weights { buf, off, dtype, rows, cols }
    }
    fn random(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Self {
        Self::new(dtype, rows, cols, &rng.vec(rows * cols, 1.0))
    }
    fn mat(&self) -> MatRef<'_> {
        let len = self.rows * self.cols * self.dtype.size();
        MatRef::new(self.dtype, self.rows, self.cols, &self.buf[self.off..self.off + len])
    }
}

/// Σ_k |x·w| per output: the scale of the rounding error of any summation order.
fn abs_scale(x: &[f32], m: usize, w: MatRef) -> Vec<f32> {
    let absx: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    let mut wa = vec![0f32; w.rows * w.cols];
    for j in 0..w.rows {
        w.row_f32(j, &mut wa[j * w.cols..(j + 1) * w.cols]);
    }
    let wa: Vec<u8> = wa.iter().flat_map(|v| v.abs().to_le_bytes()).collect();
    let mut out = vec![0f32; m * w.rows];
    scalar::matmul(&absx, m, MatRef::new(DType::F32, w.rows, w.cols, &wa), &mut out);
    out
}

fn check_matmul(isa: Isa, rng: &mut Rng, dtype: DType, rows: usize, cols: usize, m: usize) {
    let w = Weights::random(rng, dtype, rows, cols);
    let x = rng.vec(m * cols, 2.0);
    let mut want = vec![0f32; m * rows];
    scalar::matmul(&x, m, w.mat(), &mut want);
    let mut got = vec![f32::NAN; m * rows];
    matmul_with(isa, &x, m, w.mat(), &mut got);
    let scale = abs_scale(&x, m, w.mat());
    let tol = 2e-6 * (cols as f32).sqrt().max(1.0);
    for (e, ((g, v), s)) in got.iter().zip(&want).zip(&scale).enumerate() {
        assert!(
            (g - v).abs() <= tol * s + 1e-30,
            "{isa} {dtype:?} [{rows}x{cols}] m={m}: out[{}, {}] = {g}, scalar {v} (Σ|xw| = {s})",
            e / rows,
            e % rows
        );
    }
}

#[test]
fn matmul_matches_scalar_on_odd_shapes() {
    let mut rng = Rng(1);
    for isa in simd_isas() {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for rows in [1, 3, 4, 5, 17] {
                for cols in [1, 7, 8, 16, 31, 33, 64, 100] {
                    for m in (1..=17).chain([24, 33]) {
                        check_matmul(isa, &mut rng, dtype, rows, cols, m);
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_matches_scalar_on_larger_shapes() {
    let mut rng = Rng(2);
    for isa in simd_isas() {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            // Long rows (several vectors plus a tail), more rows than one thread chunk.
            check_matmul(isa, &mut rng, dtype, 203, 1000, 5);
            // Rows this long make the activation block smaller than m: several x blocks.
            check_matmul(isa, &mut rng, dtype, 9, 9001, 37);
            // One group whose x panel overflows L1: K chunks outside the tile loop.
            check_matmul(isa, &mut rng, dtype, 29, 5003, 8);
            check_matmul(isa, &mut rng, dtype, 7, 4100, 6);
            check_matmul(isa, &mut rng, dtype, 11, 3000, 12);
            check_matmul(isa, &mut rng, dtype, 6, 7000, 4);
            check_matmul(isa, &mut rng, dtype, 5, 9000, 5);
            // ... over more weight rows than one panel of tiles holds (and a tail).
            check_matmul(isa, &mut rng, dtype, 1031, 2600, 5);
        }
    }
}

#[test]
fn matmul_empty_shapes() {
    for isa in Isa::available() {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            // cols = 0: every output is an empty sum.
            let w = Weights::new(dtype, 3, 0, &[]);
            let mut out = vec![f32::NAN; 6];
            matmul_with(isa, &[], 2, w.mat(), &mut out);
            assert!(out.iter().all(|&v| v == 0.0), "{isa} {dtype:?}");
            // rows = 0 or m = 0: nothing to do.
            let w = Weights::new(dtype, 0, 5, &[]);
            matmul_with(isa, &[0.0; 10], 2, w.mat(), &mut []);
            let w = Weights::new(dtype, 2, 5, &[0.5; 10]);
            matmul_with(isa, &[], 0, w.mat(), &mut []);
        }
    }
}

/// With an identity bf16 matrix the product is exact, so this checks that every path rounds the
/// activations to bf16 exactly as the reference does (ties to even included).
#[test]
fn matmul_bf16_rounds_activations_like_reference() {
    let k = 77;
    let mut eye = vec![0f32; k * k];
    for j in 0..k {
        eye[j * k + j] = 1.0;
    }
    let w = Weights::new(DType::BF16, k, k, &eye);
    let mut rng = Rng(3);
    let mut x = rng.vec(2 * k, 3.0);
    // Exact ties: halfway between two bf16 values, even and odd low mantissa bit.
    x[0] = f32::from_bits(0x3f80_8000);
    x[1] = f32::from_bits(0x3f81_8000);
    x[2] = f32::from_bits(0xbf80_8000);
    for isa in Isa::available() {
        let mut got = vec![0f32; 2 * k];
        matmul_with(isa, &x, 2, w.mat(), &mut got);
        for (g, v) in got.iter().zip(&x) {
            assert_eq!(g.to_bits(), DType::BF16.round(*v).to_bits(), "{isa}: {v}");
        }
    }
}

/// Each output element is computed by one thread in a fixed order: the split and the pool size must
/// not change a single bit, and neither may the number of activation rows (batch invariance).
#[test]
fn matmul_is_bit_exact_across_threads_and_batch() {
    let mut rng = Rng(4);
    let pool1 = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let pool3 = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for isa in simd_isas() {
        for (dtype, rows, cols) in [
            (DType::BF16, 203, 77),
            // A drafter's shape: one row goes through `dot_rows`, more through the tiles.
            (DType::BF16, 97, 128),
            (DType::F16, 203, 77),
            (DType::F32, 203, 77),
            // m = 5 over all of K in one AVX2 tile (the x panel just fits L1), with a K tail.
            (DType::BF16, 101, 1530),
            (DType::F16, 101, 1530),
            (DType::BF16, 31, 3001),
            (DType::F32, 31, 3001),
            (DType::BF16, 800, 2600),
        ] {
            let w = Weights::random(&mut rng, dtype, rows, cols);
            // 40: more rows than the AMX kernel's two tiles of activations (16 each) take at once; 18
            // and 40 are cut into equal groups there (9 + 9, 14 + 14 + 12); from 6 rows its tiles are
            // written out transposed.
            for m in [1, 3, 5, 8, 9, 16, 18, 40] {
                let x = rng.vec(m * cols, 1.0);
                let run = |split: Split| {
                    let mut out = vec![0f32; m * rows];
                    matmul_split(isa, &x, m, w.mat(), &mut out, split);
                    out
                };
                let inline = run(Split::Auto);
                let one = pool1.install(|| run(Split::Rows(8)));
                let three = pool3.install(|| run(Split::Rows(8)));
                // Chunks are whole multiples of 48 rows: 96 is a second split.
                let odd = pool3.install(|| run(Split::Rows(60)));
                // From this (non-rayon) thread the chunks go to the spinning pool when it is free.
                let spun = run(Split::Rows(8));
                for (name, other) in
                    [("1 thread", &one), ("3 threads", &three), ("chunks of 96", &odd), ("spinning pool", &spun)]
                {
                    assert!(
                        inline.iter().zip(other).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{isa} {dtype:?} m={m}: {name}"
                    );
                }
                for i in 0..m {
                    let mut single = vec![0f32; rows];
                    matmul_with(isa, &x[i * cols..(i + 1) * cols], 1, w.mat(), &mut single);
                    let row = &inline[i * rows..(i + 1) * rows];
                    assert!(
                        row.iter().zip(&single).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{isa} {dtype:?} m={m} row {i}: batch variance"
                    );
                }
            }
        }
    }
}

/// The kernels that read a weight row at a time (what Zen 4 runs, see `streams_rows`,
/// `streams_many` and `streams_long`), for one row and for a few, give every row the bits the tile kernel gives it in a
/// batch, on any split, on every CPU that can run them.
#[cfg(target_arch = "x86_64")]
#[test]
fn streamed_rows_have_the_bits_of_the_tiles() {
    if !avx512bf16::supported() {
        return;
    }
    let mut rng = Rng(12);
    let pool3 = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    let splits = [("inline", Split::Auto), ("chunks of 8", Split::Rows(8)), ("chunks of 60", Split::Rows(60))];
    let same = |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits());
    for (rows, cols) in
        [(203, 77), (97, 128), (101, 1530), (31, 3001), (800, 2600), (64, 32), (5, 31), (700, 384), (90, 12_300)]
    {
        let w = Weights::random(&mut rng, DType::BF16, rows, cols);
        let m = 16;
        let x = rng.vec(m * cols, 1.0);
        let mut tiled = vec![0f32; m * rows];
        avx512bf16::tiled(&x, m, w.mat(), &mut tiled, Split::Auto);
        // With and without the software prefetch (a small model's step fits the cache; a large one's
        // does not): prefetches never change a result.
        for step_bytes in [0, usize::MAX] {
            super::note_step_bytes(step_bytes);
            for i in 0..8 {
                let xi = &x[i * cols..(i + 1) * cols];
                for (name, split) in splits {
                    let mut got = vec![f32::NAN; rows];
                    pool3.install(|| avx512bf16::stream_rows(xi, w.mat(), &mut got, split));
                    let prefetch = super::step_fits_cache();
                    assert!(same(&tiled[i * rows..(i + 1) * rows], &got), "{rows}x{cols} row {i}, {name}, {prefetch}");
                }
            }
        }
        // A few rows at once, starting anywhere in the batch (a row's bits do not depend on its place
        // in a group or on the group's size).
        // One group of up to 8 and two groups (equal or not).
        for (first, n) in
            [(0, 1), (0, 2), (1, 3), (0, 4), (3, 5), (2, 6), (1, 7), (0, 8), (5, 9), (1, 12), (0, 15), (0, 16)]
        {
            let xs = &x[first * cols..(first + n) * cols];
            for (name, split) in splits {
                let mut got = vec![f32::NAN; n * rows];
                pool3.install(|| avx512bf16::stream_many(xs, n, w.mat(), &mut got, split));
                let want = &tiled[first * rows..(first + n) * rows];
                assert!(same(want, &got), "{rows}x{cols} rows {first}..{}, {name}", first + n);
                // In passes over K, a block of weight rows at a time (blocks of odd size too).
                let mut got = vec![f32::NAN; n * rows];
                pool3.install(|| avx512bf16::stream_long(xs, n, w.mat(), &mut got, split));
                assert!(same(want, &got), "{rows}x{cols} rows {first}..{} in passes, {name}", first + n);
            }
        }
    }
}

#[test]
fn gathered_rows_have_the_bits_of_the_matmul_over_them() {
    // The drafter's centroid head takes a few hundred scattered embedding rows; each must get what
    // a matmul over those rows, copied together, gives it (and so what the full matrix gives it), on
    // the instruction set that reads them (AVX512_BF16's where the process runs AMX).
    let mut rng = Rng(11);
    for (dtype, rows, cols) in
        [(DType::BF16, 300, 128), (DType::BF16, 97, 100), (DType::BF16, 50, 40), (DType::F32, 97, 100)]
    {
        let w = Weights::random(&mut rng, dtype, rows, cols);
        let x = rng.vec(cols, 1.0);
        for n in [1usize, 3, 4, 9, 130] {
            let ids: Vec<u32> = (0..n).map(|_| (rng.next() % rows as u64) as u32).collect();
            let mut got = vec![0f32; n];
            matmul_gather(&x, w.mat(), &ids, &mut got);
            let mut full = vec![0f32; rows];
            // With AMX the bf16 candidates are read in place by the AVX512_BF16 path (`matmul_gather`).
            let reference = match (isa(), dtype) {
                (Isa::Amx, DType::BF16) => Isa::Avx512Bf16,
                (isa, _) => isa,
            };
            matmul_with(reference, &x, 1, w.mat(), &mut full);
            for (i, &id) in ids.iter().enumerate() {
                assert_eq!(got[i].to_bits(), full[id as usize].to_bits(), "{dtype:?} {rows}x{cols}, {n} ids: id {id}");
            }
            // The kernels that read the candidates in place, whichever the process uses.
            #[cfg(target_arch = "x86_64")]
            {
                type Gather = fn(&[f32], MatRef, &[u32], &mut [f32], Split);
                let direct: [(Isa, bool, Gather); 2] = [
                    (Isa::Avx512Bf16, avx512bf16::supported(), avx512bf16::gather),
                    (Isa::Avx2, avx2::supported(), avx2::gather),
                ];
                for (isa, _, gather) in direct.into_iter().filter(|d| d.1 && dtype == DType::BF16) {
                    let mut full = vec![0f32; rows];
                    matmul_with(isa, &x, 1, w.mat(), &mut full);
                    // On this thread, and in runs of 48 ids over the pool.
                    for split in [Split::Auto, Split::Rows(1)] {
                        let mut got = vec![0f32; n];
                        gather(&x, w.mat(), &ids, &mut got, split);
                        for (i, &id) in ids.iter().enumerate() {
                            assert_eq!(got[i].to_bits(), full[id as usize].to_bits(), "{isa} {rows}x{cols}: id {id}");
                        }
                    }
                }
            }
        }
    }
}

const LENS: [usize; 12] = [0, 1, 7, 8, 15, 16, 17, 33, 100, 256, 512, 1001];

#[test]
fn dot_and_axpy_match_scalar() {
    let mut rng = Rng(5);
    for isa in simd_isas() {
        for n in LENS {
            let (a, b) = (rng.vec(n, 1.0), rng.vec(n, 1.0));
            let s: f32 = a.iter().zip(&b).map(|(x, y)| (x * y).abs()).sum();
            let (got, want) = (dot_with(isa, &a, &b), scalar::dot(&a, &b));
            assert!((got - want).abs() <= 1e-6 * (n as f32).sqrt() * s, "{isa} dot n={n}: {got} vs {want}");

            let alpha = rng.f32();
            let (mut y1, mut y2) = (b.clone(), b.clone());
            axpy_with(isa, alpha, &a, &mut y1);
            scalar::axpy(alpha, &a, &mut y2);
            for i in 0..n {
                let tol = 2.4e-7 * (b[i].abs() + (alpha * a[i]).abs());
                assert!((y1[i] - y2[i]).abs() <= tol, "{isa} axpy n={n} i={i}: {} vs {}", y1[i], y2[i]);
            }
        }
    }
}

#[test]
fn rms_norm_matches_scalar() {
    let mut rng = Rng(6);
    for isa in simd_isas() {
        for n in LENS.into_iter().filter(|&n| n > 0) {
            let (x, g) = (rng.vec(n, 3.0), rng.vec(n, 1.0));
            for w in [Some(&g[..]), None] {
                let (mut o1, mut o2) = (vec![0f32; n], vec![0f32; n]);
                rms_norm_with(isa, &x, w, 1e-6, &mut o1);
                scalar::rms_norm(&x, w, 1e-6, &mut o2);
                for (a, b) in o1.iter().zip(&o2) {
                    assert!((a - b).abs() <= 4e-6 * b.abs().max(1e-6), "{isa} rms_norm n={n}: {a} vs {b}");
                }
            }
        }
    }
}

#[test]
fn softmax_matches_reference() {
    let mut rng = Rng(7);
    for isa in simd_isas() {
        for n in LENS {
            let mut x = rng.vec(n, 30.0);
            // Masked positions.
            for i in (0..n).step_by(3) {
                x[i] = f32::NEG_INFINITY;
            }
            let (mut got, mut sc) = (x.clone(), x.clone());
            softmax_with(isa, &mut got);
            scalar::softmax(&mut sc);
            // f64 reference: the SIMD sum uses many partial sums, so it is compared at 1e-6
            // relative; the scalar reference's long sequential sum can itself be off by more.
            // (x - max is rounded to f32 first, as every version does: that rounding alone moves
            // exp by up to |x - max|·2⁻²⁴ relative.)
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f64> = x.iter().map(|&v| ((v - max) as f64).exp()).collect();
            let sum: f64 = e.iter().sum();
            for i in 0..n {
                let want = if max == f32::NEG_INFINITY { 0.0 } else { e[i] / sum };
                let tol = 1e-6 * want + 1e-37;
                assert!((got[i] as f64 - want).abs() <= tol, "{isa} softmax n={n} i={i}: {} vs {want}", got[i]);
                assert!((got[i] - sc[i]).abs() <= 1e-5 * sc[i] + 1e-37, "{isa} softmax vs scalar n={n} i={i}");
                if x[i] == f32::NEG_INFINITY {
                    assert_eq!(got[i], 0.0);
                }
            }
        }
        let mut all_masked = vec![f32::NEG_INFINITY; 37];
        softmax_with(isa, &mut all_masked);
        assert!(all_masked.iter().all(|&v| v == 0.0), "{isa}: all -inf row");
    }
}

#[test]
fn softmax_and_exp_shifted_give_no_subnormals() {
    // Scores spread over [-120, 0] relative to the max: exponentials from 1 down past 2^-149, so every
    // range (normal, subnormal, underflow to zero) and the band around -87.4 appear, in every lane.
    for isa in std::iter::once(Isa::Scalar).chain(simd_isas()) {
        for n in [1usize, 7, 16, 33, 200, 1000] {
            let x: Vec<f32> = (0..n).map(|i| -(((i * 7919) % 1201) as f32) / 10.0).collect();
            let mut got = x.clone();
            softmax_with(isa, &mut got);
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f64> = x.iter().map(|&v| ((v - max) as f64).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (i, &g) in got.iter().enumerate() {
                let want = e[i] / sum;
                assert!(!g.is_subnormal(), "{isa} n={n} i={i}: subnormal {g:e}");
                // Clearly normal results survive; clearly subnormal ones are zero.
                if want >= 2.0 * f32::MIN_POSITIVE as f64 {
                    assert!((g as f64 - want).abs() <= 1e-6 * want, "{isa} n={n} i={i}: {g:e} vs {want:e}");
                } else if want < 0.5 * f32::MIN_POSITIVE as f64 {
                    assert_eq!(g, 0.0, "{isa} n={n} i={i}: {g:e} for {want:e}");
                }
            }
        }
        // exp_shifted, the sampler's numerators, follows the same rule.
        let x: Vec<f32> = (0..1000).map(|i| -(((i * 7919) % 1201) as f32) / 10.0).collect();
        let mut got = vec![f32::NAN; x.len()];
        exp_shifted_with(isa, &x, 0.0, &mut got);
        for (&v, &g) in x.iter().zip(&got) {
            let want = (v as f64).exp();
            assert!(!g.is_subnormal(), "{isa} exp_shifted({v}) = {g:e}");
            if want >= 2.0 * f32::MIN_POSITIVE as f64 {
                assert!((g as f64 - want).abs() <= 1e-6 * want, "{isa} exp_shifted({v}) = {g:e}, want {want:e}");
            } else if want < 0.5 * f32::MIN_POSITIVE as f64 {
                assert_eq!(g, 0.0, "{isa} exp_shifted({v}) = {g:e}");
            }
        }
        // A NaN score is not cleared with the tiny ones: every result is NaN, as before.
        let mut x: Vec<f32> = (0..40).map(|i| -(i as f32) * 5.0).collect();
        x[25] = f32::NAN;
        softmax_with(isa, &mut x);
        assert!(x.iter().all(|v| v.is_nan()), "{isa}: a NaN score gave {x:?}");
    }
}

#[test]
fn gelu_matches_reference() {
    let mut rng = Rng(8);
    for isa in simd_isas() {
        for n in LENS {
            let mut x = rng.vec(n, 6.0);
            for (i, v) in [0.0, -0.0, 1e-30, -1e-30, 12.0, -12.0, 100.0, -100.0, 3e38, -3e38].into_iter().enumerate() {
                if i < n {
                    x[i] = v;
                }
            }
            let (mut got, mut sc) = (x.clone(), x.clone());
            gelu_tanh_with(isa, &mut got);
            scalar::gelu_tanh(&mut sc);
            for i in 0..n {
                let u = x[i] as f64;
                let y = 0.797_884_560_802_865_4 * (u + 0.044715 * u * u * u);
                let want = 0.5 * u * (1.0 + y.tanh());
                let g = got[i] as f64;
                // y itself is computed in f32 (relative error ~1e-7), which moves e^(-2y) by ~|y|·1e-7.
                let tol = 1e-6 * (1.0 + y.abs().min(1e3)) * want.abs() + 1e-37;
                assert!((g - want).abs() <= tol, "{isa} gelu({u}) = {g}, want {want}");
                // The scalar version loses relative accuracy where 1 + tanh cancels (x ≪ 0).
                let s = sc[i] as f64;
                assert!((g - s).abs() <= 1e-6 * s.abs() + 1e-7 * u.abs(), "{isa} gelu({u}) = {g}, scalar {s}");
            }
        }
        let mut nan = [f32::NAN; 3];
        gelu_tanh_with(isa, &mut nan);
        assert!(nan.iter().all(|v| v.is_nan()), "{isa}: gelu(NaN)");
    }
}

#[test]
fn isa_names_parse_and_order() {
    for isa in Isa::ALL {
        assert_eq!(Isa::parse(isa.name()), Some(isa));
        assert_eq!(Isa::parse(&isa.name().to_uppercase()), Some(isa));
    }
    assert_eq!(Isa::parse("sse9"), None);
    assert!(Isa::Scalar < Isa::Avx2 && Isa::Avx2 < Isa::Avx512 && Isa::Avx512 < Isa::Avx512Bf16);
    assert!(Isa::Avx512Bf16 < Isa::Amx);
    assert!(isa() <= Isa::detected());
    assert_eq!(Isa::available().first(), Some(&Isa::Scalar));
}

#[test]
fn bandwidth_is_positive() {
    let gbs = bandwidth::measure_read_bandwidth(4 << 20);
    assert!(gbs.is_finite() && gbs > 0.0);
}

#[test]
fn softcap_and_bf16_rounding_match_scalar() {
    let mut rng = Rng(77);
    // Raw logits over a wide range, including exact zeros, huge values and infinities.
    let mut base = rng.vec(1000, 200.0);
    base.extend(rng.vec(1000, 30.0)); // |x/c| < 1: the range where the series takes over
    base.extend(rng.vec(1000, 0.01));
    base.extend([0.0, -0.0, 1e-30, 3e38, -3e38, f32::INFINITY, f32::NEG_INFINITY]);
    for isa in simd_isas() {
        for dt in [DType::F32, DType::BF16] {
            let mut want = base.clone();
            scalar::softcap(&mut want, 30.0, dt);
            let mut got = base.clone();
            softcap_with(isa, &mut got, 30.0, dt);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                // bf16: one tanh ulp may move a value across a rounding boundary (one bf16 step at 30 is 0.125).
                let tol = if dt == DType::BF16 { 0.125 + 1e-6 } else { 2e-5 * (1.0 + w.abs()) };
                assert!((g - w).abs() <= tol, "{isa:?} {dt:?} [{i}] x={}: {g} vs {w}", base[i]);
            }
        }
    }
    base.extend([f32::NAN, -f32::NAN, f32::from_bits(0x7f80_0001), f32::from_bits(0x0000_8001), 1.0 + 1.0 / 256.0]);
    for isa in Isa::available() {
        // Every length up to a few vectors, for the masked tails.
        for len in (0..40).chain([base.len()]) {
            let mut got = base[..len].to_vec();
            DType::BF16.round_slice_with(isa, &mut got);
            for (g, x) in got.iter().zip(&base) {
                assert_eq!(g.to_bits(), half::bf16::from_f32(*x).to_f32().to_bits(), "{isa:?} {x:e}");
            }
        }
    }
}

#[test]
fn weighted_rows_match_scalar_and_do_not_depend_on_the_batch() {
    let mut rng = Rng(12);
    for isa in simd_isas() {
        for dtype in [DType::BF16, DType::F32] {
            for (n, d) in [(1, 16), (7, 64), (100, 512), (33, 24), (5, 100), (64, 256), (0, 32)] {
                let v = Weights::random(&mut rng, dtype, n, d);
                for m in [1, 2, 5, 6, 7, 13, 17] {
                    let p = rng.vec(m * n, 1.0);
                    let (mut got, mut want) = (vec![f32::NAN; m * d], vec![0f32; m * d]);
                    weighted_rows_with(isa, &p, m, v.mat(), &mut got);
                    scalar::weighted_rows(&p, m, v.mat(), 0..d, &mut want);
                    for i in 0..m {
                        let mut row = vec![0f32; d];
                        for j in 0..d {
                            let s: f32 =
                                (0..n).map(|t| (p[i * n + t] * dtype.load(v.mat().data, t * d + j)).abs()).sum();
                            let (g, w) = (got[i * d + j], want[i * d + j]);
                            assert!(
                                (g - w).abs() <= 1e-6 * (n as f32 + 1.0) * s,
                                "{isa} {dtype:?} n={n} d={d} m={m} [{i},{j}]: {g} vs {w}"
                            );
                        }
                        // The same row alone: the same bits.
                        weighted_rows_with(isa, &p[i * n..(i + 1) * n], 1, v.mat(), &mut row);
                        assert!(
                            row.iter().zip(&got[i * d..(i + 1) * d]).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{isa} {dtype:?} m={m} row {i}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn exp_shifted_matches_scalar() {
    let mut rng = Rng(13);
    for isa in simd_isas() {
        for n in LENS {
            let mut x = rng.vec(n, 30.0);
            if n > 3 {
                x[1] = f32::NEG_INFINITY;
                x[2] = -200.0;
                x[3] = 0.0;
            }
            let (mut got, mut want) = (vec![f32::NAN; n], vec![0f32; n]);
            exp_shifted_with(isa, &x, 5.0, &mut got);
            scalar::exp_shifted(&x, 5.0, &mut want);
            for i in 0..n {
                assert!(
                    (got[i] - want[i]).abs() <= 4e-7 * want[i] + 1e-38,
                    "{isa} n={n} x={}: {} vs {}",
                    x[i],
                    got[i],
                    want[i]
                );
            }
            if n > 3 {
                assert_eq!(got[1], 0.0, "{isa}: exp(-inf)");
            }
        }
    }
}

/// Large products split their columns across threads; every element keeps its own FMA chain, so the
/// split and the pool size change no bit.
#[test]
fn weighted_rows_are_bit_exact_across_threads() {
    let mut rng = Rng(14);
    let pool1 = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let pool3 = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for isa in Isa::available() {
        for (dtype, n, d) in [(DType::BF16, 2100, 512), (DType::F32, 1500, 704)] {
            let v = Weights::random(&mut rng, dtype, n, d);
            let m = 5;
            let p = rng.vec(m * n, 1.0);
            let run = |pool: &rayon::ThreadPool| {
                let mut out = vec![f32::NAN; m * d];
                pool.install(|| weighted_rows_with(isa, &p, m, v.mat(), &mut out));
                out
            };
            let (one, three) = (run(&pool1), run(&pool3));
            assert!(one.iter().zip(&three).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa} {dtype:?} n={n} d={d}");
        }
    }
}

#[test]
fn flush_subnormal_zeroes_exactly_the_subnormals() {
    let tiny = f32::MIN_POSITIVE;
    let mut x = [
        0.0,
        -0.0,
        tiny,
        -tiny,
        tiny * 0.5,
        -tiny * 0.25,
        f32::from_bits(1),
        1e-30,
        0.5,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    x.iter_mut().for_each(|v| *v = flush_subnormal(*v));
    let want = [0.0, -0.0, tiny, -tiny, 0.0, 0.0, 0.0, 1e-30, 0.5, f32::INFINITY, f32::NEG_INFINITY];
    for (i, (got, w)) in x.iter().zip(want).enumerate() {
        assert!(got.to_bits() == w.to_bits() || (*got == 0.0 && w == 0.0), "element {i}: {got:e} vs {w:e}");
    }
    assert!(x[11].is_nan());
}

#[test]
fn cache_sizes_parse_as_sysfs_writes_them() {
    assert_eq!(super::parse_cache_size("32768K"), Some(32 << 20));
    assert_eq!(super::parse_cache_size("1M"), Some(1 << 20));
    assert_eq!(super::parse_cache_size("512"), Some(512));
    assert_eq!(super::parse_cache_size(""), None);
    assert_eq!(super::parse_cache_size("K"), None);
    assert_eq!(super::parse_cache_size("12X"), None);
    // Where sysfs tells it, the last-level cache is at least an L1's size.
    if let Some(bytes) = super::last_level_cache_bytes() {
        assert!(bytes >= 16 << 10, "{bytes}");
    }
}

#[test]
fn row_f32_widens_every_value_as_load_does() {
    // Every 16-bit pattern (NaNs included: any NaN for a NaN), and f32 patterns around the edges.
    for dtype in [DType::BF16, DType::F16] {
        let data: Vec<u8> = (0..=u16::MAX).flat_map(|v| v.to_le_bytes()).collect();
        let m = MatRef::new(dtype, 256, 256, &data);
        let mut row = vec![0f32; 256];
        for r in 0..256 {
            m.row_f32(r, &mut row);
            for (j, &x) in row.iter().enumerate() {
                let want = dtype.load(&data, r * 256 + j);
                assert!(x.to_bits() == want.to_bits() || (x.is_nan() && want.is_nan()), "{dtype:?} {r} {j}");
            }
        }
    }
    let vals = [0.0f32, -0.0, 1.5, -3.25e-40, f32::MAX, f32::INFINITY, f32::NEG_INFINITY, 1e-45];
    let data: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let m = MatRef::new(DType::F32, 2, 4, &data);
    let mut row = vec![0f32; 4];
    for r in 0..2 {
        m.row_f32(r, &mut row);
        let want: Vec<u32> = vals[r * 4..r * 4 + 4].iter().map(|v| v.to_bits()).collect();
        assert_eq!(row.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want);
    }
}
