//! Models: the Gemma 4 target (and, later, its assistant drafter) with their caches.

pub mod assistant;
pub mod cache;
pub mod ops;
pub mod rope;
pub mod sections;
pub mod target;

pub use cache::KvCache;
pub use target::{Forward, Keep, SeqInput, TargetModel};
