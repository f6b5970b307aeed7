//! Tests of the quantized formats and kernels: quantize/dequantize error per format, the reference
//! matmul against `dot_row`, every SIMD path against the reference (within the float reordering the
//! formats allow), and batch / split invariance of every path.

use super::quant::{self, dequantize_row, quantize_acts, quantize_row, unpack, QActs, QMatRef, QType, Unpacked};
use super::{matmul, matmul_each, matmul_quant, DType, Isa, MatRef, Split, Weight};

// The quantized kernels exist for AVX2 and AVX-512 VNNI; every SIMD level the CPU runs reaches one of them.
use super::tests::{simd_isas, Rng};

fn quantize(qt: QType, rows: usize, cols: usize, vals: &[f32]) -> Vec<u8> {
    let rb = qt.row_bytes(cols).unwrap();
    let mut out = vec![0u8; rows * rb];
    for (x, o) in vals.chunks_exact(cols).zip(out.chunks_exact_mut(rb)) {
        quantize_row(qt, x, o);
    }
    out
}

/// Random bytes in `qt`'s layout, every level and packed scale bit pattern possible, with the f16
/// scales set to finite values of moderate size (random f16 bits would be NaN or huge).
fn random_blocks(rng: &mut Rng, qt: QType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = qt.row_bytes(cols).unwrap();
    let mut data: Vec<u8> = (0..rows * rb).map(|_| rng.next() as u8).collect();
    let f16_at: &[usize] = match qt {
        QType::Q8_0 | QType::Q8_0x16 | QType::Q4_0 | QType::Q5_0 | QType::IQ4_NL | QType::IQ4_XS => &[0],
        QType::Q5_1 | QType::Q4_K | QType::Q4_Kx16 | QType::Q5_K => &[0, 2],
        QType::Q6_K | QType::Q6_Kx16 => &[208],
    };
    for b in data.chunks_exact_mut(qt.block_bytes()) {
        for &at in f16_at {
            let v = half::f16::from_f32(rng.f32() * 0.05);
            b[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    data
}

fn run(isa: Isa, x: &[f32], m: usize, w: QMatRef, split: Split) -> Vec<f32> {
    let mut out = vec![f32::NAN; m * w.rows];
    matmul_quant(isa, x, m, w, &mut out, split);
    out
}

/// Σ |terms| of output `(r, j)` as the formats compute it: each weight's scaled part and minimum
/// part times the dequantized activation, in f64.
fn abs_bound(qt: QType, w: &[u8], a: &QActs, r: usize) -> f64 {
    let be = qt.block_elems();
    let (xq, xd) = (a.row_qs(r), a.row_d(r));
    let mut u = Unpacked::new();
    let mut total = 0f64;
    for (bi, b) in w.chunks_exact(qt.block_bytes()).enumerate() {
        unpack(qt, b, &mut u);
        for i in 0..be {
            let x = (xq[bi * be + i] as f64 * xd[bi] as f64).abs();
            let q = u.q[i] as f64;
            let (d, m) = (u.d as f64, u.m as f64);
            let (s, mn) = match qt {
                QType::Q8_0 | QType::Q8_0x16 | QType::Q4_0 | QType::Q5_0 | QType::IQ4_NL => (d * q, 0.0),
                QType::Q5_1 => (d * q, m),
                QType::Q4_K | QType::Q4_Kx16 | QType::Q5_K => (d * u.sc[i / 32] as f64 * q, m * u.mn[i / 32] as f64),
                QType::Q6_K | QType::Q6_Kx16 => (d * u.sc[i / 16] as f64 * q, 0.0),
                QType::IQ4_XS => (d * u.sc[i / 32] as f64 * q, 0.0),
            };
            total += (s.abs() + mn.abs()) * x;
        }
    }
    total
}

/// Every SIMD path against the reference: equal up to float summation order, i.e. within a few
/// rounding errors per block of Σ |terms|.
fn check_against_reference(qt: QType, w: QMatRef, x: &[f32], m: usize, what: &str) {
    let want = run(Isa::Scalar, x, m, w, Split::Auto);
    let acts = quantize_acts(qt, x, m, w.cols);
    let nb = w.cols / qt.block_elems();
    for isa in simd_isas() {
        let got = run(isa, x, m, w, Split::Auto);
        for i in 0..m {
            for j in 0..w.rows {
                let (g, r) = (got[i * w.rows + j], want[i * w.rows + j]);
                let tol = (nb + 16) as f64 * 2.4e-7 * abs_bound(qt, w.row(j), &acts, i);
                assert!(
                    g.is_finite() && ((g - r) as f64).abs() <= tol,
                    "{isa} {qt} {what} [{}x{}] m={m} ({i}, {j}): {g} vs reference {r} (tolerance {tol:e})",
                    w.rows,
                    w.cols
                );
            }
        }
    }
}

#[test]
fn reference_matmul_is_dot_row() {
    let mut rng = Rng(1);
    for qt in QType::ALL {
        let (rows, cols, m) = (7, 2 * QType::Q4_K.block_elems(), 3);
        let data = quantize(qt, rows, cols, &rng.vec(rows * cols, 1.0));
        let w = QMatRef::new(qt, rows, cols, &data);
        let x = rng.vec(m * cols, 2.0);
        let acts = quantize_acts(qt, &x, m, cols);
        let mut out = vec![0f32; m * rows];
        let mut outs: Vec<&mut [f32]> = out.chunks_mut(rows).collect();
        quant::matmul(&acts, w, &mut outs);
        for i in 0..m {
            for j in 0..rows {
                let d = quant::dot_row(qt, w.row(j), &acts, i);
                assert_eq!(out[i * rows + j].to_bits(), d.to_bits(), "{qt} ({i}, {j})");
            }
        }
    }
}

#[test]
fn simd_matches_reference_on_many_shapes() {
    let mut rng = Rng(2);
    for qt in QType::ALL {
        let be = qt.block_elems();
        let mut shapes = vec![(1, be), (5, 2 * be), (13, 3 * be), (203, be), (13, 1536), (5, 6144)];
        if be == 32 {
            // Whole 4-block steps of the AVX-512 kernels plus 1, 2 or 3 blocks; for Q8_0, whole
            // 16-block steps plus 6 or 2 blocks (the 26B-A4B's rows of 704 and 2112).
            shapes.extend([(203, 96), (7, 5 * 32), (6, 7 * 32), (9, 6 * 32), (9, 22 * 32), (5, 66 * 32)]);
        }
        for (rows, cols) in shapes {
            let data = quantize(qt, rows, cols, &rng.vec(rows * cols, 1.0));
            let w = QMatRef::new(qt, rows, cols, &data);
            for m in [1, 2, 3, 5, 8, 16] {
                let x = rng.vec(m * cols, 3.0);
                check_against_reference(qt, w, &x, m, "quantized random");
            }
        }
    }
}

/// Raw random blocks: every level (Q8_0's -128 included), every packed 6-bit scale and minimum, Q6_K
/// scales of -128, and the fifth / sixth bits, in every position.
#[test]
fn simd_matches_reference_on_random_bytes() {
    let mut rng = Rng(3);
    for qt in QType::ALL {
        let (rows, cols) = (9, 4 * qt.block_elems().max(64));
        let data = random_blocks(&mut rng, qt, rows, cols);
        let w = QMatRef::new(qt, rows, cols, &data);
        for m in [1, 4, 6] {
            let x = rng.vec(m * cols, 1.0);
            check_against_reference(qt, w, &x, m, "random bytes");
        }
    }
}

/// Blocks of extreme shapes for the weight quantizers (one outlier, constant, one-signed, tiny,
/// alternating extremes) and activation rows of zeros, huge and tiny magnitudes.
#[test]
fn simd_matches_reference_on_extreme_values() {
    let mut rng = Rng(4);
    for qt in QType::ALL {
        let cols = 2 * QType::Q4_K.block_elems();
        let mut w = Vec::new();
        let mut push = |row: Vec<f32>| w.extend(row);
        push((0..cols).map(|i| if i % 97 == 5 { 1e4 } else { rng.f32() }).collect());
        push(vec![0.75; cols]);
        push((0..cols).map(|_| -rng.f32().abs() - 0.5).collect());
        push((0..cols).map(|_| rng.f32().abs() * 40.0 + 1.0).collect());
        push((0..cols).map(|_| rng.f32() * 1e-6).collect());
        push((0..cols).map(|i| if i % 2 == 0 { 30.0 } else { -30.0 }).collect());
        push((0..cols).map(|i| if (i / 16) % 2 == 0 { 0.0 } else { rng.f32() * 100.0 }).collect());
        push(vec![0.0; cols]);
        let rows = w.len() / cols;
        let data = quantize(qt, rows, cols, &w);
        let wm = QMatRef::new(qt, rows, cols, &data);
        let mut x = Vec::new();
        x.extend(vec![0f32; cols]);
        // Q8_1 keeps each block's scaled sum as f16: past ~2000 per element it overflows (as in
        // llama.cpp), so Q5_1's large rows are smaller.
        x.extend(rng.vec(cols, if qt == QType::Q5_1 { 1e3 } else { 1e6 }));
        x.extend(rng.vec(cols, 1e-6));
        x.extend((0..cols).map(|i| if i % 3 == 0 { 127.0 } else { -127.0 }).collect::<Vec<_>>());
        x.extend((0..cols).map(|i| if i % 50 == 7 { -1e3 } else { rng.f32() }).collect::<Vec<_>>());
        let m = x.len() / cols;
        check_against_reference(qt, wm, &x, m, "extreme values");
    }
}

/// All-zero weights or activations give exact zeros on every path, also next to non-zero blocks.
#[test]
fn zero_blocks_give_zero() {
    let mut rng = Rng(5);
    for qt in QType::ALL {
        let cols = 3 * qt.block_elems();
        let mut vals = vec![0f32; 2 * cols];
        vals[cols + qt.block_elems()..cols + 2 * qt.block_elems()].copy_from_slice(&rng.vec(qt.block_elems(), 1.0));
        let data = quantize(qt, 2, cols, &vals);
        let w = QMatRef::new(qt, 2, cols, &data);
        let mut x = rng.vec(2 * cols, 1.0);
        x[cols..].fill(0.0);
        // Activations zero exactly where the second weight row is not.
        x[qt.block_elems()..2 * qt.block_elems()].fill(0.0);
        for isa in Isa::available() {
            let out = run(isa, &x, 2, w, Split::Auto);
            assert_eq!(out, vec![0.0; 4], "{isa} {qt}");
        }
    }
}

/// Every path gives row `i` of an `m`-row product the same bits as that row alone, whatever `m`
/// (1..=16) and however the weight rows are split over threads.
#[test]
fn quant_matmul_is_bit_exact_across_batch_and_splits() {
    let mut rng = Rng(6);
    let pool3 = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for qt in QType::ALL {
        let cols = 2 * QType::Q4_K.block_elems();
        let rows = 37;
        let data = quantize(qt, rows, cols, &rng.vec(rows * cols, 1.0));
        let w = QMatRef::new(qt, rows, cols, &data);
        let mut x = rng.vec(16 * cols, 1.0);
        x[3 * cols..4 * cols].fill(0.0);
        for v in &mut x[9 * cols..10 * cols] {
            *v *= 1e5;
        }
        for isa in Isa::available() {
            let single: Vec<Vec<f32>> =
                (0..16).map(|i| run(isa, &x[i * cols..(i + 1) * cols], 1, w, Split::Auto)).collect();
            for m in 1..=16 {
                let xs = &x[..m * cols];
                let auto = run(isa, xs, m, w, Split::Auto);
                let split = pool3.install(|| run(isa, xs, m, w, Split::Rows(12)));
                let odd = pool3.install(|| run(isa, xs, m, w, Split::Rows(5)));
                let spun = run(isa, xs, m, w, Split::Rows(5));
                for (name, other) in [("chunks of 12", &split), ("chunks of 5", &odd), ("spinning pool", &spun)] {
                    assert!(
                        auto.iter().zip(other).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{isa} {qt} m={m}: {name}"
                    );
                }
                for (i, want) in single.iter().enumerate().take(m) {
                    let row = &auto[i * rows..(i + 1) * rows];
                    assert!(
                        row.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{isa} {qt} m={m} row {i}: batch variance"
                    );
                }
            }
        }
    }
}

/// Dequantize ∘ quantize on random data: per-block error bounds where the format has a simple one,
/// and RMSE growing as the bits shrink.
#[test]
fn dequantized_error_bounds() {
    let mut rng = Rng(7);
    let n = 64 * 256;
    let x = rng.vec(n, 1.0);
    let mut rmse = std::collections::HashMap::new();
    for qt in QType::ALL {
        let data = quantize(qt, 1, n, &x);
        let mut y = vec![0f32; n];
        dequantize_row(qt, &data, &mut y);
        let mut u = Unpacked::new();
        for (bi, b) in data.chunks_exact(qt.block_bytes()).enumerate() {
            unpack(qt, b, &mut u);
            let be = qt.block_elems();
            let (xs, ys) = (&x[bi * be..(bi + 1) * be], &y[bi * be..(bi + 1) * be]);
            let max_err = xs.iter().zip(ys).fold(0f32, |a, (p, q)| a.max((p - q).abs()));
            let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
            let bound = match qt {
                // Rounding to the nearest level (the scale is f16-rounded: a little slack).
                QType::Q8_0 | QType::Q8_0x16 => u.d.abs() / 2.0 + amax * 2e-3,
                // The level opposite the largest value can clamp: up to one step.
                QType::Q4_0 | QType::Q5_0 => u.d.abs() + amax * 2e-3,
                QType::Q5_1 => u.d.abs() / 2.0 + amax * 2e-3,
                // Sub-block scales on 6 bits: loose, but catches layout errors.
                QType::Q4_K | QType::Q4_Kx16 => 2.5 * amax / 15.0,
                QType::Q5_K => 2.5 * amax / 31.0,
                QType::Q6_K | QType::Q6_Kx16 => 2.5 * amax / 31.0,
                // Non-uniform levels (steps up to 24 of 240 around the largest); IQ4_XS's scales on 6 bits.
                QType::IQ4_NL => 0.12 * amax + amax * 2e-3,
                QType::IQ4_XS => 2.5 * amax / 15.0,
            };
            assert!(max_err <= bound, "{qt} block {bi}: max error {max_err} > {bound}");
        }
        let e = (x.iter().zip(&y).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>() / n as f64).sqrt();
        rmse.insert(qt, e);
    }
    let r = |q: QType| rmse[&q];
    // Uniform [-1, 1): step / sqrt(12) with steps 2/254 (Q8_0), 2/16 (Q4_0), 2/32 (Q5_0).
    assert!(r(QType::Q8_0) < 0.003, "{rmse:?}");
    assert!(r(QType::Q4_0) < 0.045, "{rmse:?}");
    assert!(r(QType::Q4_0) > r(QType::Q5_0) && r(QType::Q5_0) > r(QType::Q8_0), "{rmse:?}");
    assert!(r(QType::Q5_0) > r(QType::Q5_1) * 0.9, "{rmse:?}");
    assert!(r(QType::Q4_K) > r(QType::Q5_K) && r(QType::Q5_K) > r(QType::Q6_K), "{rmse:?}");
    assert!(r(QType::Q6_K) > r(QType::Q8_0), "{rmse:?}");
    assert!(r(QType::Q4_K) < 0.045 && r(QType::Q6_K) < 0.012, "{rmse:?}");
    // The non-linear 4-bit formats: about Q4_0's error on uniform data (their levels suit bell-shaped
    // weights better), and well below Q4_0's bound.
    assert!(r(QType::IQ4_NL) < 0.045 && r(QType::IQ4_XS) < 0.045, "{rmse:?}");
    assert!(r(QType::IQ4_NL) > r(QType::Q5_0) && r(QType::IQ4_XS) > r(QType::Q5_K), "{rmse:?}");
}

/// The activation quantizers: levels within ±127, and dequantized within half a step of the input.
#[test]
fn activation_quantization_bounds() {
    let mut rng = Rng(8);
    for qt in [QType::Q8_0, QType::Q5_1, QType::Q4_K] {
        let (m, k) = (3, 512);
        let mut x = rng.vec(m * k, 5.0);
        x[k..2 * k].fill(0.0);
        let a = quantize_acts(qt, &x, m, k);
        let be = a.block();
        for r in 0..m {
            for (i, (&q, &v)) in a.row_qs(r).iter().zip(&x[r * k..(r + 1) * k]).enumerate() {
                let d = a.row_d(r)[i / be];
                assert!(q > -128, "{qt}");
                // Q8_0's scale is f16-rounded after the levels are chosen: a little slack.
                assert!((q as f32 * d - v).abs() <= d.abs() * 0.502 + v.abs() * 1e-3, "{qt} row {r} elem {i}");
            }
            if !a.bsums.is_empty() {
                for (g, s) in a.row_qs(r).chunks_exact(16).zip(&a.bsums[r * k / 16..(r + 1) * k / 16]) {
                    assert_eq!(g.iter().map(|&v| v as i16).sum::<i16>(), *s);
                }
            }
        }
    }
}

/// The AVX-512 activation quantizer gives the portable one's levels, scales and sums exactly, for every
/// kind: zero blocks, ties at half a step, a block whose largest magnitude repeats with both signs.
/// Skipped without AVX-512.
#[cfg(target_arch = "x86_64")]
#[test]
fn simd_activation_quantization_is_the_portable_one() {
    if !super::avx512_quant::supported() {
        return;
    }
    let mut rng = Rng(23);
    let (m, k) = (5, 1024);
    let mut x = rng.vec(m * k, 3.0);
    x[k..k + 256].fill(0.0);
    // Products exactly halfway between two levels: each block led by 63.5 (a scale of exactly 2, or
    // -2 for Q8_K), the rest quarters.
    for (j, v) in x[2 * k..2 * k + 256].iter_mut().enumerate() {
        *v = if j % 32 == 0 { 63.5 } else { (j % 32) as f32 / 4.0 - 4.0 };
    }
    x[3 * k + 7] = -9.0;
    x[3 * k + 200] = 9.0;
    for v in &mut x[4 * k..5 * k] {
        *v *= 1e-30;
    }
    for qt in [QType::Q8_0, QType::Q5_1, QType::Q4_K] {
        let want = quantize_acts(qt, &x, m, k);
        let mut got = QActs::default();
        quant::quantize_acts_with(qt, &x, m, k, &mut got, true);
        assert_eq!(got.qs, want.qs, "{qt} levels");
        assert!(got.d.iter().zip(&want.d).all(|(a, b)| a.to_bits() == b.to_bits()), "{qt} scales");
        assert!(got.s.iter().zip(&want.s).all(|(a, b)| a.to_bits() == b.to_bits()), "{qt} sums");
        assert_eq!(got.bsums, want.bsums, "{qt} group sums");
    }
}

/// The AVX-512 VNNI kernels called directly (not through the dispatch), when the CPU has them: every
/// tile shape (m = 1..=16 against 4-row tiles and 1-row leftovers), against the reference within
/// float reordering, on quantized and on raw random blocks, with partial 4-block steps; both walks
/// through the weight rows (tiles, or one row at a time) give the same bits; and the
/// dispatch of `Isa::Avx512` / `Isa::Avx512Bf16` gives exactly their bits. Skipped without AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_vnni_kernels_direct() {
    use super::avx512_quant;
    if !avx512_quant::supported() {
        eprintln!("no AVX-512 VNNI on this CPU: avx512_quant not tested");
        return;
    }
    let mut rng = Rng(9);
    for qt in QType::ALL {
        let be = qt.block_elems();
        // 32-weight formats: a partial last step of 4 blocks, and (Q8_0's 16-block steps) one whole
        // step and a partial one.
        let widths = if be == 32 { vec![7 * 32, 22 * 32] } else { vec![2 * be] };
        let rows = 11;
        for (cols, raw) in widths.into_iter().flat_map(|c| [(c, false), (c, true)]) {
            let data = if raw {
                random_blocks(&mut rng, qt, rows, cols)
            } else {
                quantize(qt, rows, cols, &rng.vec(rows * cols, 1.0))
            };
            let w = QMatRef::new(qt, rows, cols, &data);
            let x = rng.vec(16 * cols, 2.0);
            let direct = |xs: &[f32], m: usize| {
                let acts = quantize_acts(qt, xs, m, cols);
                let mut got = vec![f32::NAN; m * rows];
                let mut outs: Vec<&mut [f32]> = got.chunks_mut(rows).collect();
                avx512_quant::matmul(&acts, w, &mut outs);
                (acts, got)
            };
            let single: Vec<Vec<f32>> = (0..16).map(|i| direct(&x[i * cols..(i + 1) * cols], 1).1).collect();
            for m in 1..=16 {
                let (acts, got) = direct(&x[..m * cols], m);
                for (i, want) in single.iter().enumerate().take(m) {
                    assert!(
                        got[i * rows..(i + 1) * rows].iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{qt} raw={raw} m={m} row {i}: batch variance"
                    );
                }
                // Both walks through the weight rows, whichever `matmul` chose on this CPU.
                for walk in [avx512_quant::Walk::Tiles, avx512_quant::Walk::Rows] {
                    let mut by = vec![f32::NAN; m * rows];
                    let mut outs: Vec<&mut [f32]> = by.chunks_mut(rows).collect();
                    avx512_quant::with_prepared(&acts, qt, |p| avx512_quant::matmul_walk(p, w, &mut outs, walk));
                    assert!(
                        by.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{qt} raw={raw} m={m}: {walk:?} walk differs"
                    );
                }
                for i in 0..m {
                    for j in 0..rows {
                        let (g, r) = (got[i * rows + j], quant::dot_row(qt, w.row(j), &acts, i));
                        let tol = (cols / be + 16) as f64 * 2.4e-7 * abs_bound(qt, w.row(j), &acts, i);
                        assert!(
                            g.is_finite() && ((g - r) as f64).abs() <= tol,
                            "{qt} raw={raw} m={m} ({i}, {j}): {g} vs reference {r} (tolerance {tol:e})"
                        );
                    }
                }
                for isa in [Isa::Avx512, Isa::Avx512Bf16] {
                    if Isa::available().contains(&isa) {
                        let via = run(isa, &x[..m * cols], m, w, Split::Rows(5));
                        assert!(
                            via.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{isa} {qt} m={m}: dispatch differs from avx512_quant"
                        );
                    }
                }
            }
        }
    }
}

/// IQ4 details the goldens may not reach: an all-zero group takes level index 8 (the table's 1, nearest
/// 0) and scale 0; IQ4_XS's all-zero super-block has `d = −0` (llama.cpp's `−max/32`) and every 6-bit
/// scale at its offset, 32; and reading back gives `d · T[q]` from the right nibbles.
#[test]
fn iq4_layouts() {
    let mut b = vec![0u8; 18];
    quantize_row(QType::IQ4_NL, &[0.0; 32], &mut b);
    assert_eq!(b[..2], [0, 0]);
    assert!(b[2..].iter().all(|&v| v == 0x88));
    let mut b = vec![0u8; 136];
    quantize_row(QType::IQ4_XS, &[0.0; 256], &mut b);
    assert_eq!(b[..8], [0x00, 0x80, 0xaa, 0xaa, 0, 0, 0, 0]);
    assert!(b[8..].iter().all(|&v| v == 0x88));

    // One IQ4_NL block: d = 0.5, byte j holds index j % 16 (weight j) and 15 - j % 16 (weight j + 16).
    let mut b = vec![0u8; 18];
    b[..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
    for j in 0..16 {
        b[2 + j] = (j as u8) | ((15 - j as u8) << 4);
    }
    let mut y = [0f32; 32];
    dequantize_row(QType::IQ4_NL, &b, &mut y);
    for j in 0..16 {
        assert_eq!(y[j], 0.5 * quant::IQ4_VALUES[j] as f32);
        assert_eq!(y[j + 16], 0.5 * quant::IQ4_VALUES[15 - j] as f32);
    }
    // IQ4_XS: d = 0.25, sub-block j's scale ls = 32 + j − 4 (so scales −4..3), spread over scales_l / scales_h.
    let mut b = vec![0u8; 136];
    b[..2].copy_from_slice(&half::f16::from_f32(0.25).to_bits().to_le_bytes());
    let mut h = 0u16;
    for j in 0..8 {
        let ls = (32 + j - 4) as u8;
        b[4 + j / 2] |= (ls & 0x0f) << (4 * (j % 2));
        h |= ((ls >> 4) as u16) << (2 * j);
    }
    b[2..4].copy_from_slice(&h.to_le_bytes());
    for (i, v) in b[8..].iter_mut().enumerate() {
        *v = (i % 16) as u8 | (((i / 16) as u8 % 16) << 4);
    }
    let mut y = [0f32; 256];
    dequantize_row(QType::IQ4_XS, &b, &mut y);
    for j in 0..8 {
        let dl = 0.25 * (j as f32 - 4.0);
        for i in 0..16 {
            assert_eq!(y[32 * j + i], dl * quant::IQ4_VALUES[i] as f32, "sub-block {j} weight {i}");
            assert_eq!(y[32 * j + 16 + i], dl * quant::IQ4_VALUES[j] as f32, "sub-block {j} weight {}", 16 + i);
        }
    }
}

#[test]
fn matmul_each_gives_every_product_the_bits_of_matmul() {
    // Two small products (one KV head's K and V: on two threads side by side) and a large one (split
    // over threads itself), with bf16 and quantized weights, at one, two and five activation rows.
    let mut rng = Rng(7);
    let cols = 384;
    let shapes = [64usize, 64, 1536];
    let bf16: Vec<Vec<u8>> = shapes
        .iter()
        .map(|&r| {
            rng.vec(r * cols, 1.0).iter().flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes()).collect()
        })
        .collect();
    let q8: Vec<Vec<u8>> = shapes.iter().map(|&r| quantize(QType::Q8_0, r, cols, &rng.vec(r * cols, 1.0))).collect();
    for m in [1, 2, 5] {
        let x = rng.vec(m * cols, 2.0);
        for quant in [false, true] {
            let ws: Vec<Weight<'_>> = shapes
                .iter()
                .enumerate()
                .map(|(i, &r)| match quant {
                    false => Weight::Float(MatRef::new(DType::BF16, r, cols, &bf16[i])),
                    true => Weight::Quant(QMatRef::new(QType::Q8_0, r, cols, &q8[i])),
                })
                .collect();
            let want: Vec<Vec<f32>> = ws
                .iter()
                .map(|w| {
                    let mut o = vec![0f32; m * w.rows()];
                    matmul(&x, m, *w, &mut o);
                    o
                })
                .collect();
            let mut got: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; m * w.rows()]).collect();
            let mut jobs: Vec<(Weight<'_>, &mut [f32])> =
                ws.iter().zip(got.iter_mut()).map(|(w, o)| (*w, o.as_mut_slice())).collect();
            matmul_each(&x, m, &mut jobs);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "m = {m}, quantized {quant}: product {i} differs from matmul");
            }
        }
    }
}

