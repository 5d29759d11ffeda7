//! The parameter server's wire format: one frame per message, a fixed
//! 56-byte little-endian header and a payload of f32 values (or another
//! encoding the header names), over a TCP stream.
//!
//! Every read and write is bounded by the stream's timeouts; an error
//! says what was being read or written, so the caller can name the peer.

use std::io::{self, Read, Write};

/// The first four bytes of every frame ("BPS1").
pub const MAGIC: u32 = 0x3153_5042;

/// The largest payload a frame may carry: 4 GiB (a shard of a 1B-parameter
/// model in f32); anything longer is a corrupt or foreign stream.
pub const MAX_PAYLOAD: u64 = 1 << 32;

const HEADER: usize = 56;

/// What a frame asks or answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Worker → server: who it is (`worker`, `step` = the workers' count,
    /// `offset` = the flat buffer's length, payload = the run's
    /// description, which must agree).
    Hello = 1,
    /// Server → worker: the shard (`offset`, `step` = its length), the
    /// server's version of the parameters (`a`), whether they were given
    /// (`b`), and the worker's clock (payload: 8 bytes, little-endian: the
    /// step it goes on from).
    Welcome = 2,
    /// Worker → server: the shard's initial parameters (payload).
    Init = 3,
    /// Worker → server: parameters wanted (reply [`Kind::Params`]).
    GetParams = 4,
    /// Server → worker: the shard's parameters (payload), at version
    /// `step`, with the staleness of the worker's last push in `a`.
    Params = 5,
    /// Worker → server: gradients of step `step` for the shard's elements
    /// from `offset` (payload).
    Push = 6,
    /// Worker → server: the sum over the workers of step `step`'s
    /// gradients, wanted (reply [`Kind::Sum`]).
    GetSum = 7,
    /// Server → worker: that sum (payload).
    Sum = 8,
    /// Worker → server: the squared norm of step `step`'s summed
    /// gradients wanted (reply [`Kind::Norm`]).
    GetNorm = 9,
    /// Server → worker: the squared norm in `a`.
    Norm = 10,
    /// Worker → server: apply step `step` with learning rate `a` and
    /// gradient scale `b`; reply [`Kind::Params`].
    Update = 11,
    /// Worker → server: done (the connection closes after it).
    Bye = 12,
    /// Either way: what went wrong (payload: UTF-8 text).
    Error = 13,
    /// Worker → server: the shard's whole state wanted (reply
    /// [`Kind::State`]).
    GetState = 14,
    /// Either way: a shard's state — its parameters then each optimizer
    /// moment, one after another (payload), `a` the number of moments,
    /// `b` the optimizer's update count, `step` the version. Worker →
    /// server: replaces the shard's (a resumed run).
    State = 15,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        use Kind::*;
        Some(match v {
            1 => Hello,
            2 => Welcome,
            3 => Init,
            4 => GetParams,
            5 => Params,
            6 => Push,
            7 => GetSum,
            8 => Sum,
            9 => GetNorm,
            10 => Norm,
            11 => Update,
            12 => Bye,
            13 => Error,
            14 => GetState,
            15 => State,
            _ => return None,
        })
    }
}

/// How a frame's payload holds its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Encoding {
    /// Raw little-endian f32 (or UTF-8 text for descriptions and errors).
    F32 = 0,
    /// Little-endian IEEE half floats (2 bytes a value).
    F16 = 1,
    /// Sparse: the nonzero values only, each as a u32 index and an f32
    /// (8 bytes), the dense length in the frame's `b` (a top-k push).
    Sparse = 2,
}

/// One message.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    pub kind: Kind,
    pub encoding: Encoding,
    pub worker: u32,
    pub step: u64,
    pub offset: u64,
    pub a: f64,
    pub b: f64,
    pub payload: Vec<u8>,
}

impl Frame {
    /// A frame of `kind` with every field zero and no payload.
    pub fn new(kind: Kind) -> Frame {
        Frame {
            kind,
            encoding: Encoding::F32,
            worker: 0,
            step: 0,
            offset: 0,
            a: 0.0,
            b: 0.0,
            payload: Vec::new(),
        }
    }

