//! weights
