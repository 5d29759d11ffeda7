//! A small tensor: shape, dtype, device and contiguous storage — just what
//! the engine needs at its edges (checkpoints, named parameter access,
//! bf16 conversion), not a general framework. The device is part of every
//! tensor from the start; CPU storage holds f32 or bf16, and CUDA storage
//! slots in with the GPU engine.

use braid_core::DType;
use half::bf16;

/// Where a tensor's storage lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// GPU `ordinal`.
    Cuda(usize),
}

/// A tensor's elements, contiguous, row-major.
#[derive(Debug, Clone, PartialEq)]
pub enum Storage {
    /// f32 in host memory.
    F32(Vec<f32>),
    /// bf16 in host memory.
    Bf16(Vec<bf16>),
}

/// Why a tensor operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    /// Element count and shape disagree.
    #[error("shape {shape:?} holds {want} elements, not {got}")]
    Shape {
        /// The shape.
        shape: Vec<usize>,
        /// Elements it holds.
        want: usize,
        /// Elements given.
        got: usize,
    },
    /// A dtype or device this engine does not store.
    #[error("{0}")]
    Unsupported(String),
}

/// Shape + dtype + device + storage.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    device: Device,
    storage: Storage,
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

impl Tensor {
    /// Zeros of `dtype` (f32 or bf16) on `device`.
    pub fn zeros(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor, TensorError> {
        if let Device::Cuda(i) = device {
            return Err(TensorError::Unsupported(format!(
                "cuda:{i}: CUDA storage comes with the GPU engine; tensors live on the CPU for now"
            )));
        }
        let n = numel(shape);
        let storage = match dtype {
            DType::F32 => Storage::F32(vec![0.0; n]),
            DType::BF16 => Storage::Bf16(vec![bf16::ZERO; n]),
            other => {
                return Err(TensorError::Unsupported(format!(
                    "tensors store f32 or bf16, not {other}"
                )))
            }
        };
        Ok(Tensor {
            shape: shape.to_vec(),
            device,
            storage,
        })
    }

    /// An f32 CPU tensor of `shape` holding `data`.
    pub fn from_f32(shape: &[usize], data: Vec<f32>) -> Result<Tensor, TensorError> {
        if data.len() != numel(shape) {
            return Err(TensorError::Shape {
                shape: shape.to_vec(),
                want: numel(shape),
                got: data.len(),
            });
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            device: Device::Cpu,
            storage: Storage::F32(data),
        })
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self.storage {
            Storage::F32(_) => DType::F32,
            Storage::Bf16(_) => DType::BF16,
        }
    }

    /// Where the storage lives.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The storage.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The elements, if stored as f32.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.storage {
            Storage::F32(v) => Some(v),
            Storage::Bf16(_) => None,
        }
    }

    /// The elements as f32 (converted from bf16 if need be).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match &self.storage {
            Storage::F32(v) => v.clone(),
            Storage::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// A copy in `dtype` (f32 → bf16 rounds to nearest even).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor, TensorError> {
        let storage = match (dtype, &self.storage) {
            (DType::F32, _) => Storage::F32(self.to_f32_vec()),
            (DType::BF16, Storage::F32(v)) => {
                Storage::Bf16(v.iter().map(|&x| bf16::from_f32(x)).collect())
            }
            (DType::BF16, Storage::Bf16(v)) => Storage::Bf16(v.clone()),
            (other, _) => {
                return Err(TensorError::Unsupported(format!(
                    "tensors store f32 or bf16, not {other}"
                )))
            }
        };
        Ok(Tensor {
            shape: self.shape.clone(),
            device: self.device,
            storage,
        })
    }

    /// The same elements under another shape with as many elements.
    pub fn reshape(mut self, shape: &[usize]) -> Result<Tensor, TensorError> {
        if numel(shape) != self.numel() {
            return Err(TensorError::Shape {
                shape: shape.to_vec(),
                want: numel(shape),
                got: self.numel(),
            });
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    /// The storage as little-endian bytes (what safetensors holds).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match &self.storage {
            Storage::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Storage::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_dtypes_and_devices_are_checked() {
        let t = Tensor::from_f32(&[2, 3], vec![1.0, -2.5, 3.0, 0.1, 1e-3, 7.0]).unwrap();
        assert_eq!(
            (t.numel(), t.dtype(), t.device()),
            (6, DType::F32, Device::Cpu)
        );
        let b = t.to_dtype(DType::BF16).unwrap();
        assert_eq!(b.dtype(), DType::BF16);
        let back = b.to_f32_vec();
        assert_eq!(back[..3], [1.0, -2.5, 3.0]);
        assert!((back[3] - 0.1).abs() < 1e-3);
        assert_eq!(b.to_le_bytes().len(), 12);
        assert!(t.clone().reshape(&[3, 2]).is_ok());
        assert!(matches!(t.reshape(&[4]), Err(TensorError::Shape { .. })));
        assert!(Tensor::from_f32(&[2, 2], vec![0.0; 3]).is_err());
        let e = Tensor::zeros(&[2], DType::F32, Device::Cuda(0)).unwrap_err();
        assert!(e.to_string().contains("cuda:0"));
        assert!(Tensor::zeros(&[2], DType::I32, Device::Cpu).is_err());
    }
}
