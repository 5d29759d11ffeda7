//! `braid serve`: a trained model behind an OpenAI-compatible HTTP API
//! (braid-serve): continuous batching over a paged KV cache sized from
//! `--kv-memory`, listening on 127.0.0.1 unless `--host` says otherwise,
//! with an optional API key, on the CPU or one GPU (f32). Loads what
//! `braid generate` loads, and decodes where it does.

use super::bench::parse_size;
use super::generate::Source;
use super::generate::{decoder, decoding_device, dtype_name, load, locate, model_tokenizer};
use super::serve_tp;
use braid_core::DType;
use braid_serve::http::{serve, AppState};
use braid_serve::tensor_parallel::{follow, StepBus, TensorParallelDecoder};
use braid_serve::{spawn, Batcher, BatcherOptions, CpuDecoder, CudaDecoder, Decoder};
use clap::Args;
use std::path::PathBuf;
use std::sync::Arc;

/// Serve a trained model over HTTP.
#[derive(Args)]
#[command(
    about = "Serve a trained model over an OpenAI-compatible HTTP API (/v1/completions, streaming)",
    after_help = "Examples:\n  \
        braid serve --load tiny.safetensors --port 8100     # http://127.0.0.1:8100\n  \
        braid serve --load ck --port 9000 --api-key s3cret  # Authorization: Bearer s3cret\n  \
        braid serve --load tiny.safetensors --port 8101 --device cuda  # one GPU, f32\n  \
        braid serve --load tiny.safetensors --port 8102 --tp 2  # 2 CPU ranks, heads split\n  \
        curl -s localhost:8100/v1/completions -H 'content-type: application/json' \\\n    \
        -d '{\"prompt\": \"the quick\", \"max_tokens\": 20, \"temperature\": 0}'\n\n\
        Routes: POST /v1/completions (\"stream\": true for server-sent events), GET /v1/models, \
        GET /health (no key needed), GET /metrics (Prometheus). Requests are decoded together \
        (continuous batching) over a paged KV cache of --kv-memory bytes; a request is admitted \
        when the cache can hold its prompt and max_tokens, others wait in a queue of \
        --max-waiting (beyond it: 429). Decoding runs on the CPU (f32), or on one GPU in f32 with \
        --device cuda (LOCAL_RANK's, else GPU 0; --device auto, the default, takes a GPU where \
        there is one). --tp N splits the model's heads and MLP columns over N CPU ranks, started \
        here; rank 0 serves."
)]
pub struct ServeArgs {
    /// The model: what `braid generate --load` takes (a safetensors file,
    /// a directory holding model.safetensors, a --ckpt-dir or one of its
    /// step directories).
    #[arg(long, value_name = "PATH")]
    load: PathBuf,
    /// Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every
    /// interface).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// A key every request but /health must bring as
    /// `Authorization: Bearer KEY`.
    #[arg(
        long,
        env = "BRAID_API_KEY",
        value_name = "KEY",
        hide_env_values = true
    )]
    api_key: Option<String>,
    /// auto, cpu or cuda (cuda: one GPU, LOCAL_RANK's or GPU 0;
    /// auto: a GPU where there is one, else the CPU).
    #[arg(long, default_value = "auto")]
    device: String,
    /// The products' precision on a GPU: bf16 (the weights, each
    /// product's input and the KV cache in bf16, f32 accumulation) or f32
    /// (exact parity with the CPU; auto: bf16 on a GPU; the CPU and
    /// tensor-parallel ranks decode in f32).
    #[arg(long, default_value = "auto", value_name = "DTYPE")]
    dtype: String,
    /// Memory for the KV cache (e.g. 512M, 2G), on the device decoding
    /// (with --tp: on each rank, which holds its heads' keys and values).
    #[arg(long, default_value = "1G", value_name = "BYTES")]
    kv_memory: String,
    /// Tensor-parallel ranks: the heads and MLP columns split over N
    /// processes on the CPU, started here (rank 0 serves).
    #[arg(long, default_value_t = 1, value_name = "N")]
    tp: usize,
    /// Positions per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Requests decoded at once at most.
    #[arg(long, default_value_t = 64)]
    max_running: usize,
    /// Requests queued at most (more get 429).
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// Tokens one model step runs at most (decodes first, then prompt
    /// chunks; default: 2048 on a GPU, 512 on the CPU).
    #[arg(long, value_name = "N")]
    step_tokens: Option<usize>,
    /// bytes or gpt2 (default: what the checkpoint was trained with).
    #[arg(long)]
    tokenizer: Option<String>,
    /// The model's name in the API (default: the file or directory name).
    #[arg(long)]
    model_name: Option<String>,
}

