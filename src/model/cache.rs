//! Per-layer K/V caches (spec §3.7): full layers keep every position, sliding layers keep a window plus
//! enough history to roll back a rejected speculative draft, reuse layers keep nothing.

use anyhow::{bail, Result};

use crate::config::{KvMode, LayerType, TextConfig};

/// The most entries a single rollback may remove (and so the most rows one forward can later undo).
pub const MAX_ROLLBACK: usize = 64;

/// Keys and values of one layer: `[entries, kv_heads, head_dim]`, post k_norm+RoPE / post v_norm,
/// values already rounded to the model dtype.
#[derive(Clone, Debug)]
pub struct LayerKv {
    pub kind: LayerType,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Absolute position of entry 0.
    pub start: usize,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl LayerKv {
    fn row(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    pub fn entries(&self) -> usize {
        self.k.len() / self.row()
    }

    /// One past the last absolute position held.
    pub fn end(&self) -> usize {
        self.start + self.entries()
    }

    /// Key of absolute position `pos`, KV head `g`.
    #[inline]
    pub fn key(&self, pos: usize, g: usize) -> &[f32] {
        let i = (pos - self.start) * self.row() + g * self.head_dim;
        &self.k[i..i + self.head_dim]
    }

    #[inline]
    pub fn value(&self, pos: usize, g: usize) -> &[f32] {
        let i = (pos - self.start) * self.row() + g * self.head_dim;
        &self.v[i..i + self.head_dim]
    }
}

pub struct KvCache {
    layers: Vec<Option<LayerKv>>,
    len: usize,
    /// Sliding layers keep at least this many newest entries: the window, the drafter's W+1 keys, and rollback.
    sliding_keep: usize,
}

impl KvCache {
    pub fn new(cfg: &TextConfig) -> KvCache {
        let layers = cfg
            .layers
            .iter()
            .map(|l| {
                (l.kv_mode != KvMode::Reuse).then(|| LayerKv {
                    kind: l.kind,
                    kv_heads: l.kv_heads,
                    head_dim: l.head_dim,
                    start: 0,
                    k: Vec::new(),
                    v: Vec::new(),
                })
            })
            .collect();
        KvCache { layers, len: 0, sliding_keep: cfg.sliding_window + 1 + MAX_ROLLBACK }
    }

    /// Number of positions processed (the next token's position).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn clear(&mut self) {
        for l in self.layers.iter_mut().flatten() {
            l.start = 0;
            l.k.clear();
            l.v.clear();
        }
        self.len = 0;
    }

    pub fn layer(&self, i: usize) -> &LayerKv {
        self.layers[i].as_ref().expect("reuse layers have no cache; use the store layer")
    }

    /// Append `k`, `v` (`[rows, kv_heads, head_dim]`) for the positions `len..len+rows` of layer `i`.
    pub(crate) fn append(&mut self, i: usize, k: &[f32], v: &[f32]) {
        let l = self.layers[i].as_mut().expect("append to a layer with a cache");
        debug_assert_eq!(l.end(), self.len, "layer {i} out of step with the cache");
        l.k.extend_from_slice(k);
        l.v.extend_from_slice(v);
    }

    /// Mark `rows` new positions as processed, and trim sliding layers (amortised: only when they have
    /// grown to twice what they must keep).
    pub(crate) fn advance(&mut self, rows: usize) {
        self.len += rows;
        let keep = self.sliding_keep;
        for l in self.layers.iter_mut().flatten() {
            if l.kind == LayerType::Sliding && l.entries() > 2 * keep {
                let drop = l.entries() - keep;
                let row = l.row();
                l.k.drain(..drop * row);
                l.v.drain(..drop * row);
                l.start += drop;
            }
        }
    }

    /// Forget the newest `r` positions (rejected draft tokens).
    pub fn rollback(&mut self, r: usize) -> Result<()> {
        if r > self.len {
            bail!("cannot roll back {r} positions: the cache holds {}", self.len);
        }
        if r > MAX_ROLLBACK {
            bail!("cannot roll back {r} positions at once (at most {MAX_ROLLBACK})");
        }
        for l in self.layers.iter_mut().flatten() {
            let keep = l.entries().saturating_sub(r);
            let row = l.row();
            l.k.truncate(keep * row);
            l.v.truncate(keep * row);
        }
        self.len -= r;
        Ok(())
    }

    /// The K/V a store layer publishes (what reuse layers and the drafter read).
    pub fn store_kv(&self, cfg: &TextConfig, kind: LayerType) -> Option<&LayerKv> {
        cfg.store_layer(kind).map(|i| self.layer(i))
    }
}
