//! etcd discovery with a real etcd server (Debian's etcd-server, on free loopback ports): workers register under
//! leases, the router follows them; a killed worker's key expires after its TTL and the router drops it; a new
//! worker takes requests within about a second of registering; etcd stopped and restarted mid-run loses no request.

use std::time::{Duration, Instant};

use parse_client::{Client, GenerateRequest};
use parse_discovery::Role;
use parse_router::RouterConfig;
use parse_target_worker::Worker as _;
use parse_tests::*;

const TTL: Duration = Duration::from_secs(2);

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn req(max: u32) -> GenerateRequest {
    GenerateRequest {
        prompt: "Write a function that adds two numbers.".into(),
        max_new_tokens: max,
        mode: "parse".into(),
        ..Default::default()
    }
}

fn etcd_router(etcd: &Etcd) -> Server<parse_router::Router> {
    router_server(RouterConfig {
        etcd: vec![etcd.endpoint()],
        ..Default::default()
    })
}

fn ids(members: &[(String, String)]) -> Vec<String> {
    members.iter().map(|(id, _)| id.clone()).collect()
}

#[test]
fn registrations_are_visible_and_a_killed_worker_expires_and_is_dropped() {
    let etcd = Etcd::start();
    let ep = etcd.endpoint();
    let _d = registered_draft(tiny_engine(DRAFT_SEED), &ep, "d1", TTL);
    let t1 = registered_target(tiny_engine(TARGET_SEED), &ep, "t1", TTL);
    let mut t2 = registered_target(tiny_engine(TARGET_SEED), &ep, "t2", TTL);
    assert!(
        eventually(Duration::from_secs(5), || etcd
            .get_prefix("/parse/v1/workers/")
            .len()
            == 3),
        "{:?}",
        etcd.get_prefix("/parse/v1/workers/")
    );
    let keys = etcd.get_prefix("/parse/v1/workers/target/");
    assert_eq!(keys[0].0, "/parse/v1/workers/target/t1");
    let rec: serde_json::Value = serde_json::from_str(&keys[0].1).unwrap();
    assert_eq!(rec["address"], t1.endpoint());
    assert_eq!(rec["role"], "target");
    assert_eq!(rec["tp"], 1);

    let router = etcd_router(&etcd);
    assert!(
        eventually(Duration::from_secs(3), || ids(&router
            .worker
            .members(Role::Target))
            == ["t1", "t2"]
            && ids(&router.worker.members(Role::Draft)) == ["d1"]),
        "{:?}",
        router.worker.members(Role::Target)
    );
    let r = rt();
    let endpoint = router.endpoint();
    r.block_on(async {
        let mut c = Client::connect(&endpoint).await.unwrap();
        assert_eq!(c.generate(req(16)).await.unwrap().token_ids.len(), 16);
    });

    // SIGKILL-like: the server and its keep-alives stop at once; the key goes when the lease runs out.
    t2.kill();
    let killed = Instant::now();
    assert!(
        eventually(Duration::from_secs(10), || etcd
            .get_prefix("/parse/v1/workers/target/")
            .len()
            == 1),
        "t2's key outlived its lease"
    );
    assert!(
        eventually(Duration::from_secs(3), || ids(&router
            .worker
            .members(Role::Target))
            == ["t1"]),
        "the router still lists t2"
    );
    let gone = killed.elapsed();
    assert!(gone < TTL + Duration::from_secs(4), "took {gone:?}");
    r.block_on(async {
        let mut c = Client::connect(&endpoint).await.unwrap();
        for _ in 0..3 {
            let out = c.generate(req(8)).await.unwrap();
            assert_eq!(
                out.stats.unwrap().target_failovers,
                0,
                "no request went to t2"
            );
        }
    });
}

