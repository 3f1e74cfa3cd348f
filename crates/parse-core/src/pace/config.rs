//! The pacing policy's tunables, in one place. A [`Costs`](super::Costs) is made with them ([`Costs::with_config`](super::Costs::with_config)) and every
//! request that reports to it is paced by them; the defaults are the project's.

/// What the pacing rules are tuned by. Counts of tokens are output tokens; shares and factors are of times.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PaceConfig {
    /// Rounds of its own after which a request is judged on them alone.
    pub probe_rounds: usize,
    /// Context tokens a drafter may catch up on per token left to write, where no drafter's prefill is priced yet
    /// ([`Pace::entry_unpriced_and_far`](super::Pace::entry_unpriced_and_far)).
    pub unpriced_entry: usize,
    /// The first pause where the target's speed at this load is not known yet.
    pub first_pause: usize,
    /// Tokens a request writes by the sort of rounds it chose before it chooses again ([`Pace::choose_rounds`](super::Pace::choose_rounds)).
    pub streak: usize,
    /// The longest pause before the figures are read again (the load may have moved).
    pub max_pause: usize,
    /// A request measuring the first rounds of its kind at a load stops before [`PaceConfig::probe_rounds`] rounds where its
    /// rounds so far cost more than this many times the target's step per token: rounds that pay cost well under a
    /// step, and two more rounds do not turn a loss of this size.
    pub far_behind: f64,
    /// Tokens written alone before the first probe of a losing speculation.
    pub min_gap: usize,
    /// The most tokens written alone between two probes.
    pub max_gap: usize,
    /// After a losing probe, the next waits at least this many times the tokens the target alone would have written
    /// in the time the probe lost, its setup included (the draft's prefill of a request that had not drafted yet): a
    /// probe of a speculation that loses by far then costs at most a 33rd of the time between probes (gaps that only
    /// double let losing probes write a large share of a loaded pool's output). The price is a slower return to
    /// speculating where it starts to pay at that load: up to [`PaceConfig::max_gap`] tokens written alone at that load by the requests
    /// of that kind.
    pub probe_share: f64,
    /// A drafted token that costs less than this share of a verification row counts as free
    /// ([`Costs::free_rounds_pay`](super::Costs::free_rounds_pay)).
    pub free_draft: f64,
    /// Tokens the sort of rounds that writes faster at a load writes there before a request makes a round of the other
    /// sort ([`Costs::choose_rounds`](super::Costs::choose_rounds)). Such a round costs what the other sort loses for one round: at most a few
    /// percent of the time of 128 tokens where they differ by a fifth.
    pub try_other_every: usize,
    /// While one-token guesses lose, one in this many places where they could be made still makes one
    /// ([`Costs::guess_pays`](super::Costs::guess_pays)).
    pub guess_probe: usize,
    /// Finished requests' lengths kept for [`Costs::expected_left`](super::Costs::expected_left).
    pub lengths: usize,
    /// Fewer past requests than this that wrote as far as a request has: its tokens so far stand for what is left.
    pub min_lengths: usize,
}

impl PaceConfig {
    /// The project's tuning.
    pub const DEFAULT: PaceConfig = PaceConfig {
        probe_rounds: 3,
        unpriced_entry: 32,
        first_pause: 4,
        streak: 32,
        max_pause: 64,
        far_behind: 2.0,
        min_gap: 16,
        max_gap: 4096,
        probe_share: 32.0,
        free_draft: 0.01,
        try_other_every: 128,
        guess_probe: 8,
        lengths: 256,
        min_lengths: 4,
    };
}

impl Default for PaceConfig {
    fn default() -> Self {
        PaceConfig::DEFAULT
    }
}
