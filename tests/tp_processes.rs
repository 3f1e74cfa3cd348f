//! A tensor-parallel group of real `parse-target-worker` processes (`--tp 2`, static rendezvous over loopback TCP)
//! with the default draft checkpoint as its model: the leader serves, the follower only reports health; a follower
//! killed with SIGKILL fails the leader's in-flight call with UNAVAILABLE within seconds, and the leader turns
//! NOT_SERVING.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use parse_proto::v1::verifier_client::VerifierClient;
use parse_proto::v1::{ExtendRequest, OpenSessionRequest};
use parse_tests::{Etcd, Proc, draft_checkpoint, eventually, free_port, workspace_binary};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

fn rank(r: usize, listen: u16, addrs: &str) -> Proc {
    rank_with(r, listen, &["--tp-addrs", addrs])
}

fn rank_with(r: usize, listen: u16, extra: &[&str]) -> Proc {
    Proc(
        Command::new(workspace_binary("parse-target-worker"))
            .args(["--model", &draft_checkpoint().display().to_string()])
            .args(["--listen", &format!("127.0.0.1:{listen}")])
            .args(["--tp", "2", "--rank", &r.to_string()])
            .args(extra)
            .args(["--tp-timeout-s", "5"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

async fn health(port: u16) -> Option<i32> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .ok()?
        .connect_timeout(Duration::from_secs(1))
        .connect()
        .await
        .ok()?;
    let r = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .ok()?;
    Some(r.into_inner().status)
}

#[test]
fn a_killed_follower_process_fails_the_leaders_call_with_unavailable() {
    let (l0, l1, g0, g1) = (free_port(), free_port(), free_port(), free_port());
    let addrs = format!("127.0.0.1:{g0},127.0.0.1:{g1}");
    let _leader = rank(0, l0, &addrs);
    let mut follower = rank(1, l1, &addrs);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let start = Instant::now();
        while health(l0).await != Some(1) || health(l1).await != Some(1) {
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "the group did not come up"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{l0}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut v = VerifierClient::new(channel);
        v.open_session(OpenSessionRequest {
            session: "s".into(),
            prompt: vec![9707, 11, 1246, 525, 498, 30],
            sampling: None,
        })
        .await
        .unwrap();
        // Extension after extension runs on both ranks; the follower is killed under them.
        let calls = tokio::spawn(async move {
            let mut pending = 30;
            loop {
                let r = v
                    .extend(ExtendRequest {
                        session: "s".into(),
                        pending,
                        max_tokens: 8,
                        segment: None,
                    })
                    .await;
                match r {
                    Ok(r) => pending = *r.into_inner().tokens.last().unwrap(),
                    Err(s) => return (s, Instant::now()),
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(1500)).await;
        follower.0.kill().unwrap();
        let killed = Instant::now();
        let (status, at) = tokio::time::timeout(Duration::from_secs(30), calls)
            .await
            .expect("the leader's calls fail once the follower is gone")
            .unwrap();
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        assert!(
            at.duration_since(killed) < Duration::from_secs(5),
            "failed {:?} after the kill",
            at.duration_since(killed)
        );
    });
    assert!(
        eventually(Duration::from_secs(5), || rt.block_on(health(l0))
            == Some(2)),
        "the leader reports NOT_SERVING"
    );
}

#[test]
fn a_group_meets_through_etcd_and_its_leader_registers_with_its_size() {
    let etcd = Etcd::start();
    let ep = etcd.endpoint();
    let (l0, l1, g0, g1) = (free_port(), free_port(), free_port(), free_port());
    let group = |g: u16| {
        vec![
            "--etcd".to_string(),
            ep.clone(),
            "--tp-group".into(),
            "g1".into(),
            "--tp-listen".into(),
            format!("127.0.0.1:{g}"),
            "--worker-id".into(),
            "g1-leader".into(),
        ]
    };
    // The follower first: it waits in etcd for the leader.
    let a1 = group(g1);
    let _f = rank_with(1, l1, &a1.iter().map(String::as_str).collect::<Vec<_>>());
    std::thread::sleep(Duration::from_millis(500));
    let a0 = group(g0);
    let _l = rank_with(0, l0, &a0.iter().map(String::as_str).collect::<Vec<_>>());
    let rt = tokio::runtime::Runtime::new().unwrap();
    assert!(
        eventually(Duration::from_secs(120), || rt.block_on(health(l0))
            == Some(1)),
        "the group did not come up"
    );
    let ranks = etcd.get_prefix("/parse/v1/groups/g1/");
    assert_eq!(ranks.len(), 2, "{ranks:?}");
    assert!(ranks[0].1.contains(&format!("127.0.0.1:{g0}")), "{ranks:?}");
    // Only the leader registers as a worker, with the group's size.
    let workers = etcd.get_prefix("/parse/v1/workers/");
    assert_eq!(workers.len(), 1, "{workers:?}");
    assert_eq!(workers[0].0, "/parse/v1/workers/target/g1-leader");
    let rec: serde_json::Value = serde_json::from_str(&workers[0].1).unwrap();
    assert_eq!(rec["tp"], 2);
    assert_eq!(rec["address"], format!("127.0.0.1:{l0}"));
}
