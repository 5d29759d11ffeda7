//! CUDA graphs of the decoder's steady steps: a step whose every row is a
//! sequence's next token is captured once per bucket of rows (the rows
//! padded up to it, see `StepPlan::padded`) and replayed after, so the
//! host launches one graph instead of some fifteen kernels a layer — at
//! a batch of one the launches, not the GPU, bound a step. The graphs
//! hold the scratch buffers' addresses: they are forgotten when one is
//! reallocated, and captured again as needed. `BRAID_DECODE_GRAPHS=0`
//! turns them off; a capture the driver refuses turns them off too, with
//! a note, and the steps run as they are.

use crate::cuda::decode::switches::on_unless_off;
use braid_cuda::{CudaError, Graph, Result, Stream};
use std::collections::HashMap;

/// The row counts graphs are captured for: a step of `n` rows runs as the
/// smallest at least `n`.
const BUCKETS: [usize; 18] = [
    1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256, 512,
];

/// The captured graphs, by rows and by how many tokens their picks choose
/// among (a kernel argument baked in).
pub(super) struct DecodeGraphs {
    on: bool,
    graphs: HashMap<(usize, usize), Graph>,
}

impl DecodeGraphs {
    /// On unless `BRAID_DECODE_GRAPHS` is `0` or `off`.
    pub(super) fn from_env() -> DecodeGraphs {
        DecodeGraphs {
            on: on_unless_off(braid_core::env::BRAID_DECODE_GRAPHS),
            graphs: HashMap::new(),
        }
    }

    /// Graphs on, whatever the environment says.
    #[cfg(test)]
    pub(super) fn on() -> DecodeGraphs {
        DecodeGraphs {
            on: true,
            graphs: HashMap::new(),
        }
    }

    /// No graphs: every step runs as it is.
    #[cfg(test)]
    pub(super) fn off() -> DecodeGraphs {
        DecodeGraphs {
            on: false,
            graphs: HashMap::new(),
        }
    }

    /// The bucket a step of `n` rows runs in, when graphs are on and one
    /// holds it.
    pub(super) fn bucket(&self, n: usize) -> Option<usize> {
        match self.on {
            true => BUCKETS.iter().copied().find(|&b| b >= n),
            false => None,
        }
    }

    /// The row counts graphs are captured for (none when graphs are off).
    pub(super) fn buckets(&self) -> Vec<usize> {
        match self.on {
            true => BUCKETS.to_vec(),
            false => Vec::new(),
        }
    }

    /// Whether a graph of `rows` rows choosing among `choosable` tokens
    /// is captured.
    pub(super) fn has(&self, rows: usize, choosable: usize) -> bool {
        self.graphs.contains_key(&(rows, choosable))
    }

    /// Keeps a graph just captured.
    pub(super) fn keep(&mut self, rows: usize, choosable: usize, g: Graph) {
        self.graphs.insert((rows, choosable), g);
    }

    /// Forgets every graph (the buffers they name moved).
    pub(super) fn forget(&mut self) {
        self.graphs.clear();
    }

    /// Turns graphs off after a failed capture, saying why once.
    pub(super) fn give_up(&mut self, e: &CudaError) {
        eprintln!("note: braid decodes without CUDA graphs: capturing a step failed ({e})");
        self.on = false;
        self.graphs.clear();
    }

    /// Queues a replay of the graph of `rows` rows on `s`.
    pub(super) fn launch(&self, rows: usize, choosable: usize, s: &Stream) -> Result<()> {
        match self.graphs.get(&(rows, choosable)) {
            Some(g) => g.launch(s),
            None => Err(CudaError::Invalid(format!(
                "no decode graph of {rows} rows was captured"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_go_to_the_smallest_bucket_that_holds_them() {
        let g = DecodeGraphs {
            on: true,
            graphs: HashMap::new(),
        };
        assert_eq!(g.bucket(1), Some(1));
        assert_eq!(g.bucket(3), Some(4));
        assert_eq!(g.bucket(17), Some(24));
        assert_eq!(g.bucket(64), Some(64));
        assert_eq!(g.bucket(65), Some(96));
        assert_eq!(g.bucket(513), None);
        let off = DecodeGraphs { on: false, ..g };
        assert_eq!(off.bucket(1), None);
    }
}
