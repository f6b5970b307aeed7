//! Block-quantized weights in GGUF's layouts (docs/quantization.md): the formats, quantizing rows into
//! them, reading them back, and the portable reference matmul the SIMD versions are tested against.
//!
//! A quantized matmul first quantizes its activations per block, into the 8-bit companion format the
//! weight format is paired with (Q8_0 for Q8_0/Q4_0/Q5_0/IQ4_NL, Q8_1 for Q5_1, Q8_K for the k-quants and
//! IQ4_XS), so that
//! every product inside a block is an exact integer; only the per-block scaling is floating point. Each
//! output element is then one fixed sequence of operations over its weight row and activation row,
//! whatever the number of rows or threads: row `i` of a 16-row verify equals the same row alone.
//!
//! The quantizers reproduce llama.cpp's reference quantizers (`llama-quantize` without an importance
//! matrix) operation for operation, so a tensor quantized here has the same bytes as in a llama.cpp file
//! (tested against goldens written by `llama-quantize`).

use half::f16;

/// Elements in a k-quant super-block.
pub const QK_K: usize = 256;
/// Weight rows per strip of the layouts packed at load (`QType::unpacked`).
pub const STRIP: usize = 16;

/// A block-quantized weight format (named as GGUF names them).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QType {
    /// 32 int8 values and an f16 scale: 8.5 bits per weight.
    Q8_0,
    /// 32 4-bit values (offset 8) and an f16 scale: 4.5 bits.
    Q4_0,
    /// 32 5-bit values (offset 16) and an f16 scale: 5.5 bits.
    Q5_0,
    /// 32 5-bit values, an f16 scale and an f16 minimum: 6 bits.
    Q5_1,
    /// 256 4-bit values in 8 sub-blocks with 6-bit scales and minimums: 4.5 bits.
    Q4_K,
    /// 256 5-bit values in 8 sub-blocks with 6-bit scales and minimums: 5.5 bits.
    Q5_K,
    /// 256 6-bit values in 16 sub-blocks with 8-bit scales: 6.5625 bits.
    Q6_K,
    /// 32 4-bit indices into a fixed table of 16 non-uniform int8 levels ([`IQ4_VALUES`]) and an f16
    /// scale: 4.5 bits.
    IQ4_NL,
    /// 256 4-bit indices into the same table in 8 sub-blocks of 32 with 6-bit signed scales: 4.25 bits.
    IQ4_XS,
    /// Q8_0 repacked at load in strips of 16 rows for the SIMD kernels (`q8x16`): not a file format.
    Q8_0x16,
    /// Q4_K repacked at load in strips of 16 rows for the SIMD kernels (`q4kx16`): not a file format.
    Q4_Kx16,
    /// Q6_K repacked at load in strips of 16 rows for the SIMD kernels (`q6kx16`): not a file format.
    Q6_Kx16,
}

/// The levels of IQ4_NL / IQ4_XS (ggml's `kvalues_iq4nl`), indexed by the stored nibble.
pub const IQ4_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// The 8-bit format a weight format's activations are quantized into.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActKind {
    /// Blocks of 32 with an f16-rounded scale.
    Q8_0,
    /// As Q8_0, plus the block's scaled sum (for formats with a minimum).
    Q8_1,
    /// Blocks of 256 with an f32 scale and sums of every 16 values.
    Q8_K,
}

impl QType {
    pub const ALL: [QType; 9] = [
        QType::Q8_0,
        QType::Q4_0,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q4_K,
        QType::Q5_K,
        QType::Q6_K,
        QType::IQ4_NL,
        QType::IQ4_XS,
    ];

