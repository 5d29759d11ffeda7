//! The server's bounds on connections: the connection cap, the handshake
//! deadline for new connections (a client that sends nothing, or trickles
//! its first frame), and the frame timeout for a request dribbled later,
//! each shown while a real client keeps working.
//!
//! Timeouts here are shortened to 1 s so that every test takes a few
//! seconds; the margins asserted are wide enough for a loaded machine.

mod common;

use braid_store::protocol::{ErrorCode, Request, Response};
use braid_store::{ClientOptions, ServerOptions, StoreClient, StoreError, StoreServer};
use common::{connect, read_reply, wait_closed, wait_until};
use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(1);

/// Sends `bytes` one at a time, `gap` apart, until a write fails; returns
/// how many were written.
fn dribble(mut stream: TcpStream, bytes: Vec<u8>, gap: Duration) -> usize {
    for (i, b) in bytes.iter().enumerate() {
        if stream.write_all(&[*b]).is_err() {
            return i;
        }
        std::thread::sleep(gap);
    }
    bytes.len()
}

/// On its own thread: reads `stream` until it yields a reply, then until
/// it is closed; returns the reply and how long after `start` it closed.
fn watch(
    mut stream: TcpStream,
    start: Instant,
) -> std::thread::JoinHandle<(Option<Response>, bool, Duration)> {
    std::thread::spawn(move || {
        let reply = read_reply(&mut stream);
        let closed = wait_closed(&mut stream);
        (reply, closed, start.elapsed())
    })
}

fn assert_timeout_reply(reply: &Option<Response>, needle: &str) {
    match reply {
        Some(Response::Error {
            code: ErrorCode::Timeout,
            message,
        }) => assert!(message.contains(needle), "{message}"),
        other => panic!("expected a Timeout error naming {needle:?}, got {other:?}"),
    }
}

/// (b) A client that sends its first frame (a `hello` with the right token)
/// one byte every 200 ms would need 3.2 s; the server cuts it off at the 1 s
/// handshake deadline, while an authenticated client blocks in a `wait`
/// for longer than that deadline and is not cut off.
#[test]
fn slow_sender_is_cut_off_at_the_handshake_deadline() {
    let s = StoreServer::bind(
        "127.0.0.1:0",
        ServerOptions {
            token: Some("s3cret".into()),
            handshake_timeout: DEADLINE,
            ..Default::default()
        },
    )
    .unwrap();
    let addr = s.local_addr().to_string();
    let good = connect(&addr, Some("s3cret"));
    good.set("before", b"1").unwrap();

    let hello = Request::Hello {
        token: b"s3cret".to_vec(),
    }
    .encode();
    assert_eq!(hello.len(), 16);
    let start = Instant::now();
    let slow = TcpStream::connect(&addr).unwrap();
    let watcher = watch(slow.try_clone().unwrap(), start);
    let sender = {
        let slow = slow.try_clone().unwrap();
        let hello = hello.clone();
        std::thread::spawn(move || dribble(slow, hello, Duration::from_millis(200)))
    };

    // Meanwhile: a wait that outlasts the handshake deadline, answered when
    // another client sets the key 1.5 s in.
    let setter = {
        let other = connect(&addr, Some("s3cret"));
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1500));
            other.set("late", b"2").unwrap();
        })
    };
    let waited = Instant::now();
    good.wait(&["before", "late"], Duration::from_secs(20))
        .unwrap();
    assert!(waited.elapsed() >= Duration::from_millis(1400));
    setter.join().unwrap();

    let (reply, closed, after) = watcher.join().unwrap();
    assert_timeout_reply(&reply, "handshake deadline");
    assert!(closed, "the slow sender's connection stayed open");
    assert!(
        after >= Duration::from_millis(900) && after < Duration::from_secs(3),
        "closed {after:?} after connecting (deadline {DEADLINE:?})"
    );
    let sent = sender.join().unwrap();
    assert!(
        sent < hello.len(),
        "the whole hello got through ({sent} bytes)"
    );
    drop(slow);
    assert_eq!(s.handshakes_timed_out(), 1);

    // The real client, idle past the deadline too, still works.
    assert_eq!(good.get("late").unwrap(), b"2");
    good.ping().unwrap();
    wait_until(
        "the slow sender's slot is freed",
        Duration::from_secs(5),
        || s.num_connections() == 1,
    );
}

/// (b, continued) A connection that sends nothing is closed at the deadline,
/// also when the store has no token; a client that did its handshake may
/// then idle past the deadline and keep working.
#[test]
fn silent_connection_is_closed_at_the_handshake_deadline() {
    let s = StoreServer::bind(
        "127.0.0.1:0",
        ServerOptions {
            handshake_timeout: DEADLINE,
            ..Default::default()
        },
    )
    .unwrap();
    let addr = s.local_addr().to_string();
    let good = connect(&addr, None);
    let start = Instant::now();
    let silent = TcpStream::connect(&addr).unwrap();
    let (reply, closed, after) = watch(silent, start).join().unwrap();
    assert_timeout_reply(&reply, "no complete first request within 1.0s");
    assert!(closed);
    assert!(
        after >= Duration::from_millis(900) && after < Duration::from_secs(3),
        "closed {after:?} after connecting"
    );
    assert_eq!(s.handshakes_timed_out(), 1);
    // `good` connected before the silent one and has idled since.
    assert!(start.elapsed() > DEADLINE);
    good.set("k", b"v").unwrap();
    assert_eq!(good.get("k").unwrap(), b"v");
    wait_until("the silent slot is freed", Duration::from_secs(5), || {
        s.num_connections() == 1
    });
}