/// Packs a `[rows, cols]` matrix of its file format's rows into strips.
type Packer = fn(&[u8], usize, usize) -> Vec<u8>;

/// The layouts packed at load, each with its file format and packer.
fn packed_layouts() -> [(QType, QType, Packer); 3] {
    [
        (QType::Q8_0x16, QType::Q8_0, super::q8x16::pack),
        (QType::Q4_Kx16, QType::Q4_K, super::q4kx16::pack),
        (QType::Q6_Kx16, QType::Q6_K, super::q6kx16::pack),
    ]
}

/// Packing in strips: every row comes back as its file format's bytes and dequantizes to the same
/// values.
#[test]
fn strips_pack_round_trip() {
    let mut rng = Rng(21);
    for (packed_t, file, pack) in packed_layouts() {
        let (rows, cols) = (48, 512);
        let plain = random_blocks(&mut rng, file, rows, cols);
        let packed = pack(&plain, rows, cols);
        assert_eq!(packed.len(), rows * packed_t.row_bytes(cols).unwrap());
        let w = QMatRef::new(packed_t, rows, cols, &packed);
        let p = QMatRef::new(file, rows, cols, &plain);
        let (mut row, mut a, mut b) = (vec![0u8; p.row_bytes()], vec![0f32; cols], vec![0f32; cols]);
        for r in 0..rows {
            w.unpack_row(r, &mut row);
            assert_eq!(row, p.row(r), "{packed_t} row {r}");
            w.row_f32(r, &mut a);
            p.row_f32(r, &mut b);
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{packed_t} row {r} dequantized");
        }
    }
    assert!(!super::q8x16::packable(40, 96) && !super::q8x16::packable(48, 100) && super::q8x16::packable(16, 32));
    assert!(!super::q4kx16::packable(40, 256) && !super::q4kx16::packable(48, 384) && super::q4kx16::packable(16, 256));
    assert!(!super::q6kx16::packable(40, 256) && !super::q6kx16::packable(48, 384) && super::q6kx16::packable(16, 256));
}