    /// GGUF's name (`ggml_type_name`).
    pub fn name(self) -> &'static str {
        match self {
            QType::Q8_0 => "Q8_0",
            QType::Q4_0 => "Q4_0",
            QType::Q5_0 => "Q5_0",
            QType::Q5_1 => "Q5_1",
            QType::Q4_K => "Q4_K",
            QType::Q5_K => "Q5_K",
            QType::Q6_K => "Q6_K",
            QType::IQ4_NL => "IQ4_NL",
            QType::IQ4_XS => "IQ4_XS",
            QType::Q8_0x16 => "Q8_0 (16-row strips)",
            QType::Q4_Kx16 => "Q4_K (16-row strips)",
            QType::Q6_Kx16 => "Q6_K (16-row strips)",
        }
    }

    /// GGUF's type id (`enum ggml_type`).
    pub fn ggml_id(self) -> u32 {
        match self {
            QType::Q4_0 => 2,
            QType::Q5_0 => 6,
            QType::Q5_1 => 7,
            QType::Q8_0 => 8,
            QType::Q4_K => 12,
            QType::Q5_K => 13,
            QType::Q6_K => 14,
            QType::IQ4_NL => 20,
            QType::IQ4_XS => 23,
            // Not a GGUF type: a packed matrix is never written (export refuses it) nor read.
            QType::Q8_0x16 | QType::Q4_Kx16 | QType::Q6_Kx16 => u32::MAX,
        }
    }

    pub fn from_ggml_id(id: u32) -> Option<QType> {
        QType::ALL.into_iter().find(|q| q.ggml_id() == id)
    }

    /// Weights per block.
    pub fn block_elems(self) -> usize {
        match self {
            QType::Q8_0 | QType::Q8_0x16 | QType::Q4_0 | QType::Q5_0 | QType::Q5_1 | QType::IQ4_NL => 32,
            QType::Q4_K | QType::Q4_Kx16 | QType::Q5_K | QType::Q6_K | QType::Q6_Kx16 | QType::IQ4_XS => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            // Q8_0x16: a strip's block is 16 rows' blocks.
            QType::Q8_0 | QType::Q8_0x16 => 34,
            QType::Q4_0 => 18,
            QType::Q5_0 => 22,
            QType::Q5_1 => 24,
            QType::Q4_K => 144,
            // Q4_Kx16: the scales unpacked to bytes (`q4kx16`).
            QType::Q4_Kx16 => super::q4kx16::ROW_BYTES,
            QType::Q5_K => 176,
            QType::Q6_K | QType::Q6_Kx16 => 210,
            QType::IQ4_NL => 18,
            QType::IQ4_XS => 136,
        }
    }

    /// Bytes of a row of `cols` weights, or `None` when `cols` is not a whole number of blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        cols.is_multiple_of(self.block_elems()).then(|| cols / self.block_elems() * self.block_bytes())
    }

    pub fn act(self) -> ActKind {
        match self {
            QType::Q8_0 | QType::Q8_0x16 | QType::Q4_0 | QType::Q5_0 | QType::IQ4_NL => ActKind::Q8_0,
            QType::Q5_1 => ActKind::Q8_1,
            QType::Q4_K | QType::Q4_Kx16 | QType::Q5_K | QType::Q6_K | QType::Q6_Kx16 | QType::IQ4_XS => ActKind::Q8_K,
        }
    }

    /// For a layout packed in strips of 16 rows at load (`q8x16`, `q4kx16`, `q6kx16`), the file format it was
    /// packed from; `None` for the file formats themselves.
    pub fn unpacked(self) -> Option<QType> {
        match self {
            QType::Q8_0x16 => Some(QType::Q8_0),
            QType::Q4_Kx16 => Some(QType::Q4_K),
            QType::Q6_Kx16 => Some(QType::Q6_K),
            _ => None,
        }
    }
}

impl std::fmt::Display for QType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The shapes a product over a packed layout checks first: `w` is `qtype`, the activations were
/// quantized for it at its width, `out` has one row of the chunk's width per activation row, and
/// `words` holds `per_block` of the layout's own activation words per activation block.
pub(super) fn check_strips(
    qtype: QType,
    acts: &QActs,
    words: &[i32],
    per_block: usize,
    w: &QMatRef,
    out: &[&mut [f32]],
) {
    assert_eq!(w.qtype, qtype);
    assert!(acts.kind == w.qtype.act() && acts.cols == w.cols, "activations quantized for another format or width");
    assert_eq!(out.len(), acts.rows, "one output row per activation row");
    assert!(out.iter().all(|o| o.len() == w.rows), "output rows of the chunk's width");
    assert_eq!(words.len(), acts.rows * (w.cols / qtype.block_elems()) * per_block, "activation words per block");
}

/// A row-major `[rows, cols]` matrix of blocks (each row a whole number of blocks).
#[derive(Clone, Copy, Debug)]
pub struct QMatRef<'a> {
    pub qtype: QType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> QMatRef<'a> {
    pub fn new(qtype: QType, rows: usize, cols: usize, data: &'a [u8]) -> Self {
        let row = qtype.row_bytes(cols).expect("quantized matrix width is a whole number of blocks");
        assert_eq!(data.len(), rows * row, "quantized matrix buffer size");
        assert!(qtype.unpacked().is_none() || rows.is_multiple_of(STRIP), "packed rows in whole strips");
        QMatRef { qtype, rows, cols, data }
    }

    pub fn row_bytes(&self) -> usize {
        self.qtype.row_bytes(self.cols).expect("validated at construction")
    }

    /// Row `r`'s bytes (not for a packed layout, whose rows are interleaved: `unpack_row`).
    pub fn row(&self, r: usize) -> &'a [u8] {
        assert!(self.qtype.unpacked().is_none(), "a packed row is not contiguous");
        let b = self.row_bytes();
        &self.data[r * b..(r + 1) * b]
    }

    pub fn slice_rows(&self, start: usize, n: usize) -> QMatRef<'a> {
        assert!(start + n <= self.rows);
        assert!(
            self.qtype.unpacked().is_none() || (start.is_multiple_of(STRIP) && n.is_multiple_of(STRIP)),
            "packed rows sliced in whole strips"
        );
        let b = self.row_bytes();
        QMatRef { qtype: self.qtype, rows: n, cols: self.cols, data: &self.data[start * b..(start + n) * b] }
    }

    /// Row `r` dequantized.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        fn each<B: AsRef<[u8]>>(file: QType, blocks: impl Iterator<Item = B>, out: &mut [f32]) {
            for (b, o) in blocks.zip(out.chunks_exact_mut(QK_K)) {
                dequantize_row(file, b.as_ref(), o);
            }
        }
        match self.qtype {
            QType::Q8_0x16 => super::q8x16::dequantize_row(self, r, out),
            QType::Q4_Kx16 => each(QType::Q4_K, super::q4kx16::row_blocks(self, r), out),
            QType::Q6_Kx16 => each(QType::Q6_K, super::q6kx16::row_blocks(self, r), out),
            _ => dequantize_row(self.qtype, self.row(r), out),
        }
    }

    /// Row `r` as its file format's bytes (`out`: a row of `qtype.unpacked()`, or of `qtype` when it
    /// is a file format).
    pub fn unpack_row(&self, r: usize, out: &mut [u8]) {
        fn each<const N: usize>(blocks: impl Iterator<Item = [u8; N]>, out: &mut [u8]) {
            for (b, o) in blocks.zip(out.chunks_exact_mut(N)) {
                o.copy_from_slice(&b);
            }
        }
        let file = self.qtype.unpacked().unwrap_or(self.qtype);
        assert_eq!(Some(out.len()), file.row_bytes(self.cols), "one row of the file format");
        match self.qtype {
            QType::Q8_0x16 => super::q8x16::unpack_row(self, r, out),
            QType::Q4_Kx16 => each(super::q4kx16::row_blocks(self, r), out),
            QType::Q6_Kx16 => each(super::q6kx16::row_blocks(self, r), out),
            _ => out.copy_from_slice(self.row(r)),
        }
    }
}

