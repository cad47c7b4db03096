//! The `ib` provider: real RNICs through libibverbs (rdma-sys): InfiniBand, RoCE, and the
//! kernel's Soft-RoCE (`rdma_rxe`). Compiled with the cargo feature `ibverbs`.
//!
//! # Devices, ports and GIDs
//!
//! - Every device of `ibv_get_device_list` is opened and its ports queried; ports that are not
//!   ACTIVE are skipped (and named, with the fix, when nothing is left). No device at all gives
//!   [`ErrorKind::NoDevice`] with the ways to get one (a driver, Soft-RoCE with
//!   `rdma link add rxe0 type rxe netdev eth0`, or `RPC_PROVIDER=soft`).
//! - `RPC_IB_HCA` selects and orders devices and ports with NCCL_IB_HCA's syntax
//!   (`mlx5_0:1,mlx5_1`, `=` for exact names, `^` to exclude; see [`HcaSpec`]). The order is
//!   the rail order of [`Provider::open_rails`]: shard `i` uses rail `i mod n`.
//! - RoCE has no default GID: the provider reads the port's GID table and the RoCE version of
//!   each entry (`/sys/class/infiniband/<dev>/ports/<p>/gid_attrs/types/<index>`) and prefers
//!   an IPv4-mapped RoCE v2 GID, as NCCL does. `RPC_IB_GID_INDEX` forces an index. InfiniBand
//!   uses LID routing and GID index 0.
//! - `RPC_IB_TIMEOUT` / `RPC_IB_RETRY_CNT` set the local ACK timeout (verbs encoding, default
//!   14 = 67 ms) and the transport retry count (default 7) of every connection, as
//!   NCCL_IB_TIMEOUT / NCCL_IB_RETRY_CNT do;
//! - `RPC_IB_TC` / `RPC_IB_SL` set the traffic class and service level of our packets;
//!   `RPC_IB_QPS_PER_CONNECTION` asks for several QPs per connection
//!   ([`Provider::qps_per_connection`], [`QpGroup`](crate::verbs::QpGroup)).
//!
//! # Connections
//!
//! The path MTU is the minimum of both ends' active MTU and [`ConnectAttr::path_mtu`](crate::verbs::ConnectAttr::path_mtu); RoCE
//! address vectors carry a GRH with the peer's GID and our GID index; PSNs are random and
//! exchanged in the [`Endpoint`](crate::verbs::Endpoint). Read/atomic depths are clamped to the device limits.
//!
//! # Memory
//!
//! [`Pd::alloc_mr`](crate::verbs::Pd::alloc_mr) maps page-aligned anonymous memory and registers it. Before pinning, the
//! RLIMIT_MEMLOCK is checked ([`Memlock`]); too low a limit (or ENOMEM from the driver) is
//! reported with the fix (`ulimit -l unlimited`, LimitMEMLOCK=infinity, `--ulimit
//! memlock=-1`).
//!
//! # Data path
//!
//! `post_send`/`post_recv` build `ibv_send_wr`/`ibv_recv_wr` chains in stack arrays of
//! [`POST_BATCH`] entries and hand our [`Sge`](crate::verbs::Sge)s to the device as they are
//! (same layout); `poll` reads up to [`POLL_BATCH`] `ibv_wc`s per call into a stack array. No
//! heap allocation, lock or system call of ours on these paths (the provider library may
//! ring a doorbell; Soft-RoCE makes a system call per post).
//!
//! # Queue depths and back-pressure
//!
//! [`Qp::caps`](crate::verbs::Qp::caps) and [`Cq::capacity`](crate::verbs::Cq::capacity) are
//! the sizes asked for, even where the device rounded its rings up (mlx5, rxe since Linux 6.2
//! report 2^n - 1), and they are enforced: `post_send`/`post_recv` answer
//! [`ErrorKind::QueueFull`] at exactly that depth, as on every provider (each QP keeps a
//! ledger of its outstanding requests that its CQs update by `qp_num`). A QP is admitted to
//! its CQs only while the depths of all their QPs fit, so a CQ sized from the requested depths
//! cannot overrun.
//!
//! # Shared receive queues
//!
//! [`Pd::create_srq`](crate::verbs::Pd::create_srq) makes an `ibv_srq`; QPs created on it
//! ([`Pd::create_qp_on_srq`](crate::verbs::Pd::create_qp_on_srq)) have no receive queue of
//! their own. Its depth is enforced as a QP's (`QueueFull` at `max_wr` receives posted and not
//! yet polled: the QPs' ledgers credit the SRQ's slots, see `srq`), and a receive CQ reserves
//! the SRQ's `max_wr` once however many of its QPs use it. `IBV_EVENT_SRQ_LIMIT_REACHED` is
//! [`AsyncEvent::SrqLimitReached`](crate::verbs::AsyncEvent::SrqLimitReached) naming
//! `ibv_srq.handle`, which is [`Srq::srq_num`](crate::verbs::Srq::srq_num).
//!
//! # Errors and device quirks
//!
//! Error completions are read for the fields verbs defines for them only (`wr_id`, `status`,
//! `qp_num`, `vendor_err`); their opcode is the request's. Soft-RoCE does not flush receives
//! posted after a failure: on rxe only, `post_recv` on a QP known to have failed re-enters
//! ERROR (hardware pays nothing). `ibv_fork_init` runs before the first verb
//! (`RPC_IB_FORK_INIT=0` skips it); READs are limited to the device's `max_sge_rd`; regions
//! are registered with relaxed ordering where supported (`RPC_IB_RELAXED_ORDERING=0` turns it
//! off) and large ones advised for huge pages. Device events (port down, GID change, device
//! fatal, ...) are read with [`Context::poll_async_event`].
//!
//! # Logs
//!
//! At INFO, in NCCL's style: `NET/IB : Using [0]rxe0:1/RoCE`, the GID index chosen and why,
//! and each QP reaching RTS.

