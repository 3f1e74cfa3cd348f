//! The pool's figures: the rates of the target alone and of each kind of speculation by load level, the drafter's
//! price of catching up, the requests' output lengths, and which sort of rounds writes faster.

use super::*;

impl Costs {
    /// Figures paced by `cfg`, reading the time from `clock`.
    pub fn with_config(cfg: PaceConfig, clock: Clock) -> Self {
        Costs {
            cfg,
            clock,
            ..Costs::default()
        }
    }

    /// The tunables the figures' requests are paced by.
    pub fn config(&self) -> &PaceConfig {
        &self.cfg
    }

    pub(super) fn with<T>(&self, level: u32, f: impl FnOnce(&mut Level) -> T) -> T {
        let mut levels = self.levels.lock().unwrap_or_else(|e| e.into_inner());
        f(levels.entry(level).or_default())
    }

    pub fn alone_ms(&self, level: u32) -> Option<f64> {
        self.with(level, |l| l.alone.get())
    }

    /// The target's figure at `level`, or where it has none yet, at the nearest level that has one (the lower of two
    /// as near) among those measured the same way (level 0 by wall time, the others by charged time, [`Spent::at`]).
    /// Loads just above a power of two (9 requests at 8 clients, while one request ends as the next begins) are
    /// otherwise judged against a verification's cost until a pause there measures the target.
    pub fn alone_near(&self, level: u32) -> Option<f64> {
        self.near(level, false, |l| l.alone.get())
    }

    /// `figure` at `level`, or at the nearest level that has it (the lower of two as near): among those measured the
    /// same way (see [`Costs::alone_near`]), or with `any_level`, among all.
    pub(super) fn near(
        &self,
        level: u32,
        any_level: bool,
        figure: impl Fn(&Level) -> Option<f64>,
    ) -> Option<f64> {
        let levels = self.levels.lock().unwrap_or_else(|e| e.into_inner());
        let figure = |l: u32| levels.get(&l).and_then(&figure);
        if level == 0 && !any_level {
            return figure(0);
        }
        let highest = levels.keys().copied().max().unwrap_or(0);
        (0..=highest.max(level)).find_map(|d| {
            [level.checked_sub(d), level.checked_add(d)]
                .into_iter()
                .flatten()
                .filter(|&l| any_level || l >= 1)
                .find_map(figure)
        })
    }

    /// A request of `kind` opened its drafter at `level`: the prefill of `rows` context tokens cost `ms`.
    pub fn record_entry(&self, kind: &str, level: u32, ms: f64, rows: usize) {
        self.with(level, |l| {
            l.spec
                .entry(kind.to_string())
                .or_default()
                .entry
                .add(ms, rows)
        })
    }

    /// What `kind`'s drafter costs per context token it catches up on, at `level` or where it has not been measured
    /// there, at the nearest level that has it, one request's wall time (level 0) and charged time alike: it is the
    /// drafter's prefill, whose price does not follow the target's load the way the target's figures do. Without a
    /// price from other levels, the last request of a loaded run, alone at last and hundreds of tokens in, could make
    /// the first round at one request with its whole context to prefill on the draft worker, with nothing to judge
    /// the catching up by.
    pub fn entry_ms(&self, kind: &str, level: u32) -> Option<f64> {
        self.near(level, true, |l| {
            l.spec.get(kind).and_then(|s| s.entry.get())
        })
    }

    /// A request of the pool finished with `tokens` of output.
    pub fn record_length(&self, tokens: usize) {
        let mut l = self.lengths.lock().unwrap_or_else(|e| e.into_inner());
        if l.len() == self.cfg.lengths {
            l.pop_front();
        }
        l.push_back(tokens);
    }

