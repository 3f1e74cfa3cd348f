//! OpenAI's request bodies and their translation into a `parse.v1.GenerateRequest`, with a 400 for what the
//! server does not do.

use super::*;

pub(super) fn bad(message: impl Into<String>) -> Status {
    Status::invalid_argument(message)
}

#[derive(Deserialize)]
#[serde(untagged, expecting = "expected a string or an array of strings")]
pub(super) enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub(super) fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// A completion's `prompt` as OpenAI's API takes it: a string, token ids, or an array of either (one prompt per
/// request here).
#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "expected a string, an array of token ids (integers from 0), or an array of one of these"
)]
pub(super) enum PromptIn {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// The one prompt of a completion request.
pub(super) enum OnePrompt {
    Text(String),
    Tokens(Vec<u32>),
}

impl PromptIn {
    /// The one prompt of the request, or a 400 for several or for no token at all.
    pub(super) fn one(self) -> Result<OnePrompt, Status> {
        let many = |n: usize| {
            bad(format!(
                "prompt must be one prompt (got {n}): one completion per request"
            ))
        };
        match self {
            PromptIn::Text(s) => Ok(OnePrompt::Text(s)),
            PromptIn::Tokens(t) if t.is_empty() => Err(bad("prompt: an empty array of token ids")),
            PromptIn::Tokens(t) => Ok(OnePrompt::Tokens(t)),
            PromptIn::Texts(mut v) if v.len() == 1 => Ok(OnePrompt::Text(v.remove(0))),
            PromptIn::Texts(v) => Err(many(v.len())),
            PromptIn::TokenLists(mut v) if v.len() == 1 => PromptIn::Tokens(v.remove(0)).one(),
            PromptIn::TokenLists(v) => Err(many(v.len())),
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged, expecting = "expected a string or an array of content parts")]
pub(super) enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
pub(super) struct ContentPart {
    #[serde(rename = "type")]
    pub(super) kind: String,
    #[serde(default)]
    pub(super) text: Option<String>,
}

#[derive(Deserialize)]
pub(super) struct MessageIn {
    pub(super) role: String,
    #[serde(default)]
    pub(super) content: Option<Content>,
    #[serde(default)]
    pub(super) tool_calls: Option<Value>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct ParseExt {
    pub(super) mode: Option<String>,
    pub(super) tau: Option<f32>,
    pub(super) verdict: Option<String>,
    pub(super) exact_floor: Option<bool>,
    pub(super) draft_segments: Option<u32>,
    pub(super) drafter: Option<String>,
    pub(super) adaptive: Option<bool>,
}

#[derive(Deserialize, Default)]
pub(super) struct StreamOptions {
    #[serde(default)]
    pub(super) include_usage: bool,
}

/// `cache_salt`'s string as the workers take it: its 64-bit FNV-1a hash (the same in every router replica), never 0,
/// the value of requests that set none.
pub(super) fn salt_of(s: &str) -> u64 {
    let h = s.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    h.max(1)
}

/// The fields both endpoints share.
#[derive(Deserialize, Default)]
pub(super) struct Common {
    pub(super) model: Option<String>,
    pub(super) max_tokens: Option<u32>,
    pub(super) max_completion_tokens: Option<u32>,
    pub(super) temperature: Option<f32>,
    pub(super) top_p: Option<f32>,
    /// Not OpenAI's; vLLM's and ours. 0 or -1 (vLLM's way of saying it): no cut.
    pub(super) top_k: Option<i64>,
    pub(super) seed: Option<u64>,
    /// Not OpenAI's; vLLM's and ours: the namespace of the workers' prefix caches (`Sampling.cache_salt`, from a
    /// hash of the string).
    pub(super) cache_salt: Option<String>,
    pub(super) stop: Option<OneOrMany>,
    pub(super) n: Option<u32>,
    pub(super) user: Option<String>,
    #[serde(default)]
    pub(super) stream: bool,
    pub(super) stream_options: Option<StreamOptions>,
    pub(super) presence_penalty: Option<f32>,
    pub(super) frequency_penalty: Option<f32>,
    pub(super) logprobs: Option<Value>,
    pub(super) top_logprobs: Option<u32>,
    pub(super) logit_bias: Option<Value>,
    pub(super) tools: Option<Value>,
    pub(super) functions: Option<Value>,
    pub(super) response_format: Option<Value>,
    pub(super) parse: Option<ParseExt>,
}

#[derive(Deserialize)]
pub(super) struct ChatRequest {
    pub(super) messages: Vec<MessageIn>,
    #[serde(flatten)]
    pub(super) common: Common,
}

#[derive(Deserialize)]
pub(super) struct CompletionRequest {
    pub(super) prompt: PromptIn,
    #[serde(default)]
    pub(super) echo: bool,
    pub(super) suffix: Option<String>,
    pub(super) best_of: Option<u32>,
    #[serde(flatten)]
    pub(super) common: Common,
}

/// Which endpoint a request came through (the shape of the answer).
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Kind {
    Chat,
    Completion,
}

impl Kind {
    pub(super) fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }
    pub(super) fn id_prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl-",
            Kind::Completion => "cmpl-",
        }
    }
}

