//! Devices, ports and GIDs: `ibv_get_device_list`, `ibv_open_device`, `ibv_query_device`,
//! `ibv_query_port`, `ibv_query_gid` and the sysfs GID attributes; the opened [`IbContext`].

use std::ffi::CStr;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys::{
    ___ibv_query_port, ibv_close_device, ibv_context, ibv_device, ibv_device_attr,
    ibv_free_device_list, ibv_get_device_list, ibv_get_device_name, ibv_gid, ibv_open_device,
    ibv_port_attr, ibv_port_state, ibv_query_device, ibv_query_gid,
};

use super::select::{self, GidChoice, GidEntry, GidKind, HcaSpec};
use crate::verbs::error::{ErrorKind, Verb, VerbsError};
use crate::verbs::types::{Caps, DeviceInfo, LinkLayer};

/// `IBV_LINK_LAYER_ETHERNET` (an anonymous enum in verbs.h, not in rdma-sys).
const LINK_LAYER_ETHERNET: u8 = 2;
/// Largest inline size probed at open; no RNIC we know of goes beyond ~1 KiB.
const INLINE_PROBE_MAX: u32 = 4096;

/// The OS error of the last failed libc/libibverbs call.
pub(super) fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// The errno of a verb that returns 0 or an error number (some return -1 and set errno).
pub(super) fn ret_errno(rc: i32) -> i32 {
    if rc < 0 { last_errno() } else { rc }
}

/// The message when there is no RDMA device at all.
pub(super) const NO_DEVICE_HELP: &str = "no RDMA device found. To get one: load the RNIC's \
     driver (e.g. `modprobe mlx5_ib`), or create a Soft-RoCE device on an Ethernet interface \
     (`modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0`), or run without RDMA \
     hardware with RPC_PROVIDER=soft";

/// An owned `ibv_get_device_list` result; freed on drop.
struct DeviceList {
    list: NonNull<*mut ibv_device>,
    len: usize,
}

impl DeviceList {
    /// Lists the devices. `Ok(None)` when the system has no RDMA device (NULL list with
    /// ENOSYS/ENODEV, or zero devices).
    fn get() -> Result<Option<DeviceList>, VerbsError> {
        super::events::fork_init();
        let mut n: i32 = 0;
        // SAFETY: `n` is a valid out-pointer for the duration of the call.
        let list = unsafe { ibv_get_device_list(&mut n) };
        let Some(list) = NonNull::new(list) else {
            let e = last_errno();
            return match e {
                libc::ENOSYS | libc::ENODEV | libc::ENOENT | 0 => Ok(None),
                _ => Err(VerbsError::from_errno(Verb::GetDeviceList, e, "")),
            };
        };
        let dl = DeviceList {
            list,
            len: usize::try_from(n).unwrap_or(0),
        };
        if dl.len == 0 {
            return Ok(None);
        }
        Ok(Some(dl))
    }

    /// The devices, with their names.
    fn iter(&self) -> impl Iterator<Item = (NonNull<ibv_device>, String)> + '_ {
        (0..self.len).filter_map(move |i| {
            // SAFETY: libibverbs returned an array of `len` device pointers (plus a NULL
            // terminator) that stays valid until `ibv_free_device_list`, which only our Drop
            // calls; `i < len`.
            let dev = unsafe { *self.list.as_ptr().add(i) };
            let dev = NonNull::new(dev)?;
            // SAFETY: `dev` is a live device of the list; the name is a NUL-terminated string
            // inside the device struct, copied out before the list is freed.
            let name = unsafe { CStr::from_ptr(ibv_get_device_name(dev.as_ptr())) };
            Some((dev, name.to_string_lossy().into_owned()))
        })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from `ibv_get_device_list` and is freed exactly once; opened
        // contexts stay valid after the list is freed (libibverbs documents this).
        unsafe { ibv_free_device_list(self.list.as_ptr()) }
    }
}

/// An owned `ibv_context`; closed on drop.
pub(super) struct RawContext {
    ctx: NonNull<ibv_context>,
}

