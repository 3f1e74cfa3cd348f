//! Trying again after a failure, the same way everywhere: delays that grow exponentially from a first delay to a
//! cap, each jittered (backon's `ExponentialBuilder`), so that the many routers and workers that lost the same etcd
//! or the same peer at once do not come back in step.
//!
//! A call that is tried until it works or a time is up goes through [`backoff`] with backon's `Retryable` (async)
//! or `BlockingRetryable`; a loop that runs for the life of a task (holding a registration, following a watch)
//! takes its delays from [`Pauses`], which starts again from the first delay once an attempt had worked for a while.
//! Polls that wait for something to happen (a peer's key to appear, sessions to drain) are not retries and keep
//! their fixed period.

use std::time::{Duration, Instant};

pub use backon::{BlockingRetryable, ExponentialBuilder, Retryable};

/// Delays from `first`, doubling up to `cap`, each jittered, until they add up to `total` (no end: `None`).
pub fn backoff(first: Duration, cap: Duration, total: Option<Duration>) -> ExponentialBuilder {
    ExponentialBuilder::new()
        .with_min_delay(first)
        .with_max_delay(cap)
        .with_jitter()
        .without_max_times()
        .with_total_delay(total)
}

/// The delays of a loop that runs until its task stops: [`backoff`] without an end, back to the first delay after
/// an attempt that lasted longer than the cap (it had worked, and its failure is a new one).
pub struct Pauses {
    first: Duration,
    cap: Duration,
    delays: backon::ExponentialBackoff,
}

impl Pauses {
    pub fn new(first: Duration, cap: Duration) -> Self {
        Pauses {
            first,
            cap,
            delays: backon::BackoffBuilder::build(backoff(first, cap, None)),
        }
    }

    /// The delay before the next attempt, after one that began at `began`.
    pub fn after(&mut self, began: Instant) -> Duration {
        if began.elapsed() > self.cap {
            *self = Pauses::new(self.first, self.cap);
        }
        self.delays.next().unwrap_or(self.cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_to_the_cap_and_start_again_after_an_attempt_that_lasted() {
        let (first, cap) = (Duration::from_millis(10), Duration::from_millis(80));
        let mut p = Pauses::new(first, cap);
        let now = Instant::now();
        let delays: Vec<Duration> = (0..8).map(|_| p.after(now)).collect();
        // Jitter adds up to one delay more: each lies in [d, 2d] for its step d, and no step passes the cap.
        for (i, d) in delays.iter().enumerate() {
            let step = (first * 2u32.pow(i as u32)).min(cap);
            assert!(
                *d >= step && *d <= 2 * step,
                "delay {i}: {d:?} outside [{step:?}, {:?}]",
                2 * step
            );
        }
        let long_ago = Instant::now() - 2 * cap;
        let again = p.after(long_ago);
        assert!(
            again <= 2 * first,
            "after an attempt that lasted, the delays start again: {again:?}"
        );
    }

    #[test]
    fn a_bounded_backoff_stops_once_its_delays_reach_the_total() {
        let b = backoff(
            Duration::from_millis(10),
            Duration::from_millis(40),
            Some(Duration::from_millis(100)),
        );
        let delays: Vec<Duration> = backon::BackoffBuilder::build(b).collect();
        let sum: Duration = delays.iter().sum();
        assert!(!delays.is_empty());
        assert!(
            sum <= Duration::from_millis(100),
            "{delays:?} sum to {sum:?}"
        );
    }
}
