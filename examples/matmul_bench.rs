//! Effective weight bandwidth of `kernels::matmul` for the shapes that dominate decode.
//!
//! cargo run --release --example matmul_bench [-- [--isa NAME] [--threads N] [--quick] [--prefill]
//!                                              [--small] [--hot] [--span MIB] [--dtype bf16|f16|f32]
//!                                              [--quant q8_0|q8_0x16|q4_0|q5_0|q5_1|q4_k|q4_kx16|q5_k|q6_k|q6_kx16]]
//!
//! `--quant FMT` times block-quantized weights instead (random weights quantized with
//! `quant::quantize_row`); GB/s then counts the quantized bytes. `q8_0x16` is Q8_0 packed in 16-row strips
//! as loading packs it on CPUs with AVX-512 VNNI (`kernels::q8x16`); `q4_kx16` and `q6_kx16` the same for
//! Q4_K and Q6_K (`kernels::q4kx16`, `kernels::q6kx16`).
//!
//! A matrix called again and again would sit in L3 (32 MiB here), which is not what decode sees:
//! each layer's weights are evicted by the other layers' before they are used again. So every shape
//! is allocated in enough copies to cover 256 MiB (`--span MIB`: that many instead), and consecutive
//! calls cycle through the copies.
//! `--hot` uses one copy instead: the weights stay in cache from call to call, as a drafter's
//! matrices (2 MB for the shipped one) do between its draft steps.

use std::time::Instant;
use tandem::kernels::{bandwidth, isa, matmul_with, quant, DType, Isa, MatRef, QMatRef, QType, Weight};

struct Args {
    isa: Isa,
    quick: bool,
    prefill: bool,
    small: bool,
    /// `--hot`: one copy of each matrix, called again and again (cache-resident).
    hot: bool,
    dtype: DType,
    /// `--quant q4_k`: quantized weights of this format instead of `dtype`.
    quant: Option<QType>,
    /// `--ms 1,4,8`: replaces the default m list.
    ms: Option<Vec<usize>>,
    /// `--shape 6144x1536`: only this shape.
    shape: Option<(usize, usize)>,
    /// `--align N`: weight data starts N bytes past a 64-byte boundary (default: wherever `malloc`
    /// puts it). Memory-mapped tensors are generally not 64-byte aligned.
    align: Option<usize>,
    /// `--huge`: weights in 2 MiB-aligned memory advised `MADV_HUGEPAGE` (transparent huge pages).
    huge: bool,
    /// `--span MIB`: the copies cover this many MiB instead of 256 (a small model's whole weights,
    /// partly in L3 from one token to the next).
    span_mib: usize,
}

fn parse_args() -> Args {
    let mut a = Args {
        isa: isa(),
        quick: false,
        prefill: false,
        small: false,
        hot: false,
        dtype: DType::BF16,
        quant: None,
        ms: None,
        shape: None,
        align: None,
        huge: false,
        span_mib: 256,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--isa" => match it.next().as_deref().and_then(Isa::parse) {
                Some(i) => a.isa = i.min(Isa::detected()),
                None => eprintln!("--isa wants one of scalar|avx2|avx512|avx512bf16; using {}", a.isa),
            },
            "--threads" => {
                let n = it.next().and_then(|s| s.parse().ok()).unwrap_or(0);
                if let Err(e) = rayon::ThreadPoolBuilder::new().num_threads(n).build_global() {
                    eprintln!("--threads: {e}");
                }
            }
            "--dtype" => {
                a.dtype = match it.next().as_deref() {
                    Some("f16") => DType::F16,
                    Some("f32") => DType::F32,
                    _ => DType::BF16,
                }
            }
            "--quant" => {
                let name = it.next().unwrap_or_default();
                a.quant = match name.to_ascii_lowercase().as_str() {
                    "q8_0x16" => Some(QType::Q8_0x16),
                    "q4_kx16" => Some(QType::Q4_Kx16),
                    "q6_kx16" => Some(QType::Q6_Kx16),
                    _ => QType::ALL.into_iter().find(|q| q.name().eq_ignore_ascii_case(&name)),
                };
                if a.quant.is_none() {
                    eprintln!(
                        "--quant wants one of q8_0|q8_0x16|q4_0|q5_0|q5_1|q4_k|q4_kx16|q5_k|q6_k|q6_kx16; using {}",
                        a.dtype.name()
                    );
                }
            }
            "--ms" => a.ms = it.next().map(|s| s.split(',').filter_map(|v| v.trim().parse().ok()).collect()),
            "--shape" => {
                a.shape = it.next().and_then(|s| {
                    let (r, c) = s.split_once('x')?;
                    Some((r.trim().parse().ok()?, c.trim().parse().ok()?))
                })
            }
            "--align" => a.align = it.next().and_then(|s| s.parse().ok()).map(|n: usize| n % 64 / 2 * 2),
            "--quick" => a.quick = true,
            "--huge" => a.huge = true,
            "--prefill" => a.prefill = true,
            "--small" => a.small = true,
            "--hot" => a.hot = true,
            "--span" => a.span_mib = it.next().and_then(|s| s.parse().ok()).filter(|&n| n > 0).unwrap_or(256),
            other => eprintln!("ignoring argument {other}"),
        }
    }
    a
}

