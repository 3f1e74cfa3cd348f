//! etcd discovery with a real etcd server (Debian's etcd-server, on free loopback ports): workers register under
//! leases, the router follows them; a killed worker's key expires after its TTL and the router drops it; a new
//! worker takes requests within about a second of registering; etcd stopped and restarted mid-run loses no request.

use std::time::{Duration, Instant};

use parse_client::{Client, GenerateRequest};
use parse_router::RouterConfig;
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
            .members("target"))
            == ["t1", "t2"]
            && ids(&router.worker.members("draft")) == ["d1"]),
        "{:?}",
        router.worker.members("target")
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
            .members("target"))
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
        .members("target")
        .len()
        == 1
        && router.worker.members("draft").len() == 1));
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
    assert_eq!(ids(&router.worker.members("target")), ["t1"]);
}
