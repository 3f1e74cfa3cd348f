use super::*;

#[test]
fn requests_that_name_no_drafter_get_the_default_except_in_draft_mode() {
    let default = RouterConfig::default().default_drafter;
    assert_eq!(default, DrafterKind::ModelNgram);
    for mode in [
        Mode::Parse,
        Mode::ParseTokenSpec,
        Mode::TokenSpec,
        Mode::Target,
    ] {
        assert_eq!(drafter_of("", mode, default).unwrap(), default, "{mode:?}");
        assert_eq!(
            drafter_of("", mode, DrafterKind::Ngram).unwrap(),
            DrafterKind::Ngram
        );
    }
    assert_eq!(
        drafter_of("", Mode::Draft, default).unwrap(),
        DrafterKind::Model
    );
    assert_eq!(
        drafter_of("model+ngram", Mode::Draft, DrafterKind::Model).unwrap(),
        DrafterKind::ModelNgram
    );
    assert_eq!(
        drafter_of("ngram", Mode::Parse, default).unwrap(),
        DrafterKind::Ngram
    );
    let e = drafter_of("llama", Mode::Parse, default).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidInput);
}

#[test]
fn a_clients_grpc_timeout_cannot_overflow_the_deadline() {
    for v in [
        "18446744073709551615S",
        "99999999999H",
        "5124095576030431H",
        "H",
        "",
        "12x",
        "-5S",
    ] {
        let mut r = Request::new(());
        r.metadata_mut().insert("grpc-timeout", v.parse().unwrap());
        assert_eq!(deadline_of(&r), None, "{v:?}");
    }
    let mut r = Request::new(());
    r.metadata_mut()
        .insert("grpc-timeout", "99999999H".parse().unwrap());
    assert!(deadline_of(&r).is_some());
    let mut r = Request::new(());
    r.metadata_mut()
        .insert("grpc-timeout", "250m".parse().unwrap());
    let d = deadline_of(&r).unwrap();
    assert!(d > Instant::now() && d < Instant::now() + Duration::from_millis(300));
}

#[test]
fn a_stream_left_unread_gives_up_after_the_stall_limit() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (tx, rx) = mpsc::channel(1);
    let msg = || Ok(GenerateStreamResponse { event: None });
    assert!(send_within(
        rt.handle(),
        &tx,
        msg(),
        Duration::from_millis(100)
    ));
    // Full and never read: the next send gives up instead of blocking the generation for good.
    let t = Instant::now();
    assert!(!send_within(
        rt.handle(),
        &tx,
        msg(),
        Duration::from_millis(200)
    ));
    assert!(t.elapsed() < Duration::from_secs(2));
    drop(rx);
    assert!(!send_within(
        rt.handle(),
        &tx,
        msg(),
        Duration::from_secs(60)
    ));
}

#[test]
fn oversized_requests_are_refused_before_tokenizing() {
    let cfg = RouterConfig {
        max_prompt_bytes: 100,
        ..Default::default()
    };
    let ok = GenerateRequest {
        prompt: "hi".into(),
        ..Default::default()
    };
    assert!(check_limits(&ok, &cfg).is_ok());
    let cases = [
        GenerateRequest {
            prompt: "x".repeat(101),
            ..Default::default()
        },
        GenerateRequest {
            messages: vec![
                parse_proto::v1::ChatMessage {
                    role: "user".into(),
                    content: "y".repeat(60),
                };
                2
            ],
            ..Default::default()
        },
        GenerateRequest {
            messages: vec![Default::default(); MAX_MESSAGES + 1],
            ..Default::default()
        },
        GenerateRequest {
            prompt: "hi".into(),
            stop: vec!["a".into(); MAX_STOPS + 1],
            ..Default::default()
        },
        GenerateRequest {
            prompt: "hi".into(),
            stop: vec!["a".repeat(MAX_STOP_BYTES + 1)],
            ..Default::default()
        },
        GenerateRequest {
            prompt: "hi".into(),
            draft_segments: MAX_DRAFT_SEGMENTS + 1,
            ..Default::default()
        },
    ];
    for (i, r) in cases.iter().enumerate() {
        let e = check_limits(r, &cfg).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidInput, "case {i}");
    }
}
