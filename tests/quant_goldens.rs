//! tandem's quantizers against llama.cpp's on the same weights: `tests/fixtures/quant/llama_quantize.json`
//! holds rows of real bf16 tensors and the bytes `llama-quantize` made of them in every block format
//! (written by scripts/quant_goldens.py). Same bytes means a model quantized at load equals the llama.cpp
//! file of the same recipe, tensor for tensor.

use half::bf16;
use serde_json::Value;
use tandem::kernels::quant::{dequantize_row, quantize_row};
use tandem::kernels::QType;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn goldens() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant/llama_quantize.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn quantizers_match_llama_quantize_byte_for_byte() {
    let g = goldens();
    let rows = g["rows"].as_u64().unwrap() as usize;
    let mut checked = 0;
    for t in g["tensors"].as_array().unwrap() {
        let (name, cols) = (t["name"].as_str().unwrap(), t["cols"].as_u64().unwrap() as usize);
        let src: Vec<f32> = hex(t["bf16"].as_str().unwrap())
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        assert_eq!(src.len(), rows * cols);
        for q in QType::ALL {
            let want = hex(g["quantized"][q.name()][name].as_str().unwrap());
            let row_bytes = q.row_bytes(cols).unwrap();
            assert_eq!(want.len(), rows * row_bytes, "{q} {name}");
            for r in 0..rows {
                let mut got = vec![0u8; row_bytes];
                quantize_row(q, &src[r * cols..(r + 1) * cols], &mut got);
                let w = &want[r * row_bytes..(r + 1) * row_bytes];
                if got != w {
                    let first = got.iter().zip(w).position(|(a, b)| a != b).unwrap();
                    panic!(
                        "{q} {name} row {r}: first differing byte {first} of {row_bytes} (block {}): {} vs llama.cpp {}",
                        first / q.block_bytes(),
                        got[first],
                        w[first]
                    );
                }
                // And reading the bytes back gives values close to the source.
                let mut back = vec![0f32; cols];
                dequantize_row(q, w, &mut back);
                let (err, norm) = src[r * cols..(r + 1) * cols]
                    .iter()
                    .zip(&back)
                    .fold((0f64, 0f64), |(e, n), (a, b)| (e + ((a - b) as f64).powi(2), n + (*a as f64).powi(2)));
                assert!(err <= 0.02 * norm, "{q} {name} row {r}: relative squared error {}", err / norm);
                checked += 1;
            }
        }
    }
    assert!(checked >= 3 * QType::ALL.len() * rows, "goldens cover every format on several tensors");
}
