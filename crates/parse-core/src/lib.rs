//! PARSE core: verification plans (tokens, positions, compact mask), the segmenter, verdicts and the acceptance
//! policy, and the one generation loop over the [`Drafter`] / [`Verifier`] traits. No ML and no network code: the
//! engines and the gRPC clients implement the traits.

pub mod copy_first;
pub mod driver;
pub mod env;
pub mod error;
pub mod lookup;
pub mod mask;
pub mod ngram;
pub mod pace;
pub mod plan;
pub mod policy;
pub mod process;
pub mod retry;
pub mod segmenter;
pub mod speculative;

pub use copy_first::{CopyConfig, CopyFirst};
pub use driver::{
    DraftChunk, DraftHints, DraftWindow, Drafter, ExtendOutput, FinishReason, GenerationRequest,
    Mode, Outcome, SamplingParams, Source, Stats, Verifier, generate, generate_paced,
    generate_with,
};
pub use error::{Error, ErrorKind, Result};
pub use mask::{BlockMask, MaskRow};
pub use ngram::{DrafterKind, NgramConfig, NgramDrafter, PieceFn};
pub use plan::{Scoring, VerifyPlan};
pub use policy::{AcceptPolicy, Acceptance, JudgeScore, RowScore, Verdict, VerifyOutput, decide};
pub use segmenter::SegmenterConfig;
pub use speculative::{SampleCheck, SampledRow};
