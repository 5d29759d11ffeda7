//! A measurement, not a check (ignored unless asked for by name): the
//! decode step's four products of a layer, run as a chain over many
//! layers' worth of weights (more than the L2 holds, as a model's are), at
//! a few rows, by each way the decoder can run them — cuBLASLt on its
//! heuristic's first choice, cuBLASLt timed over its offers, the skinny
//! kernel, the skinny kernel launched overlapping the product ahead, the
//! NT kernel over weights stored output by output (alone, overlapping
//! with each product started by its weights' size, the default, and
//! overlapping under each way of starting: the kernel behind released
//! before or after the wait, the weights asked for by line, in bulk or
//! not at all)
//! — each as microseconds a layer and the weights' bytes over that time;
//! then a layer's MLP half as four kernels and as one
//! (`MixedKernels::nt_mlp`); then the logits of a few rows by cuBLASLt and
//! by the NT kernel.
//! `bench/device/serve.sh products` runs it on a GPU:
//! `model-tests --ignored --nocapture decode_products_timed`.

use crate::cuda::mixed::{MixedKernels, NtMlp, NtPrefetch, NtStart, SkinnyScratch, SkinnyTo};
use braid_cuda::blas::Mat;
use braid_cuda::blaslt::{BlasLt, Epilogue, LtGemm};
use braid_cuda::{Device, DeviceBuffer, DeviceMem, Event, Stream};
use half::bf16;

/// How a chain's products run.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Way {
    Heuristic,
    Timed,
    Skinny,
    SkinnyOverlapped,
    Nt,
    NtOverlapped,
    /// Overlapped, started this way.
    NtOverlappedStarting(NtStart),
}

/// One model's layer: (input width, output width) of its four products.
fn layer(c: usize) -> [(usize, usize); 4] {
    [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)]
}