// SAFETY: libibverbs contexts may be used from any thread, and concurrently: every verb is
// thread-safe (rdma-core's documented contract; providers lock internally). The pointer is
// owned and only closed in Drop.
unsafe impl Send for RawContext {}
// SAFETY: as above: shared use from several threads is what libibverbs allows.
unsafe impl Sync for RawContext {}

impl RawContext {
    fn open(dev: NonNull<ibv_device>, name: &str) -> Result<RawContext, VerbsError> {
        // SAFETY: `dev` is a live entry of a device list that outlives this call.
        let ctx = unsafe { ibv_open_device(dev.as_ptr()) };
        match NonNull::new(ctx) {
            Some(ctx) => {
                let raw = RawContext { ctx };
                super::events::nonblocking_async_fd(&raw)?;
                Ok(raw)
            }
            None => {
                let e = last_errno();
                Err(VerbsError::from_errno(
                    Verb::OpenDevice,
                    e,
                    format!(
                        "cannot open {name}: {} (check the permissions of /dev/infiniband/uverbs*, \
                         and that ib_uverbs is loaded)",
                        std::io::Error::from_raw_os_error(e)
                    ),
                ))
            }
        }
    }

    /// The raw pointer, for verbs.
    pub(super) fn as_ptr(&self) -> *mut ibv_context {
        self.ctx.as_ptr()
    }

    fn query_device(&self, name: &str) -> Result<ibv_device_attr, VerbsError> {
        // SAFETY: all-zero bytes are a valid `ibv_device_attr` (integers and a char array).
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open; `attr` is a valid out-pointer.
        let rc = unsafe { ibv_query_device(self.as_ptr(), &mut attr) };
        if rc != 0 {
            return Err(VerbsError::from_errno(
                Verb::QueryDevice,
                ret_errno(rc),
                format!("ibv_query_device on {name} failed"),
            ));
        }
        Ok(attr)
    }

    fn query_port(&self, name: &str, port: u8) -> Result<ibv_port_attr, VerbsError> {
        // SAFETY: all-zero bytes are a valid `ibv_port_attr` (plain integers).
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open; `attr` is a full-size `ibv_port_attr`, which both the
        // extended and the compat query_port paths may fill.
        let rc = unsafe { ___ibv_query_port(self.as_ptr(), port, &mut attr) };
        if rc != 0 {
            return Err(VerbsError::from_errno(
                Verb::QueryDevice,
                ret_errno(rc),
                format!("ibv_query_port on {name}:{port} failed"),
            ));
        }
        Ok(attr)
    }

    fn query_gid(&self, port: u8, index: i32) -> Option<[u8; 16]> {
        let mut gid = ibv_gid { raw: [0; 16] };
        // SAFETY: the context is open; `gid` is a valid out-pointer.
        let rc = unsafe { ibv_query_gid(self.as_ptr(), port, index, &mut gid) };
        // SAFETY: `raw` is the byte view of the 16-byte union; every bit pattern is valid.
        let raw = unsafe { gid.raw };
        (rc == 0 && raw != [0; 16]).then_some(raw)
    }
}

impl Drop for RawContext {
    fn drop(&mut self) {
        // SAFETY: every child object (PD, CQ, channel, QP, MR) holds an `Arc` to the context
        // that owns this, so none is alive when the device is closed; closed exactly once.
        let rc = unsafe { ibv_close_device(self.ctx.as_ptr()) };
        if rc != 0 {
            tracing::warn!(errno = ret_errno(rc), "ibv_close_device failed");
        }
    }
}

/// The state of a port (`IBV_PORT_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortState {
    /// No state change.
    Nop,
    /// Link down.
    Down,
    /// Link up, not configured by the subnet manager yet (InfiniBand).
    Init,
    /// Configured, not yet active.
    Armed,
    /// Usable.
    Active,
    /// Active, deferring.
    ActiveDefer,
    /// A value libibverbs added after us.
    Other(u32),
}

