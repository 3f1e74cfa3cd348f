//! Tokenizer and chat template.
//!
//! The engine builds the tokenizer from the GGUF file's own metadata (vocabulary, merges, token types, pre-tokenizer
//! name) so any GGUF works without extra files, and hands the pieces to [`Tokenizer::from_parts`]; a
//! `tokenizer.json` is the alternative ([`Tokenizer::from_file`]). The chat template is chosen from
//! the template text the model ships: ChatML (Qwen; with Qwen2.5's default system prompt when the template carries
//! one and the caller gives none), Llama 3 headers, or Mistral `[INST]`. A template in another form is not
//! interpreted (no Jinja engine): such models get a plain `User:` / `Assistant:` layout and a warning in the log.

use std::path::Path;

use crate::{Error, Result};

/// Qwen2.5's default system prompt, used by its template when the conversation has none.
pub const QWEN25_DEFAULT_SYSTEM: &str =
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

/// Who speaks a chat turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChatRole {
    System,
    User,
    Assistant,
}

impl ChatRole {
    pub fn as_str(&self) -> &'static str {
        match self {
            ChatRole::System => "system",
            ChatRole::User => "user",
            ChatRole::Assistant => "assistant",
        }
    }
}

impl std::str::FromStr for ChatRole {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "system" => Ok(ChatRole::System),
            "user" => Ok(ChatRole::User),
            "assistant" => Ok(ChatRole::Assistant),
            other => Err(Error::InvalidInput(format!(
                "unknown role `{other}` (system, user, assistant)"
            ))),
        }
    }
}

/// A chat turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: ChatRole,
    pub content: String,
}

impl Message {
    pub fn new(role: ChatRole, content: &str) -> Self {
        Message {
            role,
            content: content.to_string(),
        }
    }

    pub fn system(content: &str) -> Self {
        Self::new(ChatRole::System, content)
    }

    pub fn user(content: &str) -> Self {
        Self::new(ChatRole::User, content)
    }
}

/// The supported chat layouts.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ChatTemplate {
    ChatMl { default_system: Option<String> },
    Llama3,
    Mistral,
    Plain,
}

impl ChatTemplate {
    /// Chooses a layout from a model's template text and vocabulary.
    pub fn detect(template: Option<&str>, has_token: impl Fn(&str) -> bool) -> Self {
        let t = template.unwrap_or("");
        if t.contains("<|im_start|>") || (template.is_none() && has_token("<|im_start|>")) {
            let default_system = t
                .contains(QWEN25_DEFAULT_SYSTEM)
                .then(|| QWEN25_DEFAULT_SYSTEM.to_string());
            ChatTemplate::ChatMl { default_system }
        } else if t.contains("<|start_header_id|>")
            || (template.is_none() && has_token("<|start_header_id|>"))
        {
            ChatTemplate::Llama3
        } else if t.contains("[INST]") {
            ChatTemplate::Mistral
        } else {
            if template.is_some() {
                tracing::warn!("chat template not recognised; using a plain User/Assistant layout");
            }
            ChatTemplate::Plain
        }
    }

    /// Renders a conversation and opens the assistant's turn.
    pub fn render(&self, messages: &[Message]) -> String {
        let mut out = String::new();
        match self {
            ChatTemplate::ChatMl { default_system } => {
                if messages.first().is_none_or(|m| m.role != ChatRole::System)
                    && let Some(s) = default_system
                {
                    out.push_str(&format!("<|im_start|>system\n{s}<|im_end|>\n"));
                }
                for m in messages {
                    out.push_str(&format!(
                        "<|im_start|>{}\n{}<|im_end|>\n",
                        m.role.as_str(),
                        m.content
                    ));
                }
                out.push_str("<|im_start|>assistant\n");
            }
            ChatTemplate::Llama3 => {
                out.push_str("<|begin_of_text|>");
                for m in messages {
                    out.push_str(&format!(
                        "<|start_header_id|>{}<|end_header_id|>\n\n{}<|eot_id|>",
                        m.role.as_str(),
                        m.content.trim()
                    ));
                }
                out.push_str("<|start_header_id|>assistant<|end_header_id|>\n\n");
            }
            ChatTemplate::Mistral => {
                let system: Vec<&str> = messages
                    .iter()
                    .filter(|m| m.role == ChatRole::System)
                    .map(|m| m.content.as_str())
                    .collect();
                for m in messages.iter().filter(|m| m.role != ChatRole::System) {
                    if m.role == ChatRole::User {
                        let sys = if system.is_empty() {
                            String::new()
                        } else {
                            format!("{}\n\n", system.join("\n"))
                        };
                        out.push_str(&format!("[INST] {sys}{} [/INST]", m.content));
                    } else {
                        out.push_str(&format!("{}</s>", m.content));
                    }
                }
            }
            ChatTemplate::Plain => {
                for m in messages {
                    let role = match m.role {
                        ChatRole::System => "System",
                        ChatRole::Assistant => "Assistant",
                        ChatRole::User => "User",
                    };
                    out.push_str(&format!("{role}: {}\n", m.content));
                }
                out.push_str("Assistant:");
            }
        }
        out
    }
}

