//! The GPU engine's flat-buffer operations past 2^31 elements: AdamW (with
//! its bf16 copy) and the global gradient norm over one buffer of
//! 2^31 + 3·2^20 + 4093 elements, checked against the same operations run
//! in chunks of 2^30 (bit for bit) and, for the norm, against a host sum.
//! Needs about 69 GB of GPU memory; without a GPU (CI) it says "skipped".

use braid_cuda::memory::copy_async;
use braid_cuda::{Device, DeviceBuffer, Stream};
use braid_model::cuda::mixed::{AdamSegments, AdamStep, MixedKernels};
use braid_model::cuda::Kernels;
use half::bf16;
use std::io::Write;

/// Elements of the large buffers: past 2^31, with a tail that is not a
/// multiple of any block size.
const N: usize = (1 << 31) + 3 * (1 << 20) + 4093;
/// Elements per chunk of the reference run (a multiple of the norm's
/// 65536-element partial sums, so its partials are the same).
const CHUNK: usize = 1 << 30;
/// The fill pattern's period: prime, so that an index off by a power of
/// two (a wrapped 32-bit index) reads a different value.
const PERIOD: usize = 10_000_019;

fn skip(why: &str) {
    let _ = writeln!(std::io::stderr(), "skipped: {why}");
}

/// The pattern: values in [-scale, scale) from a 64-bit LCG.
fn pattern(seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..PERIOD)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A device buffer of `N` elements holding `pat` repeated.
fn filled(dev: &Device, s: &Stream, pat: &[f32]) -> DeviceBuffer<f32> {
    let src = DeviceBuffer::from_host(dev, pat).unwrap();
    let mut buf = DeviceBuffer::<f32>::zeros(dev, N).unwrap();
    let mut at = 0;
    while at < N {
        let len = PERIOD.min(N - at);
        copy_async(&mut buf.view_mut(at..at + len), &src.view(0..len), s).unwrap();
        at += len;
    }
    s.synchronize().unwrap();
    buf
}

/// A copy of `src` on the device.
fn copy_of<T: braid_core::Element>(
    dev: &Device,
    s: &Stream,
    src: &DeviceBuffer<T>,
) -> DeviceBuffer<T> {
    let mut out = DeviceBuffer::<T>::zeros(dev, src.len()).unwrap();
    copy_async(&mut out, src, s).unwrap();
    s.synchronize().unwrap();
    out
}

/// The segments of the whole buffer: boundaries on both sides of 2^31,
/// decay alternating, so that the segment search runs past 32 bits.
fn segments() -> Vec<(usize, f32)> {
    let e = 1usize << 31;
    vec![
        (3, 0.1),
        (e - 7, 0.0),
        (e + 5, 0.1),
        (e + 1_000_000, 0.0),
        (N, 0.1),
    ]
}

/// The segments of `segs` inside `[a, b)`, relative to `a`.
fn clipped(segs: &[(usize, f32)], a: usize, b: usize) -> Vec<(usize, f32)> {
    let mut out = Vec::new();
    let mut start = 0;
    for &(end, d) in segs {
        if end > a && start < b {
            out.push((end.min(b) - a, d));
        }
        start = end;
    }
    out
}

/// The first index where `a` and `b` differ in their bits, if any,
/// comparing through host copies of 2^26 elements at a time.
fn first_difference<T: braid_core::Element + Copy>(
    dev: &Device,
    s: &Stream,
    a: &DeviceBuffer<T>,
    b: &DeviceBuffer<T>,
    bits: impl Fn(T) -> u32,
) -> Option<usize> {
    const PIECE: usize = 1 << 26;
    let mut at = 0;
    while at < a.len() {
        let len = PIECE.min(a.len() - at);
        let mut da = DeviceBuffer::<T>::zeros(dev, len).unwrap();
        let mut db = DeviceBuffer::<T>::zeros(dev, len).unwrap();
        copy_async(&mut da, &a.view(at..at + len), s).unwrap();
        copy_async(&mut db, &b.view(at..at + len), s).unwrap();
        s.synchronize().unwrap();
        let (ha, hb) = (da.to_vec().unwrap(), db.to_vec().unwrap());
        if let Some(i) = ha.iter().zip(&hb).position(|(x, y)| bits(*x) != bits(*y)) {
            return Some(at + i);
        }
        at += len;
    }
    None
}