    /// How many more tokens a request that has written `written` and may write `left` more is expected to write:
    /// the mean of what the pool's past requests that wrote more than `written` wrote beyond it (each at most
    /// `left`). Where fewer than [`PaceConfig::min_lengths`] got that far, `written` itself (the median of what is left
    /// when nothing is known of where in its length a request is), and while the pool has finished fewer than
    /// [`PaceConfig::min_lengths`] requests, `left` (no history: judged over the whole budget, as a fresh request always
    /// was).
    pub fn expected_left(&self, written: usize, left: usize) -> usize {
        let l = self.lengths.lock().unwrap_or_else(|e| e.into_inner());
        if l.len() < self.cfg.min_lengths {
            return left;
        }
        let beyond: Vec<usize> = l
            .iter()
            .filter(|&&n| n > written)
            .map(|&n| (n - written).min(left))
            .collect();
        if beyond.len() < self.cfg.min_lengths {
            return written.min(left);
        }
        beyond.iter().sum::<usize>() / beyond.len()
    }

    pub fn spec_ms(&self, kind: &str, level: u32) -> Option<f64> {
        self.with(level, |l| l.spec.get(kind).and_then(|s| s.rate.get()))
    }

    /// What `kind`'s speculation writes per token at `level` by its better sort of rounds, where it makes either and
    /// both have a figure there ([`Costs::choose_rounds`]: a request makes the better one), otherwise by all its
    /// rounds ([`Costs::spec_ms`]).
    pub fn best_spec_ms(&self, kind: &str, level: u32) -> Option<f64> {
        self.with(level, |l| {
            let rate = |k: String| l.spec.get(&k).and_then(|s| s.rate.get());
            let all = rate(kind.to_string());
            match (
                rate(Rounds::Segments.figure(kind)),
                rate(Rounds::Tokens.figure(kind)),
            ) {
                (Some(s), Some(t)) if all.is_some() => Some(s.min(t)),
                _ => all,
            }
        })
    }

    /// What `kind`'s speculation is set against besides the target alone at `level` ([`Level::pauses_ms`]).
    pub fn pauses_ms(&self, kind: &str, level: u32) -> Option<f64> {
        self.with(level, |l| l.pauses_ms(kind))
    }

    /// A pause of a request of `kind` at `level` wrote `tokens` in `ms` (any way: [`Level::pauses_ms`]).
    pub(super) fn record_paused(&self, kind: &str, level: u32, ms: f64, tokens: usize) {
        self.with(level, |l| {
            l.spec
                .entry(pause_kind(kind))
                .or_default()
                .rate
                .add(ms, tokens)
        })
    }

    /// [`Costs::spec_ms`] and how many rounds were reported to it.
    pub(super) fn spec_figure(&self, kind: &str, level: u32) -> (Option<f64>, usize) {
        self.with(level, |l| {
            l.spec
                .get(kind)
                .map_or((None, 0), |s| (s.rate.get(), s.reports))
        })
    }

    /// The target wrote `tokens` alone in `ms`: for a paused request of `kind`, or (`None`) in `target` mode.
    pub fn record_alone(&self, kind: Option<&str>, level: u32, ms: f64, tokens: usize) {
        self.add_alone(kind, level, ms, tokens, false);
    }

    /// [`Costs::record_alone`] for tokens written while another request's speculative round ran (`beside`): they
    /// count towards the next probe, but not towards the target's figure at that level, once it has one.
    ///
    /// Where workers share their cores (a draft worker beside the target worker on one host), a step written beside
    /// others' drafting takes longer, in wall time and in the time charged to it, and the longer the more requests
    /// draft: a figure of the target taken then makes speculation look cheaper by comparison, more requests
    /// speculate, and the target looks dearer still: a feedback loop that keeps requests speculating where it loses.
    pub(super) fn add_alone(
        &self,
        kind: Option<&str>,
        level: u32,
        ms: f64,
        tokens: usize,
        beside: bool,
    ) {
        if tokens == 0 {
            return;
        }
        self.with(level, |l| {
            if !beside || l.alone.get().is_none() {
                l.alone.add(ms, tokens);
            }
            if let Some(k) = kind {
                l.spec.entry(k.to_string()).or_default().since += tokens;
            }
        })
    }

