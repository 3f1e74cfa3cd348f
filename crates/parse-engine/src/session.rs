//! KV sessions: one cache per request id, with byte accounting against a per-worker capacity.
//!
//! Accounting counts the K/V bytes of the tokens a session holds (`tokens x kv_bytes_per_token`); a forward that
//! would take the store over its capacity fails with [`Error::CapacityExceeded`] before touching any cache.

use std::collections::HashMap;

use crate::any_model::{Net, SessionCache};
use crate::block::Block;
use crate::error::{Error, Result};
use crate::model::{Logits, Packed};
use parse_core::mask::BlockMask;

/// The sessions of one model.
#[derive(Debug)]
pub struct SessionStore {
    map: HashMap<String, SessionCache>,
    capacity: usize,
    /// The most bytes one session may hold (the capacity unless set lower): one long request cannot take the
    /// whole store from the others.
    per_session: usize,
    prefixes: Prefixes,
}

/// Default budget of the prompts' caches kept for later requests ([`SessionStore::set_prefix_budget`]): 256 MiB, a
/// few dozen prompts of a few hundred tokens of the default target.
pub const DEFAULT_PREFIX_BUDGET: usize = 256 << 20;

/// Prompts' caches kept for later requests that begin the same way (automatic prefix caching): a request that
/// shares its first tokens with a kept prompt (a system prompt, an instruction, a document asked about again) takes
/// their keys and values from it instead of computing them. A row's keys and values depend only on the tokens up to
/// it, and the kernels' arithmetic for a row does not depend on what shares its pass or where the prefill was cut,
/// so the copy holds the same bits the request's own prefill would have written. Kept by recency within a byte
/// budget of their own, beside the sessions' capacity.
#[derive(Debug)]
struct Prefixes {
    /// Least recently used first: each prompt's namespace (`SamplingParams::cache_salt`), tokens and cache.
    kept: Vec<(u64, Vec<u32>, SessionCache)>,
    bytes: usize,
    budget: usize,
}

impl Prefixes {
    /// The kept prompt of namespace `salt` that shares the most first tokens with `tokens`, and how many.
    fn longest(&self, salt: u64, tokens: &[u32]) -> Option<(usize, usize)> {
        self.kept
            .iter()
            .enumerate()
            .filter(|(_, (s, _, _))| *s == salt)
            .map(|(i, (_, kept, _))| (i, common_prefix(kept, tokens)))
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(i, n)| (n, i))
    }

    /// Marks entry `i` as used now.
    fn touch(&mut self, i: usize) {
        let e = self.kept.remove(i);
        self.kept.push(e);
    }

    fn insert(&mut self, salt: u64, tokens: Vec<u32>, cache: SessionCache) {
        let size = cache.bytes();
        if size > self.budget {
            return;
        }
        // A kept prompt that this one begins with adds nothing beside it.
        let bytes = &mut self.bytes;
        self.kept.retain(|(s, kept, c)| {
            let covered = *s == salt && tokens.starts_with(kept);
            if covered {
                *bytes -= c.bytes();
            }
            !covered
        });
        while self.bytes + size > self.budget && !self.kept.is_empty() {
            let (_, _, c) = self.kept.remove(0);
            self.bytes -= c.bytes();
        }
        self.bytes += size;
        self.kept.push((salt, tokens, cache));
    }
}