#[test]
fn a_new_worker_takes_requests_within_about_a_second_of_registering() {
    let etcd = Etcd::start();
    let ep = etcd.endpoint();
    let _d = registered_draft(tiny_engine(DRAFT_SEED), &ep, "d1", TTL);
    let router = etcd_router(&etcd);
    let r = rt();
    let endpoint = router.endpoint();
    r.block_on(async {
        let mut c = Client::connect(&endpoint).await.unwrap();
        assert!(c.generate(req(4)).await.is_err(), "no target yet");
    });
    let _t = registered_target(tiny_engine(TARGET_SEED), &ep, "t1", TTL);
    // Registration itself (lease grant, put) is part of the second.
    let start = Instant::now();
    let served = r.block_on(async {
        let mut c = Client::connect(&endpoint).await.unwrap();
        loop {
            if c.generate(req(4)).await.is_ok() {
                return start.elapsed();
            }
            if start.elapsed() > Duration::from_secs(10) {
                panic!("the new target never took a request");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    assert!(served < Duration::from_millis(1500), "took {served:?}");
}

#[test]
fn etcd_stopped_and_restarted_mid_run_loses_no_request() {
    let mut etcd = Etcd::start();
    let ep = etcd.endpoint();
    let _d = registered_draft(tiny_engine(DRAFT_SEED), &ep, "d1", TTL);
    let _t = registered_target(tiny_engine(TARGET_SEED), &ep, "t1", TTL);
    let router = etcd_router(&etcd);
    assert!(eventually(Duration::from_secs(5), || router
        .worker
        .members(Role::Target)
        .len()
        == 1
        && router.worker.members(Role::Draft).len() == 1));
    let endpoint = router.endpoint();
    let client = std::thread::spawn(move || {
        rt().block_on(async {
            let mut c = Client::connect(&endpoint).await.unwrap();
            let start = Instant::now();
            let mut done = 0;
            while start.elapsed() < Duration::from_secs(8) {
                c.generate(req(8))
                    .await
                    .expect("a request during the outage");
                done += 1;
            }
            done
        })
    });
    std::thread::sleep(Duration::from_secs(1));
    etcd.stop();
    // Longer than the lease TTL: the workers cannot keep their leases alive meanwhile.
    std::thread::sleep(Duration::from_secs(3));
    etcd.restart();
    let done = client.join().unwrap();
    assert!(done >= 3, "{done} requests");
    // The workers are registered again, and the router's view is whole.
    assert!(
        eventually(Duration::from_secs(10), || etcd
            .get_prefix("/parse/v1/workers/")
            .len()
            == 2),
        "{:?}",
        etcd.get_prefix("/parse/v1/workers/")
    );
    assert_eq!(ids(&router.worker.members(Role::Target)), ["t1"]);
}

fn admin_client(
    addr: &str,
) -> parse_proto::v1::admin_client::AdminClient<tonic::transport::Channel> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy();
    parse_proto::v1::admin_client::AdminClient::new(ch)
}

fn authed<T>(msg: T, token: Option<&str>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(t) = token {
        r.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    r
}

#[test]
fn the_admin_api_needs_the_token_and_reports_workers_stats_and_policy() {
    use parse_proto::v1::{
        GetPolicyRequest, GetStatsRequest, ListWorkersRequest, SetPolicyRequest,
    };
    let d = draft_server(
        tiny_engine(DRAFT_SEED),
        parse_draft_worker::DraftWorkerConfig::default(),
    );
    let t = target_server(
        tiny_engine(TARGET_SEED),
        parse_target_worker::TargetWorkerConfig::default(),
    );
    let (router, admin) = router_with_admin(
        RouterConfig {
            drafts: vec![d.endpoint()],
            targets: vec![t.endpoint()],
            ..Default::default()
        },
        "s3cret",
    );
    let endpoint = router.endpoint();
    rt().block_on(async {
        let mut a = admin_client(&admin);
        for token in [None, Some("wrong"), Some("s3cret ")] {
            let e = a
                .list_workers(authed(ListWorkersRequest {}, token))
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated, "{token:?}");
            let e = a
                .get_stats(authed(GetStatsRequest {}, token))
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated, "{token:?}");
        }
        let ws = a
            .list_workers(authed(ListWorkersRequest {}, Some("s3cret")))
            .await
            .unwrap()
            .into_inner()
            .workers;
        let roles: Vec<_> = ws.iter().map(|w| (w.role.as_str(), w.healthy)).collect();
        assert_eq!(roles, [("draft", true), ("target", true)]);

        // The policy: defaults, a bad change refused, a good one applied to later requests.
        let p = a
            .get_policy(authed(GetPolicyRequest {}, Some("s3cret")))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(p.default_mode, "parse+token-spec");
        let bad = a
            .set_policy(authed(
                SetPolicyRequest {
                    tau: Some(-1.0),
                    ..Default::default()
                },
                Some("s3cret"),
            ))
            .await
            .unwrap_err();
        assert_eq!(bad.code(), tonic::Code::InvalidArgument);
        let p = a
            .set_policy(authed(
                SetPolicyRequest {
                    default_mode: Some("target".into()),
                    ..Default::default()
                },
                Some("s3cret"),
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(p.default_mode, "target");
        let mut c = Client::connect(&endpoint).await.unwrap();
        let r = c
            .generate(GenerateRequest {
                prompt: "hi".into(),
                max_new_tokens: 8,
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(r.stats.unwrap().mode, "target", "the new default mode");
        c.generate(req(8)).await.unwrap();

        let s = a
            .get_stats(authed(GetStatsRequest {}, Some("s3cret")))
            .await
            .unwrap()
            .into_inner();
        let o = s.overall.unwrap();
        assert_eq!((o.requests, o.failed, o.output_tokens), (2, 0, 16));
        assert!(o.latency_p50_ms > 0.0 && o.latency_p99_ms >= o.latency_p50_ms);
        let per: Vec<_> = s
            .workers
            .iter()
            .map(|w| (w.role.as_str(), w.counters.unwrap().requests))
            .collect();
        // The target served both requests; the draft only the parse one.
        assert_eq!(per, [("draft", 1), ("target", 2)]);
    });
}

#[test]
fn drain_finishes_in_flight_requests_then_the_worker_deregisters_and_stops() {
    use parse_client::Event;
    use parse_proto::v1::{DrainWorkerRequest, ListWorkersRequest};
    use tokio_stream::StreamExt;
    let etcd = Etcd::start();
    let ep = etcd.endpoint();
    let _d = registered_draft(tiny_engine(DRAFT_SEED), &ep, "d1", TTL);
    let t1 = registered_target(tiny_engine(TARGET_SEED), &ep, "t1", TTL);
    let t2 = registered_target(tiny_engine(TARGET_SEED), &ep, "t2", TTL);
    let (router, admin) = router_with_admin(
        RouterConfig {
            etcd: vec![ep.clone()],
            ..Default::default()
        },
        "tok",
    );
    assert!(eventually(Duration::from_secs(5), || router
        .worker
        .members(Role::Target)
        .len()
        == 2
        && router.worker.members(Role::Draft).len() == 1));
    let endpoint = router.endpoint();
    let drained = rt().block_on(async {
        let mut c = Client::connect(&endpoint).await.unwrap();
        let mut stream = c.generate_stream(req(300)).await.unwrap();
        let (mut tokens, mut stats, mut drained) = (0, None, None);
        while let Some(ev) = stream.next().await {
            match ev.expect("the in-flight request finishes") {
                Event::Delta(d) => {
                    tokens += d.token_ids.len();
                    if drained.is_none() {
                        let busy = if t1.worker.open_sessions() > 0 {
                            "t1"
                        } else {
                            "t2"
                        };
                        let r = admin_client(&admin)
                            .drain_worker(authed(
                                DrainWorkerRequest { id: busy.into() },
                                Some("tok"),
                            ))
                            .await
                            .unwrap()
                            .into_inner();
                        assert!(r.worker.unwrap().draining);
                        assert_eq!(r.open_sessions, 1, "the request's session is still open");
                        drained = Some(busy);
                    }
                }
                Event::Finished(f) => stats = f.stats,
            }
        }
        let stats = stats.unwrap();
        assert_eq!(tokens, stats.output_tokens as usize);
        assert_eq!(stats.target_failovers, 0, "finished on the draining worker");
        drained.unwrap()
    });
    // Deregistered at once; stopped once its session was released.
    assert!(
        eventually(Duration::from_secs(5), || etcd
            .get_prefix("/parse/v1/workers/target/")
            .iter()
            .all(|(k, _)| !k.ends_with(drained))),
        "the drained worker's key is still there"
    );
    let (gone, other) = if drained == "t1" {
        (&t1, &t2)
    } else {
        (&t2, &t1)
    };
    rt().block_on(async {
        let mut c = Client::connect(&endpoint).await.unwrap();
        let mut stopped = false;
        for _ in 0..50 {
            if tokio::net::TcpStream::connect(gone.addr).await.is_err() {
                stopped = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(stopped, "the drained worker still listens");
        let ws = admin_client(&admin)
            .list_workers(authed(ListWorkersRequest {}, Some("tok")))
            .await
            .unwrap()
            .into_inner()
            .workers;
        assert!(ws.iter().all(|w| w.id != drained), "{ws:?}");
        // New requests go to the other worker.
        let r = c.generate(req(8)).await.unwrap();
        assert_eq!(r.stats.unwrap().target_failovers, 0);
        assert!(other.worker.open_sessions() == 0);
    });
}
