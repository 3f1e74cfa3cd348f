use super::{CALL_LIMIT_ROWS, call_limit, host_of};
use std::time::Duration;

#[test]
fn a_long_prompt_gets_a_limit_that_grows_with_the_square_of_its_rows() {
    let base = Duration::from_secs(300);
    assert_eq!(call_limit(base, 0), base);
    assert_eq!(call_limit(base, CALL_LIMIT_ROWS), base);
    assert_eq!(call_limit(base, 2 * CALL_LIMIT_ROWS), 4 * base);
    assert_eq!(call_limit(base, 4 * CALL_LIMIT_ROWS), 16 * base);
}

#[test]
fn a_worker_address_gives_its_host() {
    for (addr, host) in [
        ("127.0.0.1:50061", "127.0.0.1"),
        ("http://10.0.0.7:50071", "10.0.0.7"),
        ("https://draft-0.parse.svc:50061/", "draft-0.parse.svc"),
        ("[::1]:50061", "[::1]"),
        ("draft-worker", "draft-worker"),
    ] {
        assert_eq!(host_of(addr), host, "{addr}");
    }
    assert_ne!(host_of("10.0.0.7:50061"), host_of("10.0.0.8:50061"));
}
