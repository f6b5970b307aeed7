//! tandem: Gemma 4 text models on CPU, built for speculative decoding with the assistant drafters.

pub mod bench;
pub mod config;
pub mod decode;
pub mod engine;
pub mod files;
pub mod gguf;
pub mod kernels;
pub mod model;
pub mod params;
pub mod quantize;
pub mod serve;
pub mod system;
pub mod text;
pub mod weights;
