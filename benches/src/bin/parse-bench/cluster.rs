//! The requests of a run sent through a running cluster instead of the models in process.

use super::*;

/// Runs every prompt of `cfg` through the router at `addr`, `args.clients` at a time: each reply is streamed into its
/// [`AnswerEnd`] and dropped once the answer is over. Returns the results in prompt order and the wall time.
pub(super) fn through_router(
    addr: &str,
    args: &Args,
    cfg: &RunCfg,
    recs: &[Record],
    tok: &Tokenizer,
    budget: usize,
    cache_salt: u64,
) -> Result<(Vec<Saved>, f64)> {
    use parse_client::{Client, Event};
    use parse_proto::v1::{GenerateRequest, TokenSource};
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio_stream::StreamExt;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let prompts: Arc<Vec<String>> = Arc::new(recs.iter().map(|r| r.prompt.clone()).collect());
    let results: Arc<Mutex<Vec<Option<Saved>>>> =
        Arc::new(Mutex::new((0..recs.len()).map(|_| None).collect()));
    let next = Arc::new(AtomicUsize::new(0));
    let base = GenerateRequest {
        max_new_tokens: budget as u32,
        mode: cfg.mode.as_str().into(),
        verdict: format!("{:?}", cfg.verdict).to_lowercase(),
        tau: Some(cfg.tau),
        exact_floor: Some(true),
        drafter: cfg.drafter.as_str().into(),
        adaptive: Some(cfg.adaptive),
        sampling: Some(parse_proto::v1::Sampling {
            cache_salt,
            ..Default::default()
        }),
        ..Default::default()
    };
    let start = std::time::Instant::now();
    rt.block_on(async {
        let client = Client::connect(addr)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..args.clients {
            let (mut client, prompts, results, next, base) = (
                client.clone(),
                prompts.clone(),
                results.clone(),
                next.clone(),
                base.clone(),
            );
            let (tok, cut) = (tok.clone(), args.cuts_at_code_block());
            tasks.spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(prompt) = prompts.get(i) else {
                        return anyhow::Ok(());
                    };
                    let t = std::time::Instant::now();
                    let req = GenerateRequest {
                        prompt: prompt.clone(),
                        ..base.clone()
                    };
                    let mut stream = client
                        .generate_stream(req)
                        .await
                        .map_err(|e| anyhow::anyhow!("prompt {i}: {e}"))?;
                    let mut end = AnswerEnd::new(&tok, cut);
                    let mut stats = Stats::default();
                    let mut first = None;
                    while let Some(event) = stream.next().await {
                        match event.map_err(|e| anyhow::anyhow!("prompt {i}: {e}"))? {
                            Event::Delta(d) => {
                                let source = if d.source == TokenSource::Draft as i32 {
                                    Source::Draft
                                } else {
                                    Source::Target
                                };
                                let more = end.push(&d.token_ids, source);
                                if first.is_none() && !end.kept.is_empty() {
                                    first = Some((t.elapsed().as_secs_f64() * 1e3, end.kept.len()));
                                }
                                if !more {
                                    break;
                                }
                            }
                            Event::Finished(f) => {
                                let s = f.stats.unwrap_or_default();
                                stats = Stats {
                                    draft_tokens_proposed: s.draft_tokens_proposed as usize,
                                    draft_tokens_accepted: s.draft_tokens_accepted as usize,
                                    segments_proposed: s.segments_proposed as usize,
                                    segments_accepted: s.segments_accepted as usize,
                                    target_passes: s.target_passes as usize,
                                    target_positions: s.target_positions as usize,
                                    paused_tokens: s.paused_tokens as usize,
                                    pauses: s.pauses as usize,
                                    copy_rounds: s.copy_rounds as usize,
                                    token_rounds: s.token_rounds as usize,
                                    guesses: s.guesses as usize,
                                    guesses_right: s.guesses_right as usize,
                                    cached_prompt_tokens: s.cached_prompt_tokens as usize,
                                    ..Default::default()
                                };
                                break;
                            }
                        }
                    }
                    // Dropping the stream stops a reply whose answer is over.
                    drop(stream);
                    stats.total_ms = t.elapsed().as_secs_f64() * 1e3;
                    results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(Saved {
                        tokens: end.kept,
                        draft_tokens_in_output: end.from_draft,
                        stats,
                        first,
                    });
                    eprint!(".");
                }
            });
        }
        while let Some(r) = tasks.join_next().await {
            r??;
        }
        anyhow::Ok(())
    })?;
    let wall_s = start.elapsed().as_secs_f64();
    let outs = std::mem::take(&mut *results.lock().unwrap_or_else(|e| e.into_inner()));
    let outs = outs
        .into_iter()
        .collect::<Option<Vec<Saved>>>()
        .context("a prompt without a reply")?;
    Ok((outs, wall_s))
}
