//! GPT training windows from a `.beton` file (`braid train --data
//! X.beton`): each sample's token field holds a window of `T + 1` tokens
//! (the inputs and the token after them); an int field `split` (0 train,
//! 1 held out), when present, says which part a window belongs to. This
//! is what `braid data write --tokens` writes; a foreign file with a 1-D
//! u16/u32 array field works too. The file is memory-mapped (the OS
//! cache, shared by the ranks of a node), so a window costs a copy of its
//! tokens, and [`crate::loader::TokenWindows`] deals the windows out to
//! ranks exactly as it deals a flat token file's: the same `T` and seed
//! give the same batches from either. Shorter sequences are cut from the
//! stored windows, as many from each as it holds (`T / t`), so that a
//! run at a shorter length still reads the whole corpus.

use std::path::Path;

use crate::beton::{Beton, DType, FieldType, Value};
use crate::loader::{Result, WindowSource};

/// A `.beton` file's token windows.
pub struct BetonTokens {
    file: Beton,
    tokens: usize,
    /// Samples of the training part, then of the held-out part.
    train: Vec<usize>,
    held: Vec<usize>,
    /// Tokens per stored window (`T + 1`).
    width: usize,
    max_token: u32,
}

impl BetonTokens {
    /// Opens `path`, reading `field` (default: `tokens`, else the only
    /// 1-D integer array field) and the `split` field if there is one.
    pub fn open(path: &Path, field: Option<&str>) -> Result<BetonTokens> {
        let file = Beton::open(path)?;
        let name = path.display();
        let index = file.index();
        let pick = |f: usize| -> Option<(usize, Option<u64>)> {
            match &index.fields[f].ty {
                FieldType::Tokens {
                    dtype: DType::U16 | DType::U32,
                    window,
                    vocab,
                } => Some((*window as usize, Some(*vocab))),
                FieldType::NdArray { dtype, shape } | FieldType::TorchTensor { dtype, shape }
                    if shape.len() == 1 && matches!(dtype, DType::U16 | DType::U32) =>
                {
                    Some((shape[0] as usize, None))
                }
                _ => None,
            }
        };
        let f = match field {
            Some(n) => index.field(n)?,
            None => match index.field("tokens") {
                Ok(f) => f,
                Err(_) => {
                    let candidates: Vec<usize> = (0..index.fields.len())
                        .filter(|&f| pick(f).is_some())
                        .collect();
                    match candidates[..] {
                        [f] => f,
                        _ => {
                            return Err(format!(
                                "{name}: no field `tokens` and {} 1-D u16/u32 array fields to train from; fields: {}",
                                candidates.len(),
                                fields_of(&file)
                            ))
                        }
                    }
                }
            },
        };
        let (width, vocab) = pick(f).ok_or_else(|| {
            format!(
                "{name}: field {:?} is {}, not token windows (braid data write --tokens makes them; or a 1-D u16/u32 array)",
                index.fields[f].name,
                index.fields[f].ty.name()
            )
        })?;
        if width < 2 {
            return Err(format!(
                "{name}: windows of {width} tokens: a window needs at least 2"
            ));
        }
        let (mut train, mut held) = (Vec::new(), Vec::new());
        match index.field("split") {
            Ok(sf) if index.fields[sf].ty == FieldType::Int => {
                for s in 0..file.len() {
                    match file.value(s, sf)? {
                        Value::Int(0) => train.push(s),
                        Value::Int(1) => held.push(s),
                        other => {
                            return Err(format!(
                                "{name}: sample {s}: split {other:?}; expected 0 (train) or 1 (held out)"
                            ))
                        }
                    }
                }
            }
            _ => train = (0..file.len()).collect(),
        }
        let max_token = match vocab {
            Some(v) if v > 0 => (v - 1).min(u32::MAX as u64) as u32,
            _ => {
                // A foreign array: every token looked at once.
                let mut m = 0;
                for s in 0..file.len() {
                    let t = file.value(s, f)?.tokens().unwrap_or_default();
                    m = t.into_iter().fold(m, u32::max);
                }
                m
            }
        };
        Ok(BetonTokens {
            file,
            tokens: f,
            train,
            held,
            width,
            max_token,
        })
    }

    /// Tokens per stored window (inputs and the next token).
    pub fn window_len(&self) -> usize {
        self.width
    }
}

fn fields_of(b: &Beton) -> String {
    b.index()
        .fields
        .iter()
        .map(|f| format!("{} ({})", f.name, f.ty.name()))
        .collect::<Vec<_>>()
        .join(", ")
}

