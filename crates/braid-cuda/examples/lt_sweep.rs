//! Times every algorithm cuBLASLt's heuristic offers for the products of
//! one GPT block (bf16 operands, the shapes and epilogues the mixed engine
//! uses), beside plain cuBLAS (`cublasGemmEx`) for the same product.
//!
//! `cargo run --release -p braid-cuda --example lt_sweep -- [TOKENS] [WIDTH]`
//! (defaults 8192 and 2560: the 2.65B model at batch 8). Needs a GPU.

use braid_cuda::blas::{Blas, GemmEx, Mat};
use braid_cuda::blaslt::{BlasLt, Epilogue, LtGemm};
use braid_cuda::{Device, DeviceBuffer, DeviceMem, Event, Result, Stream};
use half::bf16;

/// Host values in [-1, 1) from a fixed xorshift sequence.
fn noise(len: usize, seed: u64) -> Vec<f32> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn bf(device: &Device, len: usize, seed: u64) -> Result<DeviceBuffer<bf16>> {
    let v: Vec<bf16> = noise(len, seed).into_iter().map(bf16::from_f32).collect();
    DeviceBuffer::from_host(device, &v)
}

fn f32s(device: &Device, len: usize, seed: u64) -> Result<DeviceBuffer<f32>> {
    DeviceBuffer::from_host(device, &noise(len, seed))
}

