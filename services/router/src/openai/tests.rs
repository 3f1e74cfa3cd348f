use super::*;

fn chat(body: Value) -> Result<(GenerateRequest, Shape), Status> {
    chat_request(&Bytes::from(body.to_string()), "m", 4096)
}

#[test]
fn chat_fields_map_to_ours() {
    let (r, shape) = chat(json!({
        "model": "m",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        ],
        "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0.5, "top_p": 0.9, "seed": 3,
        "cache_salt": "tenant-a",
        "stop": "\n\n", "n": 1, "user": "u1", "stream": true, "stream_options": {"include_usage": true},
        "parse": {"mode": "parse", "tau": 0.2, "verdict": "entropy"},
    }))
    .unwrap();
    assert_eq!(r.messages.len(), 2);
    assert_eq!(r.messages[0].role, "system");
    assert_eq!(r.messages[1].content, "Hi there");
    assert_eq!(
        r.max_new_tokens, 7,
        "max_completion_tokens wins over max_tokens"
    );
    assert!(
        !r.fit_context,
        "a budget asked for must fit beside the prompt"
    );
    let s = r.sampling.unwrap();
    assert_eq!((s.temperature, s.top_p, s.seed), (0.5, Some(0.9), 3));
    assert_eq!(s.cache_salt, salt_of("tenant-a"));
    assert!(salt_of("tenant-a") != salt_of("tenant-b") && salt_of("") != 0);
    assert_eq!(r.stop, vec!["\n\n".to_string()]);
    assert_eq!(
        (r.mode.as_str(), r.tau, r.verdict.as_str()),
        ("parse", Some(0.2), "entropy")
    );
    assert!(shape.stream && shape.include_usage);
}

#[test]
fn defaults_are_greedy_with_the_default_budget() {
    let (r, shape) = chat(json!({"messages": [{"role": "user", "content": "Hi"}]})).unwrap();
    assert_eq!(r.max_new_tokens, DEFAULT_MAX_TOKENS);
    assert!(
        r.fit_context,
        "the default budget is lowered to what fits beside the prompt"
    );
    let s = r.sampling.unwrap();
    assert_eq!(
        (s.temperature, s.cache_salt),
        (0.0, 0),
        "greedy, the default namespace"
    );
    assert!(r.mode.is_empty() && r.tau.is_none() && !shape.stream && !shape.include_usage);
    let (r, _) = chat_request(
        &Bytes::from(json!({"messages": [{"role": "user", "content": "Hi"}]}).to_string()),
        "m",
        100,
    )
    .unwrap();
    assert_eq!(
        r.max_new_tokens, 100,
        "the default budget is capped by the router's limit"
    );
}

#[test]
fn what_the_server_does_not_do_is_refused_with_400() {
    let cases = [
        json!({"messages": [{"role": "user", "content": "x"}], "n": 2}),
        json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true}),
        json!({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}),
        json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
        json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}),
        json!({"messages": [{"role": "tool", "content": "x"}]}),
        json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        json!({"messages": []}),
        json!({"messages": [{"role": "user", "content": "x"}], "parse": {"tua": 0.5}}),
        json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
        json!({"messages": [{"role": "user", "content": "x"}], "top_k": -2}),
        json!({"messages": [{"role": "user", "content": "x"}], "top_k": 1u64 << 40}),
        json!({"messages": [{"role": "user", "content": "x"}], "stop": vec!["s"; MAX_STOP + 1]}),
        json!({"prompt": "x"}),
    ];
    for c in cases {
        let e = chat(c.clone())
            .err()
            .unwrap_or_else(|| panic!("accepted {c}"));
        assert_eq!(e.code(), Code::InvalidArgument, "{c}: {}", e.message());
    }
    let e = chat(json!({"model": "other", "messages": [{"role": "user", "content": "x"}]}))
        .err()
        .unwrap();
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains("`m`"), "{}", e.message());
    // Untagged fields name what they take, not the server's types.
    for (c, expected) in [
        (
            json!({"messages": [{"role": "user", "content": "x"}], "stop": 5}),
            "a string or an array of strings",
        ),
        (
            json!({"messages": [{"role": "user", "content": 5}]}),
            "a string or an array of content parts",
        ),
    ] {
        let e = chat(c.clone())
            .err()
            .unwrap_or_else(|| panic!("accepted {c}"));
        assert!(e.message().contains(expected), "{c}: {}", e.message());
    }
    let e = chat(json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}))
        .err()
        .unwrap();
    assert!(
        e.message().starts_with("max_tokens must be at most 4096"),
        "{}",
        e.message()
    );
    let e = chat(json!({"messages": [{"role": "user", "content": "x"}], "top_k": -2}))
        .err()
        .unwrap();
    assert!(
        e.message().contains("0 or -1 for no cut"),
        "{}",
        e.message()
    );
    // top_k: vLLM's -1 and 0 mean no cut, a count is kept.
    for (k, cut) in [(-1, 0), (0, 0), (40, 40)] {
        let (r, _) =
            chat(json!({"messages": [{"role": "user", "content": "x"}], "top_k": k})).unwrap();
        assert_eq!(r.sampling.unwrap().top_k, cut, "top_k {k}");
    }
    // Explicit defaults are not refusals.
    chat(
        json!({"messages": [{"role": "user", "content": "x"}], "n": 1, "logprobs": false,
                "presence_penalty": 0, "tools": [], "response_format": {"type": "text"}}),
    )
    .unwrap();
}

