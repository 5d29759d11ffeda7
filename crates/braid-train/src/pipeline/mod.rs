//! Pipeline parallelism: the model cut into stages over the ranks of a
//! pipeline group, micro-batches flowing through them as a
//! [`crate::schedule`] says.
//!
//! - [`assign`]: which layers each stage holds;
//! - [`gather`]: the whole model put together from the stages (`--save`);
//! - [`exec`]: runs one rank's list of actions over what its stages do
//!   ([`exec::StagePasses`]) and how messages move ([`exec::Links`]);
//! - [`in_flight`]: a rank's buffers of the micro-batches between their
//!   forward and backward passes, pooled;
//! - [`memory`]: a rank's GPU memory (model states, activations held as
//!   its schedule keeps micro-batches in flight), for the pre-flight and
//!   `braid plan`;
//! - [`links`]: [`links::HostLinks`], messages between pipeline ranks over
//!   host communicators, sends on a thread of their own (a send never
//!   holds its rank up, as the schedules' checks assume);
//! - [`device_links`]: [`device_links::DeviceLinks`], the same between
//!   GPUs over NCCL point-to-point, one communicator per direction;
//! - [`timeline`]: when each rank ran each action, gathered per step: the
//!   measured idle fraction beside the theory's, and a chart.

pub mod assign;
pub mod device_links;
pub mod exec;
pub mod gather;
pub mod in_flight;
pub mod links;
pub mod memory;
pub mod timeline;
