//! Behaviour of a real store server and client over loopback TCP.

mod common;

use braid_store::protocol::{ErrorCode, Limits, Request, Response};
use braid_store::{ClientOptions, ServerOptions, StoreClient, StoreError, StoreServer};
use common::{read_reply, wait_closed};
use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn server() -> StoreServer {
    StoreServer::bind("127.0.0.1:0", ServerOptions::default()).unwrap()
}

fn client(s: &StoreServer) -> StoreClient {
    client_with(
        s,
        ClientOptions {
            timeout: Duration::from_secs(10),
            ..Default::default()
        },
    )
}

fn client_with(s: &StoreServer, o: ClientOptions) -> StoreClient {
    StoreClient::connect(&s.local_addr().to_string(), o).unwrap()
}

#[test]
fn set_get_delete_and_count() {
    let s = server();
    let c = client(&s);
    c.set("a", b"1").unwrap();
    c.set("b", b"").unwrap();
    assert_eq!(c.get("a").unwrap(), b"1");
    assert_eq!(c.try_get("b").unwrap(), Some(vec![]));
    assert_eq!(c.try_get("zz").unwrap(), None);
    assert_eq!(c.num_keys().unwrap(), 2);
    assert_eq!(c.check(&["a", "zz", "b"]).unwrap(), [true, false, true]);
    assert!(c.delete("a").unwrap());
    assert!(!c.delete("a").unwrap());
    assert_eq!(c.num_keys().unwrap(), 1);
    c.ping().unwrap();
}

#[test]
fn get_blocks_until_another_client_sets() {
    let s = server();
    let c = client(&s);
    let addr = s.local_addr().to_string();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        StoreClient::connect(&addr, ClientOptions::default())
            .unwrap()
            .set("late", b"here")
            .unwrap();
    });
    let start = Instant::now();
    assert_eq!(c.get("late").unwrap(), b"here");
    assert!(start.elapsed() >= Duration::from_millis(150));
    t.join().unwrap();
}

#[test]
fn get_timeout_names_key_and_time() {
    let s = server();
    let c = client(&s).with_prefix("job/");
    let start = Instant::now();
    let err = c
        .get_timeout("never", Duration::from_millis(300))
        .unwrap_err();
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    let msg = err.to_string();
    assert!(matches!(err, StoreError::Timeout { .. }), "{msg}");
    assert!(
        msg.contains("\"job/never\"") && msg.contains("300"),
        "{msg}"
    );
    // The connection is still usable after a timeout.
    c.set("x", b"y").unwrap();
}

#[test]
fn wait_for_several_keys_reports_the_missing_ones() {
    let s = server();
    let c = client(&s);
    c.set("k1", b"").unwrap();
    let err = c
        .wait(&["k1", "k2", "k3"], Duration::from_millis(200))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("still missing") && err.contains("k2") && err.contains("k3"),
        "{err}"
    );
    assert!(!err.contains("missing: [\"k1"), "{err}");
    c.set("k2", b"").unwrap();
    c.set("k3", b"").unwrap();
    c.wait(&["k1", "k2", "k3"], Duration::from_millis(200))
        .unwrap();
}

