//! The text form of a schedule, for files (`--schedule FILE`) and
//! messages. One line per rank, `rank R: ACTION ACTION …`; an action is
//! its stage, its operation's code and its micro-batch: `0F3` is stage
//! 0's forward pass of micro-batch 3. The codes: `F` forward, `B`
//! backward, `I` its input half, `W` its weight half, `SF`/`RF` send /
//! receive the stage's output / input activation, `SB`/`RB` send the
//! input gradient / receive the output's. `#` starts a comment. The ranks,
//! stages per rank and micro-batches are read off the actions.

use super::actions::{Action, Op, Schedule};
use crate::Result;
use std::fmt;

impl Op {
    /// The code in the text form.
    pub fn code(self) -> &'static str {
        match self {
            Op::Forward => "F",
            Op::Backward => "B",
            Op::BackwardInput => "I",
            Op::BackwardWeight => "W",
            Op::SendActivation => "SF",
            Op::RecvActivation => "RF",
            Op::SendGrad => "SB",
            Op::RecvGrad => "RB",
        }
    }

    fn from_code(code: &str) -> Option<Op> {
        Some(match code {
            "F" => Op::Forward,
            "B" => Op::Backward,
            "I" => Op::BackwardInput,
            "W" => Op::BackwardWeight,
            "SF" => Op::SendActivation,
            "RF" => Op::RecvActivation,
            "SB" => Op::SendGrad,
            "RB" => Op::RecvGrad,
            _ => return None,
        })
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}{}", self.stage, self.op.code(), self.micro)
    }
}

impl std::str::FromStr for Action {
    type Err = String;

    fn from_str(s: &str) -> Result<Action> {
        let digits = |t: &str| t.chars().take_while(char::is_ascii_digit).count();
        let stage_len = digits(s);
        let rest = &s[stage_len..];
        let code_len = rest.chars().take_while(char::is_ascii_alphabetic).count();
        let (code, micro) = rest.split_at(code_len);
        let bad = || {
            format!(
                "{s:?} is not an action: expected STAGE CODE MICRO-BATCH like 0F3, with the \
                 code one of F B I W SF RF SB RB"
            )
        };
        if stage_len == 0 || micro.is_empty() || digits(micro) != micro.len() {
            return Err(bad());
        }
        let op = Op::from_code(&code.to_ascii_uppercase()).ok_or_else(bad)?;
        let num = |t: &str| t.parse::<usize>().map_err(|_| bad());
        Ok(Action::new(num(&s[..stage_len])?, op, num(micro)?))
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "# {}: {} ranks, {} stage(s) per rank, {} micro-batches",
            self.name, self.ranks, self.virtual_stages, self.micro_batches
        )?;
        for (r, list) in self.actions.iter().enumerate() {
            let shown: Vec<String> = list.iter().map(Action::to_string).collect();
            writeln!(f, "rank {r}: {}", shown.join(" "))?;
        }
        Ok(())
    }
}

/// Reads a schedule in the text form (`name` for messages: the file's
/// path). The rank lines must be `rank 0`, `rank 1`, … in order; the
/// stages must fill `ranks × V` for some `V`.
pub fn parse(name: &str, text: &str) -> Result<Schedule> {
    let mut actions: Vec<Vec<Action>> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let at = |e: String| format!("{name}, line {}: {e}", i + 1);
        let (head, body) = line
            .split_once(':')
            .ok_or_else(|| at(format!("{line:?}: expected `rank R: ACTION ACTION …`")))?;
        let rank = head
            .trim()
            .strip_prefix("rank")
            .and_then(|r| r.trim().parse::<usize>().ok())
            .ok_or_else(|| at(format!("{head:?}: expected `rank R`")))?;
        if rank != actions.len() {
            return Err(at(format!(
                "rank {rank} comes where rank {} was expected (list the ranks in order from 0)",
                actions.len()
            )));
        }
        let list = body
            .split_whitespace()
            .map(|t| t.parse::<Action>().map_err(at))
            .collect::<Result<Vec<_>>>()?;
        actions.push(list);
    }
    let ranks = actions.len();
    if ranks == 0 {
        return Err(format!("{name}: no `rank R: …` lines"));
    }
    let all = || actions.iter().flatten();
    let stages = all().map(|a| a.stage + 1).max().unwrap_or(0);
    let micro = all().map(|a| a.micro + 1).max().unwrap_or(0);
    if stages == 0 || stages % ranks != 0 {
        return Err(format!(
            "{name}: its stages 0..{stages} do not split evenly over its {ranks} ranks (each \
             rank runs the same number of stages)"
        ));
    }
    Ok(Schedule {
        name: name.to_string(),
        ranks,
        virtual_stages: stages / ranks,
        micro_batches: micro,
        actions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::build::ScheduleKind;

    #[test]
    fn every_built_schedule_reads_back_as_itself() {
        for kind in [
            ScheduleKind::GPipe,
            ScheduleKind::OneFOneB,
            ScheduleKind::Interleaved(2),
            ScheduleKind::ZeroBubble,
            ScheduleKind::ZeroBubbleH2,
            ScheduleKind::InterleavedZeroBubble(2),
        ] {
            let s = kind.build(4, 8).unwrap();
            let back = parse(&s.name, &s.to_string()).unwrap();
            assert_eq!(back, s, "{}", kind.name());
        }
    }

    #[test]
    fn bad_text_is_named() {
        let e = parse("f", "rank 0: 0F0 0X0").unwrap_err();
        assert!(e.contains("line 1") && e.contains("\"0X0\""), "{e}");
        let e = parse("f", "rank 1: 0F0").unwrap_err();
        assert!(e.contains("rank 1 comes where rank 0"), "{e}");
        let e = parse("f", "rank 0: 0F0 1F0\nrank 1: 2F0").unwrap_err();
        assert!(e.contains("do not split evenly"), "{e}");
        assert_eq!(
            "12SB3".parse::<Action>().unwrap(),
            Action::new(12, Op::SendGrad, 3)
        );
    }
}
