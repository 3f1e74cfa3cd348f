//! The generation loop, written once against the [`Drafter`] and [`Verifier`] traits (in-process engines or gRPC
//! clients), for every mode.
//!
//! Target session convention (see `plan`): the cache holds the context except its last token, the **pending** one.
//!
//! One PARSE round: draft a few segments continuing the accepted context (the window adapts: doubled after a fully
//! accepted draft, halved after a rejection, so the draft never runs far past a likely rejection); verify them in one
//! pass; keep the accepted prefix; if the draft was cut short, take the target's own token at the cut (free from the
//! pass) and let the target extend to the end of that segment (in `parse+token-spec` by token-level speculation);
//! then draft again.

mod request;
mod run;
mod stats;
mod traits;

pub use request::*;
pub use run::{generate, generate_paced, generate_with};
pub use stats::*;
pub use traits::*;