#[inline]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

#[inline]
fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// Round to the nearest integer, ties to even, as llama.cpp's quantizers do (by adding 1.5·2^23 and
/// reading the mantissa; valid for |x| < 2^22, which every caller's values are).
#[inline]
fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Below this a group of weights counts as all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

// ---------------------------------------------------------------------------------------------------
// Quantizing weights

/// Quantize `x` (a whole number of blocks) into `out` (`row_bytes(x.len())` bytes).
pub fn quantize_row(q: QType, x: &[f32], out: &mut [u8]) {
    let (be, bb) = (q.block_elems(), q.block_bytes());
    assert!(x.len().is_multiple_of(be) && out.len() == x.len() / be * bb, "quantize_row shapes");
    for (xb, ob) in x.chunks_exact(be).zip(out.chunks_exact_mut(bb)) {
        ob.fill(0);
        match q {
            QType::Q8_0 => quantize_q8_0(xb, ob),
            QType::Q4_0 => quantize_q4_0(xb, ob),
            QType::Q5_0 => quantize_q5_0(xb, ob),
            QType::Q5_1 => quantize_q5_1(xb, ob),
            QType::Q4_K => quantize_qk_min(xb, ob, 15),
            QType::Q5_K => quantize_qk_min(xb, ob, 31),
            QType::Q6_K => quantize_q6_k(xb, ob),
            QType::IQ4_NL | QType::IQ4_XS => quantize_iq4(xb, ob),
            QType::Q8_0x16 | QType::Q4_Kx16 | QType::Q6_Kx16 => {
                panic!("a packed layout is packed from its file format's rows (q8x16, q4kx16, q6kx16), not quantized by row")
            }
        }
    }
}

fn quantize_q8_0(x: &[f32], o: &mut [u8]) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(o, 0, d);
    for (dst, v) in o[2..34].iter_mut().zip(x) {
        *dst = ((v * id).round() as i8) as u8;
    }
}

/// The value of largest magnitude (the first of equal magnitudes), as a signed number.
fn signed_max(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

fn quantize_q4_0(x: &[f32], o: &mut [u8]) {
    let d = signed_max(x) / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(o, 0, d);
    for j in 0..16 {
        let lo = ((x[j] * id + 8.5) as i8).min(15) as u8;
        let hi = ((x[j + 16] * id + 8.5) as i8).min(15) as u8;
        o[2 + j] = lo | (hi << 4);
    }
}

fn quantize_q5_0(x: &[f32], o: &mut [u8]) {
    let d = signed_max(x) / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(o, 0, d);
    let mut qh = 0u32;
    for j in 0..16 {
        let lo = ((x[j] * id + 16.5) as i8).min(31) as u8;
        let hi = ((x[j + 16] * id + 16.5) as i8).min(31) as u8;
        o[6 + j] = (lo & 0x0f) | ((hi & 0x0f) << 4);
        qh |= (((lo & 0x10) >> 4) as u32) << j;
        qh |= (((hi & 0x10) >> 4) as u32) << (j + 16);
    }
    o[2..6].copy_from_slice(&qh.to_le_bytes());
}

fn quantize_q5_1(x: &[f32], o: &mut [u8]) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    let d = (max - min) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(o, 0, d);
    put_f16(o, 2, min);
    let mut qh = 0u32;
    for j in 0..16 {
        let lo = ((x[j] - min) * id + 0.5) as u8;
        let hi = ((x[j + 16] - min) * id + 0.5) as u8;
        o[8 + j] = (lo & 0x0f) | ((hi & 0x0f) << 4);
        qh |= (((lo & 0x10) >> 4) as u32) << j;
        qh |= (((hi & 0x10) >> 4) as u32) << (j + 16);
    }
    o[4..8].copy_from_slice(&qh.to_le_bytes());
}