/// Random weights in [-1, 1] as raw little-endian bytes of `dtype` (cheap: one xorshift per value).
fn random_weights(dtype: DType, len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut out = Vec::with_capacity(len * dtype.size());
    for _ in 0..len {
        let r = next();
        let v = (r >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
        match dtype {
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes()),
            DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
        }
    }
    out
}

/// Random weights in [-1, 1] quantized to `qt`, as bytes. Quantizing (the k-quants especially) is far
/// slower than a matmul, so at most 4096 rows are quantized and repeated down the matrix; the kernels'
/// time does not depend on the values.
fn quantized_weights(qt: QType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    if qt == QType::Q8_0x16 {
        return tandem::kernels::q8x16::pack(&quantized_weights(QType::Q8_0, rows, cols, seed), rows, cols);
    }
    if qt == QType::Q4_Kx16 {
        return tandem::kernels::q4kx16::pack(&quantized_weights(QType::Q4_K, rows, cols, seed), rows, cols);
    }
    if qt == QType::Q6_Kx16 {
        return tandem::kernels::q6kx16::pack(&quantized_weights(QType::Q6_K, rows, cols, seed), rows, cols);
    }
    let distinct = rows.min(4096);
    let raw = random_weights(DType::F32, distinct * cols, seed);
    let vals: Vec<f32> = raw.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    let rb = qt.row_bytes(cols).expect("--quant: columns must be a whole number of blocks");
    let mut block = vec![0u8; distinct * rb];
    for (x, o) in vals.chunks_exact(cols).zip(block.chunks_exact_mut(rb)) {
        quant::quantize_row(qt, x, o);
    }
    let mut out = Vec::with_capacity(rows * rb);
    while out.len() < rows * rb {
        let n = (rows * rb - out.len()).min(block.len());
        out.extend_from_slice(&block[..n]);
    }
    out
}

/// `w` copied to a 2 MiB boundary of a buffer advised `MADV_HUGEPAGE` before it is first touched.
fn huge_copy(w: &[u8]) -> Vec<u8> {
    let mut buf: Vec<u8> = Vec::with_capacity(w.len() + (2 << 20));
    let off = buf.as_ptr().align_offset(2 << 20);
    // SAFETY: the range lies inside `buf`'s allocation; madvise only changes how it is backed.
    unsafe {
        libc::madvise(buf.as_mut_ptr().add(off) as *mut libc::c_void, w.len(), libc::MADV_HUGEPAGE);
    }
    buf.resize(off, 0);
    buf.extend_from_slice(w);
    buf
}

/// Times of `m`-row calls, cycling through `mats` (every copy touched once, untimed, first).
struct Runner<'a> {
    isa: Isa,
    mats: &'a [Weight<'a>],
    next: usize,
}

