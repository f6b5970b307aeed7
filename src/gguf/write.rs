//! Writing the GGUF container (version 3, little-endian, 32-byte alignment): metadata in the given order,
//! then the tensor table, then each tensor's bytes at an aligned offset.

use std::io::Write;

use anyhow::{bail, Result};

use super::file::{GgmlType, MetaValue};

/// One tensor to write: ggml-order dimensions (row length first) and its bytes in `ty`'s layout.
pub struct OutTensor<'a> {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub data: &'a [u8],
}

const ALIGN: usize = 32;

/// The GGUF type id of a value.
fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::Str(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A value's bytes (without its type id).
fn value(out: &mut Vec<u8>, v: &MetaValue) -> Result<()> {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::Str(s) => string(out, s),
        MetaValue::Array(items) => {
            let ty = items.first().map_or(4, type_id);
            if items.iter().any(|i| type_id(i) != ty) {
                bail!("a GGUF array holds values of one type");
            }
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                value(out, i)?;
            }
        }
    }
    Ok(())
}

/// The header, metadata and tensor table (padded to the alignment), and each tensor's data offset.
pub fn header(meta: &[(String, MetaValue)], tensors: &[OutTensor<'_>]) -> Result<(Vec<u8>, Vec<usize>)> {
    let mut out = Vec::new();
    out.extend_from_slice(&super::file::MAGIC);
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        string(&mut out, k);
        out.extend_from_slice(&type_id(v).to_le_bytes());
        value(&mut out, v)?;
    }
    let mut offsets = Vec::with_capacity(tensors.len());
    let mut at = 0usize;
    for t in tensors {
        string(&mut out, &t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&t.ty.0.to_le_bytes());
        out.extend_from_slice(&(at as u64).to_le_bytes());
        offsets.push(at);
        at = (at + t.data.len()).next_multiple_of(ALIGN);
    }
    out.resize(out.len().next_multiple_of(ALIGN), 0);
    Ok((out, offsets))
}

/// Write a whole GGUF file to `w`.
pub fn write(mut w: impl Write, meta: &[(String, MetaValue)], tensors: &[OutTensor<'_>]) -> Result<()> {
    let (head, _) = header(meta, tensors)?;
    w.write_all(&head)?;
    let zeros = [0u8; ALIGN];
    for t in tensors {
        w.write_all(t.data)?;
        w.write_all(&zeros[..t.data.len().next_multiple_of(ALIGN) - t.data.len()])?;
    }
    w.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufModel;

    /// A small file: two tensors, every kind of value.
    fn sample() -> Vec<u8> {
        let meta = vec![
            ("general.architecture".to_string(), MetaValue::Str("gemma4".into())),
            ("a.u32".to_string(), MetaValue::U32(7)),
            ("a.f32".to_string(), MetaValue::F32(0.5)),
            ("a.bools".to_string(), MetaValue::Array(vec![MetaValue::Bool(true), MetaValue::Bool(false)])),
            ("a.strs".to_string(), MetaValue::Array(vec![MetaValue::Str("x".into()), MetaValue::Str("yz".into())])),
        ];
        let f32s: Vec<u8> = [1.0f32, 2.0, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let q8 = vec![0u8; 34 * 2];
        let tensors = vec![
            OutTensor { name: "v".into(), dims: vec![3], ty: GgmlType::F32, data: &f32s },
            OutTensor { name: "m".into(), dims: vec![32, 2], ty: GgmlType(8), data: &q8 },
        ];
        let mut out = Vec::new();
        write(&mut out, &meta, &tensors).unwrap();
        out
    }

    fn open_bytes(bytes: &[u8]) -> Result<GgufModel> {
        let dir =
            std::env::temp_dir().join(format!("tandem-gguf-{}-{:?}", std::process::id(), std::thread::current().id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.gguf");
        std::fs::write(&path, bytes).unwrap();
        let r = GgufModel::open(&path, true);
        std::fs::remove_dir_all(&dir).unwrap();
        r
    }

    #[test]
    fn round_trip() {
        let m = open_bytes(&sample()).unwrap();
        assert_eq!(m.str_opt("general.architecture").unwrap(), Some("gemma4"));
        assert_eq!(m.usize_opt("a.u32").unwrap(), Some(7));
        assert_eq!(m.f64_opt("a.f32").unwrap(), Some(0.5));
        assert_eq!(m.array_opt("a.strs").unwrap().unwrap().len(), 2);
        let v = m.tensor("v").unwrap();
        assert_eq!(m.bytes(v).len(), 12);
        assert_eq!(m.tensor("m").unwrap().shape(), vec![2, 32]);
        assert!(m.usize_opt("a.f32").unwrap_err().to_string().contains("must be a non-negative integer"));
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        let good = sample();
        let err = |b: &[u8]| format!("{:#}", open_bytes(b).err().expect("refused"));
        let mut b = good.clone();
        b[0] = b'X';
        assert!(err(&b).contains("not a GGUF file"), "{}", err(&b));
        let mut b = good.clone();
        b[4..8].copy_from_slice(&9u32.to_le_bytes());
        assert!(err(&b).contains("unknown GGUF version 9"), "{}", err(&b));
        let mut b = good.clone();
        b[4..8].copy_from_slice(&3u32.to_be_bytes());
        assert!(err(&b).contains("big-endian"), "{}", err(&b));
        // Cut inside the metadata, the tensor table and the data.
        for cut in [30, 200, good.len() - 40] {
            assert!(err(&good[..cut]).contains("truncated"), "cut {cut}: {}", err(&good[..cut]));
        }
        // An unknown tensor type: the id follows tensor `m`'s name, dimension count and two dimensions.
        let pos = find(&good, b"\x01\x00\x00\x00\x00\x00\x00\x00m") + 9 + 4 + 16;
        let mut b = good.clone();
        b[pos..pos + 4].copy_from_slice(&16u32.to_le_bytes());
        assert!(err(&b).contains("type IQ2_XXS, which tandem does not run"), "{}", err(&b));
        // A huge count must not allocate.
        let mut b = good.clone();
        b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(err(&b).contains("cannot fit"), "{}", err(&b));
    }

    fn find(hay: &[u8], needle: &[u8]) -> usize {
        hay.windows(needle.len()).position(|w| w == needle).expect("present")
    }
}
