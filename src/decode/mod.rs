pub mod generate;
pub mod sampling;
pub mod speculative;
