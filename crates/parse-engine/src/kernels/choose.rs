//! Whether a block of rows takes the row groups ([`super::groups`]) or the panels, chosen by timing the calls
//! themselves.
//!
//! Both kernels compute the same bits (the module contract of [`super`]), so the choice moves time, never tokens.
//! Which one is faster depends on the CPU, the format and the block's rows, and the crossing differs from CPU to
//! CPU by a factor of several rows, so no fixed threshold is right everywhere. Each key (format, matrix shape, rows)
//! between [`MIN_TRIED`] and [`MAX_TRIED`] rows therefore alternates the two kernels for its first [`TRIALS`] calls
//! each, then keeps the one whose fastest call was faster: the fastest call, not the mean, because a first call that
//! faults the weights in or a call that another process slowed tells nothing of the kernel. Blocks of fewer rows take
//! the panels and blocks of more the groups without timing. See docs/decisions/kernel-choice.md.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

/// Blocks of fewer rows (one: a one-token step) take the panels untimed; from 2 rows the groups can win on some
/// matrices.
pub const MIN_TRIED: usize = 2;

/// Blocks of more rows take the row groups untimed.
pub const MAX_TRIED: usize = 64;

/// Calls each kernel gets on a key before the key's choice is made.
pub const TRIALS: u32 = 6;

/// What the choice is made for: a matrix format, its shape (weight rows `n` by columns `k`) and the block's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub format: &'static str,
    pub n: usize,
    pub k: usize,
    pub m: usize,
}

/// The fastest call of each kernel on a key so far, the calls made, and the choice once made.
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    /// Nanoseconds of the fastest call, `[panels, groups]`.
    best: [u64; 2],
    calls: [u32; 2],
    chosen: Option<bool>,
}

/// One key's choice as made (for reports): whether the groups won, and the fastest call of each kernel in ns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choice {
    pub key: Key,
    pub groups: bool,
    pub panels_ns: u64,
    pub groups_ns: u64,
}

/// The tallies of every key a process has seen.
#[derive(Debug, Default)]
pub struct Chooser {
    tallies: Mutex<HashMap<Key, Tally>>,
}

/// A block's kernel: `groups` says which, and where the call is a trial its time is recorded by [`Pick::finish`].
#[must_use = "a trial's time is recorded by finish"]
#[derive(Debug)]
pub struct Pick<'a> {
    pub groups: bool,
    trial: Option<(&'a Chooser, Key, Instant)>,
}

impl Pick<'static> {
    /// A kernel chosen without timing.
    pub fn fixed(groups: bool) -> Self {
        Pick {
            groups,
            trial: None,
        }
    }
}

impl Pick<'_> {
    /// Records the call's time where it was a trial (call it right after the matmul).
    pub fn finish(self) {
        if let Some((chooser, key, start)) = self.trial {
            let ns = start.elapsed().as_nanos().min(u64::MAX as u128) as u64;
            chooser.record(key, self.groups, ns);
        }
    }
}

impl Chooser {
    /// The kernel for a block of `key.m` rows: untimed outside [`MIN_TRIED`]..=[`MAX_TRIED`] and once the key's
    /// choice is made; otherwise the kernel with fewer trials so far (the groups first), timed.
    pub fn pick(&self, key: Key) -> Pick<'_> {
        if key.m < MIN_TRIED {
            return Pick::fixed(false);
        }
        if key.m > MAX_TRIED {
            return Pick::fixed(true);
        }
        let groups = {
            let tallies = self.tallies.lock().unwrap_or_else(|e| e.into_inner());
            match tallies.get(&key) {
                Some(Tally {
                    chosen: Some(g), ..
                }) => return Pick::fixed(*g),
                Some(t) => t.calls[1] <= t.calls[0],
                None => true,
            }
        };
        Pick {
            groups,
            trial: Some((self, key, Instant::now())),
        }
    }

    /// Counts a call of `ns` nanoseconds with the groups (`groups`) or the panels on `key`; once both kernels have
    /// [`TRIALS`] calls, the one with the faster fastest call is the key's choice.
    pub fn record(&self, key: Key, groups: bool, ns: u64) {
        let mut tallies = self.tallies.lock().unwrap_or_else(|e| e.into_inner());
        let t = tallies.entry(key).or_default();
        if t.chosen.is_some() {
            return;
        }
        let i = groups as usize;
        t.best[i] = if t.calls[i] == 0 {
            ns
        } else {
            t.best[i].min(ns)
        };
        t.calls[i] += 1;
        if t.calls.iter().all(|&c| c >= TRIALS) {
            t.chosen = Some(t.best[1] < t.best[0]);
        }
    }

    /// The choices made so far, ordered by key.
    pub fn choices(&self) -> Vec<Choice> {
        let tallies = self.tallies.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<Choice> = tallies
            .iter()
            .filter_map(|(key, t)| {
                t.chosen.map(|groups| Choice {
                    key: *key,
                    groups,
                    panels_ns: t.best[0],
                    groups_ns: t.best[1],
                })
            })
            .collect();
        out.sort_by_key(|c| c.key);
        out
    }
}

