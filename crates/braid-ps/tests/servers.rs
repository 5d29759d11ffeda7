//! Servers and workers over real TCP on this host, in threads: the
//! synchronous modes against the same arithmetic in one process, bounded
//! staleness held to its bound, and the errors a worker meets named.

use braid_model::optim::{AdamWConfig, Optimizer};
use braid_model::{GptConfig, Layout, Params};
use braid_ps::wire::Encoding;
use braid_ps::{Client, Mode, Server, ServerConfig, ServerReport, Shards, UpdateAt};
use std::sync::{Arc, Barrier};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

fn layout() -> Layout {
    Layout::new(&GptConfig::parse("L1-H2-C8-V16-T4").unwrap())
}

/// A worker's gradient of a step: different per worker, step and element.
fn grad(worker: usize, step: u64, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + worker * 13 + step as usize * 3) % 17) as f32 * 0.01 - 0.08)
        .collect()
}

fn servers(
    n: usize,
    workers: usize,
    mode: Mode,
    update_at: UpdateAt,
    timeout: Duration,
    description: &str,
) -> (Vec<String>, Vec<JoinHandle<Result<ServerReport, String>>>) {
    let layout = layout();
    let shards = Shards::balanced(layout.len, n).unwrap();
    let mut addrs = Vec::new();
    let mut handles = Vec::new();
    for s in 0..n {
        let shard = shards.range(s);
        let optimizer = (update_at == UpdateAt::Server).then(|| {
            Optimizer::adamw_shard(
                &layout,
                AdamWConfig::default(),
                std::slice::from_ref(&shard),
            )
        });
        let server = Server::bind(
            "127.0.0.1:0",
            ServerConfig {
                index: s,
                workers,
                len: layout.len,
                shard,
                mode,
                update_at,
                optimizer,
                description: description.into(),
                timeout,
                restored: None,
                compensation: None,
            },
        )
        .unwrap();
        addrs.push(server.local_addr().unwrap().to_string());
        handles.push(std::thread::spawn(move || server.run()));
    }
    (addrs, handles)
}

fn initial(layout: &Layout) -> Vec<f32> {
    Params::init_gpt2(Arc::new(layout.clone()), 5).data
}

/// What one process computes: AdamW on the sum of every worker's
/// gradients, `steps` times, scaled by 1/workers.
fn reference(workers: usize, steps: u64) -> Vec<f32> {
    let layout = layout();
    let mut p = Params {
        data: initial(&layout),
        layout: Arc::new(layout.clone()),
    };
    let mut opt = Optimizer::adamw(&layout, AdamWConfig::default());
    for step in 1..=steps {
        let mut sum = grad(0, step, layout.len);
        for w in 1..workers {
            for (a, b) in sum.iter_mut().zip(grad(w, step, layout.len)) {
                *a += b;
            }
        }
        opt.step_scaled(&mut p, &sum, 1e-2, 1.0 / workers as f32);
    }
    p.data
}

