//! Worker processes on the candle backend (`--backend candle`, on the CPU here; `--device cuda:N` on a GPU host):
//! a router in front of a candle target worker and a candle draft worker serves every mode, and requests sent at
//! once share the workers' packed passes. A worker asked for a device this build cannot open exits with a message.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use parse_proto::v1::drafter_client::DrafterClient;
use parse_proto::v1::generation_client::GenerationClient;
use parse_proto::v1::verifier_client::VerifierClient;
use parse_proto::v1::{GenerateRequest, GetModelInfoRequest};
use parse_tests::{Proc, draft_checkpoint, free_port, workspace_binary};

fn spawn(name: &str, args: &[String]) -> Proc {
    Proc(
        Command::new(workspace_binary(name))
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

fn request(mode: &str, prompt: &str) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.into(),
        max_new_tokens: 16,
        mode: mode.into(),
        ..Default::default()
    }
}

#[test]
fn a_cluster_of_candle_workers_serves_every_mode() {
    let (tp, dp, rp) = (free_port(), free_port(), free_port());
    // The small checkpoint plays both roles (one tokenizer): the test is about the backend serving, not answers.
    let m = draft_checkpoint().display().to_string();
    let worker = |listen: u16| -> Vec<String> {
        vec![
            "--model".into(),
            m.clone(),
            "--listen".into(),
            format!("127.0.0.1:{listen}"),
            "--backend".into(),
            "candle".into(),
        ]
    };
    let _target = spawn("parse-target-worker", &worker(tp));
    let _draft = spawn("parse-draft-worker", &worker(dp));
    let _router = spawn(
        "parse-router",
        &[
            "--listen".into(),
            format!("127.0.0.1:{rp}"),
            "--target".into(),
            format!("127.0.0.1:{tp}"),
            "--draft".into(),
            format!("127.0.0.1:{dp}"),
            "--no-openai".into(),
        ],
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let start = Instant::now();
        let mut client = loop {
            assert!(
                start.elapsed() < Duration::from_secs(180),
                "the cluster did not come up"
            );
            if let Ok(mut c) = GenerationClient::connect(format!("http://127.0.0.1:{rp}")).await {
                match c.generate(request("target", "Say hi.")).await {
                    Ok(_) => break c,
                    Err(s) if s.code() == tonic::Code::Unavailable => {}
                    Err(s) => panic!("generate: {s}"),
                }
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        };
        // Both workers say what computes their model.
        // (The reply carries the tokenizer: over gRPC's default 4 MiB.)
        let mut t = VerifierClient::connect(format!("http://127.0.0.1:{tp}"))
            .await
            .unwrap()
            .max_decoding_message_size(64 << 20);
        let info = t
            .get_model_info(GetModelInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.compute, "candle on cpu");
        let mut d = DrafterClient::connect(format!("http://127.0.0.1:{dp}"))
            .await
            .unwrap()
            .max_decoding_message_size(64 << 20);
        let info = d
            .get_model_info(GetModelInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.compute, "candle on cpu");
        let prompt = "Write a Python function that adds two numbers.";
        for mode in ["target", "draft", "token-spec", "parse", "parse+token-spec"] {
            let r = client
                .generate(request(mode, prompt))
                .await
                .unwrap_or_else(|s| panic!("{mode}: {s}"))
                .into_inner();
            let stats = r.stats.expect("stats");
            assert!(!r.text.is_empty(), "{mode}: empty text");
            assert_eq!(stats.output_tokens as usize, r.token_ids.len(), "{mode}");
            assert!(stats.output_tokens > 0, "{mode}");
            if mode != "target" && mode != "draft" {
                assert!(stats.draft_tokens_proposed > 0, "{mode}: nothing drafted");
            }
        }
        // The same request twice alone gives the same tokens (the candle CPU kernels are deterministic).
        let once = client.generate(request("target", prompt)).await.unwrap();
        let twice = client.generate(request("target", prompt)).await.unwrap();
        assert_eq!(once.into_inner().token_ids, twice.into_inner().token_ids);
        // Four requests at once: they overlap in the scheduler, which packs their blocks into shared passes.
        let prompts = [
            "Name three colours.",
            "What is 12 times 12?",
            "Write a haiku about rain.",
            "Explain recursion in one sentence.",
        ];
        let calls: Vec<_> = prompts
            .iter()
            .map(|p| {
                let mut c = client.clone();
                let req = request("parse+token-spec", p);
                tokio::spawn(async move { c.generate(req).await })
            })
            .collect();
        for (p, call) in prompts.iter().zip(calls) {
            let r = call
                .await
                .unwrap()
                .unwrap_or_else(|s| panic!("{p}: {s}"))
                .into_inner();
            assert!(!r.token_ids.is_empty(), "{p}");
        }
    });
}

#[test]
fn a_worker_asked_for_a_device_it_cannot_open_exits_with_a_message() {
    let m = draft_checkpoint().display().to_string();
    for (device, backend, says) in [
        ("cuda:0", None, "CUDA"),
        ("cuda:0", Some("kernels"), "--backend candle"),
        ("tpu", None, "unknown device"),
    ] {
        let mut args = vec![
            "--model".to_string(),
            m.clone(),
            "--listen".into(),
            format!("127.0.0.1:{}", free_port()),
            "--device".into(),
            device.into(),
        ];
        if let Some(b) = backend {
            args.extend(["--backend".into(), b.into()]);
        }
        let out = Command::new(workspace_binary("parse-draft-worker"))
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{device}: {stderr}");
        assert!(stderr.contains(says), "{device} {backend:?}: {stderr}");
    }
    // A tensor-parallel group runs on the kernel model: asking it for the candle backend is refused before loading.
    let out = Command::new(workspace_binary("parse-target-worker"))
        .args([
            "--model",
            &m,
            "--tp",
            "2",
            "--tp-addrs",
            "127.0.0.1:1,127.0.0.1:2",
        ])
        .args(["--backend", "candle"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("kernels backend"),
        "{stderr}"
    );
}
