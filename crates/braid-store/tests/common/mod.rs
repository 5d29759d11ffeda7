//! Helpers shared by the store's test binaries (raw-socket replies and
//! closes, clients, polling).

#![allow(dead_code)] // Each test binary uses a different subset.

use braid_store::protocol::{self, Response};
use braid_store::{ClientOptions, StoreClient};
use std::io::Read;
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Reads one reply frame (waiting up to 5 s); `None` if there is none.
pub fn read_reply(stream: &mut TcpStream) -> Option<Response> {
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let body = protocol::read_frame(stream, 1 << 20).ok()?;
    Response::decode(&body).ok()
}

/// Reads until the server closes the connection (or 5 s pass).
pub fn wait_closed(stream: &mut TcpStream) -> bool {
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// A client with a 10 s operation timeout (and `token`, if any).
pub fn connect(addr: &str, token: Option<&str>) -> StoreClient {
    StoreClient::connect(
        addr,
        ClientOptions {
            timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            token: token.map(str::to_string),
            ..Default::default()
        },
    )
    .unwrap()
}

/// Polls `done` every 10 ms until it holds; panics naming `what` after
/// `limit`.
pub fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < limit,
            "gave up after {limit:?} waiting until {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
