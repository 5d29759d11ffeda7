//! [`e`]: an error of the layers below (CUDA's, the model's) as a
//! message, the crate's error type.

pub(super) fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}
