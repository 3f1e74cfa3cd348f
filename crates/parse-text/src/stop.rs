//! Stop strings: text is released to a stream only once no stop string can still begin inside it, and cut before
//! the first stop string found.

/// Releases text to a stream, holding back any tail that could still turn into a stop string.
#[derive(Debug, Clone)]
pub struct StopFilter {
    stop: Vec<String>,
    text: String,
    sent: usize,
}

impl StopFilter {
    pub fn new(stop: Vec<String>) -> Self {
        StopFilter {
            stop,
            text: String::new(),
            sent: 0,
        }
    }

    /// All text so far (cut before a stop string once one was found).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The text so far, taking it.
    pub fn into_text(self) -> String {
        self.text
    }

    /// Adds text; returns (releasable delta, whether a stop string was found).
    pub fn push(&mut self, delta: &str) -> (String, bool) {
        self.text.push_str(delta);
        let search_from = self
            .sent
            .saturating_sub(self.stop.iter().map(|s| s.len()).max().unwrap_or(0));
        let search_from = (0..=search_from)
            .rev()
            .find(|i| self.text.is_char_boundary(*i))
            .unwrap_or(0);
        let hit = self
            .stop
            .iter()
            .filter_map(|s| {
                self.text[search_from..]
                    .find(s.as_str())
                    .map(|i| i + search_from)
            })
            .min();
        if let Some(cut) = hit {
            self.text.truncate(cut);
            let out = self.text[self.sent.min(cut)..].to_string();
            self.sent = cut;
            return (out, true);
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let mut hold = 0;
        for s in &self.stop {
            for l in (1..s.len()).rev() {
                if s.is_char_boundary(l) && self.text.ends_with(&s[..l]) {
                    hold = hold.max(l);
                    break;
                }
            }
        }
        let upto = self.text.len() - hold;
        let out = if upto > self.sent {
            self.text[self.sent..upto].to_string()
        } else {
            String::new()
        };
        self.sent = self.sent.max(upto);
        (out, false)
    }

    /// Releases whatever was held back.
    pub fn flush(&mut self) -> String {
        let out = self.text[self.sent..].to_string();
        self.sent = self.text.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_filter_holds_back_partial_matches_and_cuts() {
        let mut f = StopFilter::new(vec!["END".into()]);
        assert_eq!(f.push("abc E"), ("abc ".to_string(), false));
        assert_eq!(f.push("N"), (String::new(), false));
        assert_eq!(f.push("Dxyz"), (String::new(), true));
        assert_eq!(f.text(), "abc ");
        let mut g = StopFilter::new(vec!["END".into()]);
        assert_eq!(g.push("E"), (String::new(), false));
        assert_eq!(g.push("x"), ("Ex".to_string(), false));
        assert_eq!(g.flush(), "");
    }
}
