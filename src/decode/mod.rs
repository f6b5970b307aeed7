pub mod draft_policy;
pub mod generate;
pub mod sampling;
pub mod sequence;
pub mod speculative;
