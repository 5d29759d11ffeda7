//! Whether the GPU collectives keep ZeRO-3's block buffers in NCCL
//! symmetric windows, so that the gathers into them run on the copy
//! engines (`BRAID_ZERO3_GATHER_VIA`, `auto` by default): each rank's
//! wish, checked against `NCCL_CTA_POLICY` and its NCCL
//! ([`Wish::from_env`]), then one answer for all ranks ([`Wish::agree`]),
//! because registering a window is collective. Under `auto` the ranks
//! take the copy engines only when every one can, on one host (NCCL's
//! copy engines serve one node), and NCCL's kernels otherwise; where one
//! rank insists (`ce`) and another cannot or asks for the kernels, or the
//! ranks span hosts, every rank gets an error naming one of them. Where
//! `auto` falls back, the answer says why, naming a rank.

use super::copy_engine::host_identity;
use super::zero_cta::{self, GatherVia, GATHER_VIA_VAR};
use crate::Result;
use braid_comm::Communicator;

/// One rank's side of the choice.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Wish {
    /// What this rank asks for.
    ask: Ask,
}

/// A rank's ask, as the ranks exchange it (one byte).
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(u8)]
enum Ask {
    /// NCCL's kernels, asked for (`nccl`).
    Kernels = 0,
    /// The copy engines if every rank can have them (`auto`, and this
    /// rank can).
    IfAll = 1,
    /// The copy engines, or an error (`ce`).
    CopyEngines = 2,
    /// `auto`, and this rank's NCCL has no copy-engine gathers.
    OldNccl = 3,
    /// `auto`, and this rank's `NCCL_CTA_POLICY` is in the way.
    PolicySet = 4,
}

impl Ask {
    /// Why rank `q` with this ask keeps the ranks on NCCL's kernels.
    fn why_kernels(self, q: usize) -> String {
        match self {
            Ask::OldNccl => format!("rank {q}'s NCCL has no copy-engine gathers (2.28 or later)"),
            Ask::PolicySet => format!(
                "rank {q} runs under another {} than {}",
                zero_cta::CTA_POLICY.0,
                zero_cta::CTA_POLICY.1
            ),
            _ => format!("rank {q} asks for NCCL's kernels ({GATHER_VIA_VAR}=nccl)"),
        }
    }
}

/// The ranks' answer.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Agreed {
    /// Whether the block buffers are windows and the gathers run on the
    /// copy engines.
    pub(crate) copy_engines: bool,
    /// Where this rank asked `auto` and the ranks stay on NCCL's kernels:
    /// why, naming a rank.
    pub(crate) fallback: Option<String>,
}

impl Agreed {
    fn plain(copy_engines: bool) -> Agreed {
        Agreed {
            copy_engines,
            fallback: None,
        }
    }
}

impl Wish {
    /// This rank's wish, from its environment and NCCL. `ce` that cannot
    /// be served here is refused at once.
    pub(crate) fn from_env() -> Result<Wish> {
        Wish::given(
            GatherVia::from_env()?,
            zero_cta::policy_from_env().as_deref(),
            braid_cuda::nccl::NcclComm::has_copy_engine_gathers(),
        )
    }

    /// [`from_env`](Self::from_env) given the choice, `NCCL_CTA_POLICY`
    /// and whether NCCL all-gathers on the copy engines.
    pub(crate) fn given(choice: GatherVia, policy: Option<&str>, nccl_can: bool) -> Result<Wish> {
        let ask = match choice {
            GatherVia::Kernels => Ask::Kernels,
            GatherVia::Auto if !nccl_can => Ask::OldNccl,
            GatherVia::Auto if zero_cta::policy_in_the_way(policy).is_some() => Ask::PolicySet,
            GatherVia::Auto => Ask::IfAll,
            GatherVia::CopyEngines => Ask::CopyEngines,
        };
        if ask == Ask::CopyEngines {
            if let Some(refusal) = zero_cta::copy_engines_refused(policy) {
                return Err(refusal);
            }
            if !nccl_can {
                return Err(format!(
                    "{GATHER_VIA_VAR}=ce: the copy-engine all-gathers need NCCL 2.28 or later \
                     (symmetric memory windows); use {GATHER_VIA_VAR}=nccl"
                ));
            }
        }
        Ok(Wish { ask })
    }

