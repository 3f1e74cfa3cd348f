//! Probes: while speculation of a kind loses at a load, the tokens written alone there count towards the next
//! round that measures it again (a probe), with gaps that grow while probes keep losing; and the one request that
//! makes the first round of a kind at a load with no figure yet.

use super::*;

impl Costs {
    /// A paused request of `kind` wrote `tokens` by other means than the target alone (copy rounds while the model
    /// rests): they count towards the next probe, as tokens written alone do, and not towards any figure.
    pub(super) fn add_rested(&self, kind: &str, level: u32, tokens: usize) {
        self.with(level, |l| {
            l.spec.entry(kind.to_string()).or_default().since += tokens
        })
    }

    /// Tokens still to be written alone before the next probe of `kind` (0: a probe is due).
    pub(super) fn until_probe(&self, kind: &str, level: u32) -> usize {
        self.with(level, |l| {
            let s = l.spec.entry(kind.to_string()).or_default();
            s.gap.max(self.cfg.min_gap).saturating_sub(s.since)
        })
    }

    /// Whether a request may make the first round of `kind` at `level`, which has no figure: only if no other
    /// request is making one (it then counts as making it, until [`Costs::measured`]).
    pub(super) fn take_measuring(&self, kind: &str, level: u32) -> bool {
        self.with(level, |l| {
            let s = l.spec.entry(kind.to_string()).or_default();
            let free = !s.measuring;
            s.measuring = true;
            free
        })
    }

    /// The first round taken with [`Costs::take_measuring`] reported, or its request ended.
    pub(super) fn measured(&self, kind: &str, level: u32) {
        self.with(level, |l| {
            let s = l.spec.entry(kind.to_string()).or_default();
            s.measuring = false;
        })
    }

    /// Takes the due probe of `kind`, so that one request makes it, not every request at once: due once the tokens
    /// written alone since the last one reach the gap and, for a request whose drafter must catch up first, also
    /// [`PaceConfig::probe_share`] times the tokens the target alone writes in the time that takes (`catch_up`, see
    /// [`Pace::catch_up_tokens`]), and not while another request's probe here is out ([`Costs::probe_back`]).
    ///
    /// Both bound what probes cost where they lose by far. Without the first, every few tokens written alone at a
    /// loaded level would make another probe due while the ones taken have not reported yet (each a whole PARSE
    /// round, seconds at that load). Without the second, a probe would go to whichever request asked first, late in
    /// a burst a request hundreds of tokens in whose draft has its whole context to prefill first, which the burst's
    /// last requests wait for.
    pub(super) fn take_probe(&self, kind: &str, level: u32, catch_up: usize) -> bool {
        self.with(level, |l| {
            let s = l.spec.entry(kind.to_string()).or_default();
            let setup = (self.cfg.probe_share * catch_up as f64).ceil() as usize;
            let due = !s.probe_out && s.since >= s.gap.max(self.cfg.min_gap).saturating_add(setup);
            if due {
                s.since = 0;
                s.probe_out = true;
            }
            due
        })
    }

    /// The probe a request took ([`Costs::take_probe`]) is over: reported, or the request has moved on.
    pub(super) fn probe_back(&self, kind: &str, level: u32) {
        self.with(level, |l| {
            if let Some(s) = l.spec.get_mut(kind) {
                s.probe_out = false;
            }
        })
    }

    /// Tokens written alone at `level` by requests of `kind` since its last round there.
    pub(super) fn since(&self, kind: &str, level: u32) -> usize {
        self.with(level, |l| l.spec.get(kind).map_or(0, |s| s.since))
    }
}
