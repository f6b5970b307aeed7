//! Per-layer K/V caches: full layers keep every position, sliding layers keep a window plus enough
//! history to roll back a rejected speculative draft, reuse layers keep nothing (docs/speculative.md,
//! "The K/V cache and rollback").

use anyhow::{bail, Result};

use std::ops::Range;

use crate::config::{KvMode, LayerType, TextConfig};
use crate::kernels::{DType, MatRef};

/// The most entries a single rollback may remove (and so the most rows one forward can later undo).
pub const MAX_ROLLBACK: usize = 64;

// Matrices over the cache are handed to the kernels as little-endian bytes.
const _: () = assert!(cfg!(target_endian = "little"), "the K/V cache is read as little-endian bytes");

/// Element types whose memory may be viewed as bytes: primitive numbers without padding, every byte of
/// which is initialised. Private to this module, so f32 and u16 (bf16 bits) are the only implementors.
trait PlainData: Copy {}
impl PlainData for f32 {}
impl PlainData for u16 {}

/// The bytes of a slice of plain numbers (f32 values or bf16 bit patterns), in memory order.
fn as_bytes<T: PlainData>(x: &[T]) -> &[u8] {
    // SAFETY: `T` is f32 or u16 (the private `PlainData`): no padding, every byte initialised, so all
    // `size_of_val(x)` bytes behind the pointer are readable as u8 (alignment 1) for the lifetime of `x`.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
}

/// Cached keys or values. Entries are already rounded to the model dtype, so a bf16 model keeps them as
/// bf16 without loss: half the memory and half the attention reads of f32.
#[derive(Clone, Debug)]
pub enum KvData {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

impl KvData {
    fn new(dtype: DType) -> KvData {
        match dtype {
            DType::BF16 => KvData::Bf16(Vec::new()),
            DType::F32 | DType::F16 => KvData::F32(Vec::new()),
        }
    }

    fn len(&self) -> usize {
        match self {
            KvData::F32(v) => v.len(),
            KvData::Bf16(v) => v.len(),
        }
    }

    fn extend(&mut self, xs: &[f32]) {
        match self {
            KvData::F32(v) => v.extend_from_slice(xs),
            KvData::Bf16(v) => v.extend(xs.iter().map(|&x| half::bf16::from_f32(x).to_bits())),
        }
    }

    fn truncate(&mut self, n: usize) {
        match self {
            KvData::F32(v) => v.truncate(n),
            KvData::Bf16(v) => v.truncate(n),
        }
    }

    fn drain_front(&mut self, n: usize) {
        match self {
            KvData::F32(v) => drop(v.drain(..n)),
            KvData::Bf16(v) => drop(v.drain(..n)),
        }
    }

    /// Rows `at..at+n` of a `[_, cols]` buffer as a matrix (bytes in memory order: little-endian).
    fn rows(&self, at: usize, n: usize, cols: usize) -> MatRef<'_> {
        let (lo, hi) = (at * cols, (at + n) * cols);
        match self {
            KvData::F32(v) => MatRef::new(DType::F32, n, cols, as_bytes(&v[lo..hi])),
            KvData::Bf16(v) => MatRef::new(DType::BF16, n, cols, as_bytes(&v[lo..hi])),
        }
    }

    /// Every element as f32.
    fn to_f32(&self) -> Vec<f32> {
        match self {
            KvData::F32(v) => v.clone(),
            KvData::Bf16(v) => v.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect(),
        }
    }
}

/// Keys and values of one layer, post k_norm+RoPE / post v_norm, one `[entries, head_dim]` buffer per KV
/// head: attention reads a head's keys (or values) for a range of positions as one matrix.
#[derive(Clone, Debug)]
pub struct LayerKv {
    pub kind: LayerType,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Absolute position of entry 0.
    pub start: usize,
    k: Vec<KvData>,
    v: Vec<KvData>,
}

impl LayerKv {
    fn empty(kind: LayerType, kv_heads: usize, head_dim: usize, dtype: DType) -> LayerKv {
        let bufs = || (0..kv_heads).map(|_| KvData::new(dtype)).collect();
        LayerKv { kind, kv_heads, head_dim, start: 0, k: bufs(), v: bufs() }
    }

    /// A layer holding the given keys and values (`[kv_heads, entries, head_dim]`) from position `start`,
    /// stored as a model of `dtype` stores them.
    pub fn from_values(
        kind: LayerType,
        kv_heads: usize,
        head_dim: usize,
        start: usize,
        dtype: DType,
        k: &[f32],
        v: &[f32],
    ) -> LayerKv {
        let split = |x: &[f32]| {
            x.chunks_exact(x.len() / kv_heads.max(1))
                .map(|c| {
                    let mut h = KvData::new(dtype);
                    h.extend(c);
                    h
                })
                .collect()
        };
        LayerKv { kind, kv_heads, head_dim, start, k: split(k), v: split(v) }
    }

    pub fn entries(&self) -> usize {
        self.k.first().map_or(0, |k| k.len() / self.head_dim)
    }

    /// One past the last absolute position held.
    pub fn end(&self) -> usize {
        self.start + self.entries()
    }

