//! Aligning the ranks' clocks: each rank measures the offset of its clock
//! from a reference clock (the store server's, which every rank can ask)
//! the way NTP does — ask for the reference time several times, keep the
//! exchange with the shortest round trip, and take the reference time
//! minus the midpoint of that exchange. The error is at most half that
//! round trip, which the trace records beside the offset.

use crate::recorder;

/// How far this process's trace clock is from the reference.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ClockOffset {
    /// Reference minus local, microseconds.
    pub offset_us: f64,
    /// Round trip of the exchange used, microseconds (the offset's error
    /// is at most half of it).
    pub rtt_us: f64,
}

/// This process's clock, microseconds since the UNIX epoch: the wall
/// clock at the trace epoch advanced by the monotonic clock (no jumps).
pub fn local_us() -> f64 {
    recorder::epoch_wall_us() + recorder::now_us()
}

/// Measures the offset with `samples` exchanges; `ask` returns the
/// reference clock in microseconds since the UNIX epoch.
pub fn measure(
    samples: usize,
    mut ask: impl FnMut() -> Result<f64, String>,
) -> Result<ClockOffset, String> {
    let mut best: Option<ClockOffset> = None;
    for _ in 0..samples.max(1) {
        let t0 = local_us();
        let reference = ask()?;
        let t1 = local_us();
        let here = ClockOffset {
            offset_us: reference - 0.5 * (t0 + t1),
            rtt_us: t1 - t0,
        };
        if best.is_none_or(|b| here.rtt_us < b.rtt_us) {
            best = Some(here);
        }
    }
    Ok(best.expect("at least one sample"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_offset_of_a_shifted_clock_is_found_within_half_the_round_trip() {
        let shift = 12_345_678.0;
        let o = measure(8, || {
            std::thread::sleep(std::time::Duration::from_micros(200));
            Ok(local_us() + shift)
        })
        .unwrap();
        assert!((o.offset_us - shift).abs() <= 0.5 * o.rtt_us + 1.0, "{o:?}");
        assert!(o.rtt_us >= 200.0);
        assert!(measure(3, || Err("no store".into())).is_err());
    }
}