/// The kernels of each packed layout (portable, VNNI) give every output the same bits, whatever the
/// number of rows, the group it falls in, or the thread split; and those bits are the plain format's
/// product up to float summation order.
#[test]
fn strips_kernels_agree_bit_for_bit() {
    let mut rng = Rng(22);
    let pool3 = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for (packed_t, file, pack) in packed_layouts() {
        for (rows, cols, random) in [(80, 256, false), (48, 1024, false), (112, 512, true)] {
            let plain = if random {
                random_blocks(&mut rng, file, rows, cols)
            } else {
                quantize(file, rows, cols, &rng.vec(rows * cols, 1.0))
            };
            let packed = pack(&plain, rows, cols);
            let w = QMatRef::new(packed_t, rows, cols, &packed);
            let p = QMatRef::new(file, rows, cols, &plain);
            let mut x = rng.vec(20 * cols, 1.0);
            x[3 * cols..4 * cols].fill(0.0);
            for v in &mut x[9 * cols..10 * cols] {
                *v *= 1e5;
            }
            let want = run(Isa::Scalar, &x, 20, w, Split::Auto);
            let acts = quantize_acts(file, &x, 20, cols);
            let reference = run(Isa::Scalar, &x, 20, p, Split::Auto);
            let blocks = (cols / file.block_elems()) as f64;
            for i in 0..20 {
                for j in 0..rows {
                    let (g, r) = (want[i * rows + j], reference[i * rows + j]);
                    let tol = (blocks + 16.0) * 2.4e-7 * abs_bound(file, p.row(j), &acts, i);
                    assert!(g.is_finite() && ((g - r) as f64).abs() <= tol, "{packed_t} ({i}, {j}): {g} vs plain {r}");
                }
            }
            for isa in Isa::available() {
                for m in 1..=20 {
                    let xs = &x[..m * cols];
                    let auto = run(isa, xs, m, w, Split::Auto);
                    let split = pool3.install(|| run(isa, xs, m, w, Split::Rows(12)));
                    for (name, got) in [("auto", &auto), ("chunks of 16", &split)] {
                        assert!(
                            got.iter().zip(&want[..m * rows]).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{isa} {packed_t} [{rows}x{cols}] m={m} {name}: not the portable kernel's bits"
                        );
                    }
                }
            }
            // A gather reads the rows in their file format: the plain matrix's bits.
            let ids: Vec<u32> = (0..rows as u32).rev().step_by(3).collect();
            let (mut a, mut b) = (vec![0f32; ids.len()], vec![0f32; ids.len()]);
            super::matmul_gather(&x[..cols], w, &ids, &mut a);
            super::matmul_gather(&x[..cols], p, &ids, &mut b);
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{packed_t} gather");
        }
    }
}
