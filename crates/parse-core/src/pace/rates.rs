//! The estimators the figures are kept in: a moving rate of milliseconds per token ([`Rate`]), the line of a
//! verification's time in its rows ([`Passes`]), the chance of each draft position being accepted ([`Reach`]), and
//! the share of one-token guesses the target keeps ([`Guesses`]). Their smoothing constants define the estimators;
//! the policy's tunables are in [`super::PaceConfig`].

/// Milliseconds per token over recent samples, each weighted by its tokens: a sample of [`Rate::SPAN`] tokens moves
/// the figure as far as one step of a moving average with weight 0.4 would, a one-token sample about a sixteenth as far
/// (so that one slow step, say the first after a wave of prefills, does not stand for the whole rate).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Rate {
    pub(super) ms: f64,
    pub(super) tokens: f64,
}

impl Rate {
    pub(super) const SPAN: f64 = 16.0;
    pub(super) const KEEP: f64 = 0.6;

    pub(super) fn add(&mut self, ms: f64, tokens: usize) {
        if tokens == 0 {
            return;
        }
        let keep = Self::KEEP.powf(tokens as f64 / Self::SPAN);
        self.ms = self.ms * keep + ms;
        self.tokens = self.tokens * keep + tokens as f64;
    }

    pub(super) fn get(&self) -> Option<f64> {
        (self.tokens > 0.0).then(|| self.ms / self.tokens)
    }
}

/// Token-level rounds at one load: their verification passes (milliseconds against rows, rows being the pending token
/// and the drafted ones) and their drafting (milliseconds and tokens drafted), as sums that fade by [`Passes::KEEP`]
/// per round.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Passes {
    pub(super) weight: f64,
    pub(super) rows: f64,
    pub(super) rows2: f64,
    pub(super) verify_ms: f64,
    pub(super) rows_ms: f64,
    pub(super) draft_ms: f64,
    pub(super) drafted: f64,
    /// Rounds reported (unfaded): every [`Passes::SPREAD_EVERY`]th drafts half as far while the rows have no spread.
    pub(super) rounds: usize,
}

impl Passes {
    pub(super) const KEEP: f64 = 0.9;
    pub(super) const SPREAD_EVERY: usize = 4;

    pub(super) fn add(&mut self, verify_ms: f64, rows: usize, draft_ms: f64, drafted: usize) {
        let (k, r) = (Self::KEEP, rows as f64);
        self.weight = self.weight * k + 1.0;
        self.rows = self.rows * k + r;
        self.rows2 = self.rows2 * k + r * r;
        self.verify_ms = self.verify_ms * k + verify_ms;
        self.rows_ms = self.rows_ms * k + r * verify_ms;
        self.draft_ms = self.draft_ms * k + draft_ms;
        self.drafted = self.drafted * k + drafted as f64;
        self.rounds += 1;
    }

    /// A verification's time as a line in its rows, fitted by least squares: (fixed ms, ms per row). `None` while
    /// the rows spread less than half a row either way (a line through one point).
    pub(super) fn line(&self) -> Option<(f64, f64)> {
        let w = self.weight;
        let spread = w * self.rows2 - self.rows * self.rows;
        if w <= 0.0 || spread < 0.25 * w * w {
            return None;
        }
        let per_row = ((w * self.rows_ms - self.rows * self.verify_ms) / spread).max(0.0);
        Some((
            ((self.verify_ms - per_row * self.rows) / w).max(0.0),
            per_row,
        ))
    }

    /// Milliseconds per drafted token.
    pub(super) fn ms_per_drafted(&self) -> f64 {
        if self.drafted > 0.0 {
            (self.draft_ms / self.drafted).max(0.0)
        } else {
            0.0
        }
    }
}

/// How often each position of a kind's token-level drafts is accepted, given the ones before it were: per position,
/// the drafts that reached it with every earlier token accepted, and those of them whose token was accepted, as sums
/// that fade by [`Reach::KEEP`] per round (at every position, so that a position the drafts no longer reach drifts
/// back to the prior and gets tried again).
#[derive(Debug, Clone, Default)]
pub(super) struct Reach {
    pub(super) offered: Vec<f64>,
    pub(super) accepted: Vec<f64>,
}

impl Reach {
    pub(super) const KEEP: f64 = 0.97;
    /// Weight of the prior of a position's rate: the rate of the position before it (the first position's, 1: a
    /// kind with no rounds yet drafts as far as it may, which measures it).
    pub(super) const PRIOR: f64 = 2.0;

    pub(super) fn add(&mut self, drafted: usize, accepted: usize) {
        if self.offered.len() < drafted {
            self.offered.resize(drafted, 0.0);
            self.accepted.resize(drafted, 0.0);
        }
        for j in 0..self.offered.len() {
            self.offered[j] *= Self::KEEP;
            self.accepted[j] *= Self::KEEP;
            if j < drafted && j <= accepted {
                self.offered[j] += 1.0;
                if j < accepted {
                    self.accepted[j] += 1.0;
                }
            }
        }
    }

    /// The chance that a draft's token at each position up to `max` is accepted with every one before it.
    pub(super) fn reach(&self, max: usize) -> Vec<f64> {
        let (mut prior, mut all) = (1.0, 1.0);
        (0..max)
            .map(|j| {
                let (o, a) = (
                    self.offered.get(j).copied().unwrap_or(0.0),
                    self.accepted.get(j).copied().unwrap_or(0.0),
                );
                let p = (a + Self::PRIOR * prior) / (o + Self::PRIOR);
                prior = p;
                all *= p;
                all
            })
            .collect()
    }
}

/// A kind's one-token guesses ([`Costs::guess_pays`]): how many were made and how many the target kept (both decayed
/// by [`Guesses::KEEP`] per guess), and the guesses left out since the last one made while they lose.
#[derive(Debug, Default)]
pub(super) struct Guesses {
    pub(super) made: f64,
    pub(super) right: f64,
    pub(super) skipped: usize,
}

impl Guesses {
    /// About the last hundred guesses count.
    pub(super) const KEEP: f64 = 0.99;

    /// The share of guesses the target keeps, with one kept and one not as the prior (a kind with no guesses yet
    /// guesses, which measures it).
    pub(super) fn rate(&self) -> f64 {
        (self.right + 1.0) / (self.made + 2.0)
    }
}

/// The token-level round [`Costs::draft_length`] chooses: its draft length and the ms per output token it expects,
/// with the row and drafted-token prices it was judged by.
#[derive(Debug, Clone, Copy)]
pub(super) struct BestRound {
    pub(super) tokens: usize,
    pub(super) ms_per_token: f64,
    pub(super) per_row: f64,
    pub(super) draft_ms: f64,
}