#[test]
fn adamw_and_the_norm_past_2_31_elements_match_a_chunked_run() {
    if braid_cuda::device_count().unwrap_or(0) == 0 {
        return skip("no GPU");
    }
    let dev = Device::open(0).unwrap();
    let need = N * 32 + (1 << 30);
    let have = dev.total_memory().unwrap();
    if have < need {
        return skip(&format!(
            "needs {need} bytes of GPU memory, the GPU has {have}"
        ));
    }
    let s = dev.main_stream();
    let mk = MixedKernels::load(&dev).unwrap();
    let k = Kernels::load(&dev).unwrap();

    // The norm: whole buffer, chunks and the host's sum of the pattern.
    let gp = pattern(2, 1e-2);
    let g = filled(&dev, &s, &gp);
    let whole = k.global_norm(&s, &g).unwrap();
    let chunked = (0..N)
        .step_by(CHUNK)
        .map(|a| {
            k.global_norm(&s, &g.view(a..N.min(a + CHUNK)))
                .unwrap()
                .powi(2)
        })
        .sum::<f64>()
        .sqrt();
    let sq = |xs: &[f32]| xs.iter().map(|&x| x as f64 * x as f64).sum::<f64>();
    let host = ((N / PERIOD) as f64 * sq(&gp) + sq(&gp[..N % PERIOD])).sqrt();
    println!("norm of {N} elements: whole {whole}, in chunks {chunked}, host {host}");
    assert!(
        (whole - chunked).abs() <= 1e-12 * host,
        "{whole} vs {chunked}"
    );
    assert!(
        (whole - host).abs() <= 1e-6 * host,
        "{whole} vs host {host}"
    );

    // AdamW: two steps over the whole buffer, and the same in chunks.
    let segs = segments();
    let whole_segs = AdamSegments::from_ends(&dev, &segs).unwrap();
    let p0 = filled(&dev, &s, &pattern(1, 0.05));
    let (mut p, mut p_ref) = (copy_of(&dev, &s, &p0), p0);
    let mut m = DeviceBuffer::<f32>::zeros(&dev, N).unwrap();
    let mut v = DeviceBuffer::<f32>::zeros(&dev, N).unwrap();
    let mut pb = DeviceBuffer::<bf16>::zeros(&dev, N).unwrap();
    let mut m_ref = DeviceBuffer::<f32>::zeros(&dev, N).unwrap();
    let mut v_ref = DeviceBuffer::<f32>::zeros(&dev, N).unwrap();
    let mut pb_ref = DeviceBuffer::<bf16>::zeros(&dev, N).unwrap();
    for step in 1..=2 {
        let h = AdamStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            step,
            eps: 1e-8,
            grad_scale: 0.5,
        };
        mk.adamw_multi(
            &s,
            &mut p,
            Some(&mut pb),
            &g,
            &mut m,
            &mut v,
            &whole_segs,
            h,
        )
        .unwrap();
        for a in (0..N).step_by(CHUNK) {
            let b = N.min(a + CHUNK);
            let cs = AdamSegments::from_ends(&dev, &clipped(&segs, a, b)).unwrap();
            mk.adamw_multi(
                &s,
                &mut p_ref.view_mut(a..b),
                Some(&mut pb_ref.view_mut(a..b)),
                &g.view(a..b),
                &mut m_ref.view_mut(a..b),
                &mut v_ref.view_mut(a..b),
                &cs,
                h,
            )
            .unwrap();
        }
        s.synchronize().unwrap();
    }
    let f = |x: f32| x.to_bits();
    for (name, a, b) in [("p", &p, &p_ref), ("m", &m, &m_ref), ("v", &v, &v_ref)] {
        let d = first_difference(&dev, &s, a, b, f);
        assert_eq!(d, None, "AdamW's {name} differs from the chunked run");
    }
    let d = first_difference(&dev, &s, &pb, &pb_ref, |x: bf16| x.to_bits() as u32);
    assert_eq!(d, None, "AdamW's bf16 copy differs from the chunked run");
    // And it moved the last element (past 2^31).
    let mut last = DeviceBuffer::<f32>::zeros(&dev, 1).unwrap();
    copy_async(&mut last, &m.view(N - 1..N), &s).unwrap();
    s.synchronize().unwrap();
    assert_ne!(
        last.to_vec().unwrap()[0],
        0.0,
        "the last element's moment did not move"
    );
    println!("AdamW over {N} elements (2 steps): whole buffer = chunks of {CHUNK}, bit for bit");
}
