//! What a machine can do, as the planner's cost model needs it: one GPU's
//! product rate, memory and memory bandwidth, and the links between GPUs
//! inside a node and across nodes ([`Hardware`]). Built-in descriptions
//! carry short names (`h100`, `h200`, `a100`); a JSON file with the same
//! fields describes any other machine, one that does not exist yet
//! included.

use serde::{Deserialize, Serialize};

/// A link's collective bandwidth and latency.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// Bus bandwidth an all-reduce reaches over it, GB/s per GPU
    /// (nccl-tests' `busbw` at large sizes).
    pub busbw_gbps: f64,
    /// Latency of one collective step, microseconds.
    pub latency_us: f64,
}

impl Link {
    /// Seconds a ring all-reduce of `bytes` over `n` ranks takes.
    pub fn all_reduce_s(&self, bytes: f64, n: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let n = n as f64;
        2.0 * (n - 1.0) / n * bytes / (self.busbw_gbps * 1e9)
            + 2.0 * (n - 1.0) * self.latency_us * 1e-6
    }

    /// Seconds an all-gather (or reduce-scatter) of `bytes` in all over
    /// `n` ranks takes.
    pub fn all_gather_s(&self, bytes: f64, n: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let n = n as f64;
        (n - 1.0) / n * bytes / (self.busbw_gbps * 1e9) + (n - 1.0) * self.latency_us * 1e-6
    }

    /// Seconds a point-to-point send of `bytes` takes.
    pub fn send_s(&self, bytes: f64) -> f64 {
        bytes / (self.busbw_gbps * 1e9) + self.latency_us * 1e-6
    }
}

/// One product shape's rate as `braid plan calibrate` measured it: its
/// forward pass and both backward passes together, `[tokens, inputs] ·
/// [inputs, outputs]` and the two products of its gradients.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ProductRate {
    pub tokens: usize,
    pub inputs: usize,
    pub outputs: usize,
    /// TFLOP/s the three passes reached together.
    pub tflops: f64,
}

/// The fused attention's rate measured at one shape (`braid plan
/// calibrate`): the model's width and heads (its head size picks the
/// kernels), and the fraction of the peak its forward and backward passes
/// reached together.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AttentionRate {
    pub width: usize,
    pub heads: usize,
    pub efficiency: f64,
}

/// GiB of a GPU's memory that are not free when a run starts: the CUDA
/// context's and, over several GPUs, NCCL's. Measured on 80 GB H100s
/// (79.6 GiB): 78.66 GiB free in one process, 77.89 GiB in each of four.
pub const CONTEXT_GIB: f64 = 1.75;

/// A machine: its GPUs and their links.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hardware {
    /// A short name.
    pub name: String,
    /// Dense bf16 tensor-core peak of one GPU, TFLOP/s.
    pub peak_tflops: f64,
    /// The fraction of the peak a large bf16 product reaches.
    pub gemm_efficiency: f64,
    /// A product of this many FLOPs reaches half of that (smaller ones
    /// are launch- and tile-bound): efficiency × f / (f + this).
    pub gemm_half_flops: f64,
    /// The fraction of the peak the fused attention reaches.
    pub attention_efficiency: f64,
    /// Memory per GPU, GiB.
    pub memory_gib: f64,
    /// Memory bandwidth, GB/s (the elementwise kernels and the optimizer
    /// are bound by it).
    pub hbm_gbps: f64,
    /// GPUs per node.
    pub gpus_per_node: usize,
    /// Between the GPUs of a node (NVLink).
    pub intra: Link,
    /// Between nodes (InfiniBand), per GPU.
    pub inter: Link,
    /// Memory traffic an optimizer offloaded to the host reaches for one
    /// GPU's share, GB/s (its AdamW moves about 36 bytes a parameter):
    /// measured 94 on a 16-core H100 host (BENCHMARKS.md, 2.65B and
    /// 6.35B, 2.6 G parameters a second).
    #[serde(default = "host_update_default")]
    pub host_update_gbps: f64,
    /// Product rates measured by shape (`braid plan calibrate`): a
    /// product's time is the curve's corrected by the measured shape
    /// nearest it ([`Hardware::product_s`]); empty, the curve alone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub products: Vec<ProductRate>,
    /// The attention's rates measured by shape (`braid plan calibrate`): a
    /// model's attention runs at the rate of the measured shape nearest
    /// its head size, then its width ([`Hardware::attention_efficiency_at`]);
    /// empty, [`Hardware::attention_efficiency`] for every shape.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attention: Vec<AttentionRate>,
}

/// [`Hardware::host_update_gbps`] where a description leaves it out.
fn host_update_default() -> f64 {
    94.0
}

