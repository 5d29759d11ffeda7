//! The store's wire format.
//!
//! Every message, request or reply, is one frame:
//!
//! ```text
//! u32 LE  body length (not counting these 4 bytes)
//! u8      protocol version (currently 1)
//! u8      opcode (request) or status (reply)
//! ...     fields: byte strings are u32 LE length + bytes, integers are LE
//! ```
//!
//! Decoding never trusts a length: every length is checked against the
//! [`Limits`] and against the bytes actually present, so a malformed,
//! truncated or oversized frame becomes a [`ProtocolError`], never a panic
//! or an unbounded allocation.

use std::io::{self, Read, Write};

/// Version byte carried by every frame.
pub const VERSION: u8 = 1;

/// Size limits the server enforces (and the client checks before sending).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest key, in bytes, prefix included.
    pub max_key_len: usize,
    /// Longest value, in bytes.
    pub max_value_len: usize,
    /// Most keys in one `wait` or `check`.
    pub max_keys_per_request: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_key_len: 4096,
            max_value_len: 64 << 20,
            max_keys_per_request: 65_536,
        }
    }
}

impl Limits {
    /// Largest frame body accepted: one maximal value plus one maximal key
    /// plus room for the fixed fields, or a request listing many short keys.
    pub fn max_frame_len(&self) -> usize {
        (self.max_value_len + self.max_key_len + 64).max(1 << 20)
    }
}

/// Error categories a server reports to a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ErrorCode {
    /// The frame could not be decoded.
    Malformed = 1,
    /// A frame, key or value is over the server's limits.
    TooLarge = 2,
    /// The client did not present the right token.
    Unauthorized = 3,
    /// A blocking operation's timeout expired.
    Timeout = 4,
    /// The frame's version is not one the server speaks.
    VersionMismatch = 5,
    /// `add` on a value that is not an integer.
    NotAnInteger = 6,
    /// The server is shutting down.
    ShuttingDown = 7,
    /// The server already holds as many connections as it allows (its
    /// `max_connections`); sent, best effort, just before it closes a new
    /// connection. Clients retry until their connect timeout.
    TooManyConnections = 8,
}

impl ErrorCode {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Malformed,
            2 => Self::TooLarge,
            3 => Self::Unauthorized,
            4 => Self::Timeout,
            5 => Self::VersionMismatch,
            6 => Self::NotAnInteger,
            7 => Self::ShuttingDown,
            8 => Self::TooManyConnections,
            _ => return None,
        })
    }
}

/// A client's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// First frame of a connection: presents the shared secret.
    Hello { token: Vec<u8> },
    /// Stores `value` under `key`, replacing any previous value.
    Set { key: Vec<u8>, value: Vec<u8> },
    /// Fetches `key`, waiting up to `timeout_ms` for it to appear
    /// (0: answer `NotFound` at once).
    Get { key: Vec<u8>, timeout_ms: u64 },
    /// Waits up to `timeout_ms` until every key exists.
    Wait { keys: Vec<Vec<u8>>, timeout_ms: u64 },
    /// Reports which of `keys` exist, without waiting.
    Check { keys: Vec<Vec<u8>> },
    /// Adds `delta` to the integer stored at `key` (0 if absent).
    Add { key: Vec<u8>, delta: i64 },
    /// Sets `key` to `desired` if its value equals `expected`
    /// (`None`: if the key is absent).
    CompareSet {
        key: Vec<u8>,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    },
    /// Removes `key`.
    Delete { key: Vec<u8> },
    /// Removes every key starting with `prefix`.
    DeletePrefix { prefix: Vec<u8> },
    /// Number of keys in the whole store.
    NumKeys,
    /// Does nothing; checks the connection.
    Ping,
    /// The server's clock: microseconds since the UNIX epoch (an `Int`),
    /// what ranks align their trace clocks to.
    Time,
}