#[test]
fn add_is_atomic_across_clients() {
    let s = Arc::new(server());
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let s = s.clone();
            std::thread::spawn(move || {
                let c = client(&s);
                for _ in 0..100 {
                    c.add("counter", 1).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let c = client(&s);
    assert_eq!(c.add("counter", 0).unwrap(), 800);
    assert_eq!(c.get("counter").unwrap(), b"800");
    assert_eq!(c.add("counter", -801).unwrap(), -1);
    c.set("text", b"hello").unwrap();
    let err = c.add("text", 1).unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Rejected {
                code: ErrorCode::NotAnInteger,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn compare_set_semantics() {
    let s = server();
    let c = client(&s);
    let o = c.compare_set("leader", None, b"r0").unwrap();
    assert!(o.swapped);
    assert_eq!(o.current.as_deref(), Some(&b"r0"[..]));
    let o = c.compare_set("leader", None, b"r1").unwrap();
    assert!(!o.swapped);
    assert_eq!(o.current.as_deref(), Some(&b"r0"[..]));
    let o = c.compare_set("leader", Some(b"r0"), b"r2").unwrap();
    assert!(o.swapped);
    let o = c.compare_set("absent", Some(b"x"), b"y").unwrap();
    assert!(!o.swapped && o.current.is_none());
}

#[test]
fn prefixes_keep_groups_apart() {
    let s = server();
    let c = client(&s);
    let a = c.with_prefix("run/0/");
    let b = c.with_prefix("run/1/");
    a.set("k", b"a").unwrap();
    b.set("k", b"b").unwrap();
    assert_eq!(a.get("k").unwrap(), b"a");
    assert_eq!(b.get("k").unwrap(), b"b");
    assert_eq!(c.get("run/0/k").unwrap(), b"a");
    assert_eq!(a.with_prefix("sub/").prefix(), "run/0/sub/");
    assert_eq!(c.delete_prefix("run/0/").unwrap(), 1);
    assert_eq!(b.get("k").unwrap(), b"b");
}

#[test]
fn barrier_releases_all_and_is_reusable() {
    let s = Arc::new(server());
    let world = 6;
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let s = s.clone();
            std::thread::spawn(move || {
                let c = client(&s);
                for round in 0..20u64 {
                    c.add(&format!("round/{round}"), 1).unwrap();
                    c.barrier("step", rank, world, Duration::from_secs(10))
                        .unwrap();
                    // Everyone has incremented this round's counter.
                    assert_eq!(c.add(&format!("round/{round}"), 0).unwrap(), world as i64);
                    c.barrier("step", rank, world, Duration::from_secs(10))
                        .unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // Old generations are cleaned up: 20 round counters + one generation.
    let n = client(&s).num_keys().unwrap();
    assert!(n <= 20 + world as u64 + 2, "store holds {n} keys");
}

#[test]
fn barrier_timeout_names_missing_ranks() {
    let s = server();
    let c = client(&s);
    let other = client(&s);
    let t = std::thread::spawn(move || other.barrier("b", 2, 4, Duration::from_millis(400)));
    let err = c
        .barrier("b", 0, 4, Duration::from_millis(400))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("2 of 4 ranks arrived") && err.contains("missing ranks: [1, 3]"),
        "{err}"
    );
    assert!(t.join().unwrap().is_err());
}

#[test]
fn token_is_required_when_configured() {
    let s = StoreServer::bind(
        "127.0.0.1:0",
        ServerOptions {
            token: Some("s3cret".into()),
            ..Default::default()
        },
    )
    .unwrap();
    let addr = s.local_addr().to_string();
    let wrong = StoreClient::connect(
        &addr,
        ClientOptions {
            token: Some("nope".into()),
            ..Default::default()
        },
    );
    let msg = wrong
        .err()
        .expect("wrong token must be refused")
        .to_string();
    assert!(
        msg.contains("refused") && msg.contains("BRAID_STORE_TOKEN") && msg.contains("wrong"),
        "{msg}"
    );
    let missing = StoreClient::connect(&addr, ClientOptions::default());
    let msg = missing
        .err()
        .expect("missing token must be refused")
        .to_string();
    assert!(msg.contains("no token"), "{msg}");
    // A raw client skipping the handshake is refused too.
    let mut raw = TcpStream::connect(&addr).unwrap();
    raw.write_all(&Request::NumKeys.encode()).unwrap();
    let reply = read_reply(&mut raw);
    assert!(
        matches!(
            reply,
            Some(Response::Error {
                code: ErrorCode::Unauthorized,
                ..
            })
        ),
        "{reply:?}"
    );
    let good = StoreClient::connect(
        &addr,
        ClientOptions {
            token: Some("s3cret".into()),
            ..Default::default()
        },
    )
    .unwrap();
    good.set("k", b"v").unwrap();
}

#[test]
fn oversized_values_are_refused_by_configured_limits() {
    let limits = Limits {
        max_key_len: 16,
        max_value_len: 1024,
        max_keys_per_request: 8,
    };
    let s = StoreServer::bind(
        "127.0.0.1:0",
        ServerOptions {
            limits,
            ..Default::default()
        },
    )
    .unwrap();
    let c = client(&s);
    // The client's own limits are larger: the server is the one refusing.
    let err = c.set("k", vec![7u8; 4096]).unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Rejected {
                code: ErrorCode::TooLarge,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("exceeds the limit of 1024"),
        "{err}"
    );
    // That connection is closed; others are unaffected.
    assert!(c.ping().is_err());
    let other = client(&s);
    other.set("k", vec![7u8; 1024]).unwrap();
    let err = other.set("a-key-that-is-far-too-long", b"").unwrap_err();
    assert!(err.to_string().contains("key of 26 bytes"), "{err}");
}

#[test]
fn client_checks_its_own_limits_before_sending() {
    let s = server();
    let opts = ClientOptions {
        limits: Limits {
            max_key_len: 8,
            ..Default::default()
        },
        ..Default::default()
    };
    let c = client_with(&s, opts).with_prefix("prefix/");
    let err = c.set("key", b"").unwrap_err();
    assert!(
        matches!(err, StoreError::Invalid(_)) && err.to_string().contains("prefix/key"),
        "{err}"
    );
}

#[test]
fn client_errors_quickly_when_server_shuts_down() {
    let mut s = server();
    let c = client(&s);
    let waiter = client(&s);
    let t = std::thread::spawn(move || {
        let start = Instant::now();
        let r = waiter.get_timeout("never", Duration::from_secs(30));
        (r, start.elapsed())
    });
    std::thread::sleep(Duration::from_millis(200));
    s.shutdown();
    let (r, waited) = t.join().unwrap();
    assert!(
        r.is_err() && waited < Duration::from_secs(5),
        "{r:?} after {waited:?}"
    );
    let err = c.get_timeout("k", Duration::from_secs(30)).unwrap_err();
    assert!(matches!(err, StoreError::Disconnected { .. }), "{err}");
}

#[test]
fn client_errors_within_timeout_when_server_hangs() {
    // A listener that accepts and never answers stands in for a server
    // whose host vanished.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let holder = std::thread::spawn(move || {
        let conn = listener.accept();
        std::thread::sleep(Duration::from_secs(4));
        drop(conn);
    });
    let start = Instant::now();
    let opts = ClientOptions {
        timeout: Duration::from_millis(500),
        ..Default::default()
    };
    let err = StoreClient::connect(&addr, opts)
        .err()
        .expect("must time out");
    let waited = start.elapsed();
    assert!(waited < Duration::from_millis(2500), "took {waited:?}");
    assert!(err.to_string().contains("no reply within"), "{err}");
    holder.join().unwrap();
}

#[test]
fn connect_retries_until_server_appears() {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = probe.local_addr().unwrap();
    drop(probe);
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        StoreServer::bind(addr, ServerOptions::default()).unwrap()
    });
    let c = StoreClient::connect(&addr.to_string(), ClientOptions::default()).unwrap();
    c.set("k", b"v").unwrap();
    drop(t.join().unwrap());
}

#[test]
fn connect_gives_up_at_deadline_naming_address() {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = probe.local_addr().unwrap().to_string();
    drop(probe);
    let start = Instant::now();
    let opts = ClientOptions {
        connect_timeout: Duration::from_millis(400),
        ..Default::default()
    };
    let err = StoreClient::connect(&addr, opts).err().unwrap();
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(
        matches!(err, StoreError::Connect { .. }) && err.to_string().contains(&addr),
        "{err}"
    );
}

#[test]
fn port_in_use_is_a_clear_error() {
    let s = server();
    let err = StoreServer::bind(s.local_addr(), ServerOptions::default())
        .err()
        .unwrap();
    // The store says the port is taken; only its caller knows which flag
    // chose it, and adds that.
    let text = err.to_string();
    assert!(
        text.contains("already in use") && !text.contains("--"),
        "{text}"
    );
    let advised = err.advise_port_in_use("choose another --port").to_string();
    assert!(advised.ends_with("; choose another --port"), "{advised}");
}

#[test]
fn malformed_frames_get_an_error_and_the_connection_closes() {
    let s = server();
    let addr = s.local_addr();
    // Unknown opcode.
    let mut raw = TcpStream::connect(addr).unwrap();
    raw.write_all(&[2, 0, 0, 0, 1, 99]).unwrap();
    let reply = read_reply(&mut raw);
    assert!(
        matches!(
            reply,
            Some(Response::Error {
                code: ErrorCode::Malformed,
                ..
            })
        ),
        "{reply:?}"
    );
    assert!(wait_closed(&mut raw));
    // Oversized header.
    let mut raw = TcpStream::connect(addr).unwrap();
    raw.write_all(&u32::MAX.to_le_bytes()).unwrap();
    let reply = read_reply(&mut raw);
    assert!(
        matches!(
            reply,
            Some(Response::Error {
                code: ErrorCode::TooLarge,
                ..
            })
        ),
        "{reply:?}"
    );
    // Wrong version.
    let mut raw = TcpStream::connect(addr).unwrap();
    raw.write_all(&[2, 0, 0, 0, 7, 11]).unwrap();
    let reply = read_reply(&mut raw);
    assert!(
        matches!(
            reply,
            Some(Response::Error {
                code: ErrorCode::VersionMismatch,
                ..
            })
        ),
        "{reply:?}"
    );
    // The server still serves everyone else.
    client(&s).set("still", b"alive").unwrap();
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 96,
            // Deterministic: the same cases on every run and machine.
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x0062_7261_6964),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// Random bytes, sent raw, never take the server down.
        #[test]
        fn random_bytes_do_not_disturb_other_clients(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let s = server();
            let good = client(&s);
            good.set("before", b"1").unwrap();
            {
                let mut raw = TcpStream::connect(s.local_addr()).unwrap();
                let _ = raw.write_all(&bytes);
                let _ = raw.shutdown(std::net::Shutdown::Write);
                prop_assert!(wait_closed(&mut raw), "server kept a garbage connection open");
            }
            prop_assert_eq!(good.get("before").unwrap(), b"1".to_vec());
            good.set("after", b"2").unwrap();
            prop_assert_eq!(client(&s).get("after").unwrap(), b"2".to_vec());
        }

        /// A valid frame cut short at any point is dropped cleanly.
        #[test]
        fn truncated_frames_are_dropped(key in "[a-z]{1,16}", value in proptest::collection::vec(any::<u8>(), 0..256), cut_seed in any::<usize>()) {
            let s = server();
            let good = client(&s);
            let frame = Request::Set { key: key.into_bytes(), value }.encode();
            let cut = cut_seed % frame.len();
            let mut raw = TcpStream::connect(s.local_addr()).unwrap();
            raw.write_all(&frame[..cut]).unwrap();
            raw.shutdown(std::net::Shutdown::Write).unwrap();
            prop_assert!(wait_closed(&mut raw));
            prop_assert_eq!(good.num_keys().unwrap(), 0);
            good.set("ok", b"").unwrap();
        }

        /// Structurally valid requests with arbitrary fields always get a
        /// well-formed reply.
        #[test]
        fn valid_requests_always_get_a_reply(key in proptest::collection::vec(any::<u8>(), 0..64), delta in any::<i64>(), timeout_ms in 0u64..5) {
            let s = server();
            let mut raw = TcpStream::connect(s.local_addr()).unwrap();
            for req in [
                Request::Add { key: key.clone(), delta },
                Request::Get { key: key.clone(), timeout_ms },
                Request::Wait { keys: vec![key.clone(), b"x".to_vec()], timeout_ms },
                Request::CompareSet { key: key.clone(), expected: Some(key.clone()), desired: key.clone() },
                Request::Get { key: b"none".to_vec(), timeout_ms: u64::MAX },
            ] {
                if let Request::Get { timeout_ms: u64::MAX, .. } = req {
                    // An absurd timeout must not crash the server; don't wait for it.
                    raw.write_all(&req.encode()).unwrap();
                    break;
                }
                raw.write_all(&req.encode()).unwrap();
                prop_assert!(read_reply(&mut raw).is_some());
            }
            drop(raw);
            client(&s).ping().unwrap();
        }
    }
}
