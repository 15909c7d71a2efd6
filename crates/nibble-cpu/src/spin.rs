//! The helper threads of the matmuls: workers that spin between jobs instead of sleeping.
//!
//! A decode step of a small model is ~200 matmuls of tens of microseconds each, separated by a
//! few microseconds of norms and rotary. Handing each to a rayon pool costs a futex wake-up of a
//! sleeping worker and, for a caller outside the pool, a condvar sleep until the helper is done:
//! two scheduler round trips per matmul, each as long as a small matmul itself. These workers
//! instead watch a job counter in a tight loop for [`SPIN`] after their last job (long enough to
//! span the gap between two matmuls of a step, short enough not to hold a core through a long
//! pause such as prefill attention, which runs on the rayon pool), and the caller spins until
//! they are done. Past the spin window a worker parks on a condvar and is woken by the next job.
//!
//! Which thread runs which tile never changes an output's bits (see [`crate::linear`]), so the
//! results are the same as on the rayon path or on one thread.

use std::cell::UnsafeCell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_micros(300);

/// The job every worker runs once: a borrowed closure whose lifetime was erased. [`SpinPool::run`]
/// keeps it alive until every worker has finished with it.
type Job = *const (dyn Fn() + Sync);

struct Shared {
    /// Incremented once per job; a worker runs the job when it sees a new value.
    epoch: AtomicUsize,
    /// Written by the dispatcher only while no worker reads it: before publishing the epoch,
    /// after every worker of the previous job has counted itself out of `pending`.
    job: UnsafeCell<Option<Job>>,
    /// Workers that have not finished the current job.
    pending: AtomicUsize,
    /// A worker's job panicked (re-raised on the calling thread).
    panicked: AtomicBool,
    /// Workers parked on `wake` (changed under `lock`).
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
}

// SAFETY: `job` is only written while no worker can read it (see its doc), and the closure it
// points to is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced while the dispatcher keeps it alive.
unsafe impl Send for Shared {}

/// `threads - 1` spinning workers; the calling thread is the last participant of every job.
pub(crate) struct SpinPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One job at a time: a second caller (another thread sharing the backend, or a matmul
    /// nested in one) finds it taken and is told to use another way.
    busy: Mutex<()>,
}

impl SpinPool {
    /// A pool whose jobs run on `threads` threads in all (the caller and `threads - 1` workers).
    pub(crate) fn new(threads: usize) -> std::io::Result<SpinPool> {
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let mut pool = SpinPool {
            shared,
            workers: Vec::new(),
            busy: Mutex::new(()),
        };
        for i in 1..threads.max(1) {
            let s = pool.shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("nibble-spin-{i}"))
                .spawn(move || worker(&s))?;
            pool.workers.push(h);
        }
        Ok(pool)
    }

    /// Runs `job` on every worker and on the calling thread, and returns once all are done;
    /// `None` (without running anything) when another job holds the pool.
    pub(crate) fn try_run(&self, job: &(dyn Fn() + Sync)) -> Option<()> {
        let _busy = match self.busy.try_lock() {
            Ok(g) => g,
            Err(TryLockError::WouldBlock) => return None,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
        };
        let s = &*self.shared;
        // SAFETY: `pending` is 0 (the previous job was waited for), so no worker reads `job`.
        // The lifetime is erased here and the closure outlives every use: `Wait` below blocks
        // until every worker is done with it, even when the caller's own share panics.
        unsafe {
            let erased: Job = std::mem::transmute::<&(dyn Fn() + Sync), Job>(job);
            *s.job.get() = Some(erased);
        }
        s.pending.store(self.workers.len(), Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        // Paired with a worker's `sleepers` increment before its last look at `epoch`: either it
        // sees the new epoch, or we see it asleep and wake it.
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        struct Wait<'a>(&'a Shared);
        impl Drop for Wait<'_> {
            fn drop(&mut self) {
                let mut spins = 0u32;
                while self.0.pending.load(Ordering::Acquire) != 0 {
                    // A worker may have been preempted (the machine is shared): past a short
                    // spin, give the core away instead of burning it.
                    if spins < 1 << 14 {
                        spins += 1;
                        std::hint::spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                }
            }
        }
        let wait = Wait(s);
        job();
        drop(wait);
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a matmul worker thread panicked");
        }
        Some(())
    }
}

impl Drop for SpinPool {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.shutdown.store(true, Ordering::SeqCst);
        {
            let _g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

fn worker(s: &Shared) {
    // Not the current epoch: a job may have been published before this thread started.
    let mut seen = 0;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            if s.shutdown.load(Ordering::Relaxed) {
                return;
            }
            spins = spins.wrapping_add(1);
            // Reading the clock costs more than a spin, so look at it now and then.
            if !spins.is_multiple_of(256) || start.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            let mut g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            while s.epoch.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst) {
                g = s.wake.wait(g).unwrap_or_else(|p| p.into_inner());
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        // SAFETY: the dispatcher wrote `job` before publishing this epoch (Acquire above) and
        // keeps the closure alive until `pending` reaches 0, which this worker's decrement below
        // is part of.
        let job = unsafe { (*s.job.get()).expect("a published job") };
        // SAFETY: as above, the closure is alive until the decrement below.
        let r = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)() }));
        if r.is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_participant_runs_each_job_once() {
        let pool = SpinPool::new(3).unwrap();
        assert_eq!(pool.workers.len(), 2);
        for round in 0..2000 {
            let count = AtomicUsize::new(0);
            pool.try_run(&|| {
                count.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
            assert_eq!(count.load(Ordering::Relaxed), 3, "round {round}");
            if round % 500 == 0 {
                // Let the workers park, so the next job has to wake them.
                std::thread::sleep(SPIN * 3);
            }
        }
    }

    #[test]
    fn a_nested_job_is_refused() {
        let pool = SpinPool::new(2).unwrap();
        let refused = AtomicUsize::new(0);
        pool.try_run(&|| {
            if pool.try_run(&|| {}).is_none() {
                refused.fetch_add(1, Ordering::Relaxed);
            }
        })
        .unwrap();
        assert_eq!(refused.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_worker_panic_reaches_the_caller_and_the_pool_goes_on() {
        let pool = SpinPool::new(2).unwrap();
        let main = std::thread::current().id();
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.try_run(&|| {
                if std::thread::current().id() != main {
                    panic!("worker");
                }
            })
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.try_run(&|| {
            count.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
        assert_eq!(count.load(Ordering::Relaxed), 2);
    }
}