impl PortState {
    fn from_raw(v: u32) -> PortState {
        match v {
            ibv_port_state::IBV_PORT_NOP => PortState::Nop,
            ibv_port_state::IBV_PORT_DOWN => PortState::Down,
            ibv_port_state::IBV_PORT_INIT => PortState::Init,
            ibv_port_state::IBV_PORT_ARMED => PortState::Armed,
            ibv_port_state::IBV_PORT_ACTIVE => PortState::Active,
            ibv_port_state::IBV_PORT_ACTIVE_DEFER => PortState::ActiveDefer,
            v => PortState::Other(v),
        }
    }

    /// The name `ibv_devinfo` prints.
    pub fn name(self) -> &'static str {
        match self {
            PortState::Nop => "PORT_NOP",
            PortState::Down => "PORT_DOWN",
            PortState::Init => "PORT_INIT",
            PortState::Armed => "PORT_ARMED",
            PortState::Active => "PORT_ACTIVE",
            PortState::ActiveDefer => "PORT_ACTIVE_DEFER",
            PortState::Other(_) => "PORT_UNKNOWN",
        }
    }

    /// How to get the port to ACTIVE.
    pub fn fix(self) -> &'static str {
        match self {
            PortState::Active | PortState::ActiveDefer => "",
            PortState::Down => {
                "link down: check the cable and the switch port; for RoCE/Soft-RoCE bring the \
                 netdev up (`ip link set <netdev> up`)"
            }
            PortState::Init | PortState::Armed => {
                "link up but not configured: InfiniBand needs a running subnet manager \
                 (`systemctl start opensm` on one node, or the switch's SM)"
            }
            _ => "port is not usable",
        }
    }
}

/// What one port of a device reports.
#[derive(Clone, Debug)]
pub struct PortInfo {
    /// Port number (1-based).
    pub num: u8,
    /// Logical state.
    pub state: PortState,
    /// Physical state (`5` = LinkUp).
    pub phys_state: u8,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Active MTU in bytes.
    pub active_mtu: u32,
    /// Largest MTU the port supports, in bytes.
    pub max_mtu: u32,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Largest message, in bytes.
    pub max_msg_sz: u32,
    /// Size of the GID table.
    pub gid_tbl_len: u32,
    /// Link rate in Gb/s from active width x speed, when known.
    pub rate_gbps: Option<f64>,
}

impl PortInfo {
    fn from_attr(num: u8, a: &ibv_port_attr) -> PortInfo {
        let link_layer = match a.link_layer {
            LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
            // INFINIBAND (1), or UNSPECIFIED (0), which old drivers report for InfiniBand.
            _ => LinkLayer::InfiniBand,
        };
        PortInfo {
            num,
            state: PortState::from_raw(a.state),
            phys_state: a.phys_state,
            link_layer,
            active_mtu: select::mtu_bytes(a.active_mtu).unwrap_or(0),
            max_mtu: select::mtu_bytes(a.max_mtu).unwrap_or(0),
            lid: a.lid,
            max_msg_sz: a.max_msg_sz,
            gid_tbl_len: u32::try_from(a.gid_tbl_len).unwrap_or(0),
            rate_gbps: link_rate(a.active_width, a.active_speed),
        }
    }

    /// Whether the port can carry traffic.
    pub fn is_active(&self) -> bool {
        matches!(self.state, PortState::Active | PortState::ActiveDefer)
    }

    /// `IB` or `RoCE`, as NCCL prints it.
    pub fn fabric(&self) -> &'static str {
        match self.link_layer {
            LinkLayer::Ethernet => "RoCE",
            _ => "IB",
        }
    }
}

/// Link rate in Gb/s (lanes x per-lane rate), from `ibv_port_attr` codes.
fn link_rate(width: u8, speed: u8) -> Option<f64> {
    let lanes = match width {
        1 => 1.0,
        2 => 4.0,
        4 => 8.0,
        8 => 12.0,
        16 => 2.0,
        _ => return None,
    };
    let per_lane = match speed {
        1 => 2.5,
        2 => 5.0,
        4 | 8 => 10.0,
        16 => 14.0,
        32 => 25.0,
        64 => 50.0,
        128 => 100.0,
        _ => return None,
    };
    Some(lanes * per_lane)
}

