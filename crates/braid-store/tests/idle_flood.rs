//! (a) A flood of 5,000 idle TCP connections: the server's threads stay
//! bounded by its connection cap, the connections past it are refused with
//! the reason, and real clients keep doing set/get/wait throughout.
//!
//! This is a test binary of its own, so that it runs in a process of its
//! own and `/proc/self/task` counts only its threads and its server's.

mod common;

use braid_store::protocol::{ErrorCode, Response};
use braid_store::{ClientOptions, ServerOptions, StoreClient, StoreError, StoreServer};
use common::{connect, read_reply, wait_until};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Idle connections opened, when the file-descriptor limit allows.
const IDLE: usize = 5000;
/// The server's cap in this test (the default is larger, 4096).
const CAP: usize = 1024;
/// Descriptors left for everything else (the harness, the real clients).
const SPARE_FDS: usize = 256;

/// Threads of this process.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// Raises this process's soft limit on open files towards `want` (at most
/// to the hard limit) and returns the soft limit then in force.
#[cfg(all(
    target_os = "linux",
    any(
        target_arch = "x86_64",
        target_arch = "aarch64",
        target_arch = "riscv64",
        target_arch = "powerpc64",
        target_arch = "s390x"
    )
))]
fn raise_fd_limit(want: u64) -> u64 {
    // `struct rlimit` on these 64-bit Linux targets: two 64-bit `rlim_t`s.
    #[repr(C)]
    struct RLimit {
        cur: u64,
        max: u64,
    }
    const RLIMIT_NOFILE: i32 = 7;
    extern "C" {
        fn getrlimit(resource: i32, rlim: *mut RLimit) -> i32;
        fn setrlimit(resource: i32, rlim: *const RLimit) -> i32;
    }
    let mut lim = RLimit { cur: 0, max: 0 };
    // SAFETY: `getrlimit` only writes a `struct rlimit` through the pointer,
    // which points to one, laid out as the C struct (`repr(C)`, two u64s),
    // that lives for the whole call; the C library std links provides it.
    if unsafe { getrlimit(RLIMIT_NOFILE, &mut lim) } != 0 {
        return 1024;
    }
    if lim.cur < want {
        let raised = RLimit {
            cur: want.min(lim.max),
            max: lim.max,
        };
        // SAFETY: as above; `setrlimit` only reads the struct, which lives
        // for the call. Raising the soft limit up to the hard one is always
        // permitted and affects only this (test) process.
        if unsafe { setrlimit(RLIMIT_NOFILE, &raised) } == 0 {
            lim.cur = raised.cur;
        }
    }
    lim.cur
}

/// Elsewhere: assume the common default soft limit and size the test to it.
#[cfg(not(all(
    target_os = "linux",
    any(
        target_arch = "x86_64",
        target_arch = "aarch64",
        target_arch = "riscv64",
        target_arch = "powerpc64",
        target_arch = "s390x"
    )
)))]
fn raise_fd_limit(_want: u64) -> u64 {
    1024
}