/// A server's reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    /// Success without a value.
    Ok,
    /// A key's value.
    Value(Vec<u8>),
    /// The key does not exist (non-blocking get).
    NotFound,
    /// An integer result (counter value, number of keys, keys deleted).
    Int(i64),
    /// Whether a key existed (delete).
    Bool(bool),
    /// Which of the checked keys exist, in order.
    Present(Vec<bool>),
    /// Compare-and-set outcome and the value now stored (None: absent).
    Swapped {
        swapped: bool,
        current: Option<Vec<u8>>,
    },
    /// The request failed.
    Error { code: ErrorCode, message: String },
}

/// Why a frame could not be read or decoded.
#[derive(Debug)]
pub enum ProtocolError {
    /// The peer closed the connection cleanly between frames.
    Closed,
    /// The connection ended or failed in the middle of a frame.
    Truncated(io::Error),
    /// The header announced a body larger than allowed.
    TooLarge { len: usize, max: usize },
    /// The frame's contents are not a valid message.
    Malformed(String),
    /// The frame is of a protocol version this side does not speak.
    Version(u8),
    /// A key, value or key list exceeds the limits.
    OverLimit(String),
}

impl std::fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Closed => write!(f, "connection closed"),
            Self::Truncated(e) => write!(f, "truncated frame ({e})"),
            Self::TooLarge { len, max } => {
                write!(f, "frame of {len} bytes exceeds the limit of {max} bytes")
            }
            Self::Malformed(m) => write!(f, "malformed frame: {m}"),
            Self::Version(v) => write!(
                f,
                "protocol version {v} is not supported (this side speaks {VERSION})"
            ),
            Self::OverLimit(m) => write!(f, "{m}"),
        }
    }
}

impl ProtocolError {
    /// The error code a server replies with for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::TooLarge { .. } | Self::OverLimit(_) => ErrorCode::TooLarge,
            Self::Version(_) => ErrorCode::VersionMismatch,
            _ => ErrorCode::Malformed,
        }
    }
}

/// Reads one frame body. A clean end of stream before the first header
/// byte is [`ProtocolError::Closed`]; anywhere else it is `Truncated`.
pub fn read_frame(reader: &mut impl Read, max_len: usize) -> Result<Vec<u8>, ProtocolError> {
    let mut header = [0u8; 4];
    let mut filled = 0;
    while filled < 4 {
        match reader.read(&mut header[filled..]) {
            Ok(0) if filled == 0 => return Err(ProtocolError::Closed),
            Ok(0) => {
                return Err(ProtocolError::Truncated(
                    io::ErrorKind::UnexpectedEof.into(),
                ))
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ProtocolError::Truncated(e)),
        }
    }
    let len = u32::from_le_bytes(header) as usize;
    if len > max_len {
        return Err(ProtocolError::TooLarge { len, max: max_len });
    }
    let mut body = vec![0u8; len];
    reader
        .read_exact(&mut body)
        .map_err(ProtocolError::Truncated)?;
    Ok(body)
}

/// Writes `body` as one frame (header and body in a single write).
pub fn write_frame(writer: &mut impl Write, frame: &[u8]) -> io::Result<()> {
    writer.write_all(frame)?;
    writer.flush()
}

/// Builds frames field by field.
struct Encoder {
    buf: Vec<u8>,
}

impl Encoder {
    fn new(tag: u8) -> Self {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(&[0, 0, 0, 0, VERSION, tag]);
        Encoder { buf }
    }
    fn bytes(mut self, b: &[u8]) -> Self {
        self.buf.extend_from_slice(&(b.len() as u32).to_le_bytes());
        self.buf.extend_from_slice(b);
        self
    }
    fn u8(mut self, v: u8) -> Self {
        self.buf.push(v);
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn keys(mut self, keys: &[Vec<u8>]) -> Self {
        self.buf
            .extend_from_slice(&(keys.len() as u32).to_le_bytes());
        for k in keys {
            self = self.bytes(k);
        }
        self
    }
    fn finish(mut self) -> Vec<u8> {
        let len = (self.buf.len() - 4) as u32;
        self.buf[..4].copy_from_slice(&len.to_le_bytes());
        self.buf
    }
}

/// Reads fields back, checking every length against what is left.
struct Decoder<'a> {
    rest: &'a [u8],
}