/// After the handshake a connection may idle as long as it likes, but a
/// request it starts must arrive whole within the frame timeout, however
/// it trickles in.
#[test]
fn request_dribbled_after_the_handshake_is_cut_off_at_the_frame_timeout() {
    let s = StoreServer::bind(
        "127.0.0.1:0",
        ServerOptions {
            handshake_timeout: DEADLINE,
            frame_timeout: DEADLINE,
            ..Default::default()
        },
    )
    .unwrap();
    let addr = s.local_addr().to_string();
    let good = connect(&addr, None);
    let mut raw = TcpStream::connect(&addr).unwrap();
    raw.write_all(&Request::Hello { token: vec![] }.encode())
        .unwrap();
    assert_eq!(read_reply(&mut raw), Some(Response::Ok));
    // Idle past both timeouts: still served.
    std::thread::sleep(DEADLINE + Duration::from_millis(500));
    raw.write_all(&Request::Ping.encode()).unwrap();
    assert_eq!(read_reply(&mut raw), Some(Response::Ok));

    // 22 bytes at one per 200 ms would take 4.4 s; the frame timeout is 1 s.
    let set = Request::Set {
        key: b"key".to_vec(),
        value: b"value".to_vec(),
    }
    .encode();
    assert_eq!(set.len(), 22);
    let start = Instant::now();
    let watcher = watch(raw.try_clone().unwrap(), start);
    let sender = {
        let raw = raw.try_clone().unwrap();
        let set = set.clone();
        std::thread::spawn(move || dribble(raw, set, Duration::from_millis(200)))
    };
    let (reply, closed, after) = watcher.join().unwrap();
    assert_timeout_reply(&reply, "frame timeout");
    assert!(closed);
    assert!(
        after >= Duration::from_millis(900) && after < Duration::from_secs(3),
        "closed {after:?} after the first byte"
    );
    assert!(sender.join().unwrap() < set.len());
    // Not a handshake timeout; the partial set never happened.
    assert_eq!(s.handshakes_timed_out(), 0);
    assert_eq!(good.try_get("key").unwrap(), None);
    good.ping().unwrap();
}

/// (c) With a cap of 4, a fifth connection is refused at once with the
/// reason; clients already connected keep working; once one of them
/// closes, a new connection is accepted (and a client that was retrying
/// gets in).
#[test]
fn connection_cap_refuses_one_past_it_and_admits_again_after_a_close() {
    const CAP: usize = 4;
    let s = StoreServer::bind(
        "127.0.0.1:0",
        ServerOptions {
            max_connections: CAP,
            ..Default::default()
        },
    )
    .unwrap();
    let addr = s.local_addr().to_string();
    let mut clients: Vec<StoreClient> = (0..CAP).map(|_| connect(&addr, None)).collect();
    assert_eq!(s.num_connections(), CAP);

    // Connection CAP + 1: refused at once, with the reason, then closed.
    let start = Instant::now();
    let mut extra = TcpStream::connect(&addr).unwrap();
    let reply = read_reply(&mut extra);
    assert!(start.elapsed() < Duration::from_secs(2));
    match &reply {
        Some(Response::Error {
            code: ErrorCode::TooManyConnections,
            message,
        }) => assert!(
            message.contains("refused connection from 127.0.0.1:")
                && message.contains("4 connections open (the cap)")
                && message.contains("BRAID_STORE_MAX_CONNECTIONS"),
            "{message}"
        ),
        other => panic!("expected TooManyConnections, got {other:?}"),
    }
    assert!(wait_closed(&mut extra));
    assert_eq!(s.refused_connections(), 1);
    assert_eq!(s.num_connections(), CAP);

    // A real client past the cap is told why, every time (its hello races
    // the server's close; the refusal must still be what it reports).
    for _ in 0..20 {
        let err = StoreClient::connect(
            &addr,
            ClientOptions {
                connect_timeout: Duration::from_millis(1),
                ..Default::default()
            },
        )
        .err()
        .expect("the server is full");
        assert!(
            matches!(err, StoreError::Refused { .. })
                && err.to_string().contains("connections open (the cap)"),
            "{err}"
        );
    }
    assert_eq!(s.refused_connections(), 21);

    // Everyone already connected is unaffected.
    for (i, c) in clients.iter().enumerate() {
        c.set(&format!("k{i}"), b"v").unwrap();
    }
    assert_eq!(clients[0].num_keys().unwrap(), CAP as u64);

    // A client that keeps retrying gets in once a slot frees up.
    let retrying = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            StoreClient::connect(
                &addr,
                ClientOptions {
                    connect_timeout: Duration::from_secs(20),
                    ..Default::default()
                },
            )
        })
    };
    wait_until(
        "the retrying client is refused",
        Duration::from_secs(5),
        || s.refused_connections() > 21,
    );
    drop(clients.pop());
    let late = retrying.join().unwrap().expect("admitted after a close");
    late.set("late", b"1").unwrap();
    assert_eq!(s.num_connections(), CAP);

    // And again with a raw connection once another client leaves.
    drop(clients.pop());
    wait_until("a slot is freed", Duration::from_secs(5), || {
        s.num_connections() < CAP
    });
    let mut raw = TcpStream::connect(&addr).unwrap();
    raw.write_all(&Request::Ping.encode()).unwrap();
    assert_eq!(read_reply(&mut raw), Some(Response::Ok));
    assert_eq!(clients[0].get("late").unwrap(), b"1");
}