#[test]
fn five_thousand_idle_connections_leave_threads_bounded_and_clients_working() {
    // Each idle connection accepted costs two descriptors in this process
    // (the client's socket and the server's), each refused one only the
    // client's. If the hard limit is too low for 5,000, the test shrinks the
    // flood, and the cap with it, to what fits (and says so): it still shows
    // threads bounded by the cap while connections exceed it many times.
    let want = (IDLE + CAP + SPARE_FDS) as u64;
    let limit = raise_fd_limit(want) as usize;
    let (idle, cap) = if limit as u64 >= want {
        (IDLE, CAP)
    } else {
        let budget = limit.saturating_sub(SPARE_FDS);
        let cap = (budget / 5).max(8);
        eprintln!(
            "open-file limit {limit} is below {want}: flooding with {} connections against a cap of {cap}",
            budget - cap
        );
        (budget - cap, cap)
    };
    assert!(
        idle > 2 * cap,
        "too few descriptors ({limit}) for this test"
    );

    let baseline = threads();
    let server = StoreServer::bind(
        "127.0.0.1:0",
        ServerOptions {
            max_connections: cap,
            // Long enough that no idle connection is dropped during the test:
            // the cap alone bounds the threads here.
            handshake_timeout: Duration::from_secs(120),
            ..Default::default()
        },
    )
    .unwrap();
    let addr = server.local_addr().to_string();

    // Real clients, connected before the flood: three looping over
    // set/get/wait/add, one blocked in a long get for the whole flood, and
    // one the test drives.
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..3)
        .map(|i| {
            let c = connect(&addr, None);
            let (stop, ops) = (stop.clone(), ops.clone());
            std::thread::spawn(move || {
                let key = format!("worker/{i}");
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    c.set(&key, n.to_string()).unwrap();
                    assert_eq!(c.get(&key).unwrap(), n.to_string().as_bytes());
                    c.wait(&[&key, "ready"], Duration::from_secs(10)).unwrap();
                    c.add("ops", 1).unwrap();
                    ops.fetch_add(1, Ordering::Relaxed);
                    n += 1;
                }
                n
            })
        })
        .collect();
    let waiter = {
        let c = connect(&addr, None);
        std::thread::spawn(move || c.get_timeout("after-flood", Duration::from_secs(60)))
    };
    let main = connect(&addr, None);
    main.set("ready", b"").unwrap();
    const REAL: usize = 5;
    wait_until(
        "the real clients are connected",
        Duration::from_secs(10),
        || server.num_connections() == REAL,
    );
    // Beyond the baseline: the accept thread, one server thread per real
    // client, the three workers' threads and the waiter's.
    let real_threads = baseline + 1 + REAL + 3 + 1;

    // The flood: connections that never send a byte. It is paced to keep
    // at most 64 waiting to be accepted: std's listeners have a backlog of
    // 128, and a connect loop that outran the accept thread would only
    // wait out 1 s SYN retransmissions, which makes the test slow, not
    // stronger.
    let total = idle + REAL;
    let handled = || server.num_connections() + server.refused_connections() as usize;
    let mut flood = Vec::with_capacity(idle);
    for i in 0..idle {
        flood.push(TcpStream::connect(&addr).unwrap());
        wait_until(
            "the accept thread keeps up",
            Duration::from_secs(30),
            || REAL + i < handled() + 64,
        );
    }
    wait_until(
        "every flood connection is accepted or refused",
        Duration::from_secs(30),
        || handled() >= total,
    );
    assert_eq!(server.num_connections(), cap);
    assert_eq!(server.refused_connections() as usize, total - cap);
    let during = threads();
    assert!(
        during <= real_threads + cap - REAL + 8,
        "{during} threads with {idle} idle connections and a cap of {cap} (baseline {baseline})"
    );

    // The real clients kept working while the flood is held open.
    let before = ops.load(Ordering::Relaxed);
    wait_until(
        "the real clients make progress during the flood",
        Duration::from_secs(20),
        || ops.load(Ordering::Relaxed) >= before + 100,
    );
    main.set("during", b"1").unwrap();
    assert_eq!(main.get("during").unwrap(), b"1");

    // A newcomer is refused while the cap is full, and told why; so was the
    // last flood connection.
    let err = StoreClient::connect(
        &addr,
        ClientOptions {
            connect_timeout: Duration::from_millis(300),
            ..Default::default()
        },
    )
    .err()
    .expect("the cap is full");
    assert!(
        matches!(err, StoreError::Refused { .. })
            && err
                .to_string()
                .contains(&format!("{cap} connections open (the cap)")),
        "{err}"
    );
    let last = flood.last_mut().unwrap();
    assert!(
        matches!(
            read_reply(last),
            Some(Response::Error {
                code: ErrorCode::TooManyConnections,
                ..
            })
        ),
        "the refused connection was not told why"
    );

    // The long get, blocked through the whole flood, is answered.
    main.set("after-flood", b"done").unwrap();
    assert_eq!(waiter.join().unwrap().unwrap(), b"done");

    // Closing the flood frees the slots and their threads.
    drop(flood);
    wait_until(
        "the flood's slots are freed",
        Duration::from_secs(30),
        || server.num_connections() == REAL - 1,
    );
    wait_until("the flood's threads end", Duration::from_secs(30), || {
        threads() <= real_threads
    });
    let late = connect(&addr, None);
    late.ping().unwrap();

    stop.store(true, Ordering::Relaxed);
    for w in workers {
        assert!(w.join().unwrap() > 0);
    }
    assert!(main.add("ops", 0).unwrap() >= 100);
    drop(server);
}
