//! Training data: tokenizers (bytes, GPT-2 BPE), the built-in synthetic
//! corpus, UTF-8 text files and pre-tokenized u16 shards, and the sampler
//! that cuts (tokens, targets) batches from them.
//!
//! The synthetic corpus is the default: deterministic from its seed, with
//! structure a small model learns in minutes — sentences from a tiny
//! grammar ("the quick fox chases a red bird.") and sums ("23+45=68").

use braid_core::rng::Rng;
use std::path::{Path, PathBuf};

/// GPT-2's vocabulary (its BPE tokenizer).
pub const GPT2_VOCAB: usize = 50257;

/// How text becomes tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tokenizer {
    /// One token per byte (vocabulary 256).
    Bytes,
    /// GPT-2's BPE (vocabulary 50257), through tiktoken-rs.
    Gpt2,
}

impl Tokenizer {
    /// `bytes` or `gpt2`.
    pub fn parse(s: &str) -> Result<Tokenizer, String> {
        match s {
            "bytes" | "byte" => Ok(Tokenizer::Bytes),
            "gpt2" | "bpe" => Ok(Tokenizer::Gpt2),
            other => Err(format!(
                "unknown tokenizer {other:?}: expected bytes or gpt2"
            )),
        }
    }

    /// Name as `parse` accepts it.
    pub fn name(self) -> &'static str {
        match self {
            Tokenizer::Bytes => "bytes",
            Tokenizer::Gpt2 => "gpt2",
        }
    }

    /// Number of distinct tokens.
    pub fn vocab_size(self) -> usize {
        match self {
            Tokenizer::Bytes => 256,
            Tokenizer::Gpt2 => GPT2_VOCAB,
        }
    }

    /// Tokens of `text`.
    pub fn encode(self, text: &str) -> Vec<u32> {
        match self {
            Tokenizer::Bytes => text.bytes().map(u32::from).collect(),
            Tokenizer::Gpt2 => tiktoken_rs::r50k_base_singleton().encode_ordinary(text),
        }
    }

    /// Text of `tokens` (invalid UTF-8 replaced).
    pub fn decode(self, tokens: &[u32]) -> String {
        match self {
            Tokenizer::Bytes => {
                let b: Vec<u8> = tokens.iter().map(|&t| t.min(255) as u8).collect();
                String::from_utf8_lossy(&b).into_owned()
            }
            Tokenizer::Gpt2 => {
                let bytes = tiktoken_rs::r50k_base_singleton()
                    .decode_bytes(tokens)
                    .unwrap_or_default();
                String::from_utf8_lossy(&bytes).into_owned()
            }
        }
    }
}

/// Where training tokens come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The built-in synthetic corpus.
    Synthetic,
    /// Uniformly random tokens over the tokenizer's vocabulary (throughput
    /// measurements, like the PyTorch anchor's random batches).
    Random,
    /// A UTF-8 text file, tokenized at load.
    Text(PathBuf),
    /// Pre-tokenized u16 shards (raw, or llm.c's format with its 1 KiB
    /// header), concatenated in order.
    Shards(Vec<PathBuf>),
}

impl Source {
    /// `synthetic`, a `.bin` file or a directory of them (shards), or any
    /// other file (text).
    pub fn parse(s: &str) -> Result<Source, String> {
        if s == "synthetic" {
            return Ok(Source::Synthetic);
        }
        if s == "random" {
            return Ok(Source::Random);
        }
        let p = PathBuf::from(s);
        if p.is_dir() {
            let mut shards: Vec<PathBuf> = std::fs::read_dir(&p)
                .map_err(|e| format!("{s}: {e}"))?
                .flatten()
                .map(|e| e.path())
                .filter(|f| f.extension().is_some_and(|x| x == "bin"))
                .collect();
            shards.sort();
            if shards.is_empty() {
                return Err(format!("{s}: a directory without .bin token shards"));
            }
            return Ok(Source::Shards(shards));
        }
        if !p.exists() {
            return Err(format!(
                "{s}: no such file (use `synthetic`, `random`, a text file, or u16 .bin shards)"
            ));
        }
        if p.extension().is_some_and(|x| x == "bin") {
            Ok(Source::Shards(vec![p]))
        } else {
            Ok(Source::Text(p))
        }
    }
}

