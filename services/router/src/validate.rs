//! What a request must be before it costs anything: its sizes within the router's limits, and its prompt in exactly
//! one form.

use parse_core::Error as CoreError;
use parse_proto::v1::GenerateRequest;
use parse_text::{ChatRole, Message};

use crate::{MAX_DRAFT_SEGMENTS, MAX_MESSAGES, MAX_STOP_BYTES, MAX_STOPS, RouterConfig};

/// Size limits, checked before the prompt is tokenized (tokenizing is the first cost a request makes).
pub(crate) fn check_limits(r: &GenerateRequest, cfg: &RouterConfig) -> Result<(), CoreError> {
    let text = r.prompt.len()
        + r.system.len()
        + r.messages
            .iter()
            .map(|m| m.content.len() + m.role.len())
            .sum::<usize>();
    if text > cfg.max_prompt_bytes {
        return Err(CoreError::invalid(format!(
            "the prompt is {text} bytes; this router takes at most {}",
            cfg.max_prompt_bytes
        )));
    }
    if r.messages.len() > MAX_MESSAGES {
        return Err(CoreError::invalid(format!(
            "{} messages; at most {MAX_MESSAGES}",
            r.messages.len()
        )));
    }
    if r.stop.len() > MAX_STOPS {
        return Err(CoreError::invalid(format!(
            "{} stop strings; at most {MAX_STOPS}",
            r.stop.len()
        )));
    }
    if let Some(s) = r.stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(CoreError::invalid(format!(
            "a stop string of {} bytes; at most {MAX_STOP_BYTES}",
            s.len()
        )));
    }
    if r.draft_segments > MAX_DRAFT_SEGMENTS {
        return Err(CoreError::invalid(format!(
            "draft_segments must be 0..={MAX_DRAFT_SEGMENTS}, got {}",
            r.draft_segments
        )));
    }
    Ok(())
}

/// A request's prompt in the one form it was given: token ids, text sent as it is (`raw_prompt`), or chat messages
/// (`messages`, or `system` and `prompt`, laid out by the chat template). Converting a `GenerateRequest` checks that
/// it gives exactly one of these.
pub(crate) enum PromptIn<'a> {
    Tokens(&'a [u32]),
    Raw(&'a str),
    Chat(Vec<Message>),
}

impl<'a> TryFrom<&'a GenerateRequest> for PromptIn<'a> {
    type Error = CoreError;

    fn try_from(r: &'a GenerateRequest) -> Result<Self, CoreError> {
        if !r.prompt_tokens.is_empty() {
            if !r.prompt.is_empty() || !r.messages.is_empty() || !r.system.is_empty() {
                return Err(CoreError::invalid(
                    "prompt_tokens is the whole prompt: give no `prompt`, `messages` or `system` with it",
                ));
            }
            return Ok(PromptIn::Tokens(&r.prompt_tokens));
        }
        if r.raw_prompt {
            if !r.messages.is_empty() || !r.system.is_empty() {
                return Err(CoreError::invalid(
                    "raw_prompt takes `prompt` alone (no `messages`, no `system`)",
                ));
            }
            return Ok(PromptIn::Raw(&r.prompt));
        }
        if r.messages.is_empty() {
            if r.prompt.is_empty() {
                return Err(CoreError::invalid(
                    "empty prompt: give `prompt` or `messages`",
                ));
            }
            let mut v = Vec::new();
            if !r.system.is_empty() {
                v.push(Message::system(&r.system));
            }
            v.push(Message::user(&r.prompt));
            return Ok(PromptIn::Chat(v));
        }
        if !r.prompt.is_empty() {
            return Err(CoreError::invalid(
                "give either `prompt` or `messages`, not both",
            ));
        }
        let messages = r
            .messages
            .iter()
            .map(|x| Ok(Message::new(x.role.parse::<ChatRole>()?, &x.content)))
            .collect::<Result<_, parse_text::Error>>()?;
        Ok(PromptIn::Chat(messages))
    }
}