#[test]
#[ignore = "a measurement on a GPU: run by name"]
fn decode_products_timed() {
    if braid_cuda::device_count().unwrap_or(0) == 0 {
        eprintln!("skipped: no GPU");
        return;
    }
    let device = Device::open(0).unwrap();
    let s = Stream::new(&device).unwrap();
    for (model, c, layers) in [("124M", 768, 48), ("1558M", 1600, 12)] {
        let shapes = layer(c);
        let per_layer: usize = shapes.iter().map(|(k, n)| k * n).sum();
        // Distinct weights for every layer of the chain: 48 x 14 MB and
        // 12 x 61 MB, past the H100's 50 MB of L2.
        let weights = DeviceBuffer::<bf16>::zeros(&device, layers * per_layer).unwrap();
        let widest = 4 * c;
        let x = DeviceBuffer::<bf16>::zeros(&device, 8 * widest).unwrap();
        let bias = DeviceBuffer::<f32>::zeros(&device, widest).unwrap();
        let out = DeviceBuffer::<f32>::zeros(&device, 8 * widest).unwrap();
        let mut scratch = SkinnyScratch::new(&device, widest).unwrap();
        for rows in [1usize, 4, 8] {
            let mut line = format!("{model} rows {rows}:");
            for way in [
                Way::Heuristic,
                Way::Timed,
                Way::Skinny,
                Way::SkinnyOverlapped,
                Way::Nt,
                Way::NtOverlapped,
            ]
            .into_iter()
            .chain(
                [
                    (false, NtPrefetch::Lines),
                    (true, NtPrefetch::Lines),
                    (false, NtPrefetch::Bulk),
                    (true, NtPrefetch::Bulk),
                    (false, NtPrefetch::None),
                    (true, NtPrefetch::None),
                ]
                .map(|(release_first, prefetch)| {
                    Way::NtOverlappedStarting(NtStart {
                        release_first,
                        prefetch,
                    })
                }),
            ) {
                let mut mk = MixedKernels::load(&device).unwrap();
                mk.set_overlap(matches!(
                    way,
                    Way::SkinnyOverlapped | Way::NtOverlapped | Way::NtOverlappedStarting(_)
                ));
                if let Way::NtOverlappedStarting(start) = way {
                    mk.set_nt_start(Some(start));
                }
                let mut lt = BlasLt::new(&device).unwrap();
                lt.share_across_rows();
                if way == Way::Timed {
                    lt.time_any_offer_up_to(64);
                }
                let mut chain = |lt: &mut BlasLt| {
                    let mut at = 0;
                    for _ in 0..layers {
                        for &(k, n) in &shapes {
                            let w = weights.view(at..at + k * n);
                            at += k * n;
                            let a = x.view(0..rows * k);
                            let d = out.view(0..rows * n);
                            if matches!(
                                way,
                                Way::Nt | Way::NtOverlapped | Way::NtOverlappedStarting(_)
                            ) {
                                // (The same bytes read as [n, k].)
                                let to = SkinnyTo::F32 {
                                    out: (d.dptr(), d.dlen()),
                                    res: None,
                                };
                                let b = bias.view(0..n);
                                let b: Option<&dyn DeviceMem<f32>> = Some(&b);
                                let ran = mk.nt_product(&s, to, &a, &w, b, (rows, n, k));
                                assert!(ran.unwrap());
                            } else if matches!(way, Way::Skinny | Way::SkinnyOverlapped) {
                                let to = SkinnyTo::F32 {
                                    out: (d.dptr(), d.dlen()),
                                    res: None,
                                };
                                let b = bias.view(0..n);
                                let shape = (rows, n, k);
                                let ran =
                                    mk.skinny_product(&s, &mut scratch, to, &a, &w, &b, shape);
                                assert!(ran.unwrap());
                            } else {
                                let dm = Mat::of(&d, n);
                                lt.gemm(
                                    &s,
                                    &LtGemm {
                                        m: rows,
                                        n,
                                        k,
                                        a: Mat::of(&a, k),
                                        b: Mat::of(&w, n),
                                        c: dm,
                                        d: dm,
                                        epilogue: Epilogue::Bias {
                                            bias: (bias.dptr(), n),
                                        },
                                        alpha: 1.0,
                                        beta: 0.0,
                                    },
                                )
                                .unwrap();
                            }
                        }
                    }
                };
                // (The first run, untimed, makes the plans and times the
                // offers.)
                let ms = ms_per_run(&device, &s, || chain(&mut lt)) / layers as f64;
                let name = match way {
                    Way::NtOverlappedStarting(st) => format!(
                        "NtOverlapped[release {}, prefetch {:?}]",
                        if st.release_first { "first" } else { "after" },
                        st.prefetch
                    ),
                    other => format!("{other:?}"),
                };
                line += &entry(&name, ms, per_layer * 2);
            }
            eprintln!("{line}");
        }
        mlp_half_timed(&device, &s, model, c, layers);
        // The logits of a few rows against the tied embedding ([V, C]):
        // cuBLASLt reading it transposed, and the NT kernel.
        let vocab = 50_257;
        let wte = DeviceBuffer::<bf16>::zeros(&device, vocab * c).unwrap();
        let logits = DeviceBuffer::<f32>::zeros(&device, 8 * vocab).unwrap();
        let mk = MixedKernels::load(&device).unwrap();
        for rows in [1usize, 8] {
            let mut lt = BlasLt::new(&device).unwrap();
            lt.share_across_rows();
            let a = x.view(0..rows * c);
            let d = Mat::of(&logits.view(0..rows * vocab), vocab);
            let mut line = format!("{model} logits, rows {rows}:");
            for nt in [false, true] {
                let once = || {
                    if nt {
                        let to = SkinnyTo::F32 {
                            out: (logits.dptr(), rows * vocab),
                            res: None,
                        };
                        assert!(mk
                            .nt_product(&s, to, &a, &wte, None, (rows, vocab, c))
                            .unwrap());
                    } else {
                        let g =
                            LtGemm::plain(rows, vocab, c, Mat::of(&a, c), Mat::of(&wte, c).t(), d);
                        lt.gemm(&s, &g).unwrap();
                    }
                };
                let ms = ms_per_run(&device, &s, once);
                line += &entry(if nt { "Nt" } else { "cuBLASLt" }, ms, vocab * c * 2);
            }
            eprintln!("{line}");
        }
    }
}