impl<'a> Decoder<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], ProtocolError> {
        if self.rest.len() < n {
            return Err(ProtocolError::Malformed(format!(
                "{what} needs {n} bytes but only {} remain",
                self.rest.len()
            )));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }
    fn u8(&mut self, what: &str) -> Result<u8, ProtocolError> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32, ProtocolError> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self, what: &str) -> Result<u64, ProtocolError> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().expect("8 bytes"),
        ))
    }
    fn bytes(&mut self, what: &str, max: usize) -> Result<Vec<u8>, ProtocolError> {
        let len = self.u32(what)? as usize;
        if len > max {
            return Err(ProtocolError::OverLimit(format!(
                "{what} of {len} bytes exceeds the limit of {max} bytes"
            )));
        }
        Ok(self.take(len, what)?.to_vec())
    }
    fn keys(&mut self, limits: &Limits) -> Result<Vec<Vec<u8>>, ProtocolError> {
        let n = self.u32("key count")? as usize;
        if n > limits.max_keys_per_request {
            return Err(ProtocolError::OverLimit(format!(
                "{n} keys in one request exceeds the limit of {}",
                limits.max_keys_per_request
            )));
        }
        // Each key needs at least its 4-byte length: bound the allocation by
        // what the frame can actually hold.
        if n > self.rest.len() / 4 {
            return Err(ProtocolError::Malformed(format!(
                "key count {n} exceeds what the frame holds"
            )));
        }
        (0..n)
            .map(|_| self.bytes("key", limits.max_key_len))
            .collect()
    }
    fn end(&self) -> Result<(), ProtocolError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(ProtocolError::Malformed(format!(
                "{} unexpected trailing bytes",
                self.rest.len()
            )))
        }
    }
}

fn open(body: &[u8]) -> Result<(u8, Decoder<'_>), ProtocolError> {
    let mut d = Decoder { rest: body };
    let version = d.u8("version")?;
    if version != VERSION {
        return Err(ProtocolError::Version(version));
    }
    let tag = d.u8("opcode")?;
    Ok((tag, d))
}