mod chain;
mod cq;
mod device;
mod events;
mod ledger;
mod mr;
mod qp;
mod select;
mod srq;

use crate::verbs::error::{ErrorKind, Result, Verb, VerbsError};
use crate::verbs::types::{Caps, DeviceInfo};
use crate::verbs::{Context, Provider};

pub use cq::{IbCompChannel, IbCq, POLL_BATCH};
pub use device::{DeviceReport, IbContext, PortInfo, PortReport, PortState, diagnose};
pub use events::ENV_FORK_INIT;
pub use mr::{ENV_RELAXED_ORDERING, IbMr, IbPd, MEMLOCK_FIX, Memlock};
pub use qp::{IbQp, POST_BATCH};
pub use select::{
    ENV_GID_INDEX, ENV_HCA, ENV_QPS_PER_CONNECTION, ENV_RETRY_CNT, ENV_SL, ENV_TC, ENV_TIMEOUT,
    GidAddr, GidChoice, GidEntry, GidKind, HcaEntry, HcaSpec, MAX_QPS_PER_CONNECTION, choose_gid,
    ipv4_mapped, path_mtu, rail_of,
};
pub use srq::IbSrq;

use device::{Inventory, NO_DEVICE_HELP};

/// The `ib` provider: libibverbs on real RNICs (InfiniBand, RoCE, Soft-RoCE).
#[derive(Debug)]
pub struct Ib;

impl Ib {
    /// The `RPC_IB_HCA` selection in force (every device when unset).
    ///
    /// # Errors
    /// When `RPC_IB_HCA` does not parse.
    pub fn hca_spec() -> Result<HcaSpec> {
        match std::env::var(ENV_HCA) {
            Ok(v) => HcaSpec::parse(&v),
            Err(_) => Ok(HcaSpec::default()),
        }
    }

    /// Opens every device and port `spec` selects, as rails in the spec's order; at most
    /// `limit` of them.
    ///
    /// # Errors
    /// [`ErrorKind::NoDevice`] when the system has no RDMA device, no active port, or none
    /// that `spec` selects (the message lists what exists and how to fix it); errors of the
    /// GID choice (a RoCE port without an IP address, a bad `RPC_IB_GID_INDEX`).
    pub fn open_spec(spec: &HcaSpec, limit: Option<usize>) -> Result<Vec<IbContext>> {
        let inv = Inventory::scan()?.ok_or_else(no_device)?;
        inv.open(spec, limit)
    }
}

fn no_device() -> VerbsError {
    VerbsError::new(Verb::GetDeviceList, ErrorKind::NoDevice, NO_DEVICE_HELP)
}

impl Provider for Ib {
    const KIND: super::ProviderKind = super::ProviderKind::Ib;

    type Context = IbContext;
    type Pd = IbPd;
    type Mr = IbMr;
    type CompChannel = IbCompChannel;
    type Cq = IbCq;
    type Qp = IbQp;
    type Srq = IbSrq;

    /// One entry per ACTIVE port of every device (`RPC_IB_HCA` is not applied). Empty when
    /// the system has no RDMA device.
    fn devices() -> Result<Vec<DeviceInfo>> {
        Ok(Inventory::scan()?.map(|i| i.infos()).unwrap_or_default())
    }

    /// `name` is a device (`mlx5_0`) or a device and port (`mlx5_0:2`), matched exactly;
    /// `None` opens the first rail of `RPC_IB_HCA` (the first active port when unset).
    fn open(name: Option<&str>) -> Result<IbContext> {
        let spec = match name {
            Some(n) => HcaSpec::parse(&format!("={n}"))?,
            None => Self::hca_spec()?,
        };
        Self::open_spec(&spec, Some(1))?
            .into_iter()
            .next()
            .ok_or_else(no_device)
    }

    /// Every device and port `RPC_IB_HCA` selects (all active ports when unset), as rails
    /// numbered in that order; shard `i` uses rail [`rail_of`]`(i, n)`.
    fn open_rails() -> Result<Vec<IbContext>> {
        Self::open_spec(&Self::hca_spec()?, None)
    }

    /// `RPC_IB_QPS_PER_CONNECTION` (1..=[`MAX_QPS_PER_CONNECTION`]), 1 when unset.
    fn qps_per_connection() -> Result<u32> {
        match select::env_number(ENV_QPS_PER_CONNECTION, MAX_QPS_PER_CONNECTION)? {
            None => Ok(1),
            Some(0) => Err(VerbsError::new(
                Verb::OpenDevice,
                ErrorKind::InvalidArgument,
                format!("{ENV_QPS_PER_CONNECTION}=0: want 1..={MAX_QPS_PER_CONNECTION}"),
            )),
            Some(n) => Ok(n),
        }
    }
}

impl Context<Ib> for IbContext {
    fn info(&self) -> &DeviceInfo {
        &self.shared.info
    }

    fn caps(&self) -> &Caps {
        &self.shared.caps
    }

    fn alloc_pd(&self) -> Result<IbPd> {
        IbPd::alloc(self)
    }

    fn create_comp_channel(&self) -> Result<IbCompChannel> {
        IbCompChannel::create(self)
    }

    fn create_cq(&self, cqe: u32, channel: Option<&IbCompChannel>) -> Result<IbCq> {
        IbCq::create(self, cqe, channel)
    }

    fn poll_async_event(&self) -> Result<Option<crate::verbs::AsyncEvent>> {
        events::poll_async_event(&self.shared.raw)
    }
}
