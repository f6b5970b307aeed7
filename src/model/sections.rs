//! Opt-in wall-clock sections of a target forward and a draft step, for the profiling examples
//! (`forward_profile`, `draft_profile`; docs/numerics.md, "Where a step's time goes").
//!
//! Off by default: a section is then one relaxed load and a call. Once [`enable`]d, each
//! [`section`] adds its wall time to the calling thread's table, so a section that opens a parallel
//! region counts the region's whole time, helpers included, and the table says which part of a step
//! the helpers sit idle through (what runs outside any section or region runs on one thread).

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

static ON: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// (name, total time, calls), in the order the names were first seen.
    static TABLE: RefCell<Vec<(&'static str, Duration, u64)>> = const { RefCell::new(Vec::new()) };
}

/// Start (or stop) timing sections, on every thread.
pub fn enable(on: bool) {
    ON.store(on, Relaxed);
}

/// Run `f`, adding its wall time to this thread's entry for `name` while timing is on.
#[inline]
pub fn section<T>(name: &'static str, f: impl FnOnce() -> T) -> T {
    if !ON.load(Relaxed) {
        return f();
    }
    let start = Instant::now();
    let out = f();
    let spent = start.elapsed();
    TABLE.with(|t| {
        let mut t = t.borrow_mut();
        match t.iter_mut().find(|e| e.0 == name) {
            Some(e) => {
                e.1 += spent;
                e.2 += 1;
            }
            None => t.push((name, spent, 1)),
        }
    });
    out
}

/// This thread's sections so far, (name, total time, calls) in first-seen order, and a fresh table.
pub fn take() -> Vec<(&'static str, Duration, u64)> {
    TABLE.with(|t| std::mem::take(&mut *t.borrow_mut()))
}

/// [`take`] as a table: each section's time per step over `steps` steps, its share of `wall` (the
/// steps' whole time) and its calls per step, then what ran outside every section.
pub fn report(steps: usize, wall: Duration) -> String {
    let steps = steps.max(1) as f64;
    let per = |d: Duration| d.as_secs_f64() * 1e6 / steps;
    let share = |d: Duration| 100.0 * d.as_secs_f64() / wall.as_secs_f64().max(1e-12);
    let table = take();
    let mut out = format!("{:<24} {:>9} {:>7} {:>9}\n", "section", "us/step", "share", "calls");
    let mut inside = Duration::ZERO;
    for (name, d, calls) in &table {
        inside += *d;
        out += &format!("{name:<24} {:>9.1} {:>6.1}% {:>9.1}\n", per(*d), share(*d), *calls as f64 / steps);
    }
    let rest = wall.saturating_sub(inside);
    out += &format!("{:<24} {:>9.1} {:>6.1}%\n", "(outside any section)", per(rest), share(rest));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_count_only_while_enabled() {
        // Other tests may run forwards meanwhile: they only add to their own threads' tables, and the
        // flag is only ever turned on here and in the examples.
        take();
        section("off", || ());
        enable(true);
        let v = section("a", || 7);
        section("b", || ());
        section("a", || std::thread::sleep(Duration::from_millis(1)));
        enable(false);
        section("a", || ());
        assert_eq!(v, 7);
        let t = take();
        let names: Vec<_> = t.iter().map(|e| (e.0, e.2)).collect();
        assert_eq!(names, [("a", 2), ("b", 1)]);
        assert!(t[0].1 >= Duration::from_millis(1));
        assert!(take().is_empty());
    }
}