fn run_workers(addrs: &[String], workers: usize, steps: u64, update_at: UpdateAt) -> Vec<Vec<f32>> {
    let len = layout().len;
    let handles: Vec<_> = (0..workers)
        .map(|w| {
            let addrs = addrs.to_vec();
            std::thread::spawn(move || {
                let (mut c, joined) =
                    Client::connect(&addrs, w, workers, len, "test run", Duration::from_secs(20))
                        .unwrap();
                let mut params = vec![0f32; len];
                if w == 0 && !joined.initialized {
                    params = initial(&layout());
                    c.init(&params).unwrap();
                } else {
                    c.get_params(&mut params).unwrap();
                }
                let layout = layout();
                let mut opt = Optimizer::adamw(&layout, AdamWConfig::default());
                for step in 1..=steps {
                    let g = grad(w, step, len);
                    // Two buckets, back one first (as a backward pass).
                    let mid = len / 3;
                    c.push(step, mid..len, &g[mid..], Encoding::F32).unwrap();
                    c.push(step, 0..mid, &g[..mid], Encoding::F32).unwrap();
                    match update_at {
                        UpdateAt::Server => {
                            let n = c.get_norm(step).unwrap();
                            assert!(n > 0.0);
                            c.update(step, 1e-2, 1.0 / workers as f32, &mut params)
                                .unwrap();
                        }
                        UpdateAt::Worker => {
                            let mut sum = vec![0f32; len];
                            c.get_sum(step, &mut sum).unwrap();
                            let mut p = Params {
                                data: params,
                                layout: Arc::new(layout.clone()),
                            };
                            opt.step_scaled(&mut p, &sum, 1e-2, 1.0 / workers as f32);
                            params = p.data;
                        }
                    }
                }
                c.bye().unwrap();
                params
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn synchronous_steps_equal_one_process_with_either_side_updating() {
    for (servers_n, workers, update_at) in [
        (1, 2, UpdateAt::Server),
        (2, 3, UpdateAt::Server),
        (2, 3, UpdateAt::Worker),
        (3, 2, UpdateAt::Worker),
    ] {
        let (addrs, handles) = servers(
            servers_n,
            workers,
            Mode::Sync,
            update_at,
            Duration::from_secs(20),
            "test run",
        );
        let got = run_workers(&addrs, workers, 6, update_at);
        let want = reference(workers, 6);
        for (w, p) in got.iter().enumerate() {
            let d = max_diff(p, &want);
            assert!(
                d < 1e-6,
                "{servers_n} servers, worker {w} ({update_at}): {d}"
            );
        }
        for h in handles {
            let r = h.join().unwrap().unwrap();
            if update_at == UpdateAt::Server {
                assert_eq!(r.version, 6);
            }
            assert!(r.gone.is_empty());
        }
    }
}

#[test]
fn bounded_staleness_holds_a_fast_worker_to_its_bound() {
    // Worker 1 sleeps 60 ms a step; worker 0 does not. Under ssp:1 worker
    // 0 may finish step s only when worker 1 has finished s - 1.
    let workers = 2;
    let (addrs, handles) = servers(
        2,
        workers,
        Mode::Ssp(1),
        UpdateAt::Server,
        Duration::from_secs(20),
        "ssp",
    );
    let len = layout().len;
    let start = Arc::new(Barrier::new(workers));
    let clocks: Vec<_> = (0..workers)
        .map(|w| {
            let (addrs, start) = (addrs.clone(), start.clone());
            std::thread::spawn(move || {
                let (mut c, joined) =
                    Client::connect(&addrs, w, workers, len, "ssp", Duration::from_secs(20))
                        .unwrap();
                let mut params = vec![0f32; len];
                if w == 0 && !joined.initialized {
                    params = initial(&layout());
                    c.init(&params).unwrap();
                }
                c.get_params(&mut params).unwrap();
                start.wait();
                let t0 = Instant::now();
                let mut done = Vec::new();
                let mut stale = 0;
                for step in 1..=5u64 {
                    if w == 1 {
                        std::thread::sleep(Duration::from_millis(60));
                    }
                    let g = grad(w, step, len);
                    c.push(step, 0..len, &g, Encoding::F32).unwrap();
                    let (_, s) = c.update(step, 1e-3, 1.0, &mut params).unwrap();
                    stale = stale.max(s);
                    done.push(t0.elapsed());
                }
                c.bye().unwrap();
                (done, stale)
            })
        })
        .collect();
    let out: Vec<_> = clocks.into_iter().map(|h| h.join().unwrap()).collect();
    let (fast, slow) = (&out[0].0, &out[1].0);
    for s in 2..5 {
        // Fast's step s+1 (index s) ends after slow's step s (index s-1).
        assert!(
            fast[s] + Duration::from_millis(5) >= slow[s - 1],
            "step {}: the fast worker finished at {:?}, the slow one's step {} at {:?}",
            s + 1,
            fast[s],
            s,
            slow[s - 1]
        );
    }
    assert!(
        out[1].1 >= 1,
        "the slow worker's pushes land after the fast one's updates"
    );
    let mut total = braid_ps::Staleness::default();
    for h in handles {
        let r = h.join().unwrap().unwrap();
        assert_eq!(r.version, 10, "every push of both workers applied");
        total.add(&r.staleness);
    }
    assert_eq!(total.pushes, 20);
    assert!(total.max <= 3, "staleness {total:?}");
}

#[test]
fn a_missing_worker_is_named_and_a_foreign_run_refused() {
    let (addrs, handles) = servers(
        1,
        2,
        Mode::Sync,
        UpdateAt::Server,
        Duration::from_secs(2),
        "run A",
    );
    let len = layout().len;
    let err = Client::connect(&addrs, 1, 2, len, "run B", Duration::from_secs(5))
        .err()
        .unwrap();
    assert!(
        err.contains("parameter server 0") && err.contains("run B") && err.contains("same flags"),
        "{err}"
    );
    let (mut c, _) = Client::connect(&addrs, 0, 2, len, "run A", Duration::from_secs(5)).unwrap();
    let params = initial(&layout());
    c.init(&params).unwrap();
    c.push(1, 0..len, &grad(0, 1, len), Encoding::F32).unwrap();
    let t = Instant::now();
    let mut out = vec![0f32; len];
    let err = c.update(1, 1e-3, 1.0, &mut out).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(10));
    assert!(
        err.contains("worker 1 (never connected)") && err.contains("waited 2 s"),
        "{err}"
    );
    drop(c);
    let err = handles
        .into_iter()
        .next()
        .unwrap()
        .join()
        .unwrap()
        .unwrap_err();
    assert!(err.contains("never said goodbye"), "{err}");
}
