//! The GPUs of this host and how they are connected, from NVML: name,
//! memory, PCI bus id, NUMA node and CPU affinity per GPU, and a link
//! matrix naming, for each pair, the NVLink count (`NV18`) or the PCIe path
//! (`PIX`, `PXB`, `PHB`, `NODE`, `SYS`, as `nvidia-smi topo -m` does).

use crate::nvml::{topology_level_name, Nvml, NvmlError};
use serde::Serialize;

/// One GPU.
#[derive(Debug, Clone, Serialize)]
pub struct Gpu {
    /// NVML index.
    pub index: u32,
    /// Product name.
    pub name: String,
    /// Total memory in bytes.
    pub memory_bytes: u64,
    /// PCI bus id, e.g. `00000000:18:00.0`.
    pub pci_bus_id: String,
    /// NUMA node from sysfs (`None` when the kernel reports none).
    pub numa_node: Option<i32>,
    /// Ideal CPUs, as ranges (`0-31,64-95`).
    pub cpu_affinity: String,
}

/// The host's GPUs and links.
#[derive(Debug, Clone, Serialize)]
pub struct Topology {
    /// Every GPU.
    pub gpus: Vec<Gpu>,
    /// `links[i][j]`: `X` on the diagonal, `NV<n>` for n NVLinks, else the
    /// PCIe path.
    pub links: Vec<Vec<String>>,
}

/// Reads the topology through NVML.
pub fn discover() -> Result<Topology, NvmlError> {
    let nvml = Nvml::open()?;
    let n = nvml.device_count()?;
    let mut gpus = Vec::new();
    let mut handles = Vec::new();
    let mut peers = Vec::new();
    for i in 0..n {
        let d = nvml.device(i)?;
        let pci = nvml.pci(d)?;
        let bus_id = pci.bus_id();
        gpus.push(Gpu {
            index: i,
            name: nvml.name(d)?,
            memory_bytes: nvml.memory_total(d)?,
            numa_node: numa_node(&bus_id),
            cpu_affinity: nvml
                .cpu_affinity(d)
                .map(|w| cpu_ranges(&w))
                .unwrap_or_else(|e| format!("? ({e})")),
            pci_bus_id: bus_id,
        });
        peers.push(nvml.nvlink_peers(d));
        handles.push(d);
    }
    let mut links = vec![vec![String::new(); n as usize]; n as usize];
    for i in 0..n as usize {
        for j in 0..n as usize {
            links[i][j] = if i == j {
                "X".into()
            } else {
                // Links straight to GPU j, or — behind NVSwitches, or in a VM
                // whose bus ids differ from the host's — every active link
                // when NVML says the pair talks over NVLink.
                let direct = peers[i]
                    .iter()
                    .filter(|b| same_bus(b, &gpus[j].pci_bus_id))
                    .count();
                if direct > 0 {
                    format!("NV{direct}")
                } else if !peers[i].is_empty() && nvml.p2p_over_nvlink(handles[i], handles[j]) {
                    format!("NV{}", peers[i].len())
                } else {
                    nvml.common_ancestor(handles[i], handles[j])
                        .map(|l| topology_level_name(l).to_string())
                        .unwrap_or_else(|_| "?".into())
                }
            };
        }
    }
    Ok(Topology { gpus, links })
}

/// NVML pads the PCI domain to 8 digits, sysfs to 4: compare normalised.
fn same_bus(a: &str, b: &str) -> bool {
    let norm = |s: &str| {
        let s = s.to_ascii_lowercase();
        match s.split_once(':') {
            Some((domain, rest)) => u32::from_str_radix(domain, 16)
                .ok()
                .map(|d| format!("{d:04x}:{rest}")),
            None => None,
        }
    };
    matches!((norm(a), norm(b)), (Some(x), Some(y)) if x == y)
}

/// `/sys/bus/pci/devices/DDDD:BB:DD.F/numa_node` for an NVML bus id.
fn numa_node(bus_id: &str) -> Option<i32> {
    let lower = bus_id.to_ascii_lowercase();
    let short = if lower.len() > 12 {
        &lower[lower.len() - 12..]
    } else {
        &lower
    };
    let text = std::fs::read_to_string(format!("/sys/bus/pci/devices/{short}/numa_node")).ok()?;
    text.trim().parse::<i32>().ok().filter(|n| *n >= 0)
}

/// `[0b1111, ...]` → `0-3`.
pub fn cpu_ranges(words: &[u64]) -> String {
    let cpus: Vec<usize> = words
        .iter()
        .enumerate()
        .flat_map(|(w, bits)| {
            (0..64)
                .filter(move |b| bits >> b & 1 == 1)
                .map(move |b| w * 64 + b)
        })
        .collect();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let start = cpus[i];
        while i + 1 < cpus.len() && cpus[i + 1] == cpus[i] + 1 {
            i += 1;
        }
        parts.push(if cpus[i] == start {
            start.to_string()
        } else {
            format!("{start}-{}", cpus[i])
        });
        i += 1;
    }
    parts.join(",")
}

/// The topology as a table.
pub fn render(t: &Topology) -> String {
    let mut s = String::new();
    s += &format!(
        "{:<4} {:<28} {:>11}  {:<17} {:>4}  {}\n",
        "GPU", "name", "memory", "PCI bus id", "NUMA", "CPU affinity"
    );
    for g in &t.gpus {
        s += &format!(
            "{:<4} {:<28} {:>7.1} GiB  {:<17} {:>4}  {}\n",
            g.index,
            g.name,
            g.memory_bytes as f64 / (1u64 << 30) as f64,
            g.pci_bus_id,
            g.numa_node
                .map(|n| n.to_string())
                .unwrap_or_else(|| "-".into()),
            g.cpu_affinity
        );
    }
    if t.gpus.len() > 1 {
        s += "\nlinks:\n      ";
        for g in &t.gpus {
            s += &format!("{:>6}", format!("GPU{}", g.index));
        }
        s += "\n";
        for (i, row) in t.links.iter().enumerate() {
            s += &format!("{:<6}", format!("GPU{i}"));
            for cell in row {
                s += &format!("{cell:>6}");
            }
            s += "\n";
        }
        s += "  NV#: NVLink links; PIX/PXB: PCIe switch(es); PHB: host bridge; NODE: same NUMA node; SYS: across sockets\n";
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_masks_become_ranges() {
        assert_eq!(cpu_ranges(&[0b1111]), "0-3");
        assert_eq!(cpu_ranges(&[0b1011, 1]), "0-1,3,64");
        assert_eq!(cpu_ranges(&[0]), "");
    }

    #[test]
    fn bus_ids_compare_across_domain_widths() {
        assert!(same_bus("00000000:18:00.0", "0000:18:00.0"));
        assert!(!same_bus("00000000:18:00.0", "00000000:19:00.0"));
    }

    #[test]
    fn without_a_driver_the_error_says_so() {
        // On a machine with a driver this discovers GPUs instead.
        match discover() {
            Ok(t) => assert_eq!(t.links.len(), t.gpus.len()),
            Err(e) => assert!(e.to_string().contains("no NVIDIA driver"), "{e}"),
        }
    }
}