const NOUNS: [&str; 8] = ["cat", "dog", "bird", "fox", "owl", "fish", "mouse", "horse"];
const ADJS: [&str; 8] = [
    "red", "big", "small", "quick", "lazy", "old", "happy", "quiet",
];
const VERBS: [&str; 6] = ["sees", "chases", "likes", "finds", "follows", "hears"];
const DETS: [&str; 2] = ["the", "a"];

/// `bytes` bytes of the synthetic corpus for `seed`.
pub fn synthetic_text(seed: u64, bytes: usize) -> String {
    let mut r = Rng::new(seed ^ 0x5EED_C0DE);
    let mut s = String::with_capacity(bytes + 64);
    let pick = |r: &mut Rng, w: &[&'static str]| w[r.below(w.len())];
    while s.len() < bytes {
        if r.below(2) == 0 {
            let a = r.below(50);
            let b = r.below(50);
            s.push_str(&format!("{a}+{b}={}\n", a + b));
        } else {
            let (d1, a1, n1) = (
                pick(&mut r, &DETS),
                pick(&mut r, &ADJS),
                pick(&mut r, &NOUNS),
            );
            let v = pick(&mut r, &VERBS);
            let (d2, n2) = (pick(&mut r, &DETS), pick(&mut r, &NOUNS));
            s.push_str(&format!("{d1} {a1} {n1} {v} {d2} {n2}.\n"));
        }
    }
    s.truncate(bytes);
    s
}

/// A token stream split into training and held-out parts.
#[derive(Debug, Clone)]
pub struct Dataset {
    tokens: Vec<u32>,
    /// Tokens before this index are for training; the rest for evaluation.
    split: usize,
}

/// llm.c's shard header: 256 i32, magic first.
const SHARD_MAGIC: i32 = 20240520;

fn read_shard(path: &Path, out: &mut Vec<u32>) -> Result<(), String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let body = if bytes.len() >= 1024
        && i32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) == SHARD_MAGIC
    {
        let n = i32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
        let body = &bytes[1024..];
        if body.len() < n * 2 {
            return Err(format!(
                "{}: header says {n} tokens but the file holds {}",
                path.display(),
                body.len() / 2
            ));
        }
        &body[..n * 2]
    } else {
        &bytes[..]
    };
    if body.len() % 2 != 0 {
        return Err(format!(
            "{}: odd number of bytes for u16 tokens",
            path.display()
        ));
    }
    out.extend(
        body.chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32),
    );
    Ok(())
}

impl Dataset {
    /// Loads `source` with `tokenizer`; the last tenth is held out.
    pub fn load(source: &Source, tokenizer: Tokenizer, seed: u64) -> Result<Dataset, String> {
        let tokens = match source {
            Source::Synthetic => tokenizer.encode(&synthetic_text(seed, 1 << 20)),
            Source::Random => {
                let mut r = Rng::new(seed ^ 0x7A4D_0F11);
                let v = tokenizer.vocab_size();
                (0..1 << 22).map(|_| r.below(v) as u32).collect()
            }
            Source::Text(p) => {
                let bytes = std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?;
                tokenizer.encode(utf8_text(&bytes).map_err(|e| format!("{}: {e}", p.display()))?)
            }
            Source::Shards(files) => {
                let mut t = Vec::new();
                for f in files {
                    read_shard(f, &mut t)?;
                }
                t
            }
        };
        // Name the file that holds too few.
        Self::from_tokens(tokens).map_err(|e| match source {
            Source::Text(p) => format!("{}: {e}", p.display()),
            Source::Shards(files) if files.len() == 1 => format!("{}: {e}", files[0].display()),
            _ => e,
        })
    }

