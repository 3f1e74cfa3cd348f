//! What a worker publishes about its model (`GetModelInfo`): name, vocabulary, context, the portable tokenizer the
//! router tokenizes with, the chat layout, the tensor-parallel size, and which model implementation computes where.

use parse_core::Error as CoreError;
use parse_engine::{ChatTemplate, Engine};
use parse_proto::v1::GetModelInfoResponse;

/// What the workers say about their model, served by a group of `tp_size` ranks.
pub fn model_info(engine: &Engine, tp_size: usize) -> Result<GetModelInfoResponse, CoreError> {
    let tok = engine.tokenizer();
    let (layout, default_system) = match tok.template() {
        ChatTemplate::ChatMl { default_system } => {
            ("chatml", default_system.clone().unwrap_or_default())
        }
        ChatTemplate::Llama3 => ("llama3", String::new()),
        ChatTemplate::Mistral => ("mistral", String::new()),
        ChatTemplate::Plain => ("plain", String::new()),
    };
    let cfg = engine.model().config();
    Ok(GetModelInfoResponse {
        model: parse_discovery::model_name(engine.path()),
        vocab_size: cfg.vocab_size as u32,
        max_context: cfg.max_context as u32,
        tokenizer_json: tok.to_portable().map_err(CoreError::from)?,
        chat_layout: layout.to_string(),
        default_system,
        eos_ids: tok.eos_ids().to_vec(),
        tp_size: tp_size as u32,
        compute: engine.model().compute().to_string(),
    })
}
