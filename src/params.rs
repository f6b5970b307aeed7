//! Parsing user-supplied request parameters from text (command-line values; later request fields), with
//! one-line errors that say what is allowed. Conventions follow what users bring from other engines:
//! `top_k` 0 or -1 means off (as vLLM), seed -1 means a random seed (as llama.cpp).

use anyhow::{anyhow, bail, Result};

/// Comma-separated token ids, e.g. `2,17,33` (spaces and empty items between commas are ignored).
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let ids = s
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .map_err(|_| anyhow!("--prompt-ids: {t:?} is not a token id (a non-negative integer below 2^32)"))
        })
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("--prompt-ids: no token ids given");
    }
    Ok(ids)
}

/// A seed: a non-negative integer below 2^64, or -1 for a random one (`None`).
pub fn parse_seed(s: &str) -> Result<Option<u64>> {
    let t = s.trim();
    if t == "-1" {
        return Ok(None);
    }
    if t.starts_with('-') {
        bail!("seed {t:?}: must be a non-negative integer, or -1 for a random seed");
    }
    t.parse::<u64>()
        .map(Some)
        .map_err(|_| anyhow!("seed {t:?}: must be a non-negative integer below 2^64, or -1 for a random seed"))
}

/// top-k: a number of tokens to keep; 0 or -1 turn it off (returned as 0).
pub fn parse_top_k(s: &str) -> Result<usize> {
    let t = s.trim();
    if t == "-1" {
        return Ok(0);
    }
    if t.starts_with('-') {
        bail!("top-k {t:?}: must be a non-negative integer (0 or -1 = off)");
    }
    t.parse::<usize>().map_err(|_| anyhow!("top-k {t:?}: must be a non-negative integer (0 or -1 = off)"))
}

/// A floating-point parameter (`temperature`, `top_p`, ...); the range is checked by
/// [`crate::decode::sampling::SamplingParams::validate`], which names the allowed values.
pub fn parse_float(name: &str, s: &str) -> Result<f32> {
    let t = s.trim();
    let x: f64 = t.parse().map_err(|_| anyhow!("{name} {t:?}: not a number"))?;
    if x.is_finite() && (x as f32).is_infinite() {
        bail!("{name} {t:?}: out of range");
    }
    Ok(x as f32)
}

/// A stop string: any non-empty text (an empty one would stop before the first token).
pub fn parse_stop(s: &str) -> Result<String> {
    if s.is_empty() {
        bail!("--stop: the stop string is empty (it would end generation before anything is generated)");
    }
    Ok(s.to_string())
}

/// A random seed for requests that ask for one (time and process based; not for cryptography).
pub fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        assert_eq!(parse_ids("2, 17,33,").unwrap(), vec![2, 17, 33]);
        for bad in ["", " , ", "1,-2", "x", "4294967296", "1.5"] {
            let e = parse_ids(bad).unwrap_err().to_string();
            assert!(e.starts_with("--prompt-ids: "), "{e}");
        }
    }

    #[test]
    fn negative_values_have_meanings_or_reasons() {
        assert_eq!(parse_seed("-1").unwrap(), None);
        assert_eq!(parse_seed("18446744073709551615").unwrap(), Some(u64::MAX));
        assert!(parse_seed("-2").unwrap_err().to_string().contains("-1 for a random seed"));
        assert!(parse_seed("18446744073709551616").is_err());
        assert_eq!(parse_top_k("-1").unwrap(), 0);
        assert_eq!(parse_top_k("0").unwrap(), 0);
        assert_eq!(parse_top_k("40").unwrap(), 40);
        assert!(parse_top_k("-5").unwrap_err().to_string().contains("0 or -1 = off"));
        assert_eq!(parse_float("temperature", "-inf").unwrap(), f32::NEG_INFINITY);
        assert!(parse_float("temperature", "1e39").unwrap_err().to_string().contains("out of range"));
        assert!(parse_float("temperature", "warm").is_err());
        assert!(parse_stop("").is_err());
        assert_eq!(parse_stop("\n\n").unwrap(), "\n\n");
    }
}