    pub(super) fn activity<T>(&self, f: impl FnOnce(&mut Activity) -> T) -> T {
        f(&mut self.activity.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub(super) fn round_begins(&self) {
        self.activity(|a| a.running += 1)
    }

    pub(super) fn round_ends(&self) -> std::time::Instant {
        let now = self.clock.now();
        self.activity(|a| {
            a.running = a.running.saturating_sub(1);
            a.last_end = Some(now);
        });
        now
    }

    /// A round of `kind` wrote `tokens` in `ms`. `probe`: it was a probe of a speculation that was losing, with what
    /// its setup cost besides `ms` (the draft's first prefill, which a request that goes on speculating pays once and
    /// which is not part of the rate, but which a probe pays for a single round).
    pub fn record_spec(&self, kind: &str, level: u32, ms: f64, tokens: usize, probe: Option<f64>) {
        self.with(level, |l| {
            let alone = rival(l.alone.get(), l.pauses_ms(kind));
            let s = l.spec.entry(kind.to_string()).or_default();
            s.since = 0;
            s.reports += 1;
            s.rate.add(ms, tokens);
            match (s.rate.get(), alone) {
                (Some(x), Some(a)) if x > a => {
                    if let Some(setup) = probe {
                        let lost = ((ms + setup) / a - tokens as f64).max(0.0);
                        let pay = (self.cfg.probe_share * lost).ceil() as usize;
                        s.gap = (s.gap.max(self.cfg.min_gap) * 2)
                            .max(pay)
                            .min(self.cfg.max_gap);
                    }
                }
                _ => s.gap = 0,
            }
        })
    }

    /// Which rounds a request of `kind` at `level` should speculate with ([`Rounds`]): PARSE rounds until they have a
    /// figure there, then token-level rounds until those have one, then the sort that writes at fewer ms per token,
    /// except that every [`PaceConfig::try_other_every`] tokens the winner wrote there, one request makes a round of the
    /// other sort, which measures it again (the load, the task and the drafter's hits move both).
    pub fn choose_rounds(&self, kind: &str, level: u32) -> Rounds {
        let (segments, tokens) = (Rounds::Segments.figure(kind), Rounds::Tokens.figure(kind));
        self.with(level, |l| {
            let rate = |name: &str| l.spec.get(name).and_then(|f| f.rate.get());
            let winner = match (rate(&segments), rate(&tokens)) {
                (None, _) => return Rounds::Segments,
                (Some(_), None) => return Rounds::Tokens,
                (Some(s), Some(t)) if t < s => Rounds::Tokens,
                _ => Rounds::Segments,
            };
            let other = l.spec.entry(winner.other().figure(kind)).or_default();
            if other.since >= self.cfg.try_other_every {
                other.since = 0;
                winner.other()
            } else {
                winner
            }
        })
    }

    /// A speculative round of `rounds` made by a request of `kind` at `level` wrote `tokens` in `ms` (`None`: the
    /// first round of a switch, which is no figure of the sort): that sort's figure, and towards the next round of
    /// the other sort there.
    pub fn record_rounds(
        &self,
        kind: &str,
        rounds: Rounds,
        level: u32,
        ms: Option<f64>,
        tokens: usize,
    ) {
        self.with(level, |l| {
            if let Some(ms) = ms {
                l.spec
                    .entry(rounds.figure(kind))
                    .or_default()
                    .rate
                    .add(ms, tokens);
            }
            l.spec.entry(rounds.other().figure(kind)).or_default().since += tokens;
        })
    }

    /// Every figure measured so far, by level then path.
    pub fn snapshot(&self) -> Vec<CostFigure> {
        let levels = self.levels.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        for (&level, l) in levels.iter() {
            if let Some(ms) = l.alone.get() {
                out.push(CostFigure {
                    level,
                    path: "alone".into(),
                    ms_per_token: ms,
                });
            }
            for (k, s) in &l.spec {
                if let Some(ms) = s.rate.get() {
                    out.push(CostFigure {
                        level,
                        path: k.clone(),
                        ms_per_token: ms,
                    });
                }
            }
        }
        out.sort_by(|a, b| (a.level, &a.path).cmp(&(b.level, &b.path)));
        out
    }
}