    /// An error frame saying `text`.
    pub fn error(text: &str) -> Frame {
        Frame {
            payload: text.as_bytes().to_vec(),
            ..Frame::new(Kind::Error)
        }
    }

    /// `values` as the payload, in `encoding` (sparse: the dense length
    /// goes in `b`).
    pub fn with_values(mut self, values: &[f32], encoding: Encoding) -> Frame {
        self.encoding = encoding;
        self.payload = encode(values, encoding);
        if encoding == Encoding::Sparse {
            self.b = values.len() as f64;
        }
        self
    }

    /// The payload as text (descriptions, errors).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.payload).into_owned()
    }

    /// Number of values the payload holds.
    pub fn value_count(&self) -> usize {
        match self.encoding {
            Encoding::F32 => self.payload.len() / 4,
            Encoding::F16 => self.payload.len() / 2,
            Encoding::Sparse => self.b as usize,
        }
    }

    /// Writes the payload's values into `out` (exactly
    /// [`value_count`](Self::value_count) of them).
    pub fn values_into(&self, out: &mut [f32]) -> Result<(), String> {
        if out.len() != self.value_count() {
            return Err(format!(
                "a {:?} frame of {} values where {} were expected",
                self.kind,
                self.value_count(),
                out.len()
            ));
        }
        decode(&self.payload, self.encoding, out)
    }

    /// The payload's values (a sparse payload whose indices fall outside
    /// its length leaves those out).
    pub fn values(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.value_count()];
        let _ = decode(&self.payload, self.encoding, &mut out);
        out
    }

    /// Writes the frame to `w` (one buffered write of header and payload).
    pub fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
        let mut h = [0u8; HEADER];
        h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        h[4] = self.kind as u8;
        h[5] = self.encoding as u8;
        h[8..12].copy_from_slice(&self.worker.to_le_bytes());
        h[12..20].copy_from_slice(&self.step.to_le_bytes());
        h[20..28].copy_from_slice(&self.offset.to_le_bytes());
        h[28..36].copy_from_slice(&self.a.to_le_bytes());
        h[36..44].copy_from_slice(&self.b.to_le_bytes());
        h[44..52].copy_from_slice(&(self.payload.len() as u64).to_le_bytes());
        w.write_all(&h)?;
        w.write_all(&self.payload)?;
        w.flush()
    }

    /// Reads one frame from `r`. `Ok(None)`: the stream ended cleanly
    /// before a frame began.
    pub fn read_from(r: &mut impl Read) -> io::Result<Option<Frame>> {
        let mut h = [0u8; HEADER];
        let mut got = 0;
        while got < HEADER {
            match r.read(&mut h[got..]) {
                Ok(0) if got == 0 => return Ok(None),
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "a frame cut short",
                    ))
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
        let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
        if u32_at(0) != MAGIC {
            return Err(bad(format!(
                "not a parameter-server frame (magic {:#010x}): is something else listening on \
                 that port?",
                u32_at(0)
            )));
        }
        let kind =
            Kind::from_u8(h[4]).ok_or_else(|| bad(format!("unknown frame kind {}", h[4])))?;
        let encoding = match h[5] {
            0 => Encoding::F32,
            1 => Encoding::F16,
            2 => Encoding::Sparse,
            e => return Err(bad(format!("unknown payload encoding {e}"))),
        };
        let len = u64_at(44);
        if len > MAX_PAYLOAD {
            return Err(bad(format!(
                "a payload of {len} bytes (at most {MAX_PAYLOAD})"
            )));
        }
        let mut payload = vec![0u8; len as usize];
        r.read_exact(&mut payload)?;
        Ok(Some(Frame {
            kind,
            encoding,
            worker: u32_at(8),
            step: u64_at(12),
            offset: u64_at(20),
            a: f64::from_le_bytes(h[28..36].try_into().expect("8 bytes")),
            b: f64::from_le_bytes(h[36..44].try_into().expect("8 bytes")),
            payload,
        }))
    }
}

