//! GGUF model files (docs/gguf.md): the container, and Gemma 4 as llama.cpp lays it out in one.

pub mod convert;
pub mod export;
pub mod file;
pub mod gemma4;
pub mod vocab;
pub mod write;

pub use file::{is_gguf, GgmlType, GgufModel, MetaValue, TensorInfo};
