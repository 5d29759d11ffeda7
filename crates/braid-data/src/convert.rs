//! Making `.beton` files from other data (`braid data write`): token
//! streams into GPT windows, JSON lines into a JSON field, image folders
//! into image and label fields. Samples are encoded in parallel (rayon)
//! in chunks and written in order, so the output is the same on any
//! number of cores; `progress` hears after each chunk.

use std::path::Path;

use rayon::prelude::*;

use crate::beton::{DType, FieldType, FieldValue, Writer, Written};
use crate::tokens::Dataset;

/// Samples encoded between two progress reports.
const CHUNK: usize = 256;

/// Called with (samples written, samples in all) after each chunk.
pub type Progress<'a> = dyn FnMut(u64, u64) + 'a;

/// Writes `n` samples whose values `make(i)` builds (in parallel) into
/// `out`.
pub fn write_samples(
    out: &Path,
    fields: &[(String, FieldType)],
    n: u64,
    page_size: u64,
    make: &(dyn Fn(u64) -> Result<Vec<FieldValue>, String> + Sync),
    progress: &mut Progress,
) -> Result<Written, String> {
    let mut w = Writer::create(out, fields, n, page_size)?;
    let mut at = 0u64;
    while at < n {
        let end = (at + CHUNK as u64 * rayon::current_num_threads() as u64).min(n);
        let chunk: Vec<Vec<FieldValue>> = (at..end)
            .into_par_iter()
            .map(make)
            .collect::<Result<_, _>>()?;
        for s in &chunk {
            w.push(s)?;
        }
        at = end;
        progress(at, n);
    }
    w.finish()
}

/// GPT training windows of `dataset`: `t + 1` tokens per sample (a
/// window's inputs and the token after them), side by side at stride `t`;
/// the training part's windows first, then the held-out part's, told
/// apart by the int field `split` (0: train, 1: held out). Tokens are u16
/// when the vocabulary allows, else u32.
pub fn token_windows(
    out: &Path,
    dataset: &Dataset,
    t: usize,
    vocab: usize,
    page_size: u64,
    progress: &mut Progress,
) -> Result<Written, String> {
    let (train, held) = (dataset.windows(t, false), dataset.windows(t, true));
    if train == 0 || held == 0 {
        return Err(format!(
            "the data holds {train} training and {held} held-out windows of {t} tokens: use more data or a shorter --seq"
        ));
    }
    let dtype = if vocab <= 1 << 16 && (dataset.max_token() as usize) < 1 << 16 {
        DType::U16
    } else {
        DType::U32
    };
    let fields = vec![
        (
            "tokens".to_string(),
            FieldType::Tokens {
                dtype,
                window: t as u64 + 1,
                vocab: vocab as u64,
            },
        ),
        ("split".to_string(), FieldType::Int),
    ];
    let make = |i: u64| -> Result<Vec<FieldValue>, String> {
        let (i, eval) = if (i as usize) < train {
            (i as usize, false)
        } else {
            (i as usize - train, true)
        };
        let (mut x, mut y) = (vec![0u32; t], vec![0u32; t]);
        dataset.window(i, t, eval, &mut x, &mut y)?;
        x.push(y[t - 1]);
        Ok(vec![FieldValue::Tokens(x), FieldValue::Int(eval as i64)])
    };
    write_samples(
        out,
        &fields,
        (train + held) as u64,
        page_size,
        &make,
        progress,
    )
}

/// One JSON field (`field`) per line of a JSON-lines file (blank lines
/// skipped); a line that is not JSON is an error naming it.
pub fn json_lines(
    out: &Path,
    input: &Path,
    field: &str,
    page_size: u64,
    progress: &mut Progress,
) -> Result<Written, String> {
    let text = std::fs::read_to_string(input)
        .map_err(|e| format!("cannot read {}: {e}", input.display()))?;
    let lines: Vec<(usize, &str)> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .collect();
    if lines.is_empty() {
        return Err(format!("{}: no JSON lines", input.display()));
    }
    let fields = vec![(field.to_string(), FieldType::Json)];
    let make = |i: u64| -> Result<Vec<FieldValue>, String> {
        let (no, line) = lines[i as usize];
        serde_json::from_str::<serde::de::IgnoredAny>(line)
            .map_err(|e| format!("{}:{}: not JSON ({e})", input.display(), no + 1))?;
        Ok(vec![FieldValue::Json(line.trim().to_string())])
    };
    write_samples(out, &fields, lines.len() as u64, page_size, &make, progress)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::beton::Beton;

    #[test]
    fn token_windows_hold_each_window_and_its_next_token() {
        let d = Dataset::from_tokens((0..1000).map(|x| x * 70).collect()).unwrap();
        let out = std::env::temp_dir().join(format!("braid-tokwin-{}.beton", std::process::id()));
        let mut calls = 0;
        let w = token_windows(&out, &d, 16, 70_000, 1 << 16, &mut |_, _| calls += 1).unwrap();
        assert!(calls >= 1);
        let b = Beton::open(&out).unwrap();
        std::fs::remove_file(&out).unwrap();
        assert_eq!(
            w.samples as usize,
            d.windows(16, false) + d.windows(16, true)
        );
        // Tokens up to 69930 need u32.
        assert_eq!(b.index().fields[0].ty.name(), "tokens <u4 [17]");
        let first = b.value(0, 0).unwrap().tokens().unwrap();
        assert_eq!(first, (0..17).map(|x| x * 70).collect::<Vec<u32>>());
        let last = b.len() - 1;
        assert_eq!(b.value(last, 1).unwrap(), crate::beton::Value::Int(1));
        assert_eq!(b.value(0, 1).unwrap(), crate::beton::Value::Int(0));
    }
}
