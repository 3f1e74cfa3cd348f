//! The calling process's own resource use, for its metrics (`process_cpu_seconds_total` on the router's and the
//! workers' `/metrics`, the name Prometheus's client libraries give it).

/// User and system CPU time the process has spent, in seconds, all its threads together (those that have ended
/// included), at microsecond resolution (`getrusage(RUSAGE_SELF)`); `None` where the call fails.
///
/// Not the `prometheus` crate's process collector: that one counts whole seconds, and a benchmark cell's CPU time
/// (`parse-bench --cpu-metrics`) moves by a few seconds between modes.
#[allow(unsafe_code)]
pub fn cpu_seconds() -> Option<f64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `getrusage` writes a `rusage` into the pointer it is given, which points at one.
    let ok = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } == 0;
    if !ok {
        return None;
    }
    // SAFETY: zeroed, then written by a call that succeeded.
    let usage = unsafe { usage.assume_init() };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Some(secs(usage.ru_utime) + secs(usage.ru_stime))
}

/// `process_cpu_seconds_total`, registered on a Prometheus registry and brought up to date by [`ProcessCpu::update`]
/// before each scrape's gather.
#[cfg(feature = "prometheus")]
pub struct ProcessCpu {
    counter: prometheus::Counter,
    /// Two scrapes at once would both add the time since the counter's last value.
    update: std::sync::Mutex<()>,
}

#[cfg(feature = "prometheus")]
impl ProcessCpu {
    pub fn register(r: &prometheus::Registry) -> Self {
        let counter = prometheus::Counter::new(
            "process_cpu_seconds_total",
            "Total user and system CPU time spent in seconds.",
        )
        .expect("valid metric");
        r.register(Box::new(counter.clone()))
            .expect("unique metric");
        let me = ProcessCpu {
            counter,
            update: std::sync::Mutex::new(()),
        };
        me.update();
        me
    }

    /// Sets the counter to the process's CPU time now (it never goes back).
    pub fn update(&self) {
        let _one = self.update.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(now) = cpu_seconds() {
            let seen = self.counter.get();
            if now > seen {
                self.counter.inc_by(now - seen);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spins until the process has spent `secs` more CPU seconds than `from` (at most 10 s of wall time: on a loaded
    /// machine the thread gets a share of a core, not a core).
    fn spin_past(from: f64, secs: f64) {
        let t = std::time::Instant::now();
        let mut x = 1u64;
        while cpu_seconds().expect("getrusage") < from + secs
            && t.elapsed() < std::time::Duration::from_secs(10)
        {
            for i in 0..10_000u64 {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
            }
        }
    }

    #[test]
    fn cpu_seconds_grow_with_work_done() {
        let before = cpu_seconds().expect("getrusage");
        assert!(before > 0.0);
        spin_past(before, 0.02);
        let after = cpu_seconds().expect("getrusage");
        assert!(after - before >= 0.02, "{before} -> {after}");
    }

    #[cfg(feature = "prometheus")]
    #[test]
    fn the_counter_follows_the_process_cpu_time() {
        let r = prometheus::Registry::new();
        let cpu = ProcessCpu::register(&r);
        let first = cpu.counter.get();
        assert!(first > 0.0);
        spin_past(first, 0.02);
        cpu.update();
        assert!(
            cpu.counter.get() >= first + 0.02,
            "{first} -> {}",
            cpu.counter.get()
        );
        let names: Vec<String> = r.gather().iter().map(|m| m.name().to_string()).collect();
        assert_eq!(names, ["process_cpu_seconds_total"]);
    }
}
