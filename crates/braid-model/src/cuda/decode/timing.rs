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
//! then the logits of a few rows by cuBLASLt and by the NT kernel.
//! `bench/device/serve.sh products` runs it on a GPU:
//! `model-tests --ignored --nocapture decode_products_timed`.

use crate::cuda::mixed::{MixedKernels, NtPrefetch, NtStart, SkinnyScratch, SkinnyTo};
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
                // Plans made (and offers timed) outside the measurement.
                chain(&mut lt);
                s.synchronize().unwrap();
                let (t0, t1) = (
                    Event::timed(&device).unwrap(),
                    Event::timed(&device).unwrap(),
                );
                let reps = 20;
                t0.record(&s).unwrap();
                for _ in 0..reps {
                    chain(&mut lt);
                }
                t1.record(&s).unwrap();
                t1.synchronize().unwrap();
                let ms = t1.elapsed_ms(&t0).unwrap() as f64 / (reps * layers) as f64;
                let gbs = (per_layer * 2) as f64 / (ms * 1e-3) / 1e9;
                let name = match way {
                    Way::NtOverlappedStarting(st) => format!(
                        "NtOverlapped[release {}, prefetch {:?}]",
                        if st.release_first { "first" } else { "after" },
                        st.prefetch
                    ),
                    other => format!("{other:?}"),
                };
                line += &format!("  {name} {:.1} us ({gbs:.0} GB/s)", ms * 1e3);
            }
            eprintln!("{line}");
        }
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
                let mut once = || {
                    if nt {
                        let to = SkinnyTo::F32 {
                            out: (logits.dptr(), rows * vocab),
                            res: None,
                        };
                        assert!(mk
                            .nt_product(&s, to, &a, &wte, None, (rows, vocab, c))
                            .unwrap());
                    } else {
                        let g = LtGemm {
                            m: rows,
                            n: vocab,
                            k: c,
                            a: Mat::of(&a, c),
                            b: Mat::of(&wte, c).t(),
                            c: d,
                            d,
                            epilogue: Epilogue::Plain,
                            alpha: 1.0,
                            beta: 0.0,
                        };
                        lt.gemm(&s, &g).unwrap();
                    }
                };
                once();
                s.synchronize().unwrap();
                let (t0, t1) = (
                    Event::timed(&device).unwrap(),
                    Event::timed(&device).unwrap(),
                );
                t0.record(&s).unwrap();
                for _ in 0..20 {
                    once();
                }
                t1.record(&s).unwrap();
                t1.synchronize().unwrap();
                let ms = t1.elapsed_ms(&t0).unwrap() as f64 / 20.0;
                let gbs = (vocab * c * 2) as f64 / (ms * 1e-3) / 1e9;
                let name = if nt { "Nt" } else { "cuBLASLt" };
                line += &format!("  {name} {:.1} us ({gbs:.0} GB/s)", ms * 1e3);
            }
            eprintln!("{line}");
        }
    }
}
