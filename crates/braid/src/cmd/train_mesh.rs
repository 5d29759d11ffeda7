//! `braid train`'s tensor-parallel knobs from the environment, checked
//! at start with one clear error (the rank's place and its groups:
//! [`braid_train::place`]).

/// `BRAID_TP_OVERLAP=K`: the bf16 engine's row-split products run in K
/// row blocks, each block's sum over the tensor group beside the next
/// block's product; unset or 1, the whole product then its sum (to be
/// chosen by measurement: `bash bench/device/tp.sh overlap`).
pub fn tensor_overlap_blocks() -> Result<usize, String> {
    match std::env::var(braid_core::env::BRAID_TP_OVERLAP).as_deref() {
        Err(_) | Ok("") => Ok(1),
        Ok(v) => match v.parse::<usize>() {
            Ok(k) if (1..=64).contains(&k) => Ok(k),
            _ => Err(format!(
                "BRAID_TP_OVERLAP={v}: expected a number of row blocks from 1 to 64"
            )),
        },
    }
}

/// `BRAID_TP_GRAD_OVERLAP=on|off`: the bf16 engine's backward pass sums
/// each column-split product's input gradient (qkv's, the MLP's first)
/// over the tensor group on the group's stream while its weight gradient
/// runs (`on`, the default: Megatron's overlap, the LayerNorm's output
/// recomputed for it first), or sums first (`off`). The same bits either
/// way; on 4 H100s `--tp 4` measured 206.8 / 206.4 against 211.1 / 210.4
/// ms a step at 2.65B and 447.0 against 451.9 ms at 12.85B (`bash
/// bench/device/tp.sh grads`).
pub fn tensor_grad_sums_beside() -> Result<bool, String> {
    match std::env::var(braid_core::env::BRAID_TP_GRAD_OVERLAP).as_deref() {
        Err(_) | Ok("") | Ok("on") => Ok(true),
        Ok("off") => Ok(false),
        Ok(v) => Err(format!("BRAID_TP_GRAD_OVERLAP={v}: expected on or off")),
    }
}

/// `BRAID_TP_SUMS=f32|bf16`: the dtype in which the bf16 engine sums its
/// row-split products (the attention's output projection, the MLP's
/// second product) over the tensor group — `bf16` (the default,
/// Megatron's: half the bytes, the sum rounded to bf16 once before every
/// rank adds the residual and bias in f32) or `f32` (the f32 partial
/// products, the residual and bias added by the group's first rank
/// before the sum). bf16 measured faster on 4 H100s, `--tp 4`: 214.8
/// against 231.4 ms a step at 2.65B, 477.8 against 503.8 ms at 12.85B
/// (`bash bench/device/tp.sh sums`), and tracks one GPU as closely.
pub fn tensor_sums_in_bf16() -> Result<bool, String> {
    match std::env::var(braid_core::env::BRAID_TP_SUMS).as_deref() {
        Ok("f32") => Ok(false),
        Err(_) | Ok("") | Ok("bf16") => Ok(true),
        Ok(v) => Err(format!("BRAID_TP_SUMS={v}: expected f32 or bf16")),
    }
}

/// The tensor-group knobs that sequence parallelism in the bf16 engine
/// does not take, refused with the way out: its row-split products are
/// always summed in bf16 (a reduce-scatter onto each rank's rows), whole.
/// (`BRAID_TP_GRAD_OVERLAP` is allowed and does nothing there: the input
/// gradients' reductions run in order.)
pub fn sequence_knobs(bf16_sequence: bool) -> Result<(), String> {
    if !bf16_sequence {
        return Ok(());
    }
    if tensor_overlap_blocks()? > 1 {
        return Err(
            "BRAID_TP_OVERLAP: row blocks are not built with sequence parallelism in the bf16 \
             engine (unset it, or add --no-sp)"
                .into(),
        );
    }
    if !tensor_sums_in_bf16()? {
        return Err(
            "BRAID_TP_SUMS=f32: sequence parallelism in the bf16 engine reduce-scatters in bf16 \
             (unset it, or add --no-sp)"
                .into(),
        );
    }
    Ok(())
}