    /// A dataset from tokens (the last tenth held out).
    pub fn from_tokens(tokens: Vec<u32>) -> Result<Dataset, String> {
        if tokens.len() < 64 {
            return Err(format!(
                "only {} tokens of data; need at least 64",
                tokens.len()
            ));
        }
        let split = tokens.len() - tokens.len() / 10;
        Ok(Dataset { tokens, split })
    }

    /// Writes the whole stream (the training part, then the held-out
    /// one) to `path` as an llm.c shard: a 1 KiB header (256 i32: magic,
    /// version 1, the token count) and the tokens as little-endian u16,
    /// written whole or not at all. `braid train --data` reads it back as
    /// this dataset (the same split), and numpy reads it with
    /// `np.fromfile(path, np.uint16, offset=1024)`. Returns the bytes
    /// written.
    pub fn write_shard(&self, path: &Path) -> Result<u64, String> {
        if self.max_token() > u16::MAX as u32 {
            return Err(format!(
                "{}: token {} does not fit a u16 shard (a vocabulary of at most 65536)",
                path.display(),
                self.max_token()
            ));
        }
        let n = i32::try_from(self.tokens.len()).map_err(|_| {
            format!(
                "{}: {} tokens are more than an llm.c shard's header counts",
                path.display(),
                self.tokens.len()
            )
        })?;
        let mut bytes = vec![0u8; 1024];
        bytes[..4].copy_from_slice(&SHARD_MAGIC.to_le_bytes());
        bytes[4..8].copy_from_slice(&1i32.to_le_bytes());
        bytes[8..12].copy_from_slice(&n.to_le_bytes());
        bytes.reserve(self.tokens.len() * 2);
        for &t in &self.tokens {
            bytes.extend_from_slice(&(t as u16).to_le_bytes());
        }
        braid_core::atomic_file::write(path, &bytes)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(bytes.len() as u64)
    }

