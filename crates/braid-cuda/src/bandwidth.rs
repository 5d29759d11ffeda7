//! Measured copy bandwidth and latency between every pair of GPUs (with
//! peer access off and on) and between host and device — the course's
//! "measure NVLink vs PCIe bandwidth" exercise, as `braid topo` prints it.
//!
//! Each figure times `reps` back-to-back copies with CUDA events on a stream
//! of the source GPU, after one untimed warm-up copy. With peer access off
//! the driver stages GPU→GPU copies through host memory; with it on they go
//! over NVLink or PCIe peer-to-peer directly.

use crate::driver::{Device, Event, Stream};
use crate::error::Result;
use crate::memory::{copy_peer_async, DeviceBuffer, PinnedBuffer};
use serde::Serialize;

/// What to measure.
#[derive(Debug, Clone, Copy)]
pub struct MeasureOptions {
    /// Bytes per bandwidth copy.
    pub bytes: usize,
    /// Timed copies per figure.
    pub reps: usize,
    /// Timed small copies per latency figure.
    pub latency_reps: usize,
}

impl Default for MeasureOptions {
    fn default() -> Self {
        MeasureOptions {
            bytes: 64 << 20,
            reps: 10,
            latency_reps: 200,
        }
    }
}

/// The measured matrices: `[src][dst]`, GB/s (10^9 bytes/s) and µs.
#[derive(Debug, Clone, Serialize)]
pub struct Measured {
    /// Bytes per bandwidth copy.
    pub bytes: usize,
    /// Unidirectional copy bandwidth with peer access off.
    pub bandwidth_peer_off_gbs: Vec<Vec<f64>>,
    /// With peer access on; `None` where the pair cannot access each other.
    pub bandwidth_peer_on_gbs: Vec<Vec<Option<f64>>>,
    /// One small (4-byte) copy's latency with peer access off.
    pub latency_peer_off_us: Vec<Vec<f64>>,
    /// With peer access on.
    pub latency_peer_on_us: Vec<Vec<Option<f64>>>,
    /// Pinned host → device bandwidth per GPU.
    pub host_to_device_gbs: Vec<f64>,
    /// Device → pinned host bandwidth per GPU.
    pub device_to_host_gbs: Vec<f64>,
}

/// A `[src][dst]` matrix with gaps where a pair was not measured.
type Matrix = Vec<Vec<Option<f64>>>;

struct Timer {
    start: Event,
    stop: Event,
}

impl Timer {
    fn new(d: &Device) -> Result<Timer> {
        Ok(Timer {
            start: Event::timed(d)?,
            stop: Event::timed(d)?,
        })
    }

    /// Seconds per repetition of `f` on `stream`, after one warm-up.
    fn time(&self, stream: &Stream, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        f()?;
        self.start.record(stream)?;
        for _ in 0..reps {
            f()?;
        }
        self.stop.record(stream)?;
        self.stop.synchronize()?;
        Ok(self.stop.elapsed_ms(&self.start)? as f64 / 1e3 / reps.max(1) as f64)
    }
}

fn set_peer(devs: &[Device], on: bool) -> Result<()> {
    for a in devs {
        for b in devs {
            if a.ordinal() == b.ordinal() || !a.can_access_peer(b)? {
                continue;
            }
            if on {
                a.enable_peer_access(b)?;
            } else {
                a.disable_peer_access(b)?;
            }
        }
    }
    Ok(())
}

fn pair_matrices(
    devs: &[Device],
    bufs: &[DeviceBuffer<u8>],
    opts: &MeasureOptions,
    only: impl Fn(usize, usize) -> Result<bool>,
) -> Result<(Matrix, Matrix)> {
    let n = devs.len();
    let mut bw = vec![vec![None; n]; n];
    let mut lat = vec![vec![None; n]; n];
    for (i, src) in devs.iter().enumerate() {
        let stream = Stream::new(src)?;
        let timer = Timer::new(src)?;
        for (j, dst) in devs.iter().enumerate() {
            if !only(i, j)? {
                continue;
            }
            // Same-GPU copies use the second half of the buffer as target.
            let half = opts.bytes;
            let (dst_ptr, src_ptr) = if i == j {
                (bufs[j].ptr_at(half), bufs[i].device_ptr())
            } else {
                (bufs[j].device_ptr(), bufs[i].device_ptr())
            };
            let t = timer.time(&stream, opts.reps, || {
                copy_peer_async(dst_ptr, dst, src_ptr, src, opts.bytes, &stream)
            })?;
            bw[i][j] = Some(opts.bytes as f64 / t / 1e9);
            let t = timer.time(&stream, opts.latency_reps, || {
                copy_peer_async(dst_ptr, dst, src_ptr, src, 4, &stream)
            })?;
            lat[i][j] = Some(t * 1e6);
        }
    }
    Ok((bw, lat))
}

