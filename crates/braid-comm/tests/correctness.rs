//! Every operation × dtype × reduce op × world size 1–8 × awkward sizes, on
//! shm, tcp and hierarchical backends, checked element by element against a
//! reference computed independently on each rank.

mod common;

use braid_comm::BackendKind;
use common::{run_world, WorldSpec};

fn check(n: usize, backend: BackendKind) {
    let results = run_world(WorldSpec::new(n, backend), |c| {
        let name = c.backend_name();
        braid_comm::verify::everything(&c).unwrap();
        name
    });
    let want = match (backend, n) {
        (BackendKind::Hier, 1) => "shm",
        (BackendKind::Hier, _) => "hier",
        (BackendKind::Shm, _) => "shm",
        _ => "tcp",
    };
    assert!(
        results.iter().all(|b| *b == want),
        "backends used: {results:?}"
    );
}

macro_rules! world_tests {
    ($($name:ident: $n:expr, $backend:expr;)*) => {
        $(#[test] fn $name() { check($n, $backend); })*
    };
}

world_tests! {
    shm_1: 1, BackendKind::Shm;
    shm_2: 2, BackendKind::Shm;
    shm_3: 3, BackendKind::Shm;
    shm_4: 4, BackendKind::Shm;
    shm_5: 5, BackendKind::Shm;
    shm_6: 6, BackendKind::Shm;
    shm_7: 7, BackendKind::Shm;
    shm_8: 8, BackendKind::Shm;
    tcp_1: 1, BackendKind::Tcp;
    tcp_2: 2, BackendKind::Tcp;
    tcp_3: 3, BackendKind::Tcp;
    tcp_4: 4, BackendKind::Tcp;
    tcp_5: 5, BackendKind::Tcp;
    tcp_6: 6, BackendKind::Tcp;
    tcp_7: 7, BackendKind::Tcp;
    tcp_8: 8, BackendKind::Tcp;
    hier_2: 2, BackendKind::Hier;
    hier_3: 3, BackendKind::Hier;
    hier_4: 4, BackendKind::Hier;
    hier_5: 5, BackendKind::Hier;
    hier_6: 6, BackendKind::Hier;
    hier_7: 7, BackendKind::Hier;
    hier_8: 8, BackendKind::Hier;
}