/// Scale and minimum for `x` with levels `0..=nmax` (`x ≈ scale·l − min`), chosen by weighted least
/// squares over a small grid of candidate inverse scales; fills `levels`. Returns `(scale, min)`.
fn fit_scale_min(x: &[f32], w: &[f32], nmax: i32, rmin: f32, rdelta: f32, nstep: i32, levels: &mut [u8]) -> (f32, f32) {
    let n = x.len();
    let (mut lo, mut hi) = (x[0], x[0]);
    let (mut sum_w, mut sum_x) = (w[0], w[0] * x[0]);
    for i in 1..n {
        lo = lo.min(x[i]);
        hi = hi.max(x[i]);
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    // (min/max written as comparisons above would differ only for NaN, which min()/max() skip.)
    if lo > 0.0 {
        lo = 0.0;
    }
    if hi == lo {
        levels.fill(0);
        return (0.0, -lo);
    }
    let mut iscale = nmax as f32 / (hi - lo);
    let mut scale = 1.0 / iscale;
    let mut best = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - lo)).clamp(0, nmax);
        levels[i] = l as u8;
        let diff = scale * l as f32 + lo - x[i];
        best += w[i] * (diff * diff);
    }
    let mut trial = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (hi - lo);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - lo)).clamp(0, nmax);
            trial[i] = l as u8;
            let lf = l as f32;
            sum_l += w[i] * lf;
            sum_l2 += w[i] * lf * lf;
            sum_xl += w[i] * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut err = 0f32;
            for i in 0..n {
                let diff = this_scale * trial[i] as f32 + this_min - x[i];
                err += w[i] * (diff * diff);
            }
            if err < best {
                levels[..n].copy_from_slice(&trial[..n]);
                best = err;
                scale = this_scale;
                lo = this_min;
            }
        }
    }
    (scale, -lo)
}

/// The 6-bit scale and minimum of sub-block `j` from a k-quant's 12 packed bytes.
#[inline]
pub(crate) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Q4_K (`nmax` 15) and Q5_K (`nmax` 31): a super-block of 8 sub-blocks of 32, each with a 6-bit scale
/// and minimum relative to the super-block's f16 `d` and `dmin`.
fn quantize_qk_min(x: &[f32], o: &mut [u8], nmax: i32) {
    let (rmin, nstep) = if nmax == 15 { (-1.0, 20) } else { (-0.5, 15) };
    let mut levels = [0u8; QK_K];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let mut weights = [0f32; 32];
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let sum_x2: f32 = xs.iter().fold(0.0, |a, v| a + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (s, m) = fit_scale_min(xs, &weights, nmax, rmin, 0.1, nstep, &mut levels[32 * j..32 * j + 32]);
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let sc = &mut o[4..16];
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    put_f16(o, 0, max_scale / 63.0);
    put_f16(o, 2, max_min / 63.0);
    let (d_all, dmin_all) = (f16_at(o, 0), f16_at(o, 2));
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, &o[4..16]);
        let d = d_all * s as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * m as f32;
        for i in 0..32 {
            levels[32 * j + i] = nearest_int((x[32 * j + i] + dm) / d).clamp(0, nmax) as u8;
        }
    }
    if nmax == 15 {
        let qs = &mut o[16..144];
        for c in 0..4 {
            for l in 0..32 {
                qs[32 * c + l] = levels[64 * c + l] | (levels[64 * c + 32 + l] << 4);
            }
        }
    } else {
        let (qh, qs) = o[16..176].split_at_mut(32);
        for c in 0..4 {
            for l in 0..32 {
                let (mut a, mut b) = (levels[64 * c + l], levels[64 * c + 32 + l]);
                if a > 15 {
                    a -= 16;
                    qh[l] |= 1 << (2 * c);
                }
                if b > 15 {
                    b -= 16;
                    qh[l] |= 2 << (2 * c);
                }
                qs[32 * c + l] = a | (b << 4);
            }
        }
    }
}