    /// Keys of KV head `g` at the absolute positions `range`, as a `[range.len(), head_dim]` matrix.
    pub fn keys(&self, g: usize, range: Range<usize>) -> MatRef<'_> {
        self.k[g].rows(range.start - self.start, range.len(), self.head_dim)
    }

    /// Values of KV head `g` at the absolute positions `range`, as a `[range.len(), head_dim]` matrix.
    pub fn values(&self, g: usize, range: Range<usize>) -> MatRef<'_> {
        self.v[g].rows(range.start - self.start, range.len(), self.head_dim)
    }

    /// All keys (or values) as f32, `[kv_heads, entries, head_dim]`.
    pub fn to_f32(&self, values: bool) -> Vec<f32> {
        (if values { &self.v } else { &self.k }).iter().flat_map(|h| h.to_f32()).collect()
    }

    fn truncate(&mut self, entries: usize) {
        for h in self.k.iter_mut().chain(self.v.iter_mut()) {
            h.truncate(entries * self.head_dim);
        }
    }

    fn drop_front(&mut self, entries: usize) {
        for h in self.k.iter_mut().chain(self.v.iter_mut()) {
            h.drain_front(entries * self.head_dim);
        }
        self.start += entries;
    }
}

pub struct KvCache {
    layers: Vec<Option<LayerKv>>,
    /// The token ids of the positions processed, so a later prompt that starts the same way can reuse them.
    tokens: Vec<u32>,
    /// Entries a sliding layer needs before the next position: the window and the drafter's W+1 keys.
    sliding_need: usize,
}

impl KvCache {
    /// Caches for `cfg`, storing entries in `dtype` (the model dtype).
    pub fn new(cfg: &TextConfig, dtype: DType) -> KvCache {
        let layers = cfg
            .layers
            .iter()
            .map(|l| (l.kv_mode != KvMode::Reuse).then(|| LayerKv::empty(l.kind, l.kv_heads, l.head_dim, dtype)))
            .collect();
        KvCache { layers, tokens: Vec::new(), sliding_need: cfg.sliding_window + 1 }
    }

    /// Number of positions processed (the next token's position).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The token ids of positions `0..len()`.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn clear(&mut self) {
        for l in self.layers.iter_mut().flatten() {
            l.start = 0;
            l.truncate(0);
        }
        self.tokens.clear();
    }

    /// Keep the longest prefix of what the cache holds that `prompt` starts with, but never the whole
    /// prompt (its last token must run to give logits), and drop the rest; returns the positions kept.
    /// When the sliding layers no longer hold the history that position would need, start over.
    pub fn reuse_prefix(&mut self, prompt: &[u32]) -> usize {
        let common = self.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let keep = common.min(prompt.len().saturating_sub(1));
        if self.truncate(keep).is_err() {
            self.clear();
        }
        self.len()
    }

    pub fn layer(&self, i: usize) -> &LayerKv {
        self.layers[i].as_ref().expect("reuse layers have no cache; use the store layer")
    }

    /// Append `k`, `v` (`[rows, kv_heads, head_dim]`) for the positions `len..len+rows` of layer `i`.
    pub(crate) fn append(&mut self, i: usize, k: &[f32], v: &[f32]) {
        let l = self.layers[i].as_mut().expect("append to a layer with a cache");
        debug_assert_eq!(l.end(), self.tokens.len(), "layer {i} out of step with the cache");
        let d = l.head_dim;
        for (g, (kh, vh)) in l.k.iter_mut().zip(l.v.iter_mut()).enumerate() {
            for (kr, vr) in k.chunks_exact(l.kv_heads * d).zip(v.chunks_exact(l.kv_heads * d)) {
                kh.extend(&kr[g * d..(g + 1) * d]);
                vh.extend(&vr[g * d..(g + 1) * d]);
            }
        }
    }

    /// Mark the positions of `tokens` as processed, and trim sliding layers (amortised: only when they
    /// have grown to twice what they must keep, which is what they need plus `MAX_ROLLBACK`).
    pub(crate) fn advance(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
        let keep = self.sliding_need + MAX_ROLLBACK;
        for l in self.layers.iter_mut().flatten() {
            if l.kind == LayerType::Sliding && l.entries() > 2 * keep {
                let drop = l.entries() - keep;
                l.drop_front(drop);
            }
        }
    }

    /// Forget the newest `r` positions (rejected draft tokens). Up to `MAX_ROLLBACK` always works.
    pub fn rollback(&mut self, r: usize) -> Result<()> {
        if r > self.len() {
            bail!("cannot roll back {r} positions: the cache holds {}", self.len());
        }
        self.truncate(self.len() - r)
    }

    /// Keep positions `0..n` only. Fails (changing nothing) when a sliding layer has already dropped
    /// history that position `n` needs.
    fn truncate(&mut self, n: usize) -> Result<()> {
        let need_from = n.saturating_sub(self.sliding_need);
        if let Some(l) = self.layers.iter().flatten().find(|l| l.kind == LayerType::Sliding && l.start > need_from) {
            bail!(
                "cannot roll back to position {n}: sliding layers keep positions from {} on (rollbacks of up to {MAX_ROLLBACK} always work)",
                l.start
            );
        }
        for l in self.layers.iter_mut().flatten() {
            l.truncate(n.saturating_sub(l.start));
        }
        self.tokens.truncate(n);
        Ok(())
    }

    /// The K/V a store layer publishes (what reuse layers and the drafter read).
    pub fn store_kv(&self, cfg: &TextConfig, kind: LayerType) -> Option<&LayerKv> {
        cfg.store_layer(kind).map(|i| self.layer(i))
    }
}