/// Runs `braid serve`.
pub fn run_serve(a: ServeArgs) -> Result<i32, String> {
    if a.tp == 0 {
        return Err("--tp 0: a model is served by at least one rank (--tp 1, the default)".into());
    }
    // Tensor-parallel ranks run on the CPU unless a GPU is asked for.
    let device = match (a.tp > 1, a.device.as_str()) {
        (true, "auto") => "cpu",
        (_, d) => d,
    };
    let dtype = match (a.tp > 1, a.dtype.as_str()) {
        (true, "auto" | "f32") => "f32",
        (true, d) => {
            return Err(format!(
                "--dtype {d} with --tp {}: tensor-parallel ranks decode in f32 (--dtype f32)",
                a.tp
            ))
        }
        (false, d) => d,
    };
    let on = decoding_device(device, dtype)?;
    if a.block_size == 0 {
        return Err("--block-size 0: a block holds at least one position (16 is usual)".into());
    }
    let kv_bytes = parse_size(&a.kv_memory).map_err(|e| format!("--kv-memory: {e}"))?;
    let source = locate(&a.load)?;
    let ranks = match a.tp {
        1 => None,
        tp => {
            let cfg = match &source {
                Source::File(path) => braid_model::checkpoint::config_of(path).ok(),
                Source::Sharded(_) => None,
            };
            match serve_tp::start(tp, on.gpu.is_some(), cfg.as_ref())? {
                serve_tp::Start::Started(code) => return Ok(code),
                serve_tp::Start::Rank(r) => Some(r),
            }
        }
    };
    let (params, saved_tokenizer) = load(&source)?;
    let cfg = params.layout.config;
    let tokenizer = model_tokenizer(a.tokenizer.as_deref(), saved_tokenizer.as_ref(), &cfg)?;
    if let Some(note) = &on.note {
        eprintln!("{note}");
    }
    // A tensor-parallel rank's share of the model, and its heads' pages.
    let share = ranks.as_ref().map(|r| r.share(&params)).transpose()?;
    let layout = share
        .as_ref()
        .map_or(&params.layout, |(gpt, _)| gpt.layout());
    let blocks = match (&share, on.gpu) {
        (None, Some(_)) => {
            CudaDecoder::blocks_in(&params.layout, kv_bytes as u64, a.block_size, on.kv)
        }
        _ => CpuDecoder::blocks_in(layout, kv_bytes as u64, a.block_size),
    };
    let one_sequence = cfg.context.div_ceil(a.block_size) + 1;
    if blocks < one_sequence {
        let per = kv_bytes / blocks.max(1);
        return Err(format!(
            "--kv-memory {}: {blocks} KV block(s) of {} positions, and one sequence filling the \
             context of {} needs {one_sequence}: give at least {} (--kv-memory)",
            a.kv_memory,
            a.block_size,
            cfg.context,
            braid_core::words::bytes((one_sequence * per.max(1)) as u64)
        ));
    }
    let name = a.model_name.clone().unwrap_or_else(|| {
        let p = a.load.canonicalize().unwrap_or_else(|_| a.load.clone());
        let stem = match p.file_stem().map(|s| s.to_string_lossy().into_owned()) {
            Some(s) if s == "model" => p
                .parent()
                .and_then(|d| d.file_name())
                .map(|d| d.to_string_lossy().into_owned()),
            s => s,
        };
        stem.unwrap_or_else(|| "model".into())
    });
    // More than every running sequence can reserve would sit unused.
    let blocks = blocks.min(a.max_running.max(1) * one_sequence);
    let base = BatcherOptions::for_device(on.gpu.is_some());
    let options = BatcherOptions {
        step_tokens: a.step_tokens.unwrap_or(base.step_tokens).max(1),
        max_running: a.max_running.max(1),
        max_waiting: a.max_waiting,
    };
    let hint = "give less --kv-memory, or --device cpu";
    // Rank 0 of a tensor-parallel server decodes here and sends each step
    // to the others, which follow it until it stops (`stopping`).
    let mut stopping = None;
    let decoder: Box<dyn Decoder + Send> = match (ranks, share) {
        (Some(r), Some((gpt, data))) if r.rank > 0 => {
            follow(&r.bus, gpt, data, blocks, a.block_size)?;
            return Ok(0);
        }
        (Some(r), Some((gpt, data))) => {
            let d = TensorParallelDecoder::new(gpt, data, blocks, a.block_size, r.bus.clone())?;
            r.bus.keep_alive();
            stopping = Some(StopFollowers(r.bus));
            Box::new(d)
        }
        _ => decoder(params, &on, blocks, a.block_size, options.step_tokens, hint)?,
    };
    let described = decoder.describe();
    let mut batcher = Batcher::new(decoder, tokenizer, options);
    if let (Some(g), 1) = (on.gpu, a.tp) {
        let w = braid_serve::offline::warm_up(&mut batcher, cfg.vocab_size, cfg.context)?;
        eprintln!(
            "braid serve: warmed up in {} ms ({} requests of {} prompt tokens at once, then {} \
             smaller bursts: the step's buffers, its products and the CUDA graphs of the steady \
             steps made before the first request)",
            w.elapsed.as_millis(),
            w.requests,
            w.prompt_tokens,
            w.smaller
        );
        if let Some(line) = step_floor(g, cfg.num_params(), on.dtype) {
            eprintln!("{line}");
        }
    }
    let engine = spawn(batcher);
    let state = Arc::new(AppState {
        engine,
        tokenizer,
        model: name.clone(),
        context: cfg.context,
        api_key: a.api_key.clone(),
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("starting the HTTP runtime: {e}"))?;
    rt.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::AddrInUse => format!(
                    "cannot listen on {addr}: the port is in use (another server?); pick another \
                     with --port, or --port 0 for any free one"
                ),
                _ => format!("cannot listen on {addr}: {e}"),
            })?;
        let local = listener
            .local_addr()
            .map_err(|e| format!("the listening address: {e}"))?;
        eprintln!(
            "braid serve: model {name} (L{}-H{}-C{}-V{}-T{}, {}, tokenizer {}) on \
             {described}; listening on http://{local}{}",
            cfg.n_layer,
            cfg.n_head,
            cfg.n_embd,
            cfg.vocab_size,
            cfg.context,
            braid_core::words::count(cfg.num_params(), "parameter"),
            tokenizer.name(),
            match &a.api_key {
                Some(_) => " (API key required)",
                None => "",
            }
        );
        let shutdown = async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("a SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            eprintln!("braid serve: stopping (requests in flight finish first)");
        };
        serve(listener, state, shutdown)
            .await
            .map_err(|e| format!("serving: {e}"))
    })?;
    if let Some(s) = stopping.take() {
        s.0.stop()?;
    }
    Ok(0)
}