/// `values` in `encoding`.
pub fn encode(values: &[f32], encoding: Encoding) -> Vec<u8> {
    match encoding {
        Encoding::F32 => {
            let mut out = Vec::with_capacity(values.len() * 4);
            for v in values {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out
        }
        Encoding::F16 => {
            let mut out = Vec::with_capacity(values.len() * 2);
            for v in values {
                out.extend_from_slice(&half::f16::from_f32(*v).to_le_bytes());
            }
            out
        }
        Encoding::Sparse => {
            let mut out = Vec::new();
            for (i, v) in values.iter().enumerate().filter(|(_, v)| **v != 0.0) {
                out.extend_from_slice(&(i as u32).to_le_bytes());
                out.extend_from_slice(&v.to_le_bytes());
            }
            out
        }
    }
}

/// `bytes` in `encoding` decoded into `out` (as many values as fit; a
/// sparse index outside `out` is an error).
fn decode(bytes: &[u8], encoding: Encoding, out: &mut [f32]) -> Result<(), String> {
    match encoding {
        Encoding::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes(c.try_into().expect("4 bytes"));
            }
        }
        Encoding::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_le_bytes(c.try_into().expect("2 bytes")).to_f32();
            }
        }
        Encoding::Sparse => {
            out.fill(0.0);
            let len = out.len();
            for c in bytes.chunks_exact(8) {
                let i = u32::from_le_bytes(c[..4].try_into().expect("4 bytes")) as usize;
                let v = f32::from_le_bytes(c[4..].try_into().expect("4 bytes"));
                *out.get_mut(i).ok_or_else(|| {
                    format!("a sparse payload's index {i} past its {len} values")
                })? = v;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_reads_back_as_written() {
        let f = Frame {
            worker: 3,
            step: 17,
            offset: 1 << 40,
            a: 3e-4,
            b: -0.5,
            ..Frame::new(Kind::Update)
        }
        .with_values(&[1.0, -2.5, 3.25], Encoding::F32);
        let mut bytes = Vec::new();
        f.write_to(&mut bytes).unwrap();
        let back = Frame::read_from(&mut bytes.as_slice()).unwrap().unwrap();
        assert_eq!(back, f);
        assert_eq!(back.values(), vec![1.0, -2.5, 3.25]);
        let h = Frame::new(Kind::Push).with_values(&[0.5, 65504.0], Encoding::F16);
        assert_eq!(h.payload.len(), 4);
        assert_eq!(h.values(), vec![0.5, 65504.0]);
        let dense = [0.0, 3.0, 0.0, 0.0, -1.5, 0.0];
        let sp = Frame::new(Kind::Push).with_values(&dense, Encoding::Sparse);
        assert_eq!(sp.payload.len(), 16);
        let mut bytes = Vec::new();
        sp.write_to(&mut bytes).unwrap();
        let back = Frame::read_from(&mut bytes.as_slice()).unwrap().unwrap();
        assert_eq!(back.values(), dense.to_vec());
        let mut bad = back.clone();
        bad.b = 3.0;
        let mut out = [0f32; 3];
        assert!(bad
            .values_into(&mut out)
            .unwrap_err()
            .contains("past its 3 values"));
    }

    #[test]
    fn foreign_and_cut_streams_are_said() {
        assert!(Frame::read_from(&mut &[][..]).unwrap().is_none());
        let err = Frame::read_from(
            &mut &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n........................................"[..],
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("not a parameter-server frame"),
            "{err}"
        );
        let mut bytes = Vec::new();
        Frame::new(Kind::Bye)
            .with_values(&[1.0; 8], Encoding::F32)
            .write_to(&mut bytes)
            .unwrap();
        let err = Frame::read_from(&mut &bytes[..40]).unwrap_err();
        assert!(err.to_string().contains("cut short"), "{err}");
        let mut wrong = [0u8; 80];
        wrong[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        wrong[4] = 99;
        let err = Frame::read_from(&mut &wrong[..]).unwrap_err();
        assert!(err.to_string().contains("unknown frame kind 99"), "{err}");
    }
}