impl BetonTokens {
    /// Windows of `t` tokens cut from each stored window (its `T` tokens
    /// and the one after them; consecutive windows share no input token).
    pub fn windows_per_sample(&self, t: usize) -> usize {
        match t {
            0 => 0,
            _ => (self.width - 1) / t,
        }
    }
}

impl WindowSource for BetonTokens {
    fn windows(&self, t: usize, eval: bool) -> usize {
        let part = if eval { &self.held } else { &self.train };
        part.len() * self.windows_per_sample(t)
    }

    fn window(
        &self,
        i: usize,
        t: usize,
        eval: bool,
        tokens: &mut [u32],
        targets: &mut [u32],
    ) -> Result<()> {
        if t + 1 > self.width {
            return Err(format!(
                "{}: its windows hold {} tokens; --seq {t} needs {}: use --seq {} or less, or rewrite it with braid data write --seq {t}",
                self.file.index().path,
                self.width - 1,
                t + 1,
                self.width - 1
            ));
        }
        let part = if eval { &self.held } else { &self.train };
        let per = self.windows_per_sample(t);
        let s = *part.get(i / per).ok_or_else(|| {
            format!(
                "window {i} of {} in the {} part",
                part.len() * per,
                if eval { "held-out" } else { "training" }
            )
        })?;
        // The window's first token in the stored one.
        let first = (i % per) * t;
        if tokens.len() != t || targets.len() != t {
            return Err(format!(
                "{} tokens / {} targets for a window of {t}",
                tokens.len(),
                targets.len()
            ));
        }
        let (dtype, data) = match self.file.value(s, self.tokens)? {
            Value::Tokens { dtype, data } => (dtype, data),
            Value::Array { dtype, data, .. } => (dtype, data),
            _ => unreachable!("the field was checked to hold token windows"),
        };
        if data.len() < (first + t + 1) * dtype.size() {
            return Err(format!(
                "{}: sample {s}'s window has {} bytes, fewer than {} tokens",
                self.file.index().path,
                data.len(),
                first + t + 1
            ));
        }
        let at = |k: usize| -> u32 {
            match dtype {
                DType::U16 => u16::from_le_bytes([data[2 * k], data[2 * k + 1]]) as u32,
                _ => u32::from_le_bytes([
                    data[4 * k],
                    data[4 * k + 1],
                    data[4 * k + 2],
                    data[4 * k + 3],
                ]),
            }
        };
        for k in 0..t {
            tokens[k] = at(first + k);
            targets[k] = at(first + k + 1);
        }
        if let Some(bad) = tokens
            .iter()
            .chain(targets.iter())
            .find(|&&v| v > self.max_token)
        {
            return Err(format!(
                "{}: sample {s} holds token {bad}, beyond the field's vocabulary of {}",
                self.file.index().path,
                self.max_token as u64 + 1
            ));
        }
        Ok(())
    }

    fn max_token(&self) -> u32 {
        self.max_token
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::Dataset;

    /// A sequence shorter than the stored windows is cut from them, as
    /// many as each holds, the same windows the flat data gives where the
    /// stored length divides by it.
    #[test]
    fn shorter_sequences_are_cut_from_every_stored_window() {
        let d = Dataset::from_tokens((0..2000).map(|x| x % 251).collect()).unwrap();
        let out = std::env::temp_dir().join(format!("braid-subwin-{}.beton", std::process::id()));
        crate::convert::token_windows(&out, &d, 32, 256, 1 << 16, &mut |_, _| {}).unwrap();
        let b = BetonTokens::open(&out, None).unwrap();
        std::fs::remove_file(&out).unwrap();
        assert_eq!(b.windows(32, false), d.windows(32, false));
        assert_eq!(b.windows_per_sample(8), 4);
        assert_eq!(b.windows(8, false), 4 * d.windows(32, false));
        assert_eq!(b.windows(8, true), 4 * d.windows(32, true));
        assert_eq!(b.windows(33, false), 0);
        let (mut x, mut y) = (vec![0; 8], vec![0; 8]);
        let (mut fx, mut fy) = (vec![0; 8], vec![0; 8]);
        for i in [0, 1, 3, 4, 17, b.windows(8, false) - 1] {
            b.window(i, 8, false, &mut x, &mut y).unwrap();
            d.window(i, 8, false, &mut fx, &mut fy).unwrap();
            assert_eq!((&x, &y), (&fx, &fy), "window {i}");
        }
        assert!(b
            .window(b.windows(8, false), 8, false, &mut x, &mut y)
            .is_err());
    }
}