/// A layer's MLP half (projection with the residual, LayerNorm 2, both MLP
/// products) chained over `layers` layers of distinct weights at 1 and 8
/// rows, launched overlapping: as four kernels (three NT products and the
/// LayerNorm's) and as one (`MixedKernels::nt_mlp`); µs a layer and the
/// weights' bytes over that time.
fn mlp_half_timed(device: &Device, s: &Stream, model: &str, c: usize, layers: usize) {
    let f = 4 * c;
    let per_layer = c * c + 2 * c * f;
    let weights = DeviceBuffer::<bf16>::zeros(device, layers * per_layer).unwrap();
    let zeros = |n: usize| DeviceBuffer::<f32>::zeros(device, n).unwrap();
    let (x, x2, out, bias) = (zeros(8 * c), zeros(8 * c), zeros(8 * c), zeros(f));
    let (mut mean, mut rstd) = (zeros(8), zeros(8));
    let halves = |n: usize| DeviceBuffer::<bf16>::zeros(device, n).unwrap();
    let (att, mut ln, h) = (halves(8 * c), halves(8 * c), halves(8 * f));
    let barrier = DeviceBuffer::<i32>::zeros(device, 2).unwrap();
    let mut mk = MixedKernels::load(device).unwrap();
    mk.set_overlap(true);
    let span = |b: &DeviceBuffer<f32>, n: usize| (b.dptr(), n);
    let half = |b: &DeviceBuffer<bf16>, n: usize| (b.dptr(), n);
    for rows in [1usize, 8] {
        let mut line = format!("{model} MLP half, rows {rows}:");
        for one in [false, true] {
            let chain = || {
                for l in 0..layers {
                    // Element offsets of the layer's three weights.
                    let wp = l * per_layer;
                    let (wf, wo) = (wp + c * c, wp + c * c + f * c);
                    let addr = |at: usize| weights.dptr() + (2 * at) as u64;
                    if one {
                        let mlp = NtMlp {
                            x2: span(&x2, rows * c),
                            h: half(&h, rows * f),
                            out: span(&out, rows * c),
                            att: half(&att, rows * c),
                            x: span(&x, rows * c),
                            wp: (addr(wp), c * c),
                            bp: span(&bias, c),
                            lw: span(&bias, c),
                            lb: span(&bias, c),
                            wf: (addr(wf), f * c),
                            bf: span(&bias, f),
                            wo: (addr(wo), c * f),
                            bo: span(&bias, c),
                        };
                        assert!(mk.nt_mlp(s, &mlp, &barrier, (rows, c, f)).unwrap());
                        continue;
                    }
                    let view = |at: usize, n: usize| weights.view(at..at + n);
                    let b: Option<&dyn DeviceMem<f32>> = Some(&bias);
                    let proj = SkinnyTo::F32 {
                        out: span(&x2, rows * c),
                        res: Some(span(&x, rows * c)),
                    };
                    let a = att.view(0..rows * c);
                    assert!(mk
                        .nt_product(s, proj, &a, &view(wp, c * c), b, (rows, c, c))
                        .unwrap());
                    let (lw, lb) = (bias.view(0..c), bias.view(0..c));
                    let x2v = x2.view(0..rows * c);
                    mk.layernorm_forward(
                        s,
                        &mut ln.view_mut(0..rows * c),
                        &mut mean,
                        &mut rstd,
                        &x2v,
                        &lw,
                        &lb,
                        rows,
                        c,
                    )
                    .unwrap();
                    let fc = SkinnyTo::GeluBf16 {
                        out: half(&h, rows * f),
                    };
                    let lnv = ln.view(0..rows * c);
                    assert!(mk
                        .nt_product(s, fc, &lnv, &view(wf, f * c), b, (rows, f, c))
                        .unwrap());
                    let fc2 = SkinnyTo::F32 {
                        out: span(&out, rows * c),
                        res: Some(span(&x2, rows * c)),
                    };
                    let hv = h.view(0..rows * f);
                    assert!(mk
                        .nt_product(s, fc2, &hv, &view(wo, c * f), b, (rows, c, f))
                        .unwrap());
                }
            };
            let ms = ms_per_run(device, s, chain) / layers as f64;
            line += &entry(
                if one { "one kernel" } else { "four kernels" },
                ms,
                per_layer * 2,
            );
        }
        eprintln!("{line}");
    }
}

/// Milliseconds a run of `run` takes on `s`: once untimed, then the mean
/// of 20 between two events.
fn ms_per_run(device: &Device, s: &Stream, mut run: impl FnMut()) -> f64 {
    run();
    s.synchronize().unwrap();
    let (t0, t1) = (Event::timed(device).unwrap(), Event::timed(device).unwrap());
    let reps = 20;
    t0.record(s).unwrap();
    for _ in 0..reps {
        run();
    }
    t1.record(s).unwrap();
    t1.synchronize().unwrap();
    t1.elapsed_ms(&t0).unwrap() as f64 / reps as f64
}

/// One way's figure on a line: `name`, µs, and `bytes` over that time.
fn entry(name: &str, ms: f64, bytes: usize) -> String {
    let gbs = bytes as f64 / (ms * 1e-3) / 1e9;
    format!("  {name} {:.1} us ({gbs:.0} GB/s)", ms * 1e3)
}