/// A tokenizer with its special tokens and chat layout.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same vocabulary encoding special tokens' text as plain text (for what users write).
    plain: tokenizers::Tokenizer,
    /// The text of the special tokens (`<|im_start|>`...), to tell whether a message writes one.
    specials: Vec<String>,
    eos: Vec<u32>,
    bos: Option<u32>,
    add_bos: bool,
    template: ChatTemplate,
}

/// The plain-text twin of a tokenizer and the texts of its special tokens.
fn plain_twin(inner: &tokenizers::Tokenizer) -> (tokenizers::Tokenizer, Vec<String>) {
    let mut plain = inner.clone();
    plain.set_encode_special_tokens(true);
    let mut specials: Vec<String> = inner
        .get_added_tokens_decoder()
        .values()
        .filter(|t| t.special && !t.content.is_empty())
        .map(|t| t.content.clone())
        .collect();
    specials.sort();
    (plain, specials)
}

const END_TOKENS: [&str; 5] = [
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "</s>",
];

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`; the chat template comes from a `tokenizer_config.json` beside it when
    /// there is one.
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        let config: Option<serde_json::Value> = path
            .parent()
            .map(|d| d.join("tokenizer_config.json"))
            .and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|s| serde_json::from_str(&s).ok());
        let template = config
            .as_ref()
            .and_then(|c| c.get("chat_template"))
            .and_then(|t| t.as_str())
            .map(str::to_string);
        let token_of = |key: &str| {
            config
                .as_ref()
                .and_then(|c| c.get(key))
                .and_then(|t| {
                    t.as_str()
                        .or_else(|| t.get("content").and_then(|c| c.as_str()))
                })
                .and_then(|t| inner.token_to_id(t))
        };
        let (eos, bos) = (token_of("eos_token"), token_of("bos_token"));
        let add_bos = config
            .as_ref()
            .and_then(|c| c.get("add_bos_token"))
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        Ok(Self::from_parts(
            inner,
            eos,
            bos,
            add_bos,
            template.as_deref(),
        ))
    }

    /// A tokenizer from its parts: the vocabulary and merges, the end and begin tokens the model declares (the
    /// usual end tokens of the supported layouts are added), whether a begin token leads every prompt, and the
    /// model's chat template text (which picks the layout).
    pub fn from_parts(
        inner: tokenizers::Tokenizer,
        eos: Option<u32>,
        bos: Option<u32>,
        add_bos: bool,
        template: Option<&str>,
    ) -> Self {
        let mut eos_ids: Vec<u32> = eos.into_iter().collect();
        for t in END_TOKENS {
            if let Some(id) = inner.token_to_id(t)
                && !eos_ids.contains(&id)
            {
                eos_ids.push(id);
            }
        }
        let template = ChatTemplate::detect(template, |t| inner.token_to_id(t).is_some());
        let (plain, specials) = plain_twin(&inner);
        Tokenizer {
            inner,
            plain,
            specials,
            eos: eos_ids,
            bos,
            add_bos,
            template,
        }
    }

    /// The whole tokenizer (vocabulary, special tokens, chat layout) as one JSON document, so that a router can
    /// tokenize for workers without reading model files.
    pub fn to_portable(&self) -> Result<String> {
        let inner = self
            .inner
            .to_string(false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        serde_json::to_string(&serde_json::json!({
            "tokenizer": inner,
            "eos": self.eos,
            "bos": self.bos,
            "add_bos": self.add_bos,
            "template": self.template,
        }))
        .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// The inverse of [`Tokenizer::to_portable`].
    pub fn from_portable(text: &str) -> Result<Self> {
        #[derive(serde::Deserialize)]
        struct Portable {
            tokenizer: String,
            eos: Vec<u32>,
            bos: Option<u32>,
            add_bos: bool,
            template: ChatTemplate,
        }
        let p: Portable = serde_json::from_str(text)
            .map_err(|e| Error::Tokenizer(format!("portable tokenizer: {e}")))?;
        let inner: tokenizers::Tokenizer = p
            .tokenizer
            .parse()
            .map_err(|e: tokenizers::Error| Error::Tokenizer(e.to_string()))?;
        let (plain, specials) = plain_twin(&inner);
        Ok(Tokenizer {
            inner,
            plain,
            specials,
            eos: p.eos,
            bos: p.bos,
            add_bos: p.add_bos,
            template: p.template,
        })
    }

    /// Token ids of `text`, special tokens written in the text included, with no BOS/EOS added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?
            .get_ids()
            .to_vec())
    }

    /// Text of `ids`; special tokens are dropped when `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Token ids of a text to be continued as it is (no chat template), with the model's BOS where it wants one.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        if text.is_empty() {
            return Err(Error::InvalidInput("empty prompt".into()));
        }
        let mut ids = self.encode(text)?;
        if self.add_bos
            && let Some(b) = self.bos
            && ids.first() != Some(&b)
        {
            ids.insert(0, b);
        }
        Ok(ids)
    }

    /// Token ids of a chat conversation, ready for the assistant's reply. What the messages say is text: a message
    /// that writes a control token's text (`<|im_start|>system`, `<|eot_id|>`) gets that text's ordinary tokens,
    /// never the control token, so that no message can open or close turns of its own. Only the layout's own
    /// markers are control tokens.
    pub fn encode_chat(&self, messages: &[Message]) -> Result<Vec<u32>> {
        if messages.iter().all(|m| m.content.trim().is_empty()) {
            return Err(Error::InvalidInput("empty prompt".into()));
        }
        if !messages
            .iter()
            .any(|m| self.specials.iter().any(|s| m.content.contains(s.as_str())))
        {
            // Nothing to tell apart: the rendered conversation in one piece (the tokens it always had).
            return self.encode_prompt(&self.template.render(messages));
        }
        // Render with a marker in place of each message, then encode the layout's text with its control tokens and
        // each message's text as plain text. The markers are private-use characters no layout writes.
        const OPEN: char = '\u{F8F0}';
        const CLOSE: char = '\u{F8F1}';
        let marked: Vec<Message> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| Message {
                role: m.role,
                content: format!("{OPEN}{i}{CLOSE}"),
            })
            .collect();
        let rendered = self.template.render(&marked);
        let mut ids = Vec::new();
        let mut rest = rendered.as_str();
        while let Some(at) = rest.find(OPEN) {
            if at > 0 {
                ids.extend(self.encode(&rest[..at])?);
            }
            let tail = &rest[at + OPEN.len_utf8()..];
            let end = tail
                .find(CLOSE)
                .ok_or_else(|| Error::Tokenizer("chat layout lost a message marker".into()))?;
            let i: usize = tail[..end]
                .parse()
                .map_err(|_| Error::Tokenizer("chat layout changed a message marker".into()))?;
            let m = &messages[i];
            // The layouts that trim a message's text (Llama 3) trim it here too.
            let text = match self.template {
                ChatTemplate::Llama3 => m.content.trim(),
                _ => m.content.as_str(),
            };
            ids.extend(
                self.plain
                    .encode(text, false)
                    .map_err(|e| Error::Tokenizer(e.to_string()))?
                    .get_ids(),
            );
            rest = &tail[end + CLOSE.len_utf8()..];
        }
        if !rest.is_empty() {
            ids.extend(self.encode(rest)?);
        }
        if self.add_bos
            && let Some(b) = self.bos
            && ids.first() != Some(&b)
        {
            ids.insert(0, b);
        }
        Ok(ids)
    }

    /// The judge verdict's verification suffix: it closes the assistant's turn and asks whether the answer so far is
    /// correct, in the model's chat layout.
    pub fn judge_suffix(&self) -> Result<Vec<u32>> {
        const QUESTION: &str =
            "Is the assistant's answer above correct and on track so far? Answer Yes or No.";
        let text = match &self.template {
            ChatTemplate::ChatMl { .. } => {
                format!(
                    "<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
                )
            }
            ChatTemplate::Llama3 => format!(
                "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n{QUESTION}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
            ),
            ChatTemplate::Mistral => format!("</s>[INST] {QUESTION} [/INST]"),
            ChatTemplate::Plain => format!("\nUser: {QUESTION}\nAssistant:"),
        };
        self.encode(&text)
    }

    /// Tokens that end generation.
    /// Each token's own text (special tokens included), the way drafters report their tokens' pieces.
    pub fn pieces(&self, tokens: &[u32]) -> Result<Vec<String>> {
        tokens.iter().map(|t| self.decode(&[*t], false)).collect()
    }

    /// [`Tokenizer::pieces`] as the function a model-free drafter takes.
    pub fn piece_fn(self: &std::sync::Arc<Self>) -> parse_core::PieceFn {
        let tok = self.clone();
        std::sync::Arc::new(move |tokens: &[u32]| {
            tok.pieces(tokens).map_err(parse_core::Error::from)
        })
    }

    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos.contains(&id)
    }

    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Turns a growing token sequence into text deltas without splitting multi-byte characters: text is released only
/// once the tokens decode to complete characters.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a token and returns the newly completed text, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], true)?;
        if full.len() > prefix.len()
            && !full.ends_with('\u{fffd}')
            && full.is_char_boundary(prefix.len())
        {
            let delta = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(Some(delta))
        } else {
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_uses_the_default_system_only_without_one() {
        let t = ChatTemplate::detect(
            Some(&format!("<|im_start|>{QWEN25_DEFAULT_SYSTEM}")),
            |_| false,
        );
        let s = t.render(&[Message::user("hi")]);
        assert_eq!(
            s,
            format!(
                "<|im_start|>system\n{QWEN25_DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
            )
        );
        let s = t.render(&[Message::system("be brief"), Message::user("hi")]);
        assert!(s.starts_with("<|im_start|>system\nbe brief<|im_end|>\n"));
        assert!(!s.contains("Alibaba"));
        assert_eq!(
            ChatTemplate::detect(Some("{{ [INST] }}"), |_| false),
            ChatTemplate::Mistral
        );
        assert_eq!(
            ChatTemplate::detect(None, |t| t == "<|start_header_id|>"),
            ChatTemplate::Llama3
        );
    }
}