impl Hardware {
    /// The built-in description named `name` (`h100`, `h200`, `a100`).
    pub fn builtin(name: &str) -> Option<Hardware> {
        let h = match name.to_ascii_lowercase().as_str() {
            // One H100 SXM as `braid plan calibrate` measured it (products by
            // shape on random operands after a second's heat, attention by
            // head size, HBM, the host's AdamW: bench/results/
            // 2026-12-07-plan-calibrate-h100-heated/, its one-GPU steps
            // within 5 %); the links are those 4 NVLink GPUs per host were
            // measured at (about 360 GB/s bus bandwidth), the inter-node
            // link a 400 Gb/s NIC per GPU.
            "h100" => Hardware::measured(include_str!("measured/h100.json")),
            // An H200 until it is calibrated: the H100's measured rates with
            // its own memory and bandwidth.
            "h200" => Hardware {
                name: "h200".into(),
                memory_gib: 139.8,
                hbm_gbps: 4300.0,
                gemm_efficiency: 0.70,
                ..Hardware::builtin("h100")?
            },
            // The machine of Megatron-LM's paper (Narayanan et al. 2021):
            // A100 80 GB SXM, 312 TFLOP/s bf16, 8 per DGX node over NVLink
            // 3 (600 GB/s each way), 8 x 200 Gb/s HDR InfiniBand per node.
            // One constant chosen, not measured: the products' efficiency,
            // 0.72 of the peak (225 TFLOP/s), which puts all ten of the
            // paper's Table 1 rows within 12 % (cost.rs's test).
            "a100" => Hardware {
                name: "a100".into(),
                peak_tflops: 312.0,
                gemm_efficiency: 0.72,
                gemm_half_flops: 1.0e9,
                attention_efficiency: 0.45,
                memory_gib: 79.2,
                hbm_gbps: 1900.0,
                gpus_per_node: 8,
                intra: Link {
                    busbw_gbps: 230.0,
                    latency_us: 10.0,
                },
                inter: Link {
                    busbw_gbps: 22.0,
                    latency_us: 15.0,
                },
                host_update_gbps: host_update_default(),
                products: Vec::new(),
                attention: Vec::new(),
            },
            _ => return None,
        };
        Some(h)
    }

    /// A description shipped as `calibrate`'s JSON (a test reads each).
    fn measured(json: &str) -> Hardware {
        serde_json::from_str(json).expect("a shipped hardware description parses")
    }

    /// The description `spec` names: a built-in name, else a JSON file
    /// of [`Hardware`]'s fields.
    pub fn named_or_file(spec: &str) -> Result<Hardware, String> {
        if let Some(h) = Hardware::builtin(spec) {
            return Ok(h);
        }
        let text = std::fs::read_to_string(spec).map_err(|e| {
            format!(
                "--hardware {spec}: neither a built-in machine (h100, h200, a100) nor a readable \
                 file ({e})"
            )
        })?;
        let h: Hardware = serde_json::from_str(&text)
            .map_err(|e| format!("--hardware {spec}: not a hardware description ({e})"))?;
        h.checked()
    }

    /// Refuses a description no machine could have.
    pub fn checked(self) -> Result<Hardware, String> {
        let positive = [
            ("peak_tflops", self.peak_tflops),
            ("gemm_efficiency", self.gemm_efficiency),
            ("attention_efficiency", self.attention_efficiency),
            ("memory_gib", self.memory_gib),
            ("hbm_gbps", self.hbm_gbps),
            ("intra.busbw_gbps", self.intra.busbw_gbps),
            ("inter.busbw_gbps", self.inter.busbw_gbps),
            ("host_update_gbps", self.host_update_gbps),
        ];
        if let Some((name, v)) = positive
            .iter()
            .find(|(_, v)| v.is_nan() || *v <= 0.0 || !v.is_finite())
        {
            return Err(format!(
                "hardware {}: {name} is {v}; it must be above 0",
                self.name
            ));
        }
        if self.gemm_efficiency > 1.0 || self.attention_efficiency > 1.0 {
            return Err(format!(
                "hardware {}: an efficiency above 1 (a fraction of the peak)",
                self.name
            ));
        }
        if self.gpus_per_node == 0 {
            return Err(format!("hardware {}: gpus_per_node is 0", self.name));
        }
        if let Some(p) = self.products.iter().find(|p| {
            p.tokens == 0
                || p.inputs == 0
                || p.outputs == 0
                || !(p.tflops.is_finite() && p.tflops > 0.0)
        }) {
            return Err(format!(
                "hardware {}: a product rate of {p:?}: sizes and TFLOP/s must be above 0",
                self.name
            ));
        }
        if let Some(a) = self.attention.iter().find(|a| {
            a.width == 0
                || a.heads == 0
                || a.width % a.heads != 0
                || !(a.efficiency.is_finite() && a.efficiency > 0.0 && a.efficiency <= 1.0)
        }) {
            return Err(format!(
                "hardware {}: an attention rate of {a:?}: the width must split into its heads \
                 and the efficiency lie in (0, 1]",
                self.name
            ));
        }
        Ok(self)
    }

