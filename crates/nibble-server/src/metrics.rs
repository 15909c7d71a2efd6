//! Prometheus text exposition for /metrics: engine gauges and counters plus latency histograms.

use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use nibble_engine::serving::EngineStats;

#[derive(Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Cumulative histogram with fixed bucket bounds (seconds).
pub struct Histogram {
    bounds: &'static [f64],
    state: Mutex<(Vec<u64>, f64, u64)>,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            bounds: LATENCY_BUCKETS,
            state: Mutex::new((vec![0; LATENCY_BUCKETS.len()], 0.0, 0)),
        }
    }
}

impl Histogram {
    pub fn observe(&self, v: f64) {
        if let Ok(mut s) = self.state.lock() {
            for (i, b) in self.bounds.iter().enumerate() {
                if v <= *b {
                    s.0[i] += 1;
                }
            }
            s.1 += v;
            s.2 += 1;
        }
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let s = self.state.lock().map(|s| s.clone()).unwrap_or_default();
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&s.0) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}",
            s.2, s.1, s.2
        );
    }
}

#[derive(Default)]
pub struct Metrics {
    pub ttft: Histogram,
    pub tpot: Histogram,
    pub completed: Counter,
    pub cancelled: Counter,
    pub failed: Counter,
    pub rejected: Counter,
}

impl Metrics {
    pub fn render(&self, s: &EngineStats) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        };
        metric(
            "nibble_requests_waiting",
            "gauge",
            "Requests queued for admission.",
            s.waiting as f64,
        );
        metric(
            "nibble_requests_running",
            "gauge",
            "Requests being decoded.",
            s.running as f64,
        );
        metric(
            "nibble_kv_blocks_in_use",
            "gauge",
            "KV cache blocks referenced by a request.",
            s.blocks_in_use as f64,
        );
        metric(
            "nibble_kv_blocks_total",
            "gauge",
            "KV cache blocks in the pool.",
            s.blocks_total as f64,
        );
        metric(
            "nibble_prefix_cache_queries_total",
            "counter",
            "Full prompt blocks looked up in the prefix cache.",
            s.prefix_cache_queries as f64,
        );
        metric(
            "nibble_prefix_cache_hits_total",
            "counter",
            "Prompt blocks found in the prefix cache.",
            s.prefix_cache_hits as f64,
        );
        metric(
            "nibble_preemptions_total",
            "counter",
            "Sequences preempted for recomputation.",
            s.preemptions as f64,
        );
        metric(
            "nibble_prompt_tokens_total",
            "counter",
            "Prompt tokens admitted.",
            s.prompt_tokens as f64,
        );
        metric(
            "nibble_generation_tokens_total",
            "counter",
            "Tokens generated.",
            s.generated_tokens as f64,
        );
        metric(
            "nibble_requests_completed_total",
            "counter",
            "Requests that finished.",
            self.completed.get() as f64,
        );
        metric(
            "nibble_requests_cancelled_total",
            "counter",
            "Requests cancelled by their client.",
            self.cancelled.get() as f64,
        );
        metric(
            "nibble_requests_failed_total",
            "counter",
            "Requests failed by an engine error.",
            self.failed.get() as f64,
        );
        metric(
            "nibble_requests_rejected_total",
            "counter",
            "Requests refused (4xx, overload).",
            self.rejected.get() as f64,
        );
        self.ttft.render(
            &mut out,
            "nibble_time_to_first_token_seconds",
            "Time from arrival to first token.",
        );
        self.tpot.render(
            &mut out,
            "nibble_time_per_output_token_seconds",
            "Time between consecutive tokens.",
        );
        out
    }
}