/// Measures every matrix for `devs` (all GPUs of the host, usually).
pub fn measure(devs: &[Device], opts: &MeasureOptions) -> Result<Measured> {
    let bufs = devs
        .iter()
        .map(|d| DeviceBuffer::<u8>::zeros(d, opts.bytes * 2))
        .collect::<Result<Vec<_>>>()?;

    set_peer(devs, false)?;
    let (off_bw, off_lat) = pair_matrices(devs, &bufs, opts, |_, _| Ok(true))?;
    set_peer(devs, true)?;
    let (on_bw, on_lat) = pair_matrices(devs, &bufs, opts, |i, j| {
        Ok(i == j || devs[i].can_access_peer(&devs[j])?)
    })?;
    set_peer(devs, false)?;

    let mut h2d = Vec::new();
    let mut d2h = Vec::new();
    for (d, buf) in devs.iter().zip(&bufs) {
        let stream = Stream::new(d)?;
        let timer = Timer::new(d)?;
        let mut host = PinnedBuffer::<u8>::zeros(d, opts.bytes * 2)?;
        let mut dev = DeviceBuffer::<u8>::zeros(d, opts.bytes * 2)?;
        let t = timer.time(&stream, opts.reps, || {
            host.copy_to_device_async(&mut dev, &stream)
        })?;
        h2d.push((opts.bytes * 2) as f64 / t / 1e9);
        let t = timer.time(&stream, opts.reps, || {
            host.copy_from_device_async(buf, &stream)
        })?;
        d2h.push((opts.bytes * 2) as f64 / t / 1e9);
    }
    let unwrap = |m: Vec<Vec<Option<f64>>>| -> Vec<Vec<f64>> {
        m.into_iter()
            .map(|r| r.into_iter().map(|v| v.unwrap_or(0.0)).collect())
            .collect()
    };
    Ok(Measured {
        bytes: opts.bytes,
        bandwidth_peer_off_gbs: unwrap(off_bw),
        bandwidth_peer_on_gbs: on_bw,
        latency_peer_off_us: unwrap(off_lat),
        latency_peer_on_us: on_lat,
        host_to_device_gbs: h2d,
        device_to_host_gbs: d2h,
    })
}

/// The measured matrices as text tables.
pub fn render(m: &Measured) -> String {
    use std::fmt::Write;
    let n = m.host_to_device_gbs.len();
    let mut s = String::new();
    let table = |s: &mut String, title: &str, cell: &dyn Fn(usize, usize) -> String| {
        let _ = writeln!(s, "\n{title}");
        let _ = write!(s, "{:>8}", "src\\dst");
        for j in 0..n {
            let _ = write!(s, "{:>10}", format!("GPU{j}"));
        }
        let _ = writeln!(s);
        for i in 0..n {
            let _ = write!(s, "{:>8}", format!("GPU{i}"));
            for j in 0..n {
                let _ = write!(s, "{:>10}", cell(i, j));
            }
            let _ = writeln!(s);
        }
    };
    let mb = m.bytes as f64 / (1 << 20) as f64;
    let f = |v: f64| format!("{v:.1}");
    let o = |v: Option<f64>| v.map(f).unwrap_or_else(|| "-".into());
    table(
        &mut s,
        &format!("Copy bandwidth, GB/s ({mb:.0} MiB copies), peer access OFF"),
        &|i, j| f(m.bandwidth_peer_off_gbs[i][j]),
    );
    table(
        &mut s,
        &format!("Copy bandwidth, GB/s ({mb:.0} MiB copies), peer access ON"),
        &|i, j| o(m.bandwidth_peer_on_gbs[i][j]),
    );
    let f2 = |v: f64| format!("{v:.2}");
    table(
        &mut s,
        "Copy latency, µs (4-byte copies), peer access OFF",
        &|i, j| f2(m.latency_peer_off_us[i][j]),
    );
    table(
        &mut s,
        "Copy latency, µs (4-byte copies), peer access ON",
        &|i, j| {
            m.latency_peer_on_us[i][j]
                .map(f2)
                .unwrap_or_else(|| "-".into())
        },
    );
    let _ = writeln!(
        s,
        "\nHost <-> device (pinned, {:.0} MiB copies), GB/s",
        mb * 2.0
    );
    let _ = writeln!(s, "{:>8}{:>10}{:>10}", "", "H2D", "D2H");
    for i in 0..n {
        let _ = writeln!(
            s,
            "{:>8}{:>10.1}{:>10.1}",
            format!("GPU{i}"),
            m.host_to_device_gbs[i],
            m.device_to_host_gbs[i]
        );
    }
    s
}