/// The process's chooser (the choice depends on the CPU and the matrices, not on who asks).
pub fn chooser() -> &'static Chooser {
    static CHOOSER: std::sync::OnceLock<Chooser> = std::sync::OnceLock::new();
    CHOOSER.get_or_init(Chooser::default)
}

/// One line per format and shape: the row counts at which each kernel was chosen. A key's format of the form
/// `<format>: <groups' kernel> or <panels' kernel>` names the two kernels a choice is between where they are not the
/// row groups and the panels (`Q4_K lanes: tiles or row groups`, [`super::amx_lanes`]).
pub fn summary(choices: &[Choice]) -> Vec<String> {
    /// A matrix: format, rows, columns.
    type Shape<'a> = (&'a str, usize, usize);
    let mut by_shape: Vec<(Shape<'_>, Vec<(usize, bool)>)> = Vec::new();
    for c in choices {
        let shape = (c.key.format, c.key.n, c.key.k);
        match by_shape.last_mut() {
            Some((s, v)) if *s == shape => v.push((c.key.m, c.groups)),
            _ => by_shape.push((shape, vec![(c.key.m, c.groups)])),
        }
    }
    by_shape
        .into_iter()
        .map(|((format, n, k), sizes)| {
            let groups: Vec<usize> = sizes.iter().filter(|s| s.1).map(|s| s.0).collect();
            let panels: Vec<usize> = sizes.iter().filter(|s| !s.1).map(|s| s.0).collect();
            let (name, (g, p)) = match format.split_once(": ") {
                Some((name, kernels)) => {
                    (name, kernels.split_once(" or ").unwrap_or((kernels, "?")))
                }
                None => (format, ("row groups", "panels")),
            };
            format!("{name} {n}x{k}: {g} at {groups:?} rows, {p} at {panels:?}")
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(m: usize) -> Key {
        Key {
            format: "Q4_K",
            n: 64,
            k: 256,
            m,
        }
    }

    /// Runs a key's trials with the given times per kernel; returns the kernels the trials took.
    fn trials(c: &Chooser, k: Key, panels_ns: u64, groups_ns: u64) -> Vec<bool> {
        let mut took = Vec::new();
        for _ in 0..2 * TRIALS {
            let p = c.pick(k);
            assert!(
                p.trial.is_some(),
                "a key is timed until both kernels have their trials"
            );
            took.push(p.groups);
            c.record(k, p.groups, if p.groups { groups_ns } else { panels_ns });
        }
        took
    }

    #[test]
    fn the_faster_kernel_is_kept_after_both_have_had_their_trials() {
        let c = Chooser::default();
        let took = trials(&c, key(8), 1_000, 1_500);
        assert_eq!(took.iter().filter(|&&g| g).count() as u32, TRIALS);
        assert!(took[0], "the groups go first");
        for _ in 0..5 {
            let p = c.pick(key(8));
            assert!(!p.groups, "the panels were faster");
            assert!(p.trial.is_none(), "a made choice is not timed again");
        }
        trials(&c, key(32), 2_000, 1_200);
        assert!(c.pick(key(32)).groups, "the groups were faster at 32 rows");
        let made = c.choices();
        assert_eq!(made.len(), 2);
        assert_eq!(
            made[0],
            Choice {
                key: key(8),
                groups: false,
                panels_ns: 1_000,
                groups_ns: 1_500
            }
        );
        assert!(made[1].groups);
        assert_eq!(
            summary(&made),
            vec!["Q4_K 64x256: row groups at [32] rows, panels at [8]".to_string()]
        );
        let named: Vec<Choice> = made
            .iter()
            .map(|c| Choice {
                key: Key {
                    format: "Q4_K lanes: tiles or row groups",
                    ..c.key
                },
                ..*c
            })
            .collect();
        assert_eq!(
            summary(&named),
            vec!["Q4_K lanes 64x256: tiles at [32] rows, row groups at [8]".to_string()]
        );
    }

    #[test]
    fn the_fastest_call_decides_not_a_slow_first_one() {
        let c = Chooser::default();
        // The groups' first call faults the weights in (far slower); their other calls beat the panels.
        let mut first = true;
        for _ in 0..2 * TRIALS {
            let p = c.pick(key(12));
            let ns = match (p.groups, first) {
                (true, true) => 100_000,
                (true, false) => 900,
                (false, _) => 1_000,
            };
            if p.groups {
                first = false;
            }
            c.record(key(12), p.groups, ns);
        }
        assert!(c.pick(key(12)).groups);
    }

    #[test]
    fn blocks_outside_the_timed_range_are_not_timed() {
        let c = Chooser::default();
        let one = c.pick(key(1));
        assert!(!one.groups && one.trial.is_none());
        let many = c.pick(key(MAX_TRIED + 1));
        assert!(many.groups && many.trial.is_none());
        assert!(c.pick(key(MIN_TRIED)).trial.is_some());
        assert!(c.pick(key(MAX_TRIED)).trial.is_some());
    }

    #[test]
    fn a_finished_trial_counts_its_call() {
        let c = Chooser::default();
        let p = c.pick(key(4));
        assert!(p.groups);
        p.finish();
        // The groups have one trial, the panels none: the next call tries the panels.
        assert!(!c.pick(key(4)).groups);
    }
}
