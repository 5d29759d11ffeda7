//! [`Real`]: the element types the CPU kernels run in — f32 for training,
//! f64 for the finite-difference checks of every backward pass.

use crate::tensor_comm::{ReduceKind, TensorComm};
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Neg, Sub, SubAssign};

/// A floating-point element of the CPU kernels.
pub trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + std::fmt::Debug
    + 'static
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
{
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
    /// From f64 (rounded).
    fn of(v: f64) -> Self;
    /// To f64.
    fn f64(self) -> f64;
    /// e^self.
    fn exp(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    /// Square root.
    fn sqrt(self) -> Self;
    /// Hyperbolic tangent.
    fn tanh(self) -> Self;
    /// The larger of two values.
    fn max(self, other: Self) -> Self;
    /// [`TensorComm`]'s all-reduce in this element type.
    fn all_reduce(comm: &dyn TensorComm, x: &mut [Self], op: ReduceKind) -> Result<(), String>;
    /// [`TensorComm`]'s all-gather in this element type.
    fn all_gather(comm: &dyn TensorComm, local: &[Self], full: &mut [Self]) -> Result<(), String>;
    /// [`TensorComm`]'s reduce-scatter in this element type.
    fn reduce_scatter(
        comm: &dyn TensorComm,
        full: &[Self],
        local: &mut [Self],
    ) -> Result<(), String>;
}

macro_rules! real {
    ($t:ty, $ar:ident, $ag:ident, $rs:ident) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            #[inline]
            fn of(v: f64) -> Self {
                v as $t
            }
            #[inline]
            fn f64(self) -> f64 {
                self as f64
            }
            #[inline]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline]
            fn max(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
            fn all_reduce(
                comm: &dyn TensorComm,
                x: &mut [Self],
                op: ReduceKind,
            ) -> Result<(), String> {
                comm.$ar(x, op)
            }
            fn all_gather(
                comm: &dyn TensorComm,
                local: &[Self],
                full: &mut [Self],
            ) -> Result<(), String> {
                comm.$ag(local, full)
            }
            fn reduce_scatter(
                comm: &dyn TensorComm,
                full: &[Self],
                local: &mut [Self],
            ) -> Result<(), String> {
                comm.$rs(full, local)
            }
        }
    };
}
real!(f32, all_reduce_f32, all_gather_f32, reduce_scatter_f32);
real!(f64, all_reduce_f64, all_gather_f64, reduce_scatter_f64);
