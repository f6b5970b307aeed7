//! Text in, text out: the checkpoint's tokenizer, its chat template, and streaming detokenization.

pub mod gguf_vocab;
pub mod stream;
pub mod template;
pub mod tokenizer;

pub use stream::{IncrementalDecoder, Pushed, StopStrings, TextStream, ThinkingFilter};
pub use template::{ChatTemplate, RenderOptions};
pub use tokenizer::{has_tokenizer, Decode, TextTokenizer, TOKENIZER_FILE};