/// Reads one GID table of a port, with the RoCE types and netdevs from sysfs.
fn gid_table(raw: &RawContext, dev: &str, port: &PortInfo) -> Vec<GidEntry> {
    let base = format!("/sys/class/infiniband/{dev}/ports/{}/gid_attrs", port.num);
    let mut out = Vec::new();
    for index in 0..port.gid_tbl_len {
        let Ok(i) = i32::try_from(index) else { break };
        let Some(gid) = raw.query_gid(port.num, i) else {
            continue;
        };
        let kind = match port.link_layer {
            LinkLayer::Ethernet => std::fs::read_to_string(format!("{base}/types/{index}"))
                .map(|s| GidKind::from_sysfs(&s))
                .unwrap_or(GidKind::Unknown),
            _ => GidKind::IbRoceV1,
        };
        let netdev = std::fs::read_to_string(format!("{base}/ndevs/{index}"))
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty());
        out.push(GidEntry {
            index,
            gid,
            kind,
            netdev,
        });
    }
    out
}

/// Caps from `ibv_device_attr` and the port; `max_inline` is probed separately.
fn caps_of(a: &ibv_device_attr, port: &PortInfo, max_inline: u32) -> Caps {
    let pos = |v: i32| u32::try_from(v).unwrap_or(0);
    Caps {
        max_inline,
        max_sge: pos(a.max_sge),
        max_qp_wr: pos(a.max_qp_wr),
        max_srq_wr: pos(a.max_srq_wr),
        max_cqe: pos(a.max_cqe),
        max_msg_size: u64::from(port.max_msg_sz),
        max_mr_size: a.max_mr_size,
        atomics: a.atomic_cap != rdma_sys::ibv_atomic_cap::IBV_ATOMIC_NONE,
        max_rd_atomic: pos(a.max_qp_init_rd_atom),
    }
}

/// Everything an open device (one port of it) needs, shared by its children.
pub(super) struct CtxShared {
    pub(super) raw: RawContext,
    pub(super) info: DeviceInfo,
    pub(super) caps: Caps,
    pub(super) port: PortInfo,
    pub(super) gid: GidEntry,
    pub(super) gid_choice: GidChoice,
    /// Responder resources (`max_qp_rd_atom`), the cap of `max_dest_rd_atomic`.
    pub(super) max_dest_rd_atomic: u32,
    /// Most SGEs of an RDMA READ (`max_sge_rd`; often below `max_sge`).
    pub(super) max_sge_rd: u32,
    /// What this device needs done differently.
    pub(super) quirks: Quirks,
    /// Shared receive queue limits (`ibv_device_attr`).
    pub(super) srq_limits: SrqLimits,
    pub(super) rail: usize,
    pub(super) traffic_class: u8,
    pub(super) service_level: u8,
    /// `RPC_IB_TIMEOUT` / `RPC_IB_RETRY_CNT`, over the connection's own attributes.
    pub(super) transport: Transport,
}

/// The transport timer settings the environment imposes on every RC connection.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Transport {
    pub(super) timeout: Option<u8>,
    pub(super) retry_cnt: Option<u8>,
}

/// A device's shared receive queue limits (`max_srq`, `max_srq_wr`, `max_srq_sge`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct SrqLimits {
    pub(super) max_srq: u32,
    pub(super) max_srq_wr: u32,
    pub(super) max_srq_sge: u32,
}

impl SrqLimits {
    fn of(a: &ibv_device_attr) -> SrqLimits {
        let pos = |v: i32| u32::try_from(v).unwrap_or(0);
        SrqLimits {
            max_srq: pos(a.max_srq),
            max_srq_wr: pos(a.max_srq_wr),
            max_srq_sge: pos(a.max_srq_sge),
        }
    }
}

/// Device-specific workarounds, decided once at open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Quirks {
    /// Receives posted in ERROR are not flushed until the QP enters ERROR again (Soft-RoCE,
    /// Linux 6.1): `post_recv` re-enters ERROR on such a QP. Hardware (mlx5, ...) flushes
    /// them itself and pays nothing.
    pub(super) reflush_recv: bool,
}