impl Runner<'_> {
    /// Median seconds per call over `calls` calls.
    fn time(&mut self, m: usize, calls: usize) -> f64 {
        let (rows, k) = (self.mats[0].rows(), self.mats[0].cols());
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0).collect();
        let mut out = vec![0f32; m * rows];
        let mut times: Vec<f64> = (0..calls.max(1))
            .map(|_| {
                let w = self.mats[self.next % self.mats.len()];
                self.next += 1;
                let t = Instant::now();
                matmul_with(self.isa, &x, m, w, &mut out);
                t.elapsed().as_secs_f64()
            })
            .collect();
        std::hint::black_box(&out);
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Rounds of every m in turn (so a slow spell on this shared machine hits all of them alike); per m
/// the median over rounds of its time and of its ratio to m = 1 in the same round.
fn bench_shape(a: &Args, rows: usize, cols: usize, ms: &[usize]) {
    let bytes = match a.quant {
        Some(q) => rows * q.row_bytes(cols).expect("--quant: columns must be a whole number of blocks"),
        None => rows * cols * a.dtype.size(),
    };
    let copies = if a.hot { 1 } else { (a.span_mib << 20).div_ceil(bytes).max(1) };
    // Quantized: one matrix, copied (quantizing every copy would take minutes).
    let quantized = a.quant.map(|q| quantized_weights(q, rows, cols, 0x9e37));
    let bufs: Vec<Vec<u8>> = (0..copies)
        .map(|i| {
            let w = match &quantized {
                Some(qw) => qw.clone(),
                None => random_weights(a.dtype, rows * cols, 0x9e37 + i as u64),
            };
            match (a.align, a.huge) {
                (_, true) => huge_copy(&w),
                (None, false) => w,
                (Some(_), false) => [vec![0u8; 128], w].concat(),
            }
        })
        .collect();
    let mats: Vec<Weight> = bufs
        .iter()
        .map(|b| {
            let data = match a.align {
                _ if a.huge => {
                    let off = b.as_ptr().align_offset(2 << 20);
                    &b[off..off + bytes]
                }
                None => &b[..],
                Some(n) => {
                    let off = b.as_ptr().align_offset(64) + n;
                    &b[off..off + bytes]
                }
            };
            match a.quant {
                Some(q) => QMatRef::new(q, rows, cols, data).into(),
                None => MatRef::new(a.dtype, rows, cols, data).into(),
            }
        })
        .collect();
    // This machine's memory bandwidth swings with its neighbours' load: measure it next to each
    // shape so the GB/s below can be read against it.
    println!("  (read bandwidth now: {:.1} GB/s)", bandwidth::measure_read_bandwidth(256 << 20));
    let mut run = Runner { isa: a.isa, mats: &mats, next: 0 };
    for &m in ms {
        run.time(m, copies);
    }
    // ~50 ms per m per round.
    let t1 = run.time(ms[0], 3);
    let calls = ((0.05 / t1) as usize).clamp(3, 400);
    let rounds = if a.quick { 3 } else { 9 };
    let mut times = vec![Vec::new(); ms.len()];
    let mut ratios = vec![Vec::new(); ms.len()];
    for _ in 0..rounds {
        let t: Vec<f64> = ms.iter().map(|&m| run.time(m, calls)).collect();
        for (idx, &ti) in t.iter().enumerate() {
            times[idx].push(ti);
            ratios[idx].push(ti / t[0]);
        }
    }
    for (idx, &m) in ms.iter().enumerate() {
        let best = times[idx].iter().copied().fold(f64::INFINITY, f64::min);
        let t = median(times[idx].clone());
        println!(
            "  [{rows:>6}, {cols:>5}] m={m:<3} {:>8.1} µs (best {:>8.1})  {:>5.1} GB/s  {:>6.1} GFLOP/s  t/t({}) = {:.2}",
            t * 1e6,
            best * 1e6,
            bytes as f64 / t / 1e9,
            2.0 * (m * rows * cols) as f64 / t / 1e9,
            ms[0],
            median(ratios[idx].clone())
        );
    }
}

fn main() {
    let a = parse_args();
    let weights = a.quant.map_or(a.dtype.name(), |q| q.name());
    println!("isa {} ({} threads), weights {weights}", a.isa, rayon::current_num_threads());
    if a.shape.is_none() {
        let gbs = bandwidth::measure_read_bandwidth(1 << 30);
        println!("measure_read_bandwidth(1 GiB): {gbs:.1} GB/s");
    }
    let ms = a.ms.clone().filter(|v| !v.is_empty()).unwrap_or_else(|| vec![1, 2, 4, 5, 8, 16]);
    if let Some((rows, cols)) = a.shape {
        bench_shape(&a, rows, cols, &ms);
        return;
    }
    bench_shape(&a, 6144, 1536, &ms);
    bench_shape(&a, 1536, 6144, &ms);
    if !a.quick {
        bench_shape(&a, 262144, 1536, &ms);
    }
    if a.prefill {
        let ms = [1, 64, 256, 512];
        bench_shape(&a, 6144, 1536, &ms);
        bench_shape(&a, 1536, 6144, &ms);
    }
    if a.small {
        // Where threading starts to pay: compare with `--threads 1`.
        for (rows, cols) in [(64, 1536), (128, 1536), (256, 1536), (512, 1536), (1024, 1536), (1536, 256), (1536, 512)]
        {
            bench_shape(&a, rows, cols, &[1, 4, 16]);
        }
    }
}