    /// Every rank's answer, the same on all: whether they all ask for (or
    /// accept) the copy engines, on one host; an error on every rank where
    /// one insists on them and another does not take them, or the ranks
    /// span hosts. Collective over `host` (the ranks of this collective),
    /// called by every rank at the same point.
    pub(crate) fn agree(&self, host: &Communicator) -> Result<Agreed> {
        self.agree_on(host, &host_identity())
    }

    /// [`agree`](Self::agree) with this rank's host named by `identity`.
    fn agree_on(&self, host: &Communicator, identity: &[u8; 64]) -> Result<Agreed> {
        let n = host.size();
        if n < 2 {
            return Ok(Agreed::plain(false));
        }
        let mut mine = vec![self.ask as u8];
        mine.extend_from_slice(identity);
        let mut all = vec![0u8; n * mine.len()];
        host.all_gather(&mine, &mut all)
            .map_err(|e| format!("agreeing on where ZeRO-3's gathers run: {e}"))?;
        let of = |q: usize| &all[q * mine.len()..(q + 1) * mine.len()];
        let ask_of = |q: usize| match of(q)[0] {
            1 => Ask::IfAll,
            2 => Ask::CopyEngines,
            3 => Ask::OldNccl,
            4 => Ask::PolicySet,
            _ => Ask::Kernels,
        };
        let asks = |a: Ask| (0..n).find(|&q| ask_of(q) == a);
        // A rank that takes NCCL's kernels, asked for or all it can have.
        let kernels = (0..n).find(|&q| !matches!(ask_of(q), Ask::IfAll | Ask::CopyEngines));
        let other_host = (0..n).find(|&q| of(q)[1..] != of(0)[1..]);
        let on_another_host = |q: usize| {
            format!(
                "rank {q} runs on another host than rank 0 (NCCL's copy-engine gathers serve \
                 one node)"
            )
        };
        let Some(insisting) = asks(Ask::CopyEngines) else {
            // `auto` everywhere it was not `nccl`: all or none.
            let fallback = match (kernels, other_host) {
                (None, None) => return Ok(Agreed::plain(true)),
                (Some(q), _) => ask_of(q).why_kernels(q),
                (None, Some(q)) => on_another_host(q),
            };
            let asked_auto = self.ask != Ask::Kernels;
            return Ok(Agreed {
                copy_engines: false,
                fallback: asked_auto.then_some(fallback),
            });
        };
        let why = if let Some(q) = kernels {
            format!(
                "rank {insisting} asks for the copy engines but {}; set it the same on every \
                 rank, where each can have them",
                ask_of(q).why_kernels(q)
            )
        } else if let Some(q) = other_host {
            format!("{}; use {GATHER_VIA_VAR}=nccl", on_another_host(q))
        } else {
            return Ok(Agreed::plain(true));
        };
        Err(format!("{GATHER_VIA_VAR}=ce: {why}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wish_is_refused_where_it_cannot_be_served() {
        let ask = |c, policy, can| Wish::given(c, policy, can).unwrap().ask;
        assert_eq!(ask(GatherVia::Kernels, Some("1"), false), Ask::Kernels);
        assert_eq!(ask(GatherVia::Kernels, None, true), Ask::Kernels);
        assert_eq!(
            ask(GatherVia::CopyEngines, Some("2"), true),
            Ask::CopyEngines
        );
        // `auto` takes the copy engines only where this rank can.
        assert_eq!(ask(GatherVia::Auto, None, true), Ask::IfAll);
        assert_eq!(ask(GatherVia::Auto, Some("2"), true), Ask::IfAll);
        assert_eq!(ask(GatherVia::Auto, Some("1"), true), Ask::PolicySet);
        assert_eq!(ask(GatherVia::Auto, None, false), Ask::OldNccl);
        let e = Wish::given(GatherVia::CopyEngines, Some("1"), true).unwrap_err();
        assert!(
            e.contains("NCCL_CTA_POLICY=\"1\"") && e.contains("unset NCCL_CTA_POLICY or use"),
            "{e}"
        );
        let e = Wish::given(GatherVia::CopyEngines, None, false).unwrap_err();
        assert!(e.contains("NCCL 2.28") && e.contains("); use BRAID"), "{e}");
    }

    /// Runs `f(rank, host)` on 3 ranks of a real host world (threads, a
    /// TCP store) and returns their answers.
    fn three_ranks<R: Send>(f: impl Fn(usize, &Communicator) -> R + Sync) -> Vec<R> {
        use braid_comm::{BackendKind, CommOptions};
        use braid_store::{ClientOptions, ServerOptions, StoreClient, StoreServer};
        let server = StoreServer::bind("127.0.0.1:0", ServerOptions::default()).unwrap();
        let addr = server.local_addr().to_string();
        std::thread::scope(|s| {
            let f = &f;
            let handles: Vec<_> = (0..3)
                .map(|rank| {
                    let addr = addr.clone();
                    s.spawn(move || {
                        let store = StoreClient::connect(&addr, ClientOptions::default())
                            .unwrap()
                            .with_prefix("agree/");
                        let options = CommOptions {
                            timeout: std::time::Duration::from_secs(30),
                            backend: BackendKind::Tcp,
                            debug: false,
                            run_id: "agree".into(),
                            host_id: None,
                            shm_half: None,
                        };
                        let host = Communicator::init(rank, 3, store, options).unwrap();
                        f(rank, &host)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn the_ranks_agree_on_one_answer() {
        let here = [7u8; 64];
        let wish = |c| Wish::given(c, None, true).unwrap();
        let (ce, nccl, auto) = (GatherVia::CopyEngines, GatherVia::Kernels, GatherVia::Auto);
        let two_hosts = |r: usize| [7u8 + (r == 2) as u8; 64];
        let engines = |a: &Result<Agreed>| a.as_ref().map(|a| a.copy_engines).ok();
        // All ask or accept, on one host: the copy engines; none: the
        // kernels, quietly.
        for asks in [[ce, ce, ce], [auto, auto, auto], [ce, auto, auto]] {
            let all = three_ranks(|r, h| wish(asks[r]).agree_on(h, &here));
            assert_eq!(all, vec![Ok(Agreed::plain(true)); 3], "{asks:?}");
        }
        let all = three_ranks(|_, h| wish(nccl).agree_on(h, &here));
        assert_eq!(all, vec![Ok(Agreed::plain(false)); 3]);
        // `auto` falls back together where one rank takes the kernels, or
        // the ranks span hosts, and says why where it was asked for.
        let all = three_ranks(|r, h| wish([auto, nccl][(r == 1) as usize]).agree_on(h, &here));
        assert!(all.iter().all(|a| engines(a) == Some(false)), "{all:?}");
        let why = all[0].as_ref().unwrap().fallback.clone().unwrap();
        assert!(why.contains("rank 1 asks for NCCL's kernels"), "{why}");
        assert_eq!(all[1].as_ref().unwrap().fallback, None);
        let all = three_ranks(|r, h| wish(auto).agree_on(h, &two_hosts(r)));
        assert!(all.iter().all(|a| engines(a) == Some(false)), "{all:?}");
        let why = all[0].as_ref().unwrap().fallback.clone().unwrap();
        assert!(why.contains("rank 2 runs on another host"), "{why}");
        for (policy, can, want) in [
            (
                Some("1"),
                true,
                "rank 2 runs under another NCCL_CTA_POLICY than 2",
            ),
            (None, false, "rank 2's NCCL has no copy-engine gathers"),
        ] {
            let all = three_ranks(|r, h| {
                let w = match r {
                    2 => Wish::given(auto, policy, can).unwrap(),
                    _ => wish(auto),
                };
                w.agree_on(h, &here)
            });
            assert!(all.iter().all(|a| engines(a) == Some(false)), "{all:?}");
            let why = all[0].as_ref().unwrap().fallback.clone().unwrap();
            assert!(why.contains(want), "{why}");
        }
        // One insisting and another taking the kernels: an error on every
        // rank, naming both.
        let all = three_ranks(|r, h| wish([ce, nccl][(r == 1) as usize]).agree_on(h, &here));
        for a in all {
            let e = a.unwrap_err();
            assert!(
                e.contains("rank 0 asks for the copy engines but rank 1 asks for NCCL's kernels"),
                "{e}"
            );
        }
        // Insisting across hosts: NCCL's copy engines serve one node.
        let all = three_ranks(|r, h| wish([ce, auto][r % 2]).agree_on(h, &two_hosts(r)));
        let e = all[0].clone().unwrap_err();
        assert!(e.contains("rank 2 runs on another host"), "{e}");
    }
}
