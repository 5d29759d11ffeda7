//! Two "hosts" with different addresses: network namespaces joined by a
//! veth pair, one launcher in each. Needs root and iproute2; otherwise the
//! test says it was skipped and why.

mod common;

use common::*;
use std::io::Write;
use std::process::Command;
use std::time::Duration;

/// Two network namespaces `a` and `b` joined by a veth pair; removed on drop.
struct TwoHosts {
    a: String,
    b: String,
    addr_a: String,
}

impl TwoHosts {
    /// `which` tells apart the host pairs of tests running at once.
    fn create(which: u32) -> Result<TwoHosts, String> {
        let id = std::process::id();
        let (a, b) = (
            format!("braid-{id}-{which}a"),
            format!("braid-{id}-{which}b"),
        );
        let (va, vb) = (
            format!("bv{}{which}a", id % 10_000),
            format!("bv{}{which}b", id % 10_000),
        );
        let subnet = format!("10.{}.{}", 231 + which, id % 250);
        let hosts = TwoHosts {
            a: a.clone(),
            b: b.clone(),
            addr_a: format!("{subnet}.1"),
        };
        let steps: Vec<Vec<String>> = vec![
            vec!["netns".into(), "add".into(), a.clone()],
            vec!["netns".into(), "add".into(), b.clone()],
            vec![
                "link".into(),
                "add".into(),
                va.clone(),
                "type".into(),
                "veth".into(),
                "peer".into(),
                "name".into(),
                vb.clone(),
            ],
            vec![
                "link".into(),
                "set".into(),
                va.clone(),
                "netns".into(),
                a.clone(),
            ],
            vec![
                "link".into(),
                "set".into(),
                vb.clone(),
                "netns".into(),
                b.clone(),
            ],
            vec![
                "-n".into(),
                a.clone(),
                "addr".into(),
                "add".into(),
                format!("{subnet}.1/24"),
                "dev".into(),
                va.clone(),
            ],
            vec![
                "-n".into(),
                b.clone(),
                "addr".into(),
                "add".into(),
                format!("{subnet}.2/24"),
                "dev".into(),
                vb.clone(),
            ],
            vec![
                "-n".into(),
                a.clone(),
                "link".into(),
                "set".into(),
                va,
                "up".into(),
            ],
            vec![
                "-n".into(),
                b.clone(),
                "link".into(),
                "set".into(),
                vb,
                "up".into(),
            ],
            vec![
                "-n".into(),
                a.clone(),
                "link".into(),
                "set".into(),
                "lo".into(),
                "up".into(),
            ],
            vec![
                "-n".into(),
                b.clone(),
                "link".into(),
                "set".into(),
                "lo".into(),
                "up".into(),
            ],
        ];
        for step in steps {
            let out = Command::new("ip")
                .args(&step)
                .output()
                .map_err(|e| format!("cannot run `ip`: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "`ip {}` failed: {}",
                    step.join(" "),
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
        }
        Ok(hosts)
    }

    fn launcher(&self, ns: &str, node_rank: usize, port: &str, program: &[&str]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args([
            "netns",
            "exec",
            ns,
            env!("CARGO_BIN_EXE_braid"),
            "launch",
            "--nnodes",
            "2",
        ])
        .args([
            "--node-rank",
            &node_rank.to_string(),
            "--master-addr",
            &self.addr_a,
            "--master-port",
            port,
        ])
        .args(["--nproc-per-node", "2", "--rdzv-timeout", "20", "--"])
        .args(program)
        .env_remove("BRAID_STORE_TOKEN")
        .env_remove("BRAID_BACKEND");
        cmd
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

fn skip(why: &str) {
    // Written past the test harness's capture so that it shows in the log.
    let _ = writeln!(std::io::stderr(), "netns test skipped: {why}");
}

/// Two namespaced hosts, or `None` after saying why the test is skipped.
fn two_hosts(id: u32) -> Option<TwoHosts> {
    if !nix::unistd::geteuid().is_root() {
        skip("not running as root (network namespaces need CAP_NET_ADMIN)");
        return None;
    }
    match TwoHosts::create(id) {
        Ok(h) => Some(h),
        Err(e) => {
            skip(&e);
            None
        }
    }
}

#[test]
fn launchers_on_two_network_hosts_form_one_world() {
    let Some(hosts) = two_hosts(0) else { return };
    let hello = example("hello");
    let hello = hello.to_str().unwrap();
    let n0 = start(hosts.launcher(&hosts.a, 0, "29500", &[hello]));
    let n1 = start(hosts.launcher(&hosts.b, 1, "29500", &[hello]));
    let (f0, f1) = (
        n0.finish(Duration::from_secs(40)),
        n1.finish(Duration::from_secs(40)),
    );
    assert_eq!((f0.code, f1.code), (Some(0), Some(0)), "{f0:?}\n{f1:?}");
    assert!(
        f0.stderr.contains("node 0/2 starts ranks 0..1 of 4"),
        "{}",
        f0.stderr
    );
    assert!(
        f1.stderr.contains("node 1/2 starts ranks 2..3 of 4"),
        "{}",
        f1.stderr
    );
    assert!(
        f1.stderr
            .contains(&format!("store at {}:29500", hosts.addr_a)),
        "{}",
        f1.stderr
    );
    for f in [&f0, &f1] {
        assert_eq!(
            f.stdout
                .matches("after all_reduce: 6 (expected 6) ok")
                .count(),
            2,
            "{f:?}"
        );
    }
}

#[test]
fn collectives_across_two_network_hosts_use_the_hierarchical_backend() {
    let Some(hosts) = two_hosts(1) else { return };
    let braid = env!("CARGO_BIN_EXE_braid");
    let n0 = start(hosts.launcher(&hosts.a, 0, "29501", &[braid, "verify"]));
    let n1 = start(hosts.launcher(&hosts.b, 1, "29501", &[braid, "verify"]));
    let (f0, f1) = (
        n0.finish(Duration::from_secs(60)),
        n1.finish(Duration::from_secs(60)),
    );
    assert_eq!((f0.code, f1.code), (Some(0), Some(0)), "{f0:?}\n{f1:?}");
    for f in [&f0, &f1] {
        assert_eq!(
            f.stdout
                .matches("/4: every collective verified on the hier backend")
                .count(),
            2,
            "{f:?}"
        );
    }
}
