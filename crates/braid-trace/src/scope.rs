//! [`timed`] and [`Timed`]: a piece of work as a span on the clock it runs
//! on — a GPU stream's (CUDA events) or the host's — in one line at the
//! call site, and as an NVTX range for Nsight where a tool is attached. A
//! trace's failure to record (a CUDA error on an event) is reported once on
//! stderr and never fails the work itself.

use crate::recorder::{self, track, Cat};
use crate::{device, nvtx};
use braid_cuda::Stream;
use std::sync::Once;

fn warn(e: impl std::fmt::Display) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| eprintln!("braid: warning: a GPU trace span could not be recorded ({e}); the trace will miss some GPU work"));
}

/// Runs `f` as a span named `name()` of category `cat`: timed on
/// `stream`'s device (on the GPU compute track) when given, on the host
/// (on the training loop's track) otherwise; and as an NVTX range where a
/// tool is attached ([`nvtx`]). Costs two atomic loads when nothing
/// records.
#[inline]
pub fn timed<R>(
    stream: Option<&Stream>,
    cat: Cat,
    name: impl FnOnce() -> String,
    f: impl FnOnce() -> R,
) -> R {
    let _t = start(stream, cat, name);
    f()
}

/// A span that ends when dropped ([`start`]), on a GPU stream or the host,
/// with its NVTX range.
#[must_use = "a span ends when dropped: bind it to a name"]
pub struct Timed {
    inner: Option<Inner>,
    // (Dropped after `inner`'s span ends: the range encloses it.)
    _range: Option<nvtx::Range>,
}

enum Inner {
    Host {
        _span: recorder::HostSpan,
    },
    Device {
        stream: Stream,
        mark: Option<device::Mark>,
        name: String,
        cat: Cat,
    },
}

/// Starts a span named `name()` of category `cat` on `stream` (the GPU
/// compute track) or, without one, on the host (the training loop's
/// track), and an NVTX range of that name where a tool is attached; they
/// end when the returned guard is dropped, which must happen while
/// `stream` lives. Two atomic loads when nothing records.
#[inline]
pub fn start(stream: Option<&Stream>, cat: Cat, name: impl FnOnce() -> String) -> Timed {
    let traced = recorder::active();
    if !traced && !nvtx::on() {
        return Timed {
            inner: None,
            _range: None,
        };
    }
    let name = name();
    let range = nvtx::on().then(|| nvtx::range_str(&name));
    if !traced {
        return Timed {
            inner: None,
            _range: range,
        };
    }
    Timed {
        _range: range,
        inner: Some(match stream {
            None => Inner::Host {
                _span: recorder::span(name, cat, track::HOST),
            },
            Some(s) => Inner::Device {
                mark: device::begin(s).unwrap_or_else(|e| {
                    warn(e);
                    None
                }),
                stream: s.borrowed(),
                name,
                cat,
            },
        }),
    }
}

impl Drop for Timed {
    fn drop(&mut self) {
        if let Some(Inner::Device {
            stream,
            mark,
            name,
            cat,
        }) = self.inner.take()
        {
            let name = std::mem::take(&mut { name });
            if let Err(e) = device::end(mark, &stream, name, cat, track::GPU_COMPUTE, Vec::new()) {
                warn(e);
            }
        }
    }
}