/// `RXE_VENDOR_ID` of the kernel's Soft-RoCE driver.
const RXE_VENDOR_ID: u32 = 0x00ff_ffff;

impl Quirks {
    pub(super) fn of(name: &str, vendor_id: u32) -> Quirks {
        Quirks {
            reflush_recv: vendor_id == RXE_VENDOR_ID || name.starts_with("rxe"),
        }
    }
}

impl CtxShared {
    /// The port's active MTU in bytes as the port says now (one `ibv_query_port`): the context
    /// is shared by the process's connections and lives as long as any of them, while the
    /// netdev's MTU may change meanwhile (on RoCE the active MTU follows it). The value read
    /// at open if the query fails.
    pub(super) fn active_mtu_now(&self) -> u32 {
        self.raw
            .query_port(&self.info.name, self.port.num)
            .ok()
            .and_then(|a| select::mtu_bytes(a.active_mtu))
            .unwrap_or(self.port.active_mtu)
    }

    /// `rxe0:1/RoCE`.
    pub(super) fn label(&self) -> String {
        format!(
            "{}:{}/{}",
            self.info.name,
            self.port.num,
            self.port.fabric()
        )
    }

    /// Whether packets carry a GRH (RoCE always; InfiniBand within one subnet does not).
    pub(super) fn is_roce(&self) -> bool {
        self.port.link_layer == LinkLayer::Ethernet
    }
}

/// An open RDMA device (one port of it, with its chosen GID): `ibv_context`.
pub struct IbContext {
    pub(super) shared: Arc<CtxShared>,
}

impl fmt::Debug for IbContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.shared;
        f.debug_struct("IbContext")
            .field("device", &s.label())
            .field("rail", &s.rail)
            .field("gid_index", &s.gid.index)
            .field("gid", &format_args!("{}", select::GidAddr(&s.gid.gid)))
            .field("active_mtu", &s.port.active_mtu)
            .field("caps", &s.caps)
            .finish()
    }
}

impl IbContext {
    /// The port this context uses.
    pub fn port(&self) -> &PortInfo {
        &self.shared.port
    }

    /// The GID this context uses (its index goes into every QP's address vector).
    pub fn gid(&self) -> &GidEntry {
        &self.shared.gid
    }

    /// Why that GID was chosen.
    pub fn gid_choice(&self) -> GidChoice {
        self.shared.gid_choice
    }

    /// The rail number (position in the `RPC_IB_HCA` order) of this context.
    pub fn rail(&self) -> usize {
        self.shared.rail
    }

    /// `rxe0:1/RoCE`, the NCCL-style label of the device, port and fabric.
    pub fn label(&self) -> String {
        self.shared.label()
    }
}

/// One usable (active) port of an opened device, before it becomes an [`IbContext`].
struct Candidate {
    name: String,
    raw: Arc<RawContext>,
    attr: ibv_device_attr,
    port: PortInfo,
}

/// Devices of the system and their ports.
pub(super) struct Inventory {
    /// Active ports in device-list order.
    active: Vec<Candidate>,
    /// Ports that are not active, with their state (for error messages).
    inactive: Vec<(String, u8, PortState)>,
}

