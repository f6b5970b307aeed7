//! Rotary position embeddings, half-split ("NeoX") layout (docs/model.md, "RoPE").

use crate::config::{RopeConfig, RopeKind};
use crate::kernels::DType;

/// Inverse frequencies for one layer type's head dim.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
    head_dim: usize,
}

impl Rope {
    pub fn new(cfg: &RopeConfig, head_dim: usize) -> Rope {
        let half = head_dim / 2;
        // Proportional RoPE rotates only the first floor(p·D/2) pairs, with exponents over the full D.
        let rotated = match cfg.kind {
            RopeKind::Default => half,
            RopeKind::Proportional { partial_rotary_factor } => {
                (((partial_rotary_factor as f64) * head_dim as f64 / 2.0).floor() as usize).min(half)
            }
        };
        // f32 like transformers: 1 / (theta ^ (2j / D)), then divided by the scaling factor.
        let inv_freq = (0..half)
            .map(|j| {
                if j < rotated {
                    let exponent = (2 * j) as f32 / head_dim as f32;
                    1.0 / cfg.theta.powf(exponent) / cfg.factor
                } else {
                    0.0
                }
            })
            .collect();
        Rope { inv_freq, head_dim }
    }

    /// cos and sin of every frequency at `pos`, rounded to the model dtype (length D/2 each).
    pub fn angles(&self, pos: usize, dtype: DType, cos: &mut [f32], sin: &mut [f32]) {
        for (j, &f) in self.inv_freq.iter().enumerate() {
            if f == 0.0 {
                // A frequency past a partial rotation's share: cos 0 and sin 0 exactly, without the
                // libm calls (three quarters of a proportional layer's pairs).
                (cos[j], sin[j]) = (1.0, 0.0);
                continue;
            }
            let a = pos as f32 * f;
            cos[j] = dtype.round((a as f64).cos() as f32);
            sin[j] = dtype.round((a as f64).sin() as f32);
        }
    }

    /// [`Rope::angles`] of each of `positions`, computed once for every layer of this type (and for
    /// both q and k): row `i` of the result belongs to `positions[i]`.
    pub fn angles_of(&self, positions: impl IntoIterator<Item = usize>, dtype: DType) -> Angles {
        let half = self.inv_freq.len();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for pos in positions {
            let at = cos.len();
            cos.resize(at + half, 0.0);
            sin.resize(at + half, 0.0);
            self.angles(pos, dtype, &mut cos[at..], &mut sin[at..]);
        }
        Angles { half, cos, sin }
    }

    /// Rotate every head of `x` (`[heads, D]`) in place: `x·cos + rotate_half(x)·sin`, each product and
    /// the sum rounded to the model dtype as transformers does in bf16.
    pub fn apply(&self, x: &mut [f32], cos: &[f32], sin: &[f32], dtype: DType) {
        let d = self.head_dim;
        let half = d / 2;
        // Products and sums in whole-head slices so the roundings vectorise.
        let mut xc = vec![0f32; d];
        let mut rs = vec![0f32; d];
        for head in x.chunks_exact_mut(d) {
            for j in 0..half {
                let (x1, x2) = (head[j], head[j + half]);
                let (c, s) = (cos[j], sin[j]);
                xc[j] = x1 * c;
                xc[j + half] = x2 * c;
                rs[j] = -x2 * s;
                rs[j + half] = x1 * s;
            }
            dtype.round_slice(&mut xc);
            dtype.round_slice(&mut rs);
            for ((h, a), b) in head.iter_mut().zip(&xc).zip(&rs) {
                *h = a + b;
            }
            dtype.round_slice(head);
        }
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
}

/// cos and sin for a list of positions ([`Rope::angles_of`]).
#[derive(Clone, Debug)]
pub struct Angles {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Angles {
    /// cos and sin of the `i`-th position.
    pub fn row(&self, i: usize) -> (&[f32], &[f32]) {
        let at = i * self.half..(i + 1) * self.half;
        (&self.cos[at.clone()], &self.sin[at])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proportional_rotates_only_the_leading_pairs() {
        let cfg = RopeConfig { kind: RopeKind::Proportional { partial_rotary_factor: 0.25 }, theta: 1e6, factor: 1.0 };
        let r = Rope::new(&cfg, 32);
        assert_eq!(r.inv_freq.iter().filter(|f| **f != 0.0).count(), 4);
        assert_eq!(r.inv_freq[0], 1.0);
        assert!((r.inv_freq[1] - 1e6f32.powf(-2.0 / 32.0)).abs() < 1e-9);
        let mut x: Vec<f32> = (0..32).map(|i| i as f32).collect();
        let (mut c, mut s) = (vec![0.0; 16], vec![0.0; 16]);
        r.angles(7, DType::F32, &mut c, &mut s);
        let before = x.clone();
        r.apply(&mut x, &c, &s, DType::F32);
        for j in 4..16 {
            assert_eq!(x[j], before[j]);
            assert_eq!(x[j + 16], before[j + 16]);
        }
        assert_ne!(x[0], before[0]);
    }

    #[test]
    fn angles_of_matches_angles_position_by_position() {
        let cfg = RopeConfig { kind: RopeKind::Default, theta: 1e4, factor: 1.0 };
        let r = Rope::new(&cfg, 16);
        let positions = [0usize, 5, 6, 4095, 3];
        let table = r.angles_of(positions, DType::BF16);
        for (i, &p) in positions.iter().enumerate() {
            let (mut c, mut s) = (vec![0.0; 8], vec![0.0; 8]);
            r.angles(p, DType::BF16, &mut c, &mut s);
            assert_eq!(table.row(i), (&c[..], &s[..]), "position {p}");
        }
    }
}