    /// Bytes a layout may hold on one GPU: what `braid train`'s
    /// pre-flight leaves its estimate — the memory free when a run starts
    /// ([`CONTEXT_GIB`] less than the GPU's) less the workspace margin
    /// (`braid_model::footprint::DEVICE_MARGIN`).
    pub fn memory_budget(&self) -> f64 {
        let gib = (1u64 << 30) as f64;
        (self.memory_gib - CONTEXT_GIB) * gib - braid_model::footprint::DEVICE_MARGIN as f64
    }

    /// Seconds a product of `flops` takes on one GPU.
    pub fn gemm_s(&self, flops: f64) -> f64 {
        let eff = self.gemm_efficiency * flops / (flops + self.gemm_half_flops);
        flops / (self.peak_tflops * 1e12 * eff.max(1e-6))
    }

    /// Seconds a product `[tokens, inputs] · [inputs, outputs]` takes on
    /// one GPU: the curve's ([`gemm_s`](Self::gemm_s)), times what the
    /// measured shape nearest it (by the logs of the three sizes) took
    /// against the curve; the curve alone where none was measured.
    /// The fraction of the peak the fused attention reaches for a model of
    /// `width` and `heads`: the measured shape's nearest in head size
    /// (the kernels differ by it), then in width; without a table,
    /// [`Hardware::attention_efficiency`].
    pub fn attention_efficiency_at(&self, width: usize, heads: usize) -> f64 {
        let ln = |x: usize| (x.max(1) as f64).ln();
        let head = ln(width / heads.max(1));
        let off = |a: &AttentionRate| {
            (
                (head - ln(a.width / a.heads.max(1))).abs(),
                (ln(width) - ln(a.width)).abs(),
            )
        };
        self.attention
            .iter()
            .min_by(|a, b| {
                let (x, y) = (off(a), off(b));
                x.0.total_cmp(&y.0).then(x.1.total_cmp(&y.1))
            })
            .map_or(self.attention_efficiency, |a| a.efficiency)
    }

    pub fn product_s(&self, tokens: f64, inputs: f64, outputs: f64) -> f64 {
        let flops = 2.0 * tokens * inputs * outputs;
        let curve = self.gemm_s(flops);
        let (t, i, o) = (tokens.ln(), inputs.ln(), outputs.ln());
        let off = |p: &ProductRate| {
            (t - (p.tokens as f64).ln()).abs()
                + (i - (p.inputs as f64).ln()).abs()
                + (o - (p.outputs as f64).ln()).abs()
        };
        let nearest = self
            .products
            .iter()
            .map(|p| (off(p), p))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        match nearest {
            None => curve,
            Some((_, p)) => {
                let f = 2.0 * (p.tokens * p.inputs * p.outputs) as f64;
                curve * (f / (p.tflops * 1e12)) / self.gemm_s(f)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_and_files_are_read_and_checked() {
        for n in ["h100", "H200", "a100"] {
            let h = Hardware::builtin(n).expect(n);
            // The shipped measurements hold what a file must.
            assert_eq!(h.clone().checked().unwrap(), h, "{n}");
        }
        let h = Hardware::builtin("a100").unwrap();
        let dir = std::env::temp_dir().join(format!("braid-hw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pod.json");
        let mut pod = h.clone();
        pod.name = "pod".into();
        pod.inter.busbw_gbps = 50.0;
        std::fs::write(&file, serde_json::to_string(&pod).unwrap()).unwrap();
        assert_eq!(
            Hardware::named_or_file(file.to_str().unwrap()).unwrap(),
            pod
        );
        pod.gemm_efficiency = 1.5;
        std::fs::write(&file, serde_json::to_string(&pod).unwrap()).unwrap();
        assert!(Hardware::named_or_file(file.to_str().unwrap())
            .unwrap_err()
            .contains("above 1"));
        assert!(Hardware::named_or_file("v100")
            .unwrap_err()
            .contains("built-in"));
        // A large product runs near the efficiency; a small one well below.
        let big = 2.0 * 8192.0 * 8192.0 * 8192.0;
        assert!((big / h.gemm_s(big) / 312e12 - h.gemm_efficiency).abs() < 0.01);
        assert!(1e8 / h.gemm_s(1e8) / 312e12 < 0.1);
        // A ring all-reduce over 8 ranks moves 2 x 7/8 of the bytes.
        let l = Link {
            busbw_gbps: 100.0,
            latency_us: 0.0,
        };
        assert!((l.all_reduce_s(1e9, 8) - 1.75e-2).abs() < 1e-9);
        std::fs::remove_dir_all(dir).ok();
    }
}