impl Inventory {
    /// Opens every device and queries its ports. `Ok(None)`: no device at all.
    pub(super) fn scan() -> Result<Option<Inventory>, VerbsError> {
        let Some(list) = DeviceList::get()? else {
            return Ok(None);
        };
        let mut inv = Inventory {
            active: Vec::new(),
            inactive: Vec::new(),
        };
        let mut first_err = None;
        for (dev, name) in list.iter() {
            let raw = match RawContext::open(dev, &name) {
                Ok(r) => Arc::new(r),
                Err(e) => {
                    tracing::warn!("NET/IB : skipping {name}: {e}");
                    first_err.get_or_insert(e);
                    continue;
                }
            };
            let attr = match raw.query_device(&name) {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!("NET/IB : skipping {name}: {e}");
                    first_err.get_or_insert(e);
                    continue;
                }
            };
            for p in 1..=attr.phys_port_cnt {
                let port = match raw.query_port(&name, p) {
                    Ok(a) => PortInfo::from_attr(p, &a),
                    Err(e) => {
                        tracing::warn!("NET/IB : skipping {name}:{p}: {e}");
                        continue;
                    }
                };
                if port.is_active() {
                    inv.active.push(Candidate {
                        name: name.clone(),
                        raw: Arc::clone(&raw),
                        attr,
                        port,
                    });
                } else {
                    tracing::debug!("NET/IB : {name}:{p} is {}, skipped", port.state.name());
                    inv.inactive.push((name.clone(), p, port.state));
                }
            }
        }
        if inv.active.is_empty()
            && inv.inactive.is_empty()
            && let Some(e) = first_err
        {
            return Err(e);
        }
        Ok(Some(inv))
    }

    /// `DeviceInfo` of every active port.
    pub(super) fn infos(&self) -> Vec<DeviceInfo> {
        self.active
            .iter()
            .map(|c| device_info(&c.name, &c.attr, &c.port))
            .collect()
    }

    /// Opens the ports selected by `spec` as contexts, rails numbered in order; at most
    /// `limit` of them.
    pub(super) fn open(
        self,
        spec: &HcaSpec,
        limit: Option<usize>,
    ) -> Result<Vec<IbContext>, VerbsError> {
        let avail: Vec<(String, u8)> = self
            .active
            .iter()
            .map(|c| (c.name.clone(), c.port.num))
            .collect();
        let mut order: Vec<usize> = spec
            .select(&avail)
            .into_iter()
            .filter_map(|sel| avail.iter().position(|a| a == sel))
            .collect();
        if order.is_empty() {
            return Err(self.nothing_selected(spec, &avail));
        }
        if let Some(l) = limit {
            order.truncate(l.max(1));
        }
        let forced_gid = select::env_number(select::ENV_GID_INDEX, u32::from(u16::MAX))?;
        let tc = select::env_number(select::ENV_TC, 255)?.unwrap_or(0);
        let sl = select::env_number(select::ENV_SL, 15)?.unwrap_or(0);
        let transport = Transport {
            timeout: select::env_number(select::ENV_TIMEOUT, 31)?.map(|n| n as u8),
            retry_cnt: select::env_number(select::ENV_RETRY_CNT, 7)?.map(|n| n as u8),
        };
        // Drop the candidates that were not chosen first, so that a device used through one
        // port only is not opened twice.
        let mut slots: Vec<Option<Candidate>> = self.active.into_iter().map(Some).collect();
        for (i, s) in slots.iter_mut().enumerate() {
            if !order.contains(&i) {
                *s = None;
            }
        }
        let mut out = Vec::with_capacity(order.len());
        for (rail, i) in order.into_iter().enumerate() {
            let Some(c) = slots.get_mut(i).and_then(Option::take) else {
                continue;
            };
            out.push(open_candidate(
                c, rail, forced_gid, tc as u8, sl as u8, transport,
            )?);
        }
        let labels: Vec<String> = out
            .iter()
            .map(|c| format!("[{}]{}", c.shared.rail, c.shared.label()))
            .collect();
        tracing::info!("NET/IB : Using {}", labels.join(" "));
        Ok(out)
    }

    fn nothing_selected(&self, spec: &HcaSpec, avail: &[(String, u8)]) -> VerbsError {
        let inactive: Vec<String> = self
            .inactive
            .iter()
            .map(|(n, p, s)| format!("{n}:{p} is {} ({})", s.name(), s.fix()))
            .collect();
        let msg = if avail.is_empty() {
            format!(
                "RDMA devices exist but no port is ACTIVE: {}",
                inactive.join("; ")
            )
        } else {
            let a: Vec<String> = avail.iter().map(|(n, p)| format!("{n}:{p}")).collect();
            let mut m = format!(
                "{}={spec} matches none of the active ports ({}); fix or unset {}",
                select::ENV_HCA,
                a.join(", "),
                select::ENV_HCA
            );
            if !inactive.is_empty() {
                m.push_str(&format!("; not active: {}", inactive.join("; ")));
            }
            m
        };
        VerbsError::new(Verb::OpenDevice, ErrorKind::NoDevice, msg)
    }
}

