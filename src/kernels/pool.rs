//! A fork-join pool for the forward's small parallel regions (docs/numerics.md, "Threads").
//!
//! A decode step is about a hundred matmuls, most of them far too small to pay for waking a sleeping
//! thread (~5 µs through rayon's condition variables on a VM, ~20 % of a 300 KB matmul at m = 1).
//! So below a few MiB they used to run on one core, which at m = 1 reads weights at half the
//! machine's bandwidth and at m = 5 leaves half the compute unused. This pool's helpers *spin* for a
//! while after each region, so the next region, typically tens of microseconds later, starts on
//! every core within a fraction of a microsecond; after [`SPIN`] without work they park, so an idle
//! server or a test run does not burn its cores.
//!
//! One region runs at a time: a caller that finds the pool busy (another thread's forward, or a call
//! nested inside a region) gets `false` from [`run`] and runs the work some other way. Which thread
//! computes which task never changes a result: every task writes its own outputs.
//!
//! Waiting loops yield the CPU every few dozen spins, so that under `SCHED_FIFO` (benchmarks run
//! with `chrt -f`) a spinning thread cannot starve a thread of its own priority on the same core.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a helper spins for the next region before it parks. Regions within a decode step are
/// microseconds to a millisecond apart; a server between requests parks after this.
const SPIN: Duration = Duration::from_micros(500);
/// Spins between `yield_now` calls (and clock reads) in every waiting loop.
const SPINS_PER_YIELD: u32 = 64;

type Task = dyn Fn(usize) + Sync;

/// The region being run: its tasks and how many.
#[derive(Clone, Copy)]
struct Job {
    f: *const Task,
    n: usize,
}

struct Shared {
    /// `epoch << 1 | open`: a new epoch (odd value) opens a region; the caller closes it (even)
    /// once every task is done.
    state: AtomicU64,
    /// Written by the caller before it opens a region, read by helpers only while it is open.
    job: UnsafeCell<Option<Job>>,
    /// Next task index to claim, and tasks finished.
    next: AtomicUsize,
    done: AtomicUsize,
    /// Helpers inside the current region (the caller waits for them to leave before it returns,
    /// so no helper touches the job after its closure is gone).
    inside: AtomicUsize,
    /// A task panicked: the caller re-raises it.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// One region at a time.
    busy: AtomicBool,
    /// Parked helpers wait here.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the caller holding `busy` while no region is open, and read by
// helpers only between their registration in `inside` and the region's close (see `run`); the
// closure it points to is `Sync`.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

struct Pool {
    shared: Arc<Shared>,
    helpers: usize,
}

static POOL: OnceLock<Pool> = OnceLock::new();

/// The pool, started on first use with one helper per rayon thread beyond the caller's own (the
/// process's thread count: `--threads`, or every core).
fn pool() -> &'static Pool {
    POOL.get_or_init(|| {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            inside: AtomicUsize::new(0),
            panic: Mutex::new(None),
            busy: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let wanted = rayon::current_num_threads().saturating_sub(1);
        let mut helpers = 0;
        for i in 0..wanted {
            let s = shared.clone();
            let spawned = std::thread::Builder::new().name(format!("tandem-pool-{i}")).spawn(move || helper(&s));
            // A helper that cannot start only means fewer threads share the work.
            if spawned.is_ok() {
                helpers += 1;
            }
        }
        Pool { shared, helpers }
    })
}

/// Threads a region runs on (helpers plus the caller), or 1 when the pool cannot serve this
/// thread: inside a rayon pool (whose size the caller chose, e.g. a test's `install`), or with a
/// single thread configured.
pub(crate) fn width() -> usize {
    if rayon::current_thread_index().is_some() || in_region() {
        return 1;
    }
    pool().helpers + 1
}

