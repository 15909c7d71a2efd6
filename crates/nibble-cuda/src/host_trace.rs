//! `NIBBLE_HOST_TRACE=1`: where eager forward passes spend their host time, by kind of op. A
//! GEMM launch that waits for a full launch queue shows as GEMM time, so a pass whose host time
//! matches its device time is waiting, not working (BENCHMARKS.md, issue 24).

use std::sync::Mutex;
use std::sync::atomic::Ordering;

/// Where an eager forward pass spends its host time (`NIBBLE_HOST_TRACE=1`): what queueing its
/// GEMMs, its attention and everything else took, printed per pass of 64 tokens or more.
#[derive(Default)]
pub(crate) struct HostTrace {
    start: Mutex<Option<(std::time::Instant, usize, usize)>>,
    first_layer: Mutex<Option<std::time::Duration>>,
    gemm_ns: std::sync::atomic::AtomicU64,
    attention_ns: std::sync::atomic::AtomicU64,
}

impl HostTrace {
    /// A forward pass of `tokens` tokens over `seqs` sequences begins.
    pub(crate) fn begin(&self, tokens: usize, seqs: usize) {
        *self.start.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((std::time::Instant::now(), tokens, seqs));
    }

    /// Its first layer begins: what came before is the pass's prologue.
    pub(crate) fn first_layer_begins(&self) {
        let start = *self.start.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((t0, ..)) = start {
            *self.first_layer.lock().unwrap_or_else(|p| p.into_inner()) = Some(t0.elapsed());
        }
    }

    /// Runs `f`, queueing a GEMM, counted as GEMM time.
    pub(crate) fn gemm<R>(&self, f: impl FnOnce() -> R) -> R {
        time(&self.gemm_ns, f)
    }

    /// Runs `f`, queueing attention, counted as attention time.
    pub(crate) fn attention<R>(&self, f: impl FnOnce() -> R) -> R {
        time(&self.attention_ns, f)
    }

    /// The pass ends: prints its host time by kind of op if it had 64 tokens or more.
    pub(crate) fn end(&self) {
        let Some((t0, tokens, seqs)) = self.start.lock().unwrap_or_else(|p| p.into_inner()).take()
        else {
            return;
        };
        let total = t0.elapsed().as_secs_f64() * 1e3;
        let gemm = self.gemm_ns.swap(0, Ordering::Relaxed) as f64 / 1e6;
        let attention = self.attention_ns.swap(0, Ordering::Relaxed) as f64 / 1e6;
        let prologue = self
            .first_layer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .map_or(0.0, |d| d.as_secs_f64() * 1e3);
        if tokens >= 64 {
            eprintln!(
                "host trace: {tokens} tokens, {seqs} seqs: forward {total:.2} ms = before the \
                 first layer {prologue:.2} + GEMMs {gemm:.2} + attention {attention:.2} + rest {:.2}",
                total - prologue - gemm - attention
            );
        }
    }
}

fn time<R>(counter: &std::sync::atomic::AtomicU64, f: impl FnOnce() -> R) -> R {
    let t = std::time::Instant::now();
    let r = f();
    counter.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    r
}
