//! The answer in OpenAI's shape: whole, or streamed as server-sent events ending in `data: [DONE]`.

use super::*;

pub(super) fn finish_reason(f: &Finished) -> &'static str {
    // Ours: eos, stop (a stop string or the client), length.
    match f.finish_reason.as_str() {
        "length" => "length",
        _ => "stop",
    }
}

pub(super) fn usage(stats: Option<&Stats>) -> Value {
    let s = stats.cloned().unwrap_or_default();
    // An end token accepted from the draft is not an output token: the share is of the output.
    let draft_share = if s.output_tokens > 0 {
        f64::from(s.draft_tokens_accepted.min(s.output_tokens)) / f64::from(s.output_tokens)
    } else {
        0.0
    };
    json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.output_tokens,
        "total_tokens": s.prompt_tokens + s.output_tokens,
        // As OpenAI reports prompt caching: the prompt tokens taken from a prompt the target kept earlier.
        "prompt_tokens_details": {"cached_tokens": s.cached_prompt_tokens},
        "parse": {
            "mode": s.mode,
            "draft_tokens_proposed": s.draft_tokens_proposed,
            "draft_tokens_accepted": s.draft_tokens_accepted,
            "draft_share": draft_share,
            "segments_proposed": s.segments_proposed,
            "segments_accepted": s.segments_accepted,
            "target_passes": s.target_passes,
            "target_passes_per_token": s.target_passes_per_token,
            "paused_tokens": s.paused_tokens,
            "copy_rounds": s.copy_rounds,
            "token_rounds": s.token_rounds,
            "guesses": s.guesses,
            "guesses_right": s.guesses_right,
            "tokens_per_s": s.tokens_per_s,
        },
    })
}

pub(super) fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// One streamed chunk carrying `text` (and the role, for a chat's first chunk).
pub(super) fn chunk(
    shape: &Shape,
    id: &str,
    created: u64,
    text: Option<&str>,
    finish: Option<&str>,
    first: bool,
) -> Value {
    let choice = match shape.kind {
        Kind::Chat => {
            let mut delta = serde_json::Map::new();
            if first {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = text {
                delta.insert("content".into(), json!(t));
            }
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
        }
        Kind::Completion => {
            json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish})
        }
    };
    let mut v = json!({
        "id": id, "object": shape.kind.object(true), "created": created, "model": shape.model,
        "choices": [choice],
    });
    if shape.include_usage {
        v["usage"] = Value::Null;
    }
    v
}

type Events = mpsc::Receiver<Result<GenerateStreamResponse, Status>>;

/// The answer as server-sent events. The first event is awaited before the headers go out, so that a request refused
/// before generating gets its HTTP status.
pub(super) async fn stream(mut rx: Events, shape: Shape, id: String, created: u64) -> Response {
    let first = match rx.recv().await {
        Some(Ok(e)) => e,
        Some(Err(s)) => return status_error(&s),
        None => return status_error(&Status::internal("generation ended without a result")),
    };
    let (out_tx, out_rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let mut first_chunk = true;
        let mut next = Some(Ok(first));
        loop {
            let item = match next.take() {
                Some(i) => i,
                None => match rx.recv().await {
                    Some(i) => i,
                    None => break,
                },
            };
            let data = match item {
                Ok(GenerateStreamResponse {
                    event: Some(Event::Delta(d)),
                }) => {
                    if d.text.is_empty() && !first_chunk {
                        continue;
                    }
                    let v = chunk(&shape, &id, created, Some(&d.text), None, first_chunk);
                    first_chunk = false;
                    vec![v]
                }
                Ok(GenerateStreamResponse {
                    event: Some(Event::Finished(f)),
                }) => {
                    let mut v = vec![chunk(
                        &shape,
                        &id,
                        created,
                        None,
                        Some(finish_reason(&f)),
                        first_chunk,
                    )];
                    if shape.include_usage {
                        v.push(json!({
                            "id": id, "object": shape.kind.object(true), "created": created,
                            "model": shape.model, "choices": [], "usage": usage(f.stats.as_ref()),
                        }));
                    }
                    v
                }
                Ok(GenerateStreamResponse { event: None }) => continue,
                // Past the headers an error can only travel in the stream (as other OpenAI servers send it).
                Err(s) => vec![status_json(&s)],
            };
            for v in data {
                if out_tx
                    .send(Ok(SseEvent::default().data(v.to_string())))
                    .await
                    .is_err()
                {
                    return; // the client went away; dropping `rx` cancels the request
                }
            }
        }
        let _ = out_tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
    });
    Sse::new(ReceiverStream::new(out_rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// The whole answer as one JSON object, once generation ends.
pub(super) async fn whole(
    mut rx: Events,
    kind: Kind,
    shape: Shape,
    id: String,
    created: u64,
) -> Response {
    let mut text = String::new();
    let mut finished = None;
    while let Some(msg) = rx.recv().await {
        match msg {
            Ok(GenerateStreamResponse {
                event: Some(Event::Delta(d)),
            }) => text.push_str(&d.text),
            Ok(GenerateStreamResponse {
                event: Some(Event::Finished(f)),
            }) => finished = Some(f),
            Ok(_) => {}
            Err(s) => return status_error(&s),
        }
    }
    let Some(f) = finished else {
        return status_error(&Status::internal("generation ended without a result"));
    };
    let choice = match kind {
        Kind::Chat => json!({
            "index": 0, "message": {"role": "assistant", "content": text},
            "logprobs": null, "finish_reason": finish_reason(&f),
        }),
        Kind::Completion => json!({
            "index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason(&f),
        }),
    };
    axum::Json(json!({
        "id": id, "object": kind.object(false), "created": created, "model": shape.model,
        "choices": [choice], "usage": usage(f.stats.as_ref()),
    }))
    .into_response()
}