/// Symmetric levels `-nmax..nmax-1` for a group (weights `x²`), searching 18 inverse scales around the
/// plain one; fills `levels` with `l + nmax` and returns the scale.
fn fit_scale_symmetric(x: &[f32], nmax: i32, levels: &mut [i8]) -> f32 {
    let max = signed_max(x);
    if max.abs() < GROUP_MAX_EPS {
        levels.fill(0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let mut iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (i, &v) in x.iter().enumerate() {
        let l = level(iscale, v);
        levels[i] = (l + nmax) as i8;
        let w = v * v;
        sumlx += w * v * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let l = level(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (i, &v) in x.iter().enumerate() {
                levels[i] = (level(iscale, v) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

fn quantize_q6_k(x: &[f32], o: &mut [u8]) {
    let mut levels = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs) = (0f32, 0f32);
    for g in 0..16 {
        let s = fit_scale_symmetric(&x[16 * g..16 * g + 16], 32, &mut levels[16 * g..16 * g + 16]);
        scales[g] = s;
        if s.abs() > max_abs {
            max_abs = s.abs();
            max_scale = s;
        }
    }
    if max_abs < GROUP_MAX_EPS {
        return; // all zero (the block was zero-filled)
    }
    let iscale = -128.0 / max_scale;
    put_f16(o, 208, 1.0 / iscale);
    let d_all = f16_at(o, 208);
    for g in 0..16 {
        let s = nearest_int(iscale * scales[g]).min(127) as i8;
        o[192 + g] = s as u8;
        let d = d_all * s as f32;
        if d == 0.0 {
            continue;
        }
        for i in 0..16 {
            levels[16 * g + i] = (nearest_int(x[16 * g + i] / d).clamp(-32, 31) + 32) as i8;
        }
    }
    let (ql, rest) = o.split_at_mut(128);
    let qh = &mut rest[..64];
    for half in 0..2 {
        let (lv, ql, qh) = (&levels[128 * half..], &mut ql[64 * half..], &mut qh[32 * half..]);
        for l in 0..32 {
            let q = |k: usize| lv[l + 32 * k] as u8;
            ql[l] = (q(0) & 0x0f) | ((q(2) & 0x0f) << 4);
            ql[l + 32] = (q(1) & 0x0f) | ((q(3) & 0x0f) << 4);
            qh[l] = (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
        }
    }
}

/// The index of the IQ4 level nearest `x` (the lower one on a tie; the end levels beyond the table).
fn iq4_index(x: f32) -> u8 {
    let v = &IQ4_VALUES;
    if x <= v[0] as f32 {
        return 0;
    }
    if x >= v[15] as f32 {
        return 15;
    }
    // Bisect for neighbours lo < hi with v[lo] <= x < v[hi].
    let (mut lo, mut hi) = (0usize, 15usize);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if x < v[mid] as f32 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    if x - (v[lo] as f32) < (v[hi] as f32) - x {
        lo as u8
    } else {
        hi as u8
    }
}

/// The scale of one group of 32 for IQ4 levels (weights `x²`): the plain scale from the value of largest
/// magnitude refined by least squares, then the best of 15 trial inverse scales around it. Zero for an
/// all-zero group.
fn fit_scale_iq4(x: &[f32]) -> f32 {
    let v0 = IQ4_VALUES[0] as f32;
    let max = signed_max(x);
    if max.abs() < GROUP_MAX_EPS {
        return 0.0;
    }
    let sums = |iscale: f32| {
        let (mut sumqx, mut sumq2) = (0f32, 0f32);
        for &v in x {
            let q = IQ4_VALUES[iq4_index(iscale * v) as usize] as f32;
            let w = v * v;
            sumqx += w * q * v;
            sumq2 += w * q * q;
        }
        (sumqx, sumq2)
    };
    let (sumqx, sumq2) = sums(1.0 / (-max / v0));
    let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for t in -7..=7 {
        let (sumqx, sumq2) = sums((t + IQ4_VALUES[0] as i32) as f32 / max);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    d
}

/// IQ4_NL (a block of 32) and IQ4_XS (a super-block of 256: 8 groups of 32 whose scales are stored as
/// 6-bit multiples, offset 32, of the super-block's f16 `d`).
fn quantize_iq4(x: &[f32], o: &mut [u8]) {
    let mut levels = [0u8; QK_K];
    let n = x.len();
    let qs_at = if n == 32 {
        let d = fit_scale_iq4(x);
        put_f16(o, 0, d);
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        for (l, &v) in levels.iter_mut().zip(x) {
            *l = iq4_index(id * v);
        }
        2
    } else {
        let mut scales = [0f32; 8];
        let (mut max_scale, mut amax_scale) = (0f32, 0f32);
        for (g, s) in scales.iter_mut().enumerate() {
            *s = fit_scale_iq4(&x[32 * g..32 * g + 32]);
            if s.abs() > amax_scale {
                amax_scale = s.abs();
                max_scale = *s;
            }
        }
        // The group levels are chosen with the unrounded super-block scale, as llama.cpp does.
        let d = -max_scale / 32.0;
        put_f16(o, 0, d);
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut scales_h = 0u16;
        for (g, &s) in scales.iter().enumerate() {
            let l = nearest_int(id * s).clamp(-32, 31);
            let dl = d * l as f32;
            let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
            for i in 32 * g..32 * g + 32 {
                levels[i] = iq4_index(idl * x[i]);
            }
            let l = (l + 32) as u8;
            o[4 + g / 2] |= (l & 0x0f) << (4 * (g % 2));
            scales_h |= ((l >> 4) as u16) << (2 * g);
        }
        o[2..4].copy_from_slice(&scales_h.to_le_bytes());
        8
    };
    for (g, qs) in o[qs_at..].chunks_exact_mut(16).enumerate() {
        for (j, b) in qs.iter_mut().enumerate() {
            *b = levels[32 * g + j] | (levels[32 * g + 16 + j] << 4);
        }
    }
}

/// The eight 6-bit scales (offset 32 kept) of an IQ4_XS super-block `b`, byte `j` for sub-block `j`.
#[inline]
pub(crate) fn iq4xs_scales(b: &[u8]) -> u64 {
    let h = u16::from_le_bytes([b[2], b[3]]) as u64;
    let mut out = 0u64;
    for j in 0..8 {
        let lo = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0f;
        out |= ((lo as u64) | (((h >> (2 * j)) & 3) << 4)) << (8 * j);
    }
    out
}

// ---------------------------------------------------------------------------------------------------
// Reading weights back

/// The integer levels of one block as the kernels multiply them, and how to scale them. `q` gets the
/// block's `block_elems` values; the meaning of the rest depends on the format:
/// - Q8_0/Q4_0/Q5_0: `q` signed (offset removed), value = `d · q`;
/// - Q5_1: `q` unsigned, value = `d · q + m`;
/// - Q4_K/Q5_K: `q` unsigned, value = `d · sc[j] · q − dmin · mn[j]` for sub-block `j` of 32;
/// - Q6_K: `q` signed (offset 32 removed), value = `d · sc[g] · q` for group `g` of 16;
/// - IQ4_NL: `q` the table's levels, value = `d · q`;
/// - IQ4_XS: `q` the table's levels, value = `d · sc[j] · q` for sub-block `j` of 32 (`sc` offset 32
///   removed).
pub(crate) struct Unpacked {
    pub q: [i8; QK_K],
    pub d: f32,
    pub m: f32,
    pub sc: [i16; 16],
    pub mn: [i16; 8],
}

impl Unpacked {
    pub fn new() -> Self {
        Unpacked { q: [0; QK_K], d: 0.0, m: 0.0, sc: [0; 16], mn: [0; 8] }
    }
}

/// Unpack one block of format `qt` (`b` is its bytes).
pub(crate) fn unpack(qt: QType, b: &[u8], u: &mut Unpacked) {
    match qt {
        QType::Q8_0x16 | QType::Q4_Kx16 | QType::Q6_Kx16 => {
            panic!("packed blocks interleave 16 rows (q8x16, q4kx16, q6kx16)")
        }
        QType::Q8_0 => {
            u.d = f16_at(b, 0);
            for (d, &s) in u.q[..32].iter_mut().zip(&b[2..34]) {
                *d = s as i8;
            }
        }
        QType::Q4_0 => {
            u.d = f16_at(b, 0);
            for j in 0..16 {
                u.q[j] = (b[2 + j] & 0x0f) as i8 - 8;
                u.q[j + 16] = (b[2 + j] >> 4) as i8 - 8;
            }
        }
        QType::Q5_0 | QType::Q5_1 => {
            let (qh_at, qs_at, off) = if qt == QType::Q5_0 { (2, 6, 16) } else { (4, 8, 0) };
            u.d = f16_at(b, 0);
            u.m = if qt == QType::Q5_1 { f16_at(b, 2) } else { 0.0 };
            let qh = u32::from_le_bytes(b[qh_at..qh_at + 4].try_into().expect("4 bytes"));
            for j in 0..16 {
                let lo = (b[qs_at + j] & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
                let hi = (b[qs_at + j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
                u.q[j] = lo as i8 - off;
                u.q[j + 16] = hi as i8 - off;
            }
        }
        QType::Q4_K | QType::Q5_K => {
            u.d = f16_at(b, 0);
            u.m = f16_at(b, 2);
            for j in 0..8 {
                let (s, m) = scale_min_k4(j, &b[4..16]);
                u.sc[j] = s as i16;
                u.mn[j] = m as i16;
            }
            let (qh, qs): (Option<&[u8]>, &[u8]) =
                if qt == QType::Q4_K { (None, &b[16..144]) } else { (Some(&b[16..48]), &b[48..176]) };
            for c in 0..4 {
                for l in 0..32 {
                    let (mut a, mut h) = (qs[32 * c + l] & 0x0f, qs[32 * c + l] >> 4);
                    if let Some(qh) = qh {
                        a |= ((qh[l] >> (2 * c)) & 1) << 4;
                        h |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                    }
                    u.q[64 * c + l] = a as i8;
                    u.q[64 * c + 32 + l] = h as i8;
                }
            }
        }
        QType::Q6_K => {
            u.d = f16_at(b, 208);
            for g in 0..16 {
                u.sc[g] = b[192 + g] as i8 as i16;
            }
            for half in 0..2 {
                let (ql, qh) = (&b[64 * half..64 * half + 64], &b[128 + 32 * half..128 + 32 * half + 32]);
                let q = &mut u.q[128 * half..128 * half + 128];
                for l in 0..32 {
                    q[l] = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i8 - 32;
                    q[l + 32] = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                    q[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                    q[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                }
            }
        }
        QType::IQ4_NL | QType::IQ4_XS => {
            u.d = f16_at(b, 0);
            let qs = if qt == QType::IQ4_NL {
                &b[2..18]
            } else {
                let sc = iq4xs_scales(b);
                for j in 0..8 {
                    u.sc[j] = ((sc >> (8 * j)) & 0x3f) as i16 - 32;
                }
                &b[8..136]
            };
            for (g, bytes) in qs.chunks_exact(16).enumerate() {
                for (j, &v) in bytes.iter().enumerate() {
                    u.q[32 * g + j] = IQ4_VALUES[(v & 0x0f) as usize];
                    u.q[32 * g + 16 + j] = IQ4_VALUES[(v >> 4) as usize];
                }
            }
        }
    }
}

/// Dequantize a row (`data` a whole number of blocks) into `out`.
pub fn dequantize_row(qt: QType, data: &[u8], out: &mut [f32]) {
    let (be, bb) = (qt.block_elems(), qt.block_bytes());
    assert!(out.len().is_multiple_of(be) && data.len() == out.len() / be * bb, "dequantize_row shapes");
    let mut u = Unpacked::new();
    for (b, o) in data.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        unpack(qt, b, &mut u);
        for (i, v) in o.iter_mut().enumerate() {
            let q = u.q[i] as f32;
            *v = match qt {
                QType::Q8_0 | QType::Q8_0x16 | QType::Q4_0 | QType::Q5_0 | QType::IQ4_NL => u.d * q,
                QType::Q5_1 => u.d * q + u.m,
                QType::Q4_K | QType::Q4_Kx16 | QType::Q5_K => {
                    (u.d * u.sc[i / 32] as f32) * q - u.m * u.mn[i / 32] as f32
                }
                QType::Q6_K | QType::Q6_Kx16 => (u.d * u.sc[i / 16] as f32) * q,
                QType::IQ4_XS => (u.d * u.sc[i / 32] as f32) * q,
            };
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Activations

/// `rows` activation rows quantized for one weight format (llama.cpp's CPU quantizers for the same
/// format: Q8_0/Q8_1 scale by `127 / amax` and round ties to even; Q8_K as its reference).
pub struct QActs {
    pub kind: ActKind,
    pub rows: usize,
    pub cols: usize,
    /// `[rows, cols]` levels.
    pub qs: Vec<i8>,
    /// `[rows, blocks]` scales.
    pub d: Vec<f32>,
    /// Q8_1: `[rows, blocks]` scale × sum of the block's levels (f16-rounded); else empty.
    pub s: Vec<f32>,
    /// Q8_K: `[rows, cols / 16]` sums of every 16 levels; else empty.
    pub bsums: Vec<i16>,
}

impl Default for QActs {
    /// No rows (a buffer for [`quantize_acts_into`]).
    fn default() -> Self {
        QActs { kind: ActKind::Q8_0, rows: 0, cols: 0, qs: Vec::new(), d: Vec::new(), s: Vec::new(), bsums: Vec::new() }
    }
}

impl QActs {
    pub fn block(&self) -> usize {
        if self.kind == ActKind::Q8_K {
            QK_K
        } else {
            32
        }
    }

    pub fn blocks(&self) -> usize {
        self.cols / self.block()
    }

    pub fn row_qs(&self, r: usize) -> &[i8] {
        &self.qs[r * self.cols..(r + 1) * self.cols]
    }

    pub fn row_d(&self, r: usize) -> &[f32] {
        let nb = self.blocks();
        &self.d[r * nb..(r + 1) * nb]
    }
}

/// Quantize `m` rows of `x` (`[m, k]`) for weights of format `qt`.
pub fn quantize_acts(qt: QType, x: &[f32], m: usize, k: usize) -> QActs {
    let mut a = QActs::default();
    quantize_acts_into(qt, x, m, k, &mut a);
    a
}

/// [`quantize_acts`] into `a`, reusing its buffers.
pub fn quantize_acts_into(qt: QType, x: &[f32], m: usize, k: usize, a: &mut QActs) {
    quantize_acts_with(qt, x, m, k, a, false)
}

/// [`quantize_acts_into`], on AVX-512 when `simd` (the caller checked the CPU has it): the same levels,
/// scales and sums (`avx512_quant::quantize_blocks`).
pub(crate) fn quantize_acts_with(qt: QType, x: &[f32], m: usize, k: usize, a: &mut QActs, simd: bool) {
    assert_eq!(x.len(), m * k, "activation shape");
    let kind = qt.act();
    let block = if kind == ActKind::Q8_K { QK_K } else { 32 };
    assert!(k.is_multiple_of(block), "activation width is a whole number of blocks");
    let nb = k / block;
    fn refill<T: Copy + Default>(v: &mut Vec<T>, n: usize) {
        v.clear();
        v.resize(n, T::default());
    }
    (a.kind, a.rows, a.cols) = (kind, m, k);
    refill(&mut a.qs, m * k);
    refill(&mut a.d, m * nb);
    refill(&mut a.s, if kind == ActKind::Q8_1 { m * nb } else { 0 });
    refill(&mut a.bsums, if kind == ActKind::Q8_K { m * k / 16 } else { 0 });
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: the caller checked the CPU (AVX-512 F/BW/VL, F16C); the buffers are sized above.
        return unsafe { super::avx512_quant::quantize_blocks(x, a) };
    }
    let _ = simd;
    for (bi, (xb, qb)) in x.chunks_exact(block).zip(a.qs.chunks_exact_mut(block)).enumerate() {
        if kind == ActKind::Q8_K {
            let max = signed_max(xb);
            if max == 0.0 {
                continue; // levels, scale and sums stay 0
            }
            let iscale = -127.0 / max;
            for (q, &v) in qb.iter_mut().zip(xb) {
                *q = nearest_int(iscale * v).min(127) as i8;
            }
            for (g, s) in qb.chunks_exact(16).zip(&mut a.bsums[bi * 16..bi * 16 + 16]) {
                *s = g.iter().map(|&v| v as i16).sum();
            }
            a.d[bi] = 1.0 / iscale;
        } else {
            let amax = xb.iter().fold(0f32, |acc, v| acc.max(v.abs()));
            let d = amax / 127.0;
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in qb.iter_mut().zip(xb) {
                // |v·id| ≤ 127 (+ rounding), where `nearest_int` is round-half-even like the SIMD quantizers'
                // rounding, and inlined (`round_ties_even` is a libm call on baseline x86-64).
                *q = nearest_int(v * id).clamp(-127, 127) as i8;
                sum += *q as i32;
            }
            a.d[bi] = f16::from_f32(d).to_f32();
            if kind == ActKind::Q8_1 {
                a.s[bi] = f16::from_f32(d * sum as f32).to_f32();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Reference matmul

/// The scaled term of block `bi` of a weight row (unpacked in `u`) with activation row `r` of `a`: the
/// block's exact integer sums, then its scaling, as the reference adds it.
#[inline]
fn block_term(qt: QType, u: &Unpacked, a: &QActs, r: usize, bi: usize) -> f32 {
    let be = qt.block_elems();
    let x = &a.row_qs(r)[bi * be..(bi + 1) * be];
    let xd = a.row_d(r)[bi];
    let isum = |lo: usize, n: usize| -> i32 {
        u.q[lo..lo + n].iter().zip(&x[lo..lo + n]).map(|(&q, &v)| q as i32 * v as i32).sum()
    };
    match qt {
        QType::Q8_0 | QType::Q8_0x16 | QType::Q4_0 | QType::Q5_0 | QType::IQ4_NL => (u.d * xd) * isum(0, 32) as f32,
        QType::Q5_1 => (u.d * xd) * isum(0, 32) as f32 + u.m * a.s[r * a.blocks() + bi],
        QType::Q4_K | QType::Q4_Kx16 | QType::Q5_K => {
            let bs = &a.bsums[(r * a.blocks() + bi) * 16..][..16];
            let (mut qsum, mut msum) = (0i32, 0i32);
            for j in 0..8 {
                qsum += u.sc[j] as i32 * isum(32 * j, 32);
                msum += u.mn[j] as i32 * (bs[2 * j] as i32 + bs[2 * j + 1] as i32);
            }
            (u.d * xd) * qsum as f32 - (u.m * xd) * msum as f32
        }
        QType::Q6_K | QType::Q6_Kx16 => {
            let qsum: i32 = (0..16).map(|g| u.sc[g] as i32 * isum(16 * g, 16)).sum();
            (u.d * xd) * qsum as f32
        }
        QType::IQ4_XS => {
            let qsum: i32 = (0..8).map(|j| u.sc[j] as i32 * isum(32 * j, 32)).sum();
            (u.d * xd) * qsum as f32
        }
    }
}

/// The reference dot product of weight row `w` (bytes of format `qt`) with activation row `r` of `a`.
/// Integer sums within a block (or super-block) are exact; the scaled block results are added in block
/// order. The SIMD kernels compute the same integers and may add the scaled terms in another order.
pub fn dot_row(qt: QType, w: &[u8], a: &QActs, r: usize) -> f32 {
    let mut u = Unpacked::new();
    let mut acc = 0f32;
    for (bi, b) in w.chunks_exact(qt.block_bytes()).enumerate() {
        unpack(qt, b, &mut u);
        acc += block_term(qt, &u, a, r, bi);
    }
    acc
}

/// `out[i, j] = Σ_k x[i, k] · w[j, k]` on the reference path, activations quantized as the SIMD paths do.
/// Each weight block is unpacked once for all activation rows; every element is still exactly
/// [`dot_row`] (the same terms added in the same order).
pub fn matmul(acts: &QActs, w: QMatRef, out: &mut [&mut [f32]]) {
    let mut acc = vec![0f32; out.len()];
    let mut u = Unpacked::new();
    for j in 0..w.rows {
        acc.fill(0.0);
        for (bi, b) in w.row(j).chunks_exact(w.qtype.block_bytes()).enumerate() {
            unpack(w.qtype, b, &mut u);
            for (i, a) in acc.iter_mut().enumerate() {
                *a += block_term(w.qtype, &u, acts, i, bi);
            }
        }
        for (o, &a) in out.iter_mut().zip(&acc) {
            o[j] = a;
        }
    }
}