impl Request {
    /// Short name of the operation, for error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Request::Hello { .. } => "hello",
            Request::Set { .. } => "set",
            Request::Get { .. } => "get",
            Request::Wait { .. } => "wait",
            Request::Check { .. } => "check",
            Request::Add { .. } => "add",
            Request::CompareSet { .. } => "compare_set",
            Request::Delete { .. } => "delete",
            Request::DeletePrefix { .. } => "delete_prefix",
            Request::NumKeys => "num_keys",
            Request::Ping => "ping",
            Request::Time => "time",
        }
    }

    /// Encodes the request as a complete frame (header included).
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Request::Hello { token } => Encoder::new(1).bytes(token),
            Request::Set { key, value } => Encoder::new(2).bytes(key).bytes(value),
            Request::Get { key, timeout_ms } => Encoder::new(3).bytes(key).u64(*timeout_ms),
            Request::Wait { keys, timeout_ms } => Encoder::new(4).keys(keys).u64(*timeout_ms),
            Request::Check { keys } => Encoder::new(5).keys(keys),
            Request::Add { key, delta } => Encoder::new(6).bytes(key).u64(*delta as u64),
            Request::CompareSet {
                key,
                expected,
                desired,
            } => {
                let e = Encoder::new(7).bytes(key);
                let e = match expected {
                    Some(v) => e.u8(1).bytes(v),
                    None => e.u8(0),
                };
                e.bytes(desired)
            }
            Request::Delete { key } => Encoder::new(8).bytes(key),
            Request::DeletePrefix { prefix } => Encoder::new(9).bytes(prefix),
            Request::NumKeys => Encoder::new(10),
            Request::Ping => Encoder::new(11),
            Request::Time => Encoder::new(12),
        }
        .finish()
    }

    /// Decodes a frame body, enforcing `limits`.
    pub fn decode(body: &[u8], limits: &Limits) -> Result<Request, ProtocolError> {
        let (tag, mut d) = open(body)?;
        let (k, v) = (limits.max_key_len, limits.max_value_len);
        let req = match tag {
            1 => Request::Hello {
                token: d.bytes("token", k)?,
            },
            2 => Request::Set {
                key: d.bytes("key", k)?,
                value: d.bytes("value", v)?,
            },
            3 => Request::Get {
                key: d.bytes("key", k)?,
                timeout_ms: d.u64("timeout")?,
            },
            4 => Request::Wait {
                keys: d.keys(limits)?,
                timeout_ms: d.u64("timeout")?,
            },
            5 => Request::Check {
                keys: d.keys(limits)?,
            },
            6 => Request::Add {
                key: d.bytes("key", k)?,
                delta: d.u64("delta")? as i64,
            },
            7 => {
                let key = d.bytes("key", k)?;
                let expected = match d.u8("expected flag")? {
                    0 => None,
                    1 => Some(d.bytes("expected value", v)?),
                    f => {
                        return Err(ProtocolError::Malformed(format!(
                            "expected flag {f} is not 0 or 1"
                        )))
                    }
                };
                Request::CompareSet {
                    key,
                    expected,
                    desired: d.bytes("desired value", v)?,
                }
            }
            8 => Request::Delete {
                key: d.bytes("key", k)?,
            },
            9 => Request::DeletePrefix {
                prefix: d.bytes("prefix", k)?,
            },
            10 => Request::NumKeys,
            11 => Request::Ping,
            12 => Request::Time,
            t => return Err(ProtocolError::Malformed(format!("unknown opcode {t}"))),
        };
        d.end()?;
        Ok(req)
    }
}