pub(super) fn parse_body<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, Status> {
    serde_json::from_slice(body).map_err(|e| bad(format!("invalid request body: {e}")))
}

pub(super) fn non_zero(v: &Option<f32>) -> bool {
    v.is_some_and(|x| x != 0.0)
}

pub(super) fn non_empty(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(_) => true,
    }
}

/// OpenAI's request fields as ours, or a 400 for what the server does not do.
pub(super) fn common_into(
    c: Common,
    r: &mut GenerateRequest,
    router_limit: usize,
) -> Result<(), Status> {
    if c.n.is_some_and(|n| n != 1) {
        return Err(bad("n must be 1: one choice per request"));
    }
    if non_zero(&c.presence_penalty) || non_zero(&c.frequency_penalty) {
        return Err(bad(
            "presence_penalty and frequency_penalty are not supported",
        ));
    }
    if matches!(&c.logprobs, Some(Value::Bool(true)))
        || matches!(&c.logprobs, Some(Value::Number(n)) if n.as_u64() != Some(0))
        || c.top_logprobs.is_some_and(|n| n > 0)
    {
        return Err(bad("logprobs are not supported"));
    }
    if non_empty(&c.logit_bias) {
        return Err(bad("logit_bias is not supported"));
    }
    if non_empty(&c.tools) || non_empty(&c.functions) {
        return Err(bad("tools and functions are not supported"));
    }
    if let Some(f) = &c.response_format
        && !f.is_null()
        && f.get("type").and_then(Value::as_str) != Some("text")
    {
        return Err(bad(
            "response_format: only {\"type\": \"text\"} is supported",
        ));
    }
    let asked = c.max_completion_tokens.or(c.max_tokens);
    let max = asked.unwrap_or_else(|| DEFAULT_MAX_TOKENS.min(router_limit as u32));
    if max == 0 {
        return Err(bad("max_tokens must be at least 1"));
    }
    if max as usize > router_limit {
        // Named as the client sent it (the router would name its own field, max_new_tokens).
        return Err(bad(format!(
            "max_tokens must be at most {router_limit} on this server, got {max}"
        )));
    }
    r.max_new_tokens = max;
    // Left out, the budget is what fits beside the prompt (up to the default); asked for, it must fit.
    r.fit_context = asked.is_none();
    let temperature = c.temperature.unwrap_or(0.0);
    let top_k = match c.top_k.unwrap_or(0) {
        -1 | 0 => 0,
        k => u32::try_from(k).map_err(|_| {
            bad(format!(
                "top_k must be a count of tokens, or 0 or -1 for no cut; got {k}"
            ))
        })?,
    };
    let seed = match c.seed {
        Some(s) => s,
        // A sampled request without a seed gets a fresh one (OpenAI's behaviour: different answers each call).
        None if temperature > 0.0 => uuid::Uuid::new_v4().as_u64_pair().0,
        None => 0,
    };
    r.sampling = Some(Sampling {
        temperature,
        top_k,
        top_p: c.top_p,
        seed,
        cache_salt: c.cache_salt.as_deref().map_or(0, salt_of),
    });
    let stop = c.stop.map(OneOrMany::into_vec).unwrap_or_default();
    if stop.len() > MAX_STOP {
        return Err(bad(format!(
            "at most {MAX_STOP} stop strings, got {}",
            stop.len()
        )));
    }
    r.stop = stop;
    if let Some(p) = c.parse {
        r.mode = p.mode.unwrap_or_default();
        r.tau = p.tau;
        r.verdict = p.verdict.unwrap_or_default();
        r.exact_floor = p.exact_floor;
        r.draft_segments = p.draft_segments.unwrap_or(0);
        r.drafter = p.drafter.unwrap_or_default();
        r.adaptive = p.adaptive;
    }
    if let Some(u) = &c.user {
        tracing::debug!(user = %u, "OpenAI request");
    }
    Ok(())
}