thread_local! {
    /// This thread is running a task of a region (as its caller or as a helper).
    static IN_REGION: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is running one of a region's tasks: work it splits then stays on this
/// thread (the region already occupies the others).
pub(crate) fn in_region() -> bool {
    IN_REGION.with(|r| r.get())
}

/// `f(0)..f(n)` in parallel: on the pool when it is free, on this thread inside a region, else on
/// rayon's threads. A single task runs on this thread outside any region, so that what it splits
/// in turn still gets the pool (one sequence's attention in a batched forward). So does everything
/// when rayon has one thread (`--threads 1`): handing the tasks to it would only add a wake-up and a
/// sleep per call (a quarter of a four-sequence draft step's time on one thread, mostly in the kernel).
pub(crate) fn for_each(n: usize, f: &(dyn Fn(usize) + Sync + '_)) {
    if n == 1 {
        return f(0);
    }
    if run(n, f) {
        return;
    }
    if in_region() || n <= 1 || rayon::current_num_threads() <= 1 {
        (0..n).for_each(f);
    } else {
        use rayon::prelude::*;
        (0..n).into_par_iter().for_each(f);
    }
}

/// `f` of every item in parallel (as [`for_each`]), results in order.
pub(crate) fn map<T: Send, U: Send>(items: Vec<T>, f: impl Fn(T) -> U + Sync) -> Vec<U> {
    let n = items.len();
    let slots: Vec<Mutex<(Option<T>, Option<U>)>> = items.into_iter().map(|t| Mutex::new((Some(t), None))).collect();
    for_each(n, &|i: usize| {
        let mut slot = slots[i].lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = slot.0.take() {
            slot.1 = Some(f(t));
        }
    });
    slots.into_iter().map(|s| s.into_inner().unwrap_or_else(|e| e.into_inner()).1.expect("every task ran")).collect()
}

/// Run `f(0)..f(n)` on the pool's threads and the caller's, returning when all are done; `false`
/// (nothing run) if the pool is busy with another region, has no helpers, or the caller is inside
/// a rayon pool. A panic in a task is re-raised here.
pub(crate) fn run(n: usize, f: &(dyn Fn(usize) + Sync + '_)) -> bool {
    if n == 0 {
        return true;
    }
    if width() <= 1 {
        return false;
    }
    let s = &*pool().shared;
    if s.busy.compare_exchange(false, true, SeqCst, SeqCst).is_err() {
        return false;
    }
    // SAFETY: only the lifetime is erased. Helpers use the pointer only while the region is open
    // and they are counted in `inside`; this function waits for both to end before returning.
    let f: *const Task = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static Task>(f) };
    // SAFETY: `busy` is ours and the region is closed, so no helper reads `job` now.
    unsafe { *s.job.get() = Some(Job { f, n }) };
    s.next.store(0, SeqCst);
    s.done.store(0, SeqCst);
    let open = (((s.state.load(SeqCst) >> 1) + 1) << 1) | 1;
    s.state.store(open, SeqCst);
    if s.sleepers.load(SeqCst) > 0 {
        let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
        s.wake.notify_all();
    }
    work(s, Job { f, n });
    wait_until(|| s.done.load(SeqCst) >= n);
    s.state.store(open & !1, SeqCst);
    wait_until(|| s.inside.load(SeqCst) == 0);
    let panic = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
    s.busy.store(false, SeqCst);
    if let Some(p) = panic {
        resume_unwind(p);
    }
    true
}

/// Claim and run tasks of `job` until none are left.
fn work(s: &Shared, job: Job) {
    loop {
        let i = s.next.fetch_add(1, SeqCst);
        if i >= job.n {
            return;
        }
        // SAFETY: see `run`: the closure outlives the open region.
        let f = unsafe { &*job.f };
        IN_REGION.with(|r| r.set(true));
        let result = catch_unwind(AssertUnwindSafe(|| f(i)));
        IN_REGION.with(|r| r.set(false));
        if let Err(p) = result {
            s.panic.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(p);
        }
        s.done.fetch_add(1, SeqCst);
    }
}

/// Spin (yielding now and then) until `ready()`.
fn wait_until(ready: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !ready() {
        spins += 1;
        if spins.is_multiple_of(SPINS_PER_YIELD) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

fn helper(s: &Shared) {
    let mut seen = s.state.load(SeqCst) >> 1;
    loop {
        let state = next_region(s, seen);
        seen = state >> 1;
        s.inside.fetch_add(1, SeqCst);
        // The region may have closed between our seeing it and registering: then its caller may
        // already have returned, and the job must not be touched.
        if s.state.load(SeqCst) == state {
            // SAFETY: the region is open and we are counted in `inside`.
            if let Some(job) = unsafe { *s.job.get() } {
                work(s, job);
            }
        }
        s.inside.fetch_sub(1, SeqCst);
    }
}

/// Wait for a region with an epoch other than `seen` to open: spin for [`SPIN`], then park.
fn next_region(s: &Shared, seen: u64) -> u64 {
    let fresh = |state: u64| state & 1 == 1 && state >> 1 != seen;
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let state = s.state.load(SeqCst);
        if fresh(state) {
            return state;
        }
        spins += 1;
        if !spins.is_multiple_of(SPINS_PER_YIELD) {
            std::hint::spin_loop();
            continue;
        }
        if start.elapsed() < SPIN {
            std::thread::yield_now();
            continue;
        }
        let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
        s.sleepers.fetch_add(1, SeqCst);
        let state = loop {
            let state = s.state.load(SeqCst);
            if fresh(state) {
                break state;
            }
            g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
        };
        s.sleepers.fetch_sub(1, SeqCst);
        return state;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_once() {
        for n in [1, 2, 3, 7, 64, 1000] {
            let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            let ran = run(n, &|i| {
                hits[i].fetch_add(1, SeqCst);
            });
            if ran {
                assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "n = {n}");
            } else {
                assert!(hits.iter().all(|h| h.load(SeqCst) == 0), "n = {n}");
            }
        }
    }

    #[test]
    fn nested_and_concurrent_regions_fall_back() {
        // From several threads at once, each region nesting another: a busy pool says no, nothing
        // deadlocks, and every task runs exactly once one way or the other.
        let total = AtomicU32::new(0);
        std::thread::scope(|sc| {
            for _ in 0..4 {
                sc.spawn(|| {
                    for _ in 0..200 {
                        let outer = |_: usize| {
                            let inner = |_: usize| {
                                total.fetch_add(1, SeqCst);
                            };
                            if !run(3, &inner) {
                                (0..3).for_each(inner);
                            }
                        };
                        if !run(4, &outer) {
                            (0..4).for_each(outer);
                        }
                    }
                });
            }
        });
        assert_eq!(total.load(SeqCst), 4 * 200 * 4 * 3);
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_and_the_pool_recovers() {
        if width() <= 1 {
            return;
        }
        let r = catch_unwind(|| {
            // Retry until the pool is free (other tests share it).
            while !run(8, &|i| assert!(i != 5, "task 5 fails")) {
                std::thread::yield_now();
            }
        });
        assert!(r.is_err());
        let count = AtomicU32::new(0);
        while !run(8, &|_| {
            count.fetch_add(1, SeqCst);
        }) {
            std::thread::yield_now();
        }
        assert_eq!(count.load(SeqCst), 8);
    }
}