/// How many first tokens `a` and `b` share.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl SessionStore {
    pub fn new(capacity_bytes: usize) -> Self {
        SessionStore {
            map: HashMap::new(),
            capacity: capacity_bytes,
            per_session: capacity_bytes,
            prefixes: Prefixes {
                kept: Vec::new(),
                bytes: 0,
                budget: DEFAULT_PREFIX_BUDGET,
            },
        }
    }

    /// Sets the bytes the prompts' caches kept for later requests may take ([`DEFAULT_PREFIX_BUDGET`] unless set;
    /// 0 keeps none and drops those kept).
    pub fn set_prefix_budget(&mut self, bytes: usize) {
        self.prefixes.budget = bytes;
        while self.prefixes.bytes > bytes && !self.prefixes.kept.is_empty() {
            let (_, _, c) = self.prefixes.kept.remove(0);
            self.prefixes.bytes -= c.bytes();
        }
    }

    /// Bytes of the prompts' caches kept for later requests, and how many prompts.
    pub fn prefix_bytes(&self) -> (usize, usize) {
        (self.prefixes.bytes, self.prefixes.kept.len())
    }

    /// Fills the empty session `id` with the keys and values of the longest run of `tokens`' first tokens that a
    /// prompt kept in namespace `salt` shares ([`SessionStore::keep_prefix`]), where the session may hold them;
    /// returns how many tokens it now holds (0: none shared, or the session is not empty, or no room).
    pub fn reuse_prefix(
        &mut self,
        model: &Net,
        id: &str,
        salt: u64,
        tokens: &[u32],
    ) -> Result<usize> {
        if !self.get(id)?.is_empty() {
            return Ok(0);
        }
        let Some((i, n)) = self.prefixes.longest(salt, tokens) else {
            return Ok(0);
        };
        if self.check_capacity(model, id, n).is_err() {
            return Ok(0);
        }
        let Some(copy) = self.prefixes.kept[i].2.prefix(n) else {
            return Ok(0);
        };
        self.prefixes.touch(i);
        self.map.insert(id.to_string(), copy);
        Ok(n)
    }

    /// Keeps a copy of session `id`'s cache, in namespace `salt`, for later requests that begin with `tokens`, the
    /// tokens it holds (nothing is kept where it holds another number of them, or its kind of cache is not copied).
    pub fn keep_prefix(&mut self, id: &str, salt: u64, tokens: &[u32]) -> Result<()> {
        let cache = self.get(id)?;
        if self.prefixes.budget == 0 || tokens.is_empty() || cache.len() != tokens.len() {
            return Ok(());
        }
        // Already kept within a longer prompt (the same prompt again, say): mark it used.
        if let Some((i, n)) = self.prefixes.longest(salt, tokens)
            && n == tokens.len()
        {
            self.prefixes.touch(i);
            return Ok(());
        }
        if let Some(copy) = cache.prefix(tokens.len()) {
            self.prefixes.insert(salt, tokens.to_vec(), copy);
        }
        Ok(())
    }

    /// Caps what one session may hold at `share` of the capacity (0 < share <= 1).
    pub fn set_session_share(&mut self, share: f64) -> Result<()> {
        if !(share > 0.0 && share <= 1.0) {
            return Err(Error::InvalidInput(format!(
                "the KV session share must be in (0, 1], got {share}"
            )));
        }
        self.per_session = (self.capacity as f64 * share) as usize;
        Ok(())
    }

    /// The most bytes one session may hold.
    pub fn session_limit(&self) -> usize {
        self.per_session
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes held by all sessions.
    pub fn used(&self) -> usize {
        self.map.values().map(SessionCache::bytes).sum()
    }

    pub fn count(&self) -> usize {
        self.map.len()
    }

    pub fn open(&mut self, model: &Net, id: &str) -> Result<()> {
        if id.is_empty() {
            return Err(Error::invalid("empty session id"));
        }
        if self.map.contains_key(id) {
            return Err(Error::SessionExists(id.to_string()));
        }
        self.map.insert(id.to_string(), model.new_cache());
        Ok(())
    }

    fn get(&self, id: &str) -> Result<&SessionCache> {
        self.map
            .get(id)
            .ok_or_else(|| Error::UnknownSession(id.to_string()))
    }

    /// Tokens held by a session.
    pub fn len(&self, id: &str) -> Result<usize> {
        Ok(self.get(id)?.len())
    }

    /// Bytes held by a session.
    pub fn bytes(&self, id: &str) -> Result<usize> {
        Ok(self.get(id)?.bytes())
    }

    /// The checks of `forward`, without running it.
    pub fn check_forward(
        &self,
        model: &Net,
        id: &str,
        tokens: &[u32],
        positions: &[u32],
        mask: &BlockMask,
        readout: &[usize],
    ) -> Result<()> {
        let cache = self.get(id)?;
        self.check_capacity(model, id, tokens.len())?;
        model.check_block(cache, tokens, positions, mask, readout)
    }

    /// Whether `n` more tokens of `model` fit in the store's capacity.
    fn check_capacity(&self, model: &Net, id: &str, n: usize) -> Result<()> {
        self.check_capacity_after(model, id, n, 0)
    }

    /// Whether `n` more tokens fit once `claimed` more bytes (blocks of the same batch) are held.
    fn check_capacity_after(&self, model: &Net, id: &str, n: usize, claimed: usize) -> Result<()> {
        let needed = n * model.config().kv_bytes_per_token();
        let would_hold = self.bytes(id).unwrap_or(0) + needed;
        if would_hold > self.per_session {
            return Err(Error::SessionShareExceeded {
                session: id.to_string(),
                would_hold,
                limit: self.per_session,
            });
        }
        let available = self.capacity.saturating_sub(self.used() + claimed);
        if needed > available {
            return Err(Error::CapacityExceeded {
                session: id.to_string(),
                needed,
                available,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// Runs a block on a session (see `Model::forward`).
    pub fn forward(
        &mut self,
        model: &Net,
        id: &str,
        tokens: &[u32],
        positions: &[u32],
        mask: &BlockMask,
        readout: &[usize],
    ) -> Result<Logits> {
        self.get(id)?;
        self.check_capacity(model, id, tokens.len())?;
        let cache = self
            .map
            .get_mut(id)
            .ok_or_else(|| Error::UnknownSession(id.to_string()))?;
        model.forward(cache, tokens, positions, mask, readout)
    }

    /// The checks of `forward_batch`, without running it: one result per block. A block fails when its session is
    /// unknown or already has a block earlier in the batch, when the store has no room for it once the earlier
    /// blocks that pass are counted, or when the block itself is bad. The blocks that pass are exactly those
    /// `forward_batch` runs.
    pub fn check_batch(&self, model: &Net, blocks: &[Block]) -> Vec<Result<()>> {
        let mut claimed = 0;
        let mut passed: Vec<&str> = Vec::new();
        blocks
            .iter()
            .map(|b| {
                if passed.contains(&b.session.as_str()) {
                    return Err(Error::invalid(format!(
                        "session `{}` has two blocks in one batch",
                        b.session
                    )));
                }
                let cache = self.get(&b.session)?;
                self.check_capacity_after(model, &b.session, b.tokens.len(), claimed)?;
                model.check_block(cache, &b.tokens, &b.positions, &b.mask, &b.readout)?;
                claimed += b.tokens.len() * model.config().kv_bytes_per_token();
                passed.push(&b.session);
                Ok(())
            })
            .collect()
    }

    /// Runs the blocks of several sessions as one packed pass (see `Model::forward_packed`); one result per
    /// block, in order. A block that fails its checks ([`SessionStore::check_batch`]) gets its error and the
    /// others run without it.
    pub fn forward_batch(&mut self, model: &Net, blocks: &[Block]) -> Vec<Result<Logits>> {
        let mut results: Vec<Option<Result<Logits>>> = blocks.iter().map(|_| None).collect();
        let mut taken: Vec<(usize, SessionCache)> = Vec::new();
        for (i, checked) in self.check_batch(model, blocks).into_iter().enumerate() {
            match checked {
                Err(e) => results[i] = Some(Err(e)),
                Ok(()) => {
                    if let Some(cache) = self.map.remove(&blocks[i].session) {
                        taken.push((i, cache));
                    }
                }
            }
        }
        let packed = {
            let mut items: Vec<Packed<'_, SessionCache>> = taken
                .iter_mut()
                .map(|(i, cache)| {
                    let b = &blocks[*i];
                    Packed {
                        cache,
                        tokens: &b.tokens,
                        positions: &b.positions,
                        mask: &b.mask,
                        readout: &b.readout,
                    }
                })
                .collect();
            model.forward_packed(&mut items)
        };
        match packed {
            Ok(logits) => {
                for ((i, _), l) in taken.iter().zip(logits) {
                    results[*i] = Some(Ok(l));
                }
            }
            // The pass failed as a whole (and changed no cache): run each block alone for its own error.
            Err(_) => {
                for (i, cache) in taken.iter_mut() {
                    let b = &blocks[*i];
                    results[*i] =
                        Some(model.forward(cache, &b.tokens, &b.positions, &b.mask, &b.readout));
                }
            }
        }
        for (i, cache) in taken {
            self.map.insert(blocks[i].session.clone(), cache);
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(Error::invalid("a block of the batch did not run"))))
            .collect()
    }

    /// Keeps a session's first `n` tokens.
    pub fn truncate(&mut self, id: &str, n: usize) -> Result<()> {
        let cache = self
            .map
            .get_mut(id)
            .ok_or_else(|| Error::UnknownSession(id.to_string()))?;
        if n > cache.len() {
            return Err(Error::invalid(format!(
                "cannot truncate session `{id}` to {n} tokens: it holds {}",
                cache.len()
            )));
        }
        cache.truncate(n);
        Ok(())
    }

    /// Drops a session; returns the bytes freed.
    pub fn release(&mut self, id: &str) -> Result<usize> {
        let cache = self
            .map
            .remove(id)
            .ok_or_else(|| Error::UnknownSession(id.to_string()))?;
        Ok(cache.bytes())
    }
}
