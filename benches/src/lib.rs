//! Benchmark harness (issue 6).