/// Milliseconds per run of `f`, `reps` runs after one warm-up.
fn time(s: &Stream, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f32> {
    let (a, b) = (Event::timed(s.device())?, Event::timed(s.device())?);
    f()?;
    a.record(s)?;
    for _ in 0..reps {
        f()?;
    }
    b.record(s)?;
    b.synchronize()?;
    Ok(b.elapsed_ms(&a)? / reps as f32)
}

/// `d = a · b (+ beta · c)` with `epilogue`, of shape (m, n, k).
#[allow(clippy::too_many_arguments)]
fn lt(
    (m, n, k): (usize, usize, usize),
    a: Mat,
    b: Mat,
    c: Mat,
    d: Mat,
    epilogue: Epilogue,
    beta: f32,
) -> LtGemm {
    LtGemm {
        m,
        n,
        k,
        a,
        b,
        c,
        d,
        epilogue,
        alpha: 1.0,
        beta,
    }
}

/// The same product through `cublasGemmEx`, in place in `g.c`.
fn as_gemm_ex(g: &LtGemm) -> GemmEx {
    GemmEx {
        m: g.m,
        n: g.n,
        k: g.k,
        a: g.a,
        b: g.b,
        c: g.c,
        alpha: g.alpha,
        beta: g.beta,
        batch: 1,
        tf32: false,
    }
}

/// FNV-1a of `bytes`.
fn hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

/// Reads a product's result back as bytes.
type Read<'a> = &'a dyn Fn() -> Result<Vec<u8>>;

fn report(
    name: &str,
    plain_ms: Option<f32>,
    lt: &mut BlasLt,
    s: &Stream,
    g: &LtGemm,
    read: Read,
) -> Result<()> {
    let flops = 2.0 * (g.m * g.n * g.k) as f64;
    let tf = |ms: f32| flops / (ms as f64 * 1e-3) / 1e12;
    println!("== {name}: {}x{}x{}", g.m, g.n, g.k);
    if let Some(ms) = plain_ms {
        println!(
            "   cublasGemmEx               {ms:8.4} ms {:6.0} TFLOP/s",
            tf(ms)
        );
    }
    match lt.time_offered(s, g, 16, 20) {
        Ok(offered) => {
            for o in offered {
                lt.gemm_offered(s, g, &o)?;
                s.synchronize()?;
                let h = hash(&read()?);
                println!(
                    "   #{:<2} {:8.4} ms {:6.0} TFLOP/s  waves {:5.2} ws {:>9}  {:016x}  {}",
                    o.rank,
                    o.ms,
                    tf(o.ms),
                    o.waves,
                    o.workspace,
                    h,
                    o.config
                );
            }
        }
        Err(e) => println!("   cuBLASLt: {e}"),
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("TOKENS and WIDTH are numbers"))
        .collect();
    let n = args.first().copied().unwrap_or(8192);
    let c = args.get(1).copied().unwrap_or(2560);
    braid_cuda::driver::init()?;
    let device = Device::open(0)?;
    let s = device.main_stream();
    let mut blas = Blas::new(&device)?;
    let mut blaslt = BlasLt::new(&device)?;
    println!("{} · tokens {n}, width {c}", device.name()?);

    let x = bf(&device, n * 4 * c, 1)?; // activations, up to 4c wide
    let w = bf(&device, 4 * c * c, 2)?; // weights, up to 4c × c
    let dy = bf(&device, n * 4 * c, 3)?; // output gradients
    let out_bf = bf(&device, n * 4 * c, 4)?;
    let aux = bf(&device, n * 4 * c, 5)?;
    let resid = f32s(&device, n * c, 6)?;
    let out_f = f32s(&device, n * c, 7)?;
    let bias_f = f32s(&device, 4 * c, 8)?;
    let bias_b = bf(&device, 4 * c, 9)?;
    let dw = f32s(&device, 4 * c * c, 10)?;

    let dw2 = f32s(&device, 4 * c * c, 11)?;
    let read_f = |b: &DeviceBuffer<f32>| -> Result<Vec<u8>> {
        Ok(b.to_vec()?
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect())
    };
    let read_b = |b: &DeviceBuffer<bf16>| -> Result<Vec<u8>> {
        Ok(b.to_vec()?
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect())
    };
    let bias_f = (bias_f.dptr(), bias_f.dlen());
    let bias_b = (bias_b.dptr(), bias_b.dlen());

    let (rf, rb) = (|| read_f(&out_f), || read_b(&out_bf));
    let bias = Epilogue::Bias { bias: bias_b };
    let gelu = Epilogue::GeluAuxBias {
        bias: bias_b,
        aux: (aux.dptr(), aux.dlen()),
        aux_ld: 4 * c,
    };
    let (xa, ob) = (|k| Mat::of(&x, k), |n| Mat::of(&out_bf, n));
    // Forward: the residual-adding products with an f32 result (proj,
    // fcproj), the same with a bf16 result, qkv and fc.
    // x[n, k] · w[k, out] into an f32 result with the residual added, or
    // into a bf16 one (overwritten) with `epi`.
    let resid_f32 = |out, k| {
        let bias = Epilogue::Bias { bias: bias_f };
        let (r, d) = (Mat::of(&resid, out), Mat::of(&out_f, out));
        lt((n, out, k), xa(k), Mat::of(&w, out), r, d, bias, 1.0)
    };
    let to_bf16 = |out, k, epi| {
        lt(
            (n, out, k),
            xa(k),
            Mat::of(&w, out),
            ob(out),
            ob(out),
            epi,
            0.0,
        )
    };
    let forward: [(&str, LtGemm, Read); 6] = [
        ("fwd proj (f32 out + residual)", resid_f32(c, c), &rf),
        ("fwd fcproj (f32 out + residual)", resid_f32(c, 4 * c), &rf),
        ("fwd proj (bf16 out)", to_bf16(c, c, bias), &rb),
        ("fwd fcproj (bf16 out)", to_bf16(c, 4 * c, bias), &rb),
        ("fwd qkv (bf16 out + bias)", to_bf16(3 * c, c, bias), &rb),
        ("fwd fc (gelu aux bias)", to_bf16(4 * c, c, gelu), &rb),
    ];
    for (name, g, read) in forward {
        report(name, None, &mut blaslt, &s, &g, read)?;
    }

    // Backward: input gradients dx = dy · wᵀ (bf16) and weight gradients
    // dw += xᵀ · dy (f32; cuBLASLt's runs write dw2, so that each run
    // starts from the same dw), beside cublasGemmEx on the same operands.
    let rd = || read_f(&dw2);
    for (name, inp, out) in [
        ("proj", c, c),
        ("fcproj", 4 * c, c),
        ("fc", c, 4 * c),
        ("qkv", c, 3 * c),
    ] {
        let dx = lt(
            (n, inp, out),
            Mat::of(&dy, out),
            Mat::of(&w, out).t(),
            ob(inp),
            ob(inp),
            Epilogue::Plain,
            0.0,
        );
        let dwg = lt(
            (inp, out, n),
            Mat::of(&x, inp).t(),
            Mat::of(&dy, out),
            Mat::of(&dw, out),
            Mat::of(&dw2, out),
            Epilogue::Plain,
            1.0,
        );
        for (what, g, read) in [("dx", dx, &rb as Read), ("dw (f32 +=)", dwg, &rd)] {
            let plain = time(&s, 20, || blas.gemm_ex(&s, &as_gemm_ex(&g)))?;
            report(
                &format!("bwd {name} {what}"),
                Some(plain),
                &mut blaslt,
                &s,
                &g,
                read,
            )?;
        }
    }
    Ok(())
}
