//! Reduction operators and the CPU kernels that apply them to raw bytes of
//! any [`DType`]. f16 and bf16 are accumulated in f32 and rounded once.

use crate::dtype::DType;
use half::{bf16, f16};

/// How values are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (wrapping for integers).
    Sum,
    /// Product (wrapping for integers).
    Prod,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Mean over ranks: the sum divided by the number of ranks (integer
    /// division for integer types).
    Avg,
}

impl ReduceOp {
    /// Every operator.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    /// Short name (`sum`, `prod`, `min`, `max`, `avg`).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    /// Parses a name.
    pub fn parse(s: &str) -> Result<ReduceOp, String> {
        ReduceOp::ALL
            .into_iter()
            .find(|o| o.name() == s.to_ascii_lowercase())
            .ok_or_else(|| format!("unknown reduce op {s:?}: expected one of sum prod min max avg"))
    }

    /// Stable small integer for wire formats.
    pub fn code(self) -> u8 {
        ReduceOp::ALL
            .iter()
            .position(|o| *o == self)
            .expect("listed") as u8
    }
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Elements processed per block when 16-bit values are widened to f32.
const BLOCK: usize = 2048;

trait Combine: Copy {
    fn combine(self, other: Self, op: ReduceOp) -> Self;
    fn divide(self, n: usize) -> Self;
}

macro_rules! combine_float {
    ($t:ty) => {
        impl Combine for $t {
            #[inline(always)]
            fn combine(self, o: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => self + o,
                    ReduceOp::Prod => self * o,
                    ReduceOp::Min => self.min(o),
                    ReduceOp::Max => self.max(o),
                }
            }
            #[inline(always)]
            fn divide(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
macro_rules! combine_int {
    ($t:ty) => {
        impl Combine for $t {
            #[inline(always)]
            fn combine(self, o: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => self.wrapping_add(o),
                    ReduceOp::Prod => self.wrapping_mul(o),
                    ReduceOp::Min => self.min(o),
                    ReduceOp::Max => self.max(o),
                }
            }
            #[inline(always)]
            fn divide(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
combine_float!(f32);
combine_float!(f64);
combine_int!(i32);
combine_int!(i64);
combine_int!(u8);

/// `dst[i] = dst[i] op src[i]`, written so each arm vectorises.
#[inline(always)]
fn combine_slices<T: Combine>(dst: &mut [T], src: &[T], op: ReduceOp) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => dst
            .iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d = d.combine(*s, ReduceOp::Sum)),
        ReduceOp::Prod => dst
            .iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d = d.combine(*s, ReduceOp::Prod)),
        ReduceOp::Min => dst
            .iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d = d.combine(*s, ReduceOp::Min)),
        ReduceOp::Max => dst
            .iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d = d.combine(*s, ReduceOp::Max)),
    }
}

/// Runs `f` on `bytes` viewed as `[T]`, copying through an aligned buffer
/// only when the bytes are misaligned.
fn with_slice<T: bytemuck::Pod, R>(bytes: &[u8], f: impl FnOnce(&[T]) -> R) -> R {
    match bytemuck::try_cast_slice::<u8, T>(bytes) {
        Ok(s) => f(s),
        Err(_) => {
            let v: Vec<T> = bytes
                .chunks_exact(std::mem::size_of::<T>())
                .map(bytemuck::pod_read_unaligned)
                .collect();
            f(&v)
        }
    }
}

fn with_slice_mut<T: bytemuck::Pod, R>(bytes: &mut [u8], f: impl FnOnce(&mut [T]) -> R) -> R {
    match bytemuck::try_cast_slice_mut::<u8, T>(bytes) {
        Ok(s) => f(s),
        Err(_) => {
            let mut v: Vec<T> = bytes
                .chunks_exact(std::mem::size_of::<T>())
                .map(bytemuck::pod_read_unaligned)
                .collect();
            let r = f(&mut v);
            bytes.copy_from_slice(bytemuck::cast_slice(&v));
            r
        }
    }
}

fn check_lengths(dtype: DType, dst: usize, src: usize) {
    assert_eq!(dst, src, "reduce: buffers of {dst} and {src} bytes differ");
    assert_eq!(
        dst % dtype.size(),
        0,
        "reduce: {dst} bytes is not a whole number of {dtype} elements"
    );
}

/// `dst = dst op src`, element-wise. For [`ReduceOp::Avg`] this only sums;
/// divide once at the end with [`divide`]. 16-bit floats are combined in
/// f32 and rounded once per call.
pub fn reduce_into(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    check_lengths(dtype, dst.len(), src.len());
    match dtype {
        DType::F32 => with_slice_mut::<f32, _>(dst, |d| {
            with_slice::<f32, _>(src, |s| combine_slices(d, s, op))
        }),
        DType::F64 => with_slice_mut::<f64, _>(dst, |d| {
            with_slice::<f64, _>(src, |s| combine_slices(d, s, op))
        }),
        DType::I32 => with_slice_mut::<i32, _>(dst, |d| {
            with_slice::<i32, _>(src, |s| combine_slices(d, s, op))
        }),
        DType::I64 => with_slice_mut::<i64, _>(dst, |d| {
            with_slice::<i64, _>(src, |s| combine_slices(d, s, op))
        }),
        DType::U8 => combine_slices(dst, src, op),
        DType::F16 | DType::BF16 => reduce_many(dtype, op, dst, &[src], None, true),
    }
}

/// `dst = srcs[0] op srcs[1] op ...` (when `include_dst`, `dst` itself is
/// the first operand). With `avg_divisor = Some(n)` and `Avg`, the result is
/// divided by `n` before rounding. 16-bit floats accumulate in f32.
pub fn reduce_many(
    dtype: DType,
    op: ReduceOp,
    dst: &mut [u8],
    srcs: &[&[u8]],
    avg_divisor: Option<usize>,
    include_dst: bool,
) {
    for s in srcs {
        check_lengths(dtype, dst.len(), s.len());
    }
    let divisor = if op == ReduceOp::Avg {
        avg_divisor
    } else {
        None
    };
    match dtype {
        DType::F16 => widened::<f16>(
            dst,
            srcs,
            op,
            divisor,
            include_dst,
            f16::to_f32,
            f16::from_f32,
        ),
        DType::BF16 => widened::<bf16>(
            dst,
            srcs,
            op,
            divisor,
            include_dst,
            bf16::to_f32,
            bf16::from_f32,
        ),
        _ => {
            // Block by block, so the destination block stays in L1 while
            // every source streams through once.
            let block = (16 << 10) / dtype.size() * dtype.size();
            let mut start = 0;
            while start < dst.len() {
                let end = (start + block).min(dst.len());
                let d = &mut dst[start..end];
                let mut rest = srcs;
                if !include_dst {
                    let Some((first, tail)) = srcs.split_first() else {
                        return;
                    };
                    d.copy_from_slice(&first[start..end]);
                    rest = tail;
                }
                for s in rest {
                    reduce_into(dtype, op, d, &s[start..end]);
                }
                start = end;
            }
            if let Some(n) = divisor {
                divide(dtype, dst, n);
            }
        }
    }
}

fn widened<T: bytemuck::Pod>(
    dst: &mut [u8],
    srcs: &[&[u8]],
    op: ReduceOp,
    divisor: Option<usize>,
    include_dst: bool,
    up: fn(T) -> f32,
    down: fn(f32) -> T,
) {
    let n = dst.len() / 2;
    let mut acc = vec![0f32; BLOCK.min(n)];
    let mut start = 0;
    while start < n {
        let len = BLOCK.min(n - start);
        let acc = &mut acc[..len];
        let range = start * 2..(start + len) * 2;
        let mut first = true;
        // `block` is this block's bytes of one operand.
        let mut fold = |block: &[u8]| {
            with_slice::<T, _>(block, |s| {
                if first {
                    acc.iter_mut().zip(s).for_each(|(a, v)| *a = up(*v));
                    first = false;
                } else {
                    let mut tmp = [0f32; BLOCK];
                    let tmp = &mut tmp[..len];
                    tmp.iter_mut().zip(s).for_each(|(t, v)| *t = up(*v));
                    combine_slices(acc, tmp, op);
                }
            })
        };
        if include_dst {
            let own = dst[range.clone()].to_vec();
            fold(&own);
        }
        for s in srcs {
            fold(&s[range.clone()]);
        }
        if let Some(d) = divisor {
            acc.iter_mut().for_each(|a| *a /= d as f32);
        }
        with_slice_mut::<T, _>(&mut dst[range], |d| {
            d.iter_mut()
                .zip(acc.iter())
                .for_each(|(o, a)| *o = down(*a))
        });
        start += len;
    }
}

/// Divides every element by `n` (the last step of [`ReduceOp::Avg`]).
pub fn divide(dtype: DType, buf: &mut [u8], n: usize) {
    fn go<T: Combine + bytemuck::Pod>(buf: &mut [u8], n: usize) {
        with_slice_mut::<T, _>(buf, |s| s.iter_mut().for_each(|x| *x = x.divide(n)))
    }
    match dtype {
        DType::F32 => go::<f32>(buf, n),
        DType::F64 => go::<f64>(buf, n),
        DType::I32 => go::<i32>(buf, n),
        DType::I64 => go::<i64>(buf, n),
        DType::U8 => go::<u8>(buf, n),
        DType::F16 => with_slice_mut::<f16, _>(buf, |s| {
            s.iter_mut()
                .for_each(|x| *x = f16::from_f32(x.to_f32() / n as f32))
        }),
        DType::BF16 => with_slice_mut::<bf16, _>(buf, |s| {
            s.iter_mut()
                .for_each(|x| *x = bf16::from_f32(x.to_f32() / n as f32))
        }),
    }
}

/// Widens 16-bit floats to f32 (`src` holds `dst.len()` elements).
pub fn widen_to_f32(dtype: DType, src: &[u8], dst: &mut [f32]) {
    match dtype {
        DType::F16 => with_slice::<f16, _>(src, |s| {
            dst.iter_mut().zip(s).for_each(|(d, v)| *d = v.to_f32())
        }),
        DType::BF16 => with_slice::<bf16, _>(src, |s| {
            dst.iter_mut().zip(s).for_each(|(d, v)| *d = v.to_f32())
        }),
        _ => panic!("widen_to_f32 is for f16/bf16, not {dtype}"),
    }
}

/// Rounds f32 values back to 16-bit floats.
pub fn narrow_from_f32(dtype: DType, src: &[f32], dst: &mut [u8]) {
    match dtype {
        DType::F16 => with_slice_mut::<f16, _>(dst, |d| {
            d.iter_mut()
                .zip(src)
                .for_each(|(o, v)| *o = f16::from_f32(*v))
        }),
        DType::BF16 => with_slice_mut::<bf16, _>(dst, |d| {
            d.iter_mut()
                .zip(src)
                .for_each(|(o, v)| *o = bf16::from_f32(*v))
        }),
        _ => panic!("narrow_from_f32 is for f16/bf16, not {dtype}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    #[test]
    fn every_op_on_f32() {
        let a = [1.0f32, -2.0, 3.0];
        let b = [4.0f32, 5.0, -6.0];
        for (op, want) in [
            (ReduceOp::Sum, [5.0, 3.0, -3.0]),
            (ReduceOp::Prod, [4.0, -10.0, -18.0]),
            (ReduceOp::Min, [1.0, -2.0, -6.0]),
            (ReduceOp::Max, [4.0, 5.0, 3.0]),
        ] {
            let mut d = bytes(&a);
            reduce_into(DType::F32, op, &mut d, &bytes(&b));
            assert_eq!(bytemuck::cast_slice::<u8, f32>(&d), &want, "{op}");
        }
    }

    #[test]
    fn integers_wrap_and_average_truncates() {
        let mut d = bytes(&[250u8, 3]);
        reduce_into(DType::U8, ReduceOp::Sum, &mut d, &bytes(&[10u8, 4]));
        assert_eq!(d, [4, 7]);
        let mut d = bytes(&[7i32, -7]);
        reduce_many(
            DType::I32,
            ReduceOp::Avg,
            &mut d,
            &[&bytes(&[0i32, 0])],
            Some(2),
            true,
        );
        assert_eq!(bytemuck::cast_slice::<u8, i32>(&d), &[3, -3]);
    }

    #[test]
    fn bf16_accumulates_in_f32() {
        // 256 + 1 + 1 + ... in bf16 pairwise would stay 256; in f32 it reaches 264.
        let big = bytes(&[bf16::from_f32(256.0)]);
        let one = bytes(&[bf16::from_f32(1.0)]);
        let srcs: Vec<&[u8]> = std::iter::once(&big[..])
            .chain(std::iter::repeat_n(&one[..], 8))
            .collect();
        let mut d = vec![0u8; 2];
        reduce_many(DType::BF16, ReduceOp::Sum, &mut d, &srcs, None, false);
        assert_eq!(bytemuck::cast_slice::<u8, bf16>(&d)[0].to_f32(), 264.0);
    }

    #[test]
    fn misaligned_buffers_work() {
        let mut d = [0u8; 9];
        d[1..].copy_from_slice(&bytes(&[1.5f64]));
        let mut s = [0u8; 9];
        s[1..].copy_from_slice(&bytes(&[2.0f64]));
        reduce_into(DType::F64, ReduceOp::Sum, &mut d[1..], &s[1..]);
        assert_eq!(bytemuck::pod_read_unaligned::<f64>(&d[1..]), 3.5);
    }
}
