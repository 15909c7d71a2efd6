//! The helper threads of the matmuls: workers that spin between jobs instead of sleeping.
//!
//! A decode step of a small model is ~200 matmuls of tens of microseconds each, separated by a
//! few microseconds of norms and rotary. Handing each to a rayon pool costs a futex wake-up of a
//! sleeping worker and, for a caller outside the pool, a condvar sleep until the helper is done:
//! two scheduler round trips per matmul, each as long as a small matmul itself. These workers
//! instead watch a job counter in a tight loop for [`SPIN`] after their last job (long enough to
//! span the gap between two matmuls of a step, short enough not to hold a core through a long
//! pause between steps), and the caller spins until they are done. Past the spin window a worker
//! parks on a condvar and is woken by the next job.
//!
//! A job is work shared through a counter (tiles, heads), so the caller alone can finish it. A
//! worker therefore *joins* a job only while it is open, and the caller closes it when its own
//! share ends, then waits only for the workers that joined: on a busy machine a worker that was
//! preempted, or is still parked, costs nothing, where waiting for every worker to show up cost a
//! scheduler time slice per matmul.
//!
//! Which thread runs which tile never changes an output's bits (see [`crate::linear`]), so the
//! results are the same as on the rayon path or on one thread.

use std::cell::UnsafeCell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_micros(300);

/// The job every worker runs at most once: a borrowed closure whose lifetime was erased.
/// [`SpinPool::try_run`] keeps it alive until every worker that joined it has finished.
type Job = *const (dyn Fn() + Sync);

/// `join`'s bit that marks the current job closed (its low bits count the workers that joined).
const CLOSED: u64 = 1 << 31;

struct Shared {
    /// Incremented once per job; a worker runs the job when it sees a new value.
    epoch: AtomicUsize,
    /// Written by the dispatcher only while no worker reads it: before opening a job, after
    /// every worker that joined the previous one has counted itself in `finished`.
    job: UnsafeCell<Option<Job>>,
    /// The open or closed job: its epoch (high 32 bits), [`CLOSED`], and the workers that joined.
    join: AtomicU64,
    /// Workers that have finished the current job.
    finished: AtomicUsize,
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
            join: AtomicU64::new(CLOSED),
            finished: AtomicUsize::new(0),
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
        // SAFETY: the previous job is closed and every worker that joined it has finished, so
        // no worker reads `job`. The lifetime is erased here and the closure outlives every use:
        // `Wait` below blocks until every worker that joins is done with it, even when the
        // caller's own share panics.
        unsafe {
            let erased: Job = std::mem::transmute::<&(dyn Fn() + Sync), Job>(job);
            *s.job.get() = Some(erased);
        }
        s.finished.store(0, Ordering::Relaxed);
        let epoch = s.epoch.load(Ordering::Relaxed).wrapping_add(1);
        s.join.store((epoch as u32 as u64) << 32, Ordering::SeqCst);
        s.epoch.store(epoch, Ordering::SeqCst);
        // Paired with a worker's `sleepers` increment before its last look at `epoch`: either it
        // sees the new epoch, or we see it asleep and wake it.
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        struct Wait<'a>(&'a Shared);
        impl Drop for Wait<'_> {
            fn drop(&mut self) {
                // From here no worker joins; those that did are running the job.
                let joined =
                    (self.0.join.fetch_or(CLOSED, Ordering::SeqCst) & (CLOSED - 1)) as usize;
                let mut spins = 0u32;
                while self.0.finished.load(Ordering::Acquire) != joined {
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
        if !try_join(s, seen) {
            continue;
        }
        // SAFETY: the dispatcher wrote `job` before opening the job this worker joined (the
        // join's Acquire), and keeps the closure alive until every worker that joined has
        // counted itself in `finished`, which this worker does below.
        let job = unsafe { (*s.job.get()).expect("a published job") };
        // SAFETY: as above, the closure is alive until the increment below.
        let r = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)() }));
        if r.is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.finished.fetch_add(1, Ordering::Release);
    }
}

/// Counts this worker in the job of `epoch` if that job is still open; `false` when it has
/// been closed (its caller finished the work alone) or replaced.
fn try_join(s: &Shared, epoch: usize) -> bool {
    let mut cur = s.join.load(Ordering::Acquire);
    loop {
        if cur >> 32 != epoch as u32 as u64 || cur & CLOSED != 0 {
            return false;
        }
        match s
            .join
            .compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => return true,
            Err(now) => cur = now,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each job runs on the caller and at most once on each worker, and work shared through a
    /// counter is all done by the time `try_run` returns.
    #[test]
    fn every_participant_runs_each_job_at_most_once() {
        let pool = SpinPool::new(3).unwrap();
        assert_eq!(pool.workers.len(), 2);
        for round in 0..2000 {
            let count = AtomicUsize::new(0);
            let (next, done) = (AtomicUsize::new(0), AtomicUsize::new(0));
            pool.try_run(&|| {
                count.fetch_add(1, Ordering::Relaxed);
                while next.fetch_add(1, Ordering::Relaxed) < 64 {
                    std::hint::black_box((0..200).sum::<u64>());
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
            .unwrap();
            let c = count.load(Ordering::Relaxed);
            assert!((1..=3).contains(&c), "round {round}: {c} participants");
            assert_eq!(done.load(Ordering::Relaxed), 64, "round {round}");
            if round % 500 == 0 {
                // Let the workers park, so the next job has to wake them.
                std::thread::sleep(SPIN * 3);
            }
        }
    }

    /// Workers join a job that stays open (and so share the work of real matmuls), whether they
    /// were spinning or parked when it was published.
    #[test]
    fn workers_join_an_open_job() {
        let pool = SpinPool::new(3).unwrap();
        for parked in [false, true] {
            if parked {
                std::thread::sleep(SPIN * 3);
            }
            let count = AtomicUsize::new(0);
            pool.try_run(&|| {
                count.fetch_add(1, Ordering::SeqCst);
                let start = Instant::now();
                while count.load(Ordering::SeqCst) < 3 && start.elapsed() < Duration::from_secs(20)
                {
                    std::hint::spin_loop();
                }
            })
            .unwrap();
            assert_eq!(count.load(Ordering::SeqCst), 3, "parked: {parked}");
        }
    }

    #[test]
    fn a_nested_job_is_refused() {
        let pool = SpinPool::new(2).unwrap();
        let (ran, refused) = (AtomicUsize::new(0), AtomicUsize::new(0));
        pool.try_run(&|| {
            ran.fetch_add(1, Ordering::Relaxed);
            if pool.try_run(&|| {}).is_none() {
                refused.fetch_add(1, Ordering::Relaxed);
            }
        })
        .unwrap();
        assert_eq!(refused.load(Ordering::Relaxed), ran.load(Ordering::Relaxed));
    }

    #[test]
    fn a_worker_panic_reaches_the_caller_and_the_pool_goes_on() {
        let pool = SpinPool::new(2).unwrap();
        let main = std::thread::current().id();
        let joined = AtomicBool::new(false);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.try_run(&|| {
                if std::thread::current().id() != main {
                    joined.store(true, Ordering::Release);
                    panic!("worker");
                }
                // Keep the job open until the worker has joined it.
                let start = Instant::now();
                while !joined.load(Ordering::Acquire) && start.elapsed() < Duration::from_secs(10) {
                    std::hint::spin_loop();
                }
            })
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.try_run(&|| {
            count.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
        assert!((1..=2).contains(&count.load(Ordering::Relaxed)));
    }
}