/// What a request asked for beyond the generation itself.
pub(super) struct Shape {
    pub(super) kind: Kind,
    pub(super) model: String,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
}

pub(super) fn unknown_model(asked: &str, served: &str) -> Status {
    Status::not_found(format!(
        "model `{asked}` does not exist: this server serves `{served}` (GET /v1/models)"
    ))
}

pub(super) fn check_model(asked: &Option<String>, served: &str) -> Result<(), Status> {
    match asked {
        Some(m) if !m.is_empty() && m != served => Err(unknown_model(m, served)),
        _ => Ok(()),
    }
}

pub(super) fn chat_request(
    body: &Bytes,
    served: &str,
    limit: usize,
) -> Result<(GenerateRequest, Shape), Status> {
    let req: ChatRequest = parse_body(body)?;
    check_model(&req.common.model, served)?;
    if req.messages.is_empty() {
        return Err(bad("messages must not be empty"));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.into_iter().enumerate() {
        if m.tool_calls.as_ref().is_some_and(|t| !t.is_null()) {
            return Err(bad(format!("messages[{i}]: tool calls are not supported")));
        }
        let role = match m.role.as_str() {
            // OpenAI's newer name for system instructions.
            "developer" => "system".to_string(),
            "system" | "user" | "assistant" => m.role,
            other => {
                return Err(bad(format!(
                    "messages[{i}]: role `{other}` is not supported (system, developer, user, assistant)"
                )));
            }
        };
        let content = match m.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for p in parts {
                    if p.kind != "text" {
                        return Err(bad(format!(
                            "messages[{i}]: content of type `{}` is not supported (text only)",
                            p.kind
                        )));
                    }
                    text.push_str(&p.text.unwrap_or_default());
                }
                text
            }
        };
        messages.push(ChatMessage { role, content });
    }
    let r = GenerateRequest {
        messages,
        ..Default::default()
    };
    with_common(r, req.common, Kind::Chat, served, limit)
}

pub(super) fn completion_request(
    body: &Bytes,
    served: &str,
    limit: usize,
) -> Result<(GenerateRequest, Shape), Status> {
    let req: CompletionRequest = parse_body(body)?;
    check_model(&req.common.model, served)?;
    let prompt = req.prompt.one()?;
    if req.echo {
        return Err(bad("echo is not supported"));
    }
    if req.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(bad("suffix is not supported"));
    }
    if req.best_of.is_some_and(|b| b != 1) {
        return Err(bad("best_of must be 1"));
    }
    let r = match prompt {
        OnePrompt::Text(text) => GenerateRequest {
            prompt: text,
            raw_prompt: true,
            ..Default::default()
        },
        OnePrompt::Tokens(tokens) => GenerateRequest {
            prompt_tokens: tokens,
            ..Default::default()
        },
    };
    with_common(r, req.common, Kind::Completion, served, limit)
}

/// Adds the shared fields to an endpoint's request and notes the answer's shape.
pub(super) fn with_common(
    mut r: GenerateRequest,
    common: Common,
    kind: Kind,
    served: &str,
    limit: usize,
) -> Result<(GenerateRequest, Shape), Status> {
    let shape = Shape {
        kind,
        model: served.to_string(),
        stream: common.stream,
        include_usage: common
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
    };
    common_into(common, &mut r, limit)?;
    Ok((r, shape))
}
