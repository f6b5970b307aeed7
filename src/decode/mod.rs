pub mod generate;
pub mod sampling;