#[test]
fn completions_send_the_prompt_raw() {
    let b = |v: Value| Bytes::from(v.to_string());
    let (r, shape) = completion_request(
        &b(json!({"prompt": ["def f():"], "max_tokens": 5})),
        "m",
        4096,
    )
    .unwrap();
    assert!(r.raw_prompt && r.messages.is_empty());
    assert_eq!((r.prompt.as_str(), r.max_new_tokens), ("def f():", 5));
    assert!(shape.kind == Kind::Completion);
    for v in [
        json!({"prompt": ["a", "b"]}),
        json!({"prompt": "a", "echo": true}),
        json!({"prompt": 3}),
    ] {
        let e = completion_request(&b(v.clone()), "m", 4096)
            .err()
            .unwrap_or_else(|| panic!("accepted {v}"));
        assert_eq!(e.code(), Code::InvalidArgument);
    }
}

#[test]
fn completions_take_a_prompt_of_token_ids() {
    let b = |v: Value| Bytes::from(v.to_string());
    for v in [
        json!({"prompt": [750, 912, 2877], "max_tokens": 5}),
        json!({"prompt": [[750, 912, 2877]], "max_tokens": 5}),
    ] {
        let (r, _) = completion_request(&b(v.clone()), "m", 4096).unwrap();
        assert_eq!(r.prompt_tokens, [750, 912, 2877], "{v}");
        assert!(
            r.prompt.is_empty() && !r.raw_prompt && r.messages.is_empty(),
            "{v}"
        );
    }
    for (v, expected) in [
        (json!({"prompt": [[1], [2]]}), "one prompt (got 2)"),
        (json!({"prompt": []}), "an empty array of token ids"),
        (json!({"prompt": [[]]}), "an empty array of token ids"),
        (
            json!({"prompt": [1, -2]}),
            "an array of token ids (integers from 0)",
        ),
        (
            json!({"prompt": [1, "a"]}),
            "an array of token ids (integers from 0)",
        ),
        (
            json!({"prompt": [1.5]}),
            "an array of token ids (integers from 0)",
        ),
    ] {
        let e = completion_request(&b(v.clone()), "m", 4096)
            .err()
            .unwrap_or_else(|| panic!("accepted {v}"));
        assert_eq!(e.code(), Code::InvalidArgument, "{v}");
        assert!(e.message().contains(expected), "{v}: {}", e.message());
    }
}

#[test]
fn statuses_map_to_http() {
    assert_eq!(
        http_status(Code::InvalidArgument).0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        http_status(Code::ResourceExhausted).0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        http_status(Code::Unavailable).0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        http_status(Code::Internal).0,
        StatusCode::INTERNAL_SERVER_ERROR
    );
}

#[test]
fn usage_carries_the_acceptance_figures() {
    let s = Stats {
        mode: "parse".into(),
        prompt_tokens: 10,
        output_tokens: 20,
        draft_tokens_accepted: 15,
        target_passes: 4,
        target_passes_per_token: 0.2,
        cached_prompt_tokens: 6,
        ..Default::default()
    };
    let u = usage(Some(&s));
    assert_eq!(u["total_tokens"], 30);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 6);
    assert_eq!(u["parse"]["draft_share"], 0.75);
    assert_eq!(u["parse"]["target_passes"], 4);
    // The draft's end token, accepted, is not output.
    let s = Stats {
        output_tokens: 9,
        draft_tokens_accepted: 10,
        ..Default::default()
    };
    assert_eq!(usage(Some(&s))["parse"]["draft_share"], 1.0);
}

#[test]
fn the_api_key_is_required_when_set() {
    let mut h = HeaderMap::new();
    assert!(check_api_key(None, &h).is_ok());
    let refused = check_api_key(Some("sk-1"), &h).unwrap_err();
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    for wrong in ["Bearer sk-2", "Bearer sk-1x", "sk-1", "Bearer "] {
        h.insert("authorization", wrong.parse().unwrap());
        assert!(check_api_key(Some("sk-1"), &h).is_err(), "{wrong}");
    }
    h.insert("authorization", "Bearer sk-1".parse().unwrap());
    assert!(check_api_key(Some("sk-1"), &h).is_ok());
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    /// JSON values of every kind, a few levels deep.
    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>()
                .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
            ".{0,12}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map(".{0,6}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    const FIELDS: [&str; 14] = [
        "messages",
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "n",
        "stream",
        "stream_options",
        "parse",
        "prompt",
    ];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Any JSON body, with the API's field names at random values: a request within the limits, or a 4xx
        /// status with a message; never a panic.
        #[test]
        fn any_body_is_a_request_or_a_clear_refusal(
            fields in proptest::collection::vec((0usize..FIELDS.len(), json()), 0..8),
            raw in proptest::option::of(".{0,40}"),
        ) {
            let mut body = serde_json::Map::new();
            for (k, v) in fields {
                body.insert(FIELDS[k].to_string(), v);
            }
            let bytes = match raw {
                Some(r) => Bytes::from(r),
                None => Bytes::from(Value::Object(body).to_string()),
            };
            for res in [
                chat_request(&bytes, "m", 4096).map(|(r, _)| r),
                completion_request(&bytes, "m", 4096).map(|(r, _)| r),
            ] {
                match res {
                    Ok(r) => {
                        prop_assert!(r.max_new_tokens >= 1 && r.max_new_tokens <= 4096);
                        prop_assert!(r.stop.len() <= 16);
                    }
                    Err(s) => {
                        prop_assert!(matches!(s.code(), Code::InvalidArgument | Code::NotFound), "{s:?}");
                        prop_assert!(!s.message().is_empty());
                    }
                }
            }
        }
    }
}