impl Response {
    /// Encodes the reply as a complete frame (header included).
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Response::Ok => Encoder::new(0),
            Response::Value(v) => Encoder::new(1).bytes(v),
            Response::NotFound => Encoder::new(2),
            Response::Int(i) => Encoder::new(3).u64(*i as u64),
            Response::Bool(b) => Encoder::new(4).u8(*b as u8),
            Response::Present(p) => {
                let bits: Vec<u8> = p.iter().map(|b| *b as u8).collect();
                Encoder::new(5).bytes(&bits)
            }
            Response::Swapped { swapped, current } => {
                let e = Encoder::new(6).u8(*swapped as u8);
                match current {
                    Some(v) => e.u8(1).bytes(v),
                    None => e.u8(0),
                }
            }
            Response::Error { code, message } => {
                Encoder::new(0x80).u8(*code as u8).bytes(message.as_bytes())
            }
        }
        .finish()
    }

    /// Decodes a reply body. Replies are bounded by the frame limit only.
    pub fn decode(body: &[u8]) -> Result<Response, ProtocolError> {
        let (tag, mut d) = open(body)?;
        let max = usize::MAX;
        let resp = match tag {
            0 => Response::Ok,
            1 => Response::Value(d.bytes("value", max)?),
            2 => Response::NotFound,
            3 => Response::Int(d.u64("integer")? as i64),
            4 => Response::Bool(d.u8("bool")? != 0),
            5 => Response::Present(
                d.bytes("presence", max)?
                    .into_iter()
                    .map(|b| b != 0)
                    .collect(),
            ),
            6 => {
                let swapped = d.u8("swapped")? != 0;
                let current = match d.u8("current flag")? {
                    0 => None,
                    _ => Some(d.bytes("current value", max)?),
                };
                Response::Swapped { swapped, current }
            }
            0x80 => {
                let code = d.u8("error code")?;
                let code = ErrorCode::from_u8(code).ok_or_else(|| {
                    ProtocolError::Malformed(format!("unknown error code {code}"))
                })?;
                let message = String::from_utf8_lossy(&d.bytes("message", max)?).into_owned();
                Response::Error { code, message }
            }
            t => {
                return Err(ProtocolError::Malformed(format!(
                    "unknown reply status {t}"
                )))
            }
        };
        d.end()?;
        Ok(resp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(req: Request) {
        let frame = req.encode();
        let body = read_frame(&mut &frame[..], usize::MAX).unwrap();
        assert_eq!(Request::decode(&body, &Limits::default()).unwrap(), req);
    }

    #[test]
    fn requests_roundtrip() {
        roundtrip(Request::Hello {
            token: b"t".to_vec(),
        });
        roundtrip(Request::Set {
            key: b"k".to_vec(),
            value: vec![0, 1, 2],
        });
        roundtrip(Request::Get {
            key: b"k".to_vec(),
            timeout_ms: 7,
        });
        roundtrip(Request::Wait {
            keys: vec![b"a".to_vec(), vec![]],
            timeout_ms: 1,
        });
        roundtrip(Request::Check {
            keys: vec![b"a".to_vec()],
        });
        roundtrip(Request::Add {
            key: b"c".to_vec(),
            delta: -5,
        });
        roundtrip(Request::CompareSet {
            key: b"c".to_vec(),
            expected: None,
            desired: b"x".to_vec(),
        });
        roundtrip(Request::CompareSet {
            key: b"c".to_vec(),
            expected: Some(vec![]),
            desired: vec![],
        });
        roundtrip(Request::Delete { key: b"c".to_vec() });
        roundtrip(Request::DeletePrefix {
            prefix: b"c/".to_vec(),
        });
        roundtrip(Request::NumKeys);
        roundtrip(Request::Ping);
        roundtrip(Request::Time);
    }

    #[test]
    fn responses_roundtrip() {
        for resp in [
            Response::Ok,
            Response::Value(b"v".to_vec()),
            Response::NotFound,
            Response::Int(-3),
            Response::Bool(true),
            Response::Present(vec![true, false]),
            Response::Swapped {
                swapped: false,
                current: None,
            },
            Response::Swapped {
                swapped: true,
                current: Some(b"x".to_vec()),
            },
            Response::Error {
                code: ErrorCode::Timeout,
                message: "late".into(),
            },
            Response::Error {
                code: ErrorCode::TooManyConnections,
                message: "full".into(),
            },
        ] {
            let frame = resp.encode();
            assert_eq!(Response::decode(&frame[4..]).unwrap(), resp);
        }
    }

    #[test]
    fn oversized_header_is_refused_before_allocating() {
        let frame = [0xff, 0xff, 0xff, 0xff, 1, 2];
        assert!(matches!(
            read_frame(&mut &frame[..], 1024),
            Err(ProtocolError::TooLarge { .. })
        ));
    }

    #[test]
    fn limits_apply_to_keys_and_values() {
        let limits = Limits {
            max_key_len: 4,
            max_value_len: 8,
            max_keys_per_request: 2,
        };
        let long_key = Request::Set {
            key: b"12345".to_vec(),
            value: vec![],
        }
        .encode();
        assert!(matches!(
            Request::decode(&long_key[4..], &limits),
            Err(ProtocolError::OverLimit(_))
        ));
        let long_value = Request::Set {
            key: b"k".to_vec(),
            value: vec![0; 9],
        }
        .encode();
        assert!(matches!(
            Request::decode(&long_value[4..], &limits),
            Err(ProtocolError::OverLimit(_))
        ));
        let many = Request::Check {
            keys: vec![vec![]; 3],
        }
        .encode();
        assert!(matches!(
            Request::decode(&many[4..], &limits),
            Err(ProtocolError::OverLimit(_))
        ));
    }

    #[test]
    fn wrong_version_is_reported() {
        let mut frame = Request::Ping.encode();
        frame[4] = 9;
        assert!(matches!(
            Request::decode(&frame[4..], &Limits::default()),
            Err(ProtocolError::Version(9))
        ));
    }
}