    /// The largest token id.
    pub fn max_token(&self) -> u32 {
        self.tokens.iter().copied().max().unwrap_or(0)
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    fn part(&self, eval: bool) -> (usize, usize) {
        if eval {
            (self.split, self.tokens.len())
        } else {
            (0, self.split)
        }
    }

    /// How many windows of `t` tokens (each with the token after it as
    /// the last target) the training part (`eval`: the held-out part)
    /// holds, side by side.
    pub fn windows(&self, t: usize, eval: bool) -> usize {
        let (lo, hi) = self.part(eval);
        if t == 0 {
            return 0;
        }
        (hi - lo).saturating_sub(1) / t
    }

    /// Window `i` of [`windows`](Self::windows): `t` tokens into `tokens`
    /// and the `t` that follow each into `targets`.
    pub fn window(
        &self,
        i: usize,
        t: usize,
        eval: bool,
        tokens: &mut [u32],
        targets: &mut [u32],
    ) -> Result<(), String> {
        let n = self.windows(t, eval);
        if i >= n || tokens.len() != t || targets.len() != t {
            return Err(format!(
                "window {i} of {n} ({} tokens / {} targets for a window of {t})",
                tokens.len(),
                targets.len()
            ));
        }
        let start = self.part(eval).0 + i * t;
        tokens.copy_from_slice(&self.tokens[start..start + t]);
        targets.copy_from_slice(&self.tokens[start + 1..start + t + 1]);
        Ok(())
    }
}

/// `bytes` as text, or where the first byte that is not UTF-8 sits (its
/// offset and line) and what to do about it.
pub(crate) fn utf8_text(bytes: &[u8]) -> Result<&str, String> {
    std::str::from_utf8(bytes).map_err(|e| {
        let at = e.valid_up_to();
        let line = bytes[..at].iter().filter(|&&b| b == b'\n').count() + 1;
        format!(
            "not UTF-8 at byte {at} (line {line}): text data must be UTF-8 (convert it, for \
             instance with iconv -t UTF-8, or remove the bytes that are not)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_that_is_not_utf8_is_refused_with_the_byte_and_line() {
        assert_eq!(utf8_text("héllo\n".as_bytes()), Ok("héllo\n"));
        let bad = b"one\ntwo \xff three";
        let e = utf8_text(bad).unwrap_err();
        assert!(e.starts_with("not UTF-8 at byte 8 (line 2)"), "{e}");
    }

    #[test]
    fn synthetic_corpus_is_deterministic_and_structured() {
        let a = synthetic_text(1, 4096);
        assert_eq!(a, synthetic_text(1, 4096));
        assert_ne!(a, synthetic_text(2, 4096));
        assert!(a.contains('=') && a.contains("the "));
        for line in a.lines().take(20) {
            if let Some((lhs, sum)) = line.split_once('=') {
                let (x, y) = lhs.split_once('+').unwrap();
                assert_eq!(
                    x.parse::<u32>().unwrap() + y.parse::<u32>().unwrap(),
                    sum.parse::<u32>().unwrap()
                );
            }
        }
    }

    #[test]
    fn tokenizers_round_trip() {
        let s = "the quick fox chases a red bird.";
        assert_eq!(Tokenizer::Bytes.decode(&Tokenizer::Bytes.encode(s)), s);
        let bpe = Tokenizer::Gpt2.encode(s);
        assert!(bpe.len() < s.len());
        assert_eq!(Tokenizer::Gpt2.decode(&bpe), s);
        assert_eq!(Tokenizer::Gpt2.encode("Hello world"), vec![15496, 995]);
    }

    #[test]
    fn batches_are_shifted_windows_and_shards_are_read() {
        let d = Dataset::from_tokens((0..1000).collect()).unwrap();
        assert_eq!(d.windows(8, false), 899 / 8);
        assert_eq!(d.windows(8, true), 99 / 8);
        let (mut x, mut y) = (vec![0; 8], vec![0; 8]);
        d.window(3, 8, false, &mut x, &mut y).unwrap();
        assert_eq!(x, (24..32).collect::<Vec<u32>>());
        for i in 0..8 {
            assert_eq!(y[i], x[i] + 1);
        }
        d.window(0, 8, true, &mut x, &mut y).unwrap();
        assert!(x.iter().all(|&v| v >= 900));
        assert!(d.window(12, 8, true, &mut x, &mut y).is_err());
        // An llm.c-style shard.
        let path = std::env::temp_dir().join(format!("braid-shard-{}.bin", std::process::id()));
        let mut bytes = vec![0u8; 1024];
        bytes[..4].copy_from_slice(&SHARD_MAGIC.to_le_bytes());
        bytes[4..8].copy_from_slice(&1i32.to_le_bytes());
        bytes[8..12].copy_from_slice(&100i32.to_le_bytes());
        for i in 0..100u16 {
            bytes.extend_from_slice(&(i * 7).to_le_bytes());
        }
        std::fs::write(&path, &bytes).unwrap();
        let d = Dataset::load(&Source::Shards(vec![path.clone()]), Tokenizer::Gpt2, 0).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(d.len(), 100);
        assert_eq!(d.max_token(), 99 * 7);
        // Written back as a shard: read as the same dataset, split and all.
        d.write_shard(&path).unwrap();
        let again = Dataset::load(&Source::Shards(vec![path.clone()]), Tokenizer::Gpt2, 0).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            (again.tokens.clone(), again.split),
            (d.tokens.clone(), d.split)
        );
        let wide = Dataset::from_tokens(vec![70_000; 64]).unwrap();
        assert!(wide.write_shard(&path).unwrap_err().contains("u16"));
    }
}