fn device_info(name: &str, attr: &ibv_device_attr, port: &PortInfo) -> DeviceInfo {
    DeviceInfo {
        name: name.to_owned(),
        provider: "ib",
        port: port.num,
        link_layer: port.link_layer,
        active_mtu: port.active_mtu,
        fw_ver: fw_ver(attr),
    }
}

fn fw_ver(attr: &ibv_device_attr) -> String {
    // SAFETY: `fw_ver` is a C char array; reinterpreting `c_char` (i8) as `u8` keeps each
    // byte, and the slice stays within the 64-byte array.
    let bytes: &[u8] =
        unsafe { std::slice::from_raw_parts(attr.fw_ver.as_ptr().cast::<u8>(), attr.fw_ver.len()) };
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

fn open_candidate(
    c: Candidate,
    rail: usize,
    forced_gid: Option<u32>,
    traffic_class: u8,
    service_level: u8,
    transport: Transport,
) -> Result<IbContext, VerbsError> {
    let ethernet = c.port.link_layer == LinkLayer::Ethernet;
    let t0 = std::time::Instant::now();
    let table = gid_table(&c.raw, &c.name, &c.port);
    let t_gids = t0.elapsed();
    let (gid, gid_choice) = select::choose_gid(&c.name, c.port.num, ethernet, &table, forced_gid)?;
    let raw = match Arc::try_unwrap(c.raw) {
        Ok(r) => r,
        // Another chosen port of the same device still holds it: open it once more, so that
        // every context owns its `ibv_context` (they are cheap and independent).
        Err(_) => reopen(&c.name)?,
    };
    let max_inline = super::qp::probe_max_inline(&raw, &c.name, INLINE_PROBE_MAX);
    tracing::debug!(
        "NET/IB : {}:{}: GID table ({} entries) read in {t_gids:?}, inline size probed in {:?}",
        c.name,
        c.port.num,
        c.port.gid_tbl_len,
        t0.elapsed() - t_gids
    );
    let caps = caps_of(&c.attr, &c.port, max_inline);
    let shared = CtxShared {
        raw,
        info: device_info(&c.name, &c.attr, &c.port),
        caps,
        port: c.port.clone(),
        gid,
        gid_choice,
        max_dest_rd_atomic: u32::try_from(c.attr.max_qp_rd_atom).unwrap_or(0),
        max_sge_rd: u32::try_from(c.attr.max_sge_rd)
            .ok()
            .filter(|&n| n > 0)
            .unwrap_or(caps.max_sge),
        quirks: Quirks::of(&c.name, c.attr.vendor_id),
        srq_limits: SrqLimits::of(&c.attr),
        rail,
        traffic_class,
        service_level,
        transport,
    };
    let why = match gid_choice {
        GidChoice::Forced => "from RPC_IB_GID_INDEX",
        GidChoice::Auto => "auto",
        GidChoice::InfiniBand => "port GID",
    };
    tracing::info!(
        "NET/IB : [{rail}]{} GID index {} ({}, {}{}) {why}; MTU {}, max inline {}",
        shared.label(),
        shared.gid.index,
        select::GidAddr(&shared.gid.gid),
        shared.gid.kind.name(),
        shared
            .gid
            .netdev
            .as_deref()
            .map(|n| format!(", {n}"))
            .unwrap_or_default(),
        shared.port.active_mtu,
        caps.max_inline,
    );
    Ok(IbContext {
        shared: Arc::new(shared),
    })
}

fn reopen(name: &str) -> Result<RawContext, VerbsError> {
    let list = DeviceList::get()?
        .ok_or_else(|| VerbsError::new(Verb::OpenDevice, ErrorKind::NoDevice, NO_DEVICE_HELP))?;
    let dev = list
        .iter()
        .find(|(_, n)| n == name)
        .map(|(d, _)| d)
        .ok_or_else(|| {
            VerbsError::new(
                Verb::OpenDevice,
                ErrorKind::NoDevice,
                format!("{name} disappeared while it was being opened"),
            )
        })?;
    RawContext::open(dev, name)
}

/// A full report of one device for `rpc-doctor`: every port, active or not, and its GIDs.
#[derive(Clone, Debug)]
pub struct DeviceReport {
    /// Device name.
    pub name: String,
    /// Firmware version.
    pub fw_ver: String,
    /// Node GUID (host byte order).
    pub node_guid: u64,
    /// PCI vendor id.
    pub vendor_id: u32,
    /// PCI part id.
    pub vendor_part_id: u32,
    /// Capabilities (with the inline size probed on the first active port, else 0).
    pub caps: Caps,
    /// Every port.
    pub ports: Vec<PortReport>,
}

/// One port in a [`DeviceReport`].
#[derive(Clone, Debug)]
pub struct PortReport {
    /// What the port reports.
    pub info: PortInfo,
    /// Its GID table (non-empty entries).
    pub gids: Vec<GidEntry>,
    /// The GID the provider would use, or why there is none.
    pub chosen: Result<(u32, GidChoice), String>,
}

/// Reports every device and port for diagnostics (`rpc-doctor`), without choosing any.
/// An empty list means the system has no RDMA device.
///
/// # Errors
/// When the device list itself cannot be read, or a device cannot be queried.
pub fn diagnose() -> Result<Vec<DeviceReport>, VerbsError> {
    let Some(list) = DeviceList::get()? else {
        return Ok(Vec::new());
    };
    let forced = select::env_number(select::ENV_GID_INDEX, u32::from(u16::MAX))?;
    let mut out = Vec::new();
    for (dev, name) in list.iter() {
        let raw = RawContext::open(dev, &name)?;
        let attr = raw.query_device(&name)?;
        let mut ports = Vec::new();
        let mut max_inline = 0;
        for p in 1..=attr.phys_port_cnt {
            let info = PortInfo::from_attr(p, &raw.query_port(&name, p)?);
            let gids = gid_table(&raw, &name, &info);
            let ethernet = info.link_layer == LinkLayer::Ethernet;
            let chosen = select::choose_gid(&name, p, ethernet, &gids, forced)
                .map(|(g, why)| (g.index, why))
                .map_err(|e| e.detail().to_owned());
            if info.is_active() && max_inline == 0 {
                max_inline = super::qp::probe_max_inline(&raw, &name, INLINE_PROBE_MAX);
            }
            ports.push(PortReport { info, gids, chosen });
        }
        let caps = match ports.iter().find(|p| p.info.is_active()).or(ports.first()) {
            Some(p) => caps_of(&attr, &p.info, max_inline),
            None => caps_of(&attr, &PortInfo::from_attr(0, &zeroed_port()), 0),
        };
        out.push(DeviceReport {
            fw_ver: fw_ver(&attr),
            name,
            node_guid: u64::from_be(attr.node_guid),
            vendor_id: attr.vendor_id,
            vendor_part_id: attr.vendor_part_id,
            caps,
            ports,
        });
    }
    Ok(out)
}

fn zeroed_port() -> ibv_port_attr {
    // SAFETY: all-zero bytes are a valid `ibv_port_attr` (plain integers).
    unsafe { std::mem::zeroed() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates() {
        assert_eq!(link_rate(2, 32), Some(100.0));
        assert_eq!(link_rate(2, 64), Some(200.0));
        assert_eq!(link_rate(1, 1), Some(2.5));
        assert_eq!(link_rate(3, 1), None);
    }

    #[test]
    fn port_state_names_and_fixes() {
        assert_eq!(PortState::from_raw(4), PortState::Active);
        assert_eq!(PortState::from_raw(1).name(), "PORT_DOWN");
        assert!(PortState::Down.fix().contains("ip link set"));
        assert!(PortState::Init.fix().contains("subnet manager"));
        assert_eq!(PortState::Active.fix(), "");
    }

    #[test]
    fn errno_of_returns() {
        assert_eq!(ret_errno(libc::EINVAL), libc::EINVAL);
    }
}