/// Tells a tensor-parallel server's other ranks to leave when rank 0
/// does, whichever way it leaves (stopped, or an error such as a port in
/// use): they would otherwise wait out their timeout.
struct StopFollowers(Arc<StepBus>);

impl Drop for StopFollowers {
    fn drop(&mut self) {
        if let Err(e) = self.0.stop() {
            eprintln!("braid serve: {e}");
        }
    }
}

/// The least time a decode step can take on GPU `gpu`: every weight read
/// once (in the products' element), at the memory bandwidth measured here
/// (a 256 MiB device copy) — one stream's floor per token, said at start
/// so a benchmark can set its figures beside it. None (nothing said) if
/// the measurement fails.
fn step_floor(gpu: usize, params: usize, dtype: DType) -> Option<String> {
    let device = braid_cuda::Device::open(gpu).ok()?;
    let gbps = braid_model::cuda::rates::copy_gbps(&device, 256 << 20, 10).ok()?;
    let bytes = params as f64 * if dtype == DType::BF16 { 2.0 } else { 4.0 };
    Some(format!(
        "braid serve: a step reads the weights at least once: {} in {} at the {:.0} GB/s \
         measured here, {:.3} ms (one stream's floor a token; the KV cache adds its reads)",
        braid_core::words::bytes(bytes as u64),
        dtype_name(dtype),
        gbps,
        bytes / (gbps * 1e9) * 1e3
    ))
}
