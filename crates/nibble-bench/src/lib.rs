//! Benchmarks that need more than the engine: `serve` is a load generator for any
//! OpenAI-compatible server (vLLM's `benchmark_serving.py`, in Rust), fed by `sharegpt`.

pub mod serve;
pub mod sharegpt;

pub use serve::{
    Endpoint, ErrorCount, LatencyStats, Outcome, RequestRecord, ServeBenchConfig, ServeBenchReport,
    run_serve_bench, run_serve_bench_blocking,
};
pub use sharegpt::{FilterStats, Sample, load_sharegpt};
