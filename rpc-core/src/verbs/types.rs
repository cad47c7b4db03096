//! Plain data types of the verbs layer: access flags, capabilities, work requests, completions,
//! queue-pair states and the out-of-band endpoint a peer needs to connect.
//!
//! Everything here is provider-neutral, `Copy` where it can be, and free of heap allocation so
//! that work requests and completions can live on the stack of a poll loop.

use std::fmt;

use super::error::{ErrorKind, Verb, VerbsError};

/// Memory-region access rights, as `ibv_access_flags`.
///
/// Local read access is always granted. Remote write and remote atomic access require
/// [`Access::LOCAL_WRITE`], as in libibverbs (the provider rejects the registration otherwise).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// No access besides local read.
    pub const NONE: Access = Access(0);
    /// The local NIC may write into the region (RECV targets, READ and atomic results).
    pub const LOCAL_WRITE: Access = Access(1);
    /// A remote peer may RDMA WRITE into the region.
    pub const REMOTE_WRITE: Access = Access(1 << 1);
    /// A remote peer may RDMA READ from the region.
    pub const REMOTE_READ: Access = Access(1 << 2);
    /// A remote peer may run atomic operations on 8-byte aligned words of the region.
    pub const REMOTE_ATOMIC: Access = Access(1 << 3);
    /// Every right above.
    pub const ALL: Access = Access(0b1111);

    /// The raw bits (same values as `IBV_ACCESS_*`).
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Flags from raw bits; unknown bits are dropped.
    pub const fn from_bits_truncate(bits: u32) -> Access {
        Access(bits & Self::ALL.0)
    }

    /// Whether every flag of `other` is set in `self`.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether the flags are valid together (remote write/atomic need local write).
    pub const fn is_valid(self) -> bool {
        let needs_local = Self::REMOTE_WRITE.0 | Self::REMOTE_ATOMIC.0;
        self.0 & needs_local == 0 || self.0 & Self::LOCAL_WRITE.0 != 0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl std::ops::BitOrAssign for Access {
    fn bitor_assign(&mut self, rhs: Access) {
        self.0 |= rhs.0;
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Self::LOCAL_WRITE, "LOCAL_WRITE"),
            (Self::REMOTE_WRITE, "REMOTE_WRITE"),
            (Self::REMOTE_READ, "REMOTE_READ"),
            (Self::REMOTE_ATOMIC, "REMOTE_ATOMIC"),
        ];
        let mut first = true;
        for (flag, name) in names {
            if self.contains(flag) {
                if !first {
                    f.write_str("|")?;
                }
                f.write_str(name)?;
                first = false;
            }
        }
        if first {
            f.write_str("NONE")?;
        }
        Ok(())
    }
}

/// What a device (and the provider's implementation of it) can do. Values are limits the
/// provider enforces: a queue pair asking for more is refused at creation, never silently
/// truncated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// Largest payload a SEND/WRITE may carry inline (copied at post time, no lkey needed).
    pub max_inline: u32,
    /// Most scatter/gather entries in one work request.
    pub max_sge: u32,
    /// Deepest send or receive queue of one QP.
    pub max_qp_wr: u32,
    /// Deepest shared receive queue (0: the device has no SRQs).
    pub max_srq_wr: u32,
    /// Deepest completion queue.
    pub max_cqe: u32,
    /// Largest message (SEND, WRITE or READ) in bytes.
    pub max_msg_size: u64,
    /// Largest memory registration in bytes.
    pub max_mr_size: u64,
    /// Whether compare-and-swap and fetch-and-add are supported.
    pub atomics: bool,
    /// Most outstanding RDMA READ/atomic operations a QP may have as requester.
    pub max_rd_atomic: u32,
}

/// Link layer of a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkLayer {
    /// InfiniBand fabric (LID routed).
    InfiniBand,
    /// RDMA over Converged Ethernet (GID routed).
    Ethernet,
    /// The soft provider's shared-memory fabric on one host.
    SharedMemory,
}

/// One device as listed by [`Provider::devices`](super::Provider::devices).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device name (`soft0`, `mlx5_0`, `rxe0`).
    pub name: String,
    /// Provider name (`soft`, `ib`).
    pub provider: &'static str,
    /// Port used by default (1-based, as in verbs).
    pub port: u8,
    /// Link layer of that port.
    pub link_layer: LinkLayer,
    /// Active MTU of that port in bytes.
    pub active_mtu: u32,
    /// Firmware version string, if the device has one.
    pub fw_ver: String,
}

/// Queue-pair states of the RC state machine (`IBV_QPS_*`; SQD and SQE are not modelled).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum QpState {
    /// Just created or reset: nothing may be posted.
    Reset = 0,
    /// Receives may be posted; nothing is received yet.
    Init = 1,
    /// Ready to receive: the peer is known, inbound traffic is accepted.
    Rtr = 2,
    /// Ready to send: sends may be posted.
    Rts = 3,
    /// Failed: every outstanding and future work request completes with `WR_FLUSH_ERR`.
    Error = 4,
}

impl QpState {
    /// State from its numeric value.
    pub const fn from_u8(v: u8) -> Option<QpState> {
        match v {
            0 => Some(QpState::Reset),
            1 => Some(QpState::Init),
            2 => Some(QpState::Rtr),
            3 => Some(QpState::Rts),
            4 => Some(QpState::Error),
            _ => None,
        }
    }
}

/// Sizes requested for a new RC queue pair. Checked against [`Caps`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth (outstanding send work requests).
    pub max_send_wr: u32,
    /// Receive queue depth (posted receives).
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send work request.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive work request.
    pub max_recv_sge: u32,
    /// Inline payload bytes per send work request.
    pub max_inline_data: u32,
}

/// Sizes of a shared receive queue ([`Pd::create_srq`](crate::verbs::Pd::create_srq)),
/// as asked and as granted ([`Srq::caps`](crate::verbs::Srq::caps)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SrqCaps {
    /// Receives posted and not yet polled, at most.
    pub max_wr: u32,
    /// Scatter/gather entries per receive.
    pub max_sge: u32,
}

impl Default for SrqCaps {
    fn default() -> Self {
        SrqCaps {
            max_wr: 1024,
            max_sge: 1,
        }
    }
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
        }
    }
}

/// Attributes of the INIT -> RTR -> RTS transitions that are not taken from the peer's
/// [`Endpoint`]. Defaults are those of a healthy RC connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectAttr {
    /// Transport retry count (0..=7) for missing ACKs before `RETRY_EXC_ERR`.
    pub retry_cnt: u8,
    /// RNR retry count (0..=7); 7 means retry forever.
    pub rnr_retry: u8,
    /// Minimal RNR NAK timer (verbs encoding 0..=31; 12 = 0.64 ms): how long a peer that
    /// found no receive posted here waits before it retries (set at RTR; the responder's value
    /// paces the requester, as in IB).
    pub min_rnr_timer: u8,
    /// Local ACK timeout (verbs encoding: 4.096 µs * 2^timeout; 14 = 67 ms).
    pub timeout: u8,
    /// Outstanding RDMA READ/atomic as requester.
    pub max_rd_atomic: u8,
    /// Outstanding RDMA READ/atomic as responder.
    pub max_dest_rd_atomic: u8,
    /// Access rights granted to the peer through this QP (`qp_access_flags`).
    pub access: Access,
    /// Path MTU wanted; the provider uses the minimum of this and both ends' active MTU.
    pub path_mtu: u32,
}

impl Default for ConnectAttr {
    fn default() -> Self {
        ConnectAttr {
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            timeout: 14,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
            access: Access::LOCAL_WRITE
                | Access::REMOTE_WRITE
                | Access::REMOTE_READ
                | Access::REMOTE_ATOMIC,
            path_mtu: 4096,
        }
    }
}

/// Largest transport and RNR retry count (3-bit fields; an RNR count of 7 means forever).
pub const MAX_RETRY_CNT: u8 = 7;
/// Largest `min_rnr_timer` and local ACK `timeout` encoding (5-bit fields).
pub const MAX_TIMER_ENCODING: u8 = 31;

/// The RNR NAK timer an encoding stands for (IB spec table of `min_rnr_timer` encodings;
/// values above 31 are taken modulo 32, as the 5-bit field would).
pub fn rnr_timer(encoding: u8) -> std::time::Duration {
    // Values in microseconds for encodings 0..=31; 0 means 655.36 ms.
    const TABLE_US: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];
    std::time::Duration::from_micros(u64::from(TABLE_US[usize::from(encoding & 31)]))
}

impl ConnectAttr {
    /// Checks the ranges verbs defines for these attributes, the same way on every provider
    /// (`ibv_modify_qp` refuses the same values with EINVAL): `retry_cnt` and `rnr_retry` at
    /// most [`MAX_RETRY_CNT`], `min_rnr_timer` and `timeout` at most [`MAX_TIMER_ENCODING`].
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming every field out of range.
    pub fn validate(&self) -> Result<(), VerbsError> {
        let mut bad = Vec::new();
        for (name, v, max) in [
            ("retry_cnt", self.retry_cnt, MAX_RETRY_CNT),
            ("rnr_retry", self.rnr_retry, MAX_RETRY_CNT),
            ("min_rnr_timer", self.min_rnr_timer, MAX_TIMER_ENCODING),
            ("timeout", self.timeout, MAX_TIMER_ENCODING),
        ] {
            if v > max {
                bad.push(format!("{name} = {v} (want 0..={max})"));
            }
        }
        if bad.is_empty() {
            return Ok(());
        }
        Err(VerbsError::new(
            Verb::ModifyQp,
            ErrorKind::InvalidArgument,
            format!("connection attributes out of range: {}", bad.join(", ")),
        ))
    }

    /// The RNR NAK timer this side asks its peer to wait after an RNR NAK from us
    /// ([`rnr_timer`] of `min_rnr_timer`): in IB it is the *responder's* timer that paces the
    /// requester's RNR retries.
    pub fn rnr_timer(&self) -> std::time::Duration {
        rnr_timer(self.min_rnr_timer)
    }

    /// The local ACK timeout as a duration (4.096 µs * 2^timeout; 0 means infinite).
    pub fn ack_timeout(&self) -> Option<std::time::Duration> {
        if self.timeout == 0 {
            return None;
        }
        let ns = 4096u64 << u32::from(self.timeout.min(31));
        Some(std::time::Duration::from_nanos(ns))
    }
}

/// What a peer needs to connect an RC queue pair to ours: the analog of LID + GID + QP number +
/// PSN. Exchanged out of band (the RPC handshake sends it over TCP) as its fixed-size byte form.
///
/// For `ib`, `gid` is the port GID chosen for RoCE (or the subnet prefix + GUID on InfiniBand)
/// and `lid` the port LID. For `soft`, `gid` names the soft RNIC instance (host, process and a
/// random nonce): it is what lets a peer find and validate the shared memory it must map.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// Provider tag: [`ProviderKind::wire_tag`](super::ProviderKind::wire_tag) of the
    /// provider that made it.
    pub provider: u8,
    /// Port number the QP is bound to.
    pub port: u8,
    /// Local identifier (InfiniBand); 0 on RoCE and soft.
    pub lid: u16,
    /// QP number.
    pub qp_num: u32,
    /// Initial packet sequence number of our send queue (the peer's `rq_psn`).
    pub psn: u32,
    /// Active MTU of our port in bytes.
    pub mtu: u32,
    /// Global identifier (RoCE/IB GID; soft RNIC identity).
    pub gid: [u8; 16],
    /// Provider-specific extra word (soft: index of the peer's doorbell; ib: GID index).
    pub aux: u64,
}

impl Endpoint {
    /// Tag of the soft provider (its registry entry's wire tag).
    pub const PROVIDER_SOFT: u8 = super::ProviderKind::Soft.wire_tag();
    /// Tag of the ib provider (its registry entry's wire tag).
    pub const PROVIDER_IB: u8 = super::ProviderKind::Ib.wire_tag();
    /// Size of the encoded form.
    pub const ENCODED_LEN: usize = 44;
    const MAGIC: [u8; 2] = *b"EP";
    const VERSION: u8 = 1;

    /// The fixed-size little-endian encoding.
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[0..2].copy_from_slice(&Self::MAGIC);
        b[2] = Self::VERSION;
        b[3] = self.provider;
        b[4] = self.port;
        b[5] = 0;
        b[6..8].copy_from_slice(&self.lid.to_le_bytes());
        b[8..12].copy_from_slice(&self.qp_num.to_le_bytes());
        b[12..16].copy_from_slice(&self.psn.to_le_bytes());
        b[16..20].copy_from_slice(&self.mtu.to_le_bytes());
        b[20..36].copy_from_slice(&self.gid);
        b[36..44].copy_from_slice(&self.aux.to_le_bytes());
        b
    }

    /// Decodes [`Endpoint::to_bytes`]. Errors on a short buffer, a bad magic or version, an
    /// unknown provider, a PSN wider than 24 bits or an MTU that is not a power of two in
    /// 256..=4096 (the soft provider allows up to 1 GiB).
    pub fn from_bytes(b: &[u8]) -> Result<Endpoint, VerbsError> {
        let bad =
            |why: &'static str| VerbsError::new(Verb::Connect, ErrorKind::InvalidEndpoint, why);
        if b.len() < Self::ENCODED_LEN {
            return Err(bad("peer endpoint is truncated"));
        }
        if b[0..2] != Self::MAGIC {
            return Err(bad(
                "peer endpoint has a bad magic (not an rdma-rpc endpoint)",
            ));
        }
        if b[2] != Self::VERSION {
            return Err(bad("peer endpoint has an unsupported version"));
        }
        let rd4 = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[20..36]);
        let mut aux = [0u8; 8];
        aux.copy_from_slice(&b[36..44]);
        let ep = Endpoint {
            provider: b[3],
            port: b[4],
            lid: u16::from_le_bytes([b[6], b[7]]),
            qp_num: rd4(8),
            psn: rd4(12),
            mtu: rd4(16),
            gid,
            aux: u64::from_le_bytes(aux),
        };
        if super::ProviderKind::from_wire_tag(ep.provider).is_none() {
            return Err(bad("peer endpoint names an unknown provider"));
        }
        if ep.psn > 0x00ff_ffff {
            return Err(bad("peer endpoint PSN is wider than 24 bits"));
        }
        if !ep.mtu.is_power_of_two() || ep.mtu < 256 || ep.mtu > (1 << 30) {
            return Err(bad(
                "peer endpoint MTU is not a power of two in 256..=1 GiB",
            ));
        }
        Ok(ep)
    }
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("provider", &self.provider)
            .field("port", &self.port)
            .field("lid", &self.lid)
            .field("qp_num", &self.qp_num)
            .field("psn", &format_args!("{:#08x}", self.psn))
            .field("mtu", &self.mtu)
            .field("gid", &format_args!("{}", GidFmt(&self.gid)))
            .field("aux", &self.aux)
            .finish()
    }
}

/// Formats a GID as eight colon-separated groups of four hex digits (`fe80:0000:...`).
#[derive(Debug)]
pub struct GidFmt<'a>(pub &'a [u8; 16]);

impl fmt::Display for GidFmt<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, pair) in self.0.chunks(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", pair[0], pair[1])?;
        }
        Ok(())
    }
}

/// A remote memory region as a peer advertises it: enough for RDMA READ/WRITE/atomics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RemoteMr {
    /// Start address in the owner's address space (what remote operations target).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

impl RemoteMr {
    /// Size of the encoded form.
    pub const ENCODED_LEN: usize = 20;

    /// Little-endian encoding: addr, len, rkey.
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..20].copy_from_slice(&self.rkey.to_le_bytes());
        b
    }

    /// Decodes [`RemoteMr::to_bytes`]; `None` when `b` is too short or `addr + len` overflows.
    pub fn from_bytes(b: &[u8]) -> Option<RemoteMr> {
        let b = b.get(..Self::ENCODED_LEN)?;
        let addr = u64::from_le_bytes(b[0..8].try_into().ok()?);
        let len = u64::from_le_bytes(b[8..16].try_into().ok()?);
        let rkey = u32::from_le_bytes(b[16..20].try_into().ok()?);
        addr.checked_add(len)?;
        Some(RemoteMr { addr, len, rkey })
    }

    /// The sub-range `[offset, offset + len)`, or `None` when it is not inside `self`.
    pub fn slice(&self, offset: u64, len: u64) -> Option<RemoteMr> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        Some(RemoteMr {
            addr: self.addr + offset,
            len,
            rkey: self.rkey,
        })
    }
}

/// One scatter/gather entry; same layout as `struct ibv_sge`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[repr(C)]
pub struct Sge {
    /// Local virtual address (inside the registered region named by `lkey`).
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the memory region.
    pub lkey: u32,
}

/// The operation of a send work request, with its operation-specific fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WrOp {
    /// Two-sided SEND: consumes a receive posted by the peer.
    Send,
    /// SEND carrying 32 bits of immediate data delivered in the peer's completion.
    SendWithImm {
        /// Immediate data (delivered in host byte order).
        imm: u32,
    },
    /// One-sided RDMA WRITE of the local SG list to `remote_addr` in the peer's region `rkey`.
    Write {
        /// Target address in the peer's address space.
        remote_addr: u64,
        /// Peer's remote key.
        rkey: u32,
    },
    /// RDMA WRITE that also consumes a peer receive and delivers `imm` in its completion.
    WriteWithImm {
        /// Target address in the peer's address space.
        remote_addr: u64,
        /// Peer's remote key.
        rkey: u32,
        /// Immediate data.
        imm: u32,
    },
    /// One-sided RDMA READ from the peer's region into the local SG list.
    Read {
        /// Source address in the peer's address space.
        remote_addr: u64,
        /// Peer's remote key.
        rkey: u32,
    },
    /// 64-bit compare-and-swap on an 8-byte aligned remote word; the old value lands in the
    /// (single, 8-byte) local SGE.
    CompareSwap {
        /// Target address (8-byte aligned).
        remote_addr: u64,
        /// Peer's remote key.
        rkey: u32,
        /// Value compared with the remote word.
        compare: u64,
        /// Value written when the comparison holds.
        swap: u64,
    },
    /// 64-bit fetch-and-add on an 8-byte aligned remote word; the old value lands in the local
    /// SGE.
    FetchAdd {
        /// Target address (8-byte aligned).
        remote_addr: u64,
        /// Peer's remote key.
        rkey: u32,
        /// Value added.
        add: u64,
    },
}

impl WrOp {
    /// Whether the operation consumes a receive the responder posted (SEND, SEND_WITH_IMM,
    /// and WRITE_WITH_IMM for its immediate).
    pub const fn consumes_receive(&self) -> bool {
        matches!(
            self,
            WrOp::Send | WrOp::SendWithImm { .. } | WrOp::WriteWithImm { .. }
        )
    }

    /// The completion opcode reported for this operation on the requester side.
    pub const fn wc_opcode(&self) -> WcOpcode {
        match self {
            WrOp::Send | WrOp::SendWithImm { .. } => WcOpcode::Send,
            WrOp::Write { .. } | WrOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
            WrOp::Read { .. } => WcOpcode::RdmaRead,
            WrOp::CompareSwap { .. } => WcOpcode::CompSwap,
            WrOp::FetchAdd { .. } => WcOpcode::FetchAdd,
        }
    }

    /// Whether the operation is an atomic.
    pub const fn is_atomic(&self) -> bool {
        matches!(self, WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. })
    }
}

/// Flags of a send work request (`IBV_SEND_*`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SendFlags(u8);

impl SendFlags {
    /// No flag: unsignaled, not inline.
    pub const NONE: SendFlags = SendFlags(0);
    /// Generate a completion on success (errors always complete).
    pub const SIGNALED: SendFlags = SendFlags(1);
    /// Copy the payload into the work request at post time; no lkey is checked and the buffer
    /// may be reused as soon as `post_send` returns.
    pub const INLINE: SendFlags = SendFlags(1 << 1);
    /// Wait for prior READ/atomic operations to complete before this one starts.
    pub const FENCE: SendFlags = SendFlags(1 << 2);
    /// Ask the peer's CQ to raise a solicited event.
    pub const SOLICITED: SendFlags = SendFlags(1 << 3);

    /// Whether every flag of `other` is set.
    pub const fn contains(self, other: SendFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// The raw bits.
    pub const fn bits(self) -> u8 {
        self.0
    }
}

impl std::ops::BitOr for SendFlags {
    type Output = SendFlags;
    fn bitor(self, rhs: SendFlags) -> SendFlags {
        SendFlags(self.0 | rhs.0)
    }
}

impl fmt::Debug for SendFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut l = f.debug_set();
        for (flag, name) in [
            (Self::SIGNALED, "SIGNALED"),
            (Self::INLINE, "INLINE"),
            (Self::FENCE, "FENCE"),
            (Self::SOLICITED, "SOLICITED"),
        ] {
            if self.contains(flag) {
                l.entry(&format_args!("{name}"));
            }
        }
        l.finish()
    }
}

/// A send work request. Borrowed SG list: building one allocates nothing.
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// Operation and its remote target.
    pub op: WrOp,
    /// Local scatter/gather list (for READ and atomics: where results land).
    pub sg_list: &'a [Sge],
    /// Flags.
    pub flags: SendFlags,
}

/// A receive work request.
#[derive(Clone, Copy, Debug)]
pub struct RecvWr<'a> {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// Where an incoming SEND's payload is scattered.
    pub sg_list: &'a [Sge],
}

/// Completion opcodes (`IBV_WC_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
pub enum WcOpcode {
    /// A SEND (with or without immediate) completed.
    #[default]
    Send = 0,
    /// An RDMA WRITE (with or without immediate) completed.
    RdmaWrite = 1,
    /// An RDMA READ completed.
    RdmaRead = 2,
    /// A compare-and-swap completed.
    CompSwap = 3,
    /// A fetch-and-add completed.
    FetchAdd = 4,
    /// A receive consumed by an incoming SEND.
    Recv = 128,
    /// A receive consumed by an incoming WRITE_WITH_IMM.
    RecvRdmaWithImm = 129,
}

/// Completion statuses (`IBV_WC_*` status values, same numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
pub enum WcStatus {
    /// The operation completed.
    #[default]
    Success = 0,
    /// Local length error: a receive too small for the incoming message, or a send larger than
    /// the message size limit.
    LocLenErr = 1,
    /// Local QP operation error (internal consistency error, e.g. inline data too long).
    LocQpOpErr = 2,
    /// Local protection error: an SGE outside its MR, a bad lkey, or missing local access.
    LocProtErr = 4,
    /// Flushed: the QP was in ERROR when this request was processed.
    WrFlushErr = 5,
    /// Memory-window bind error.
    MwBindErr = 6,
    /// Bad response from the remote side.
    BadRespErr = 7,
    /// Local access error on a READ/atomic response.
    LocAccessErr = 8,
    /// The remote side got an invalid request (e.g. a SEND larger than its posted receive).
    RemInvReqErr = 9,
    /// Remote access error: bad rkey, out of bounds, or missing remote right.
    RemAccessErr = 10,
    /// The remote side could not complete the operation (e.g. a bad receive it posted).
    RemOpErr = 11,
    /// Transport retries exhausted: the peer did not answer.
    RetryExcErr = 12,
    /// Receiver-not-ready retries exhausted: the peer posted no receive.
    RnrRetryExcErr = 13,
    /// Remote side aborted the operation.
    RemAbortErr = 16,
    /// Fatal error.
    FatalErr = 19,
    /// Response timeout.
    RespTimeoutErr = 20,
    /// General error.
    GeneralErr = 21,
}

impl WcStatus {
    /// Status from its verbs number; unknown numbers map to [`WcStatus::GeneralErr`].
    pub const fn from_u32(v: u32) -> WcStatus {
        match v {
            0 => WcStatus::Success,
            1 => WcStatus::LocLenErr,
            2 => WcStatus::LocQpOpErr,
            4 => WcStatus::LocProtErr,
            5 => WcStatus::WrFlushErr,
            6 => WcStatus::MwBindErr,
            7 => WcStatus::BadRespErr,
            8 => WcStatus::LocAccessErr,
            9 => WcStatus::RemInvReqErr,
            10 => WcStatus::RemAccessErr,
            11 => WcStatus::RemOpErr,
            12 => WcStatus::RetryExcErr,
            13 => WcStatus::RnrRetryExcErr,
            16 => WcStatus::RemAbortErr,
            19 => WcStatus::FatalErr,
            20 => WcStatus::RespTimeoutErr,
            _ => WcStatus::GeneralErr,
        }
    }

    /// The libibverbs name (`IBV_WC_REM_ACCESS_ERR`).
    pub const fn name(self) -> &'static str {
        match self {
            WcStatus::Success => "IBV_WC_SUCCESS",
            WcStatus::LocLenErr => "IBV_WC_LOC_LEN_ERR",
            WcStatus::LocQpOpErr => "IBV_WC_LOC_QP_OP_ERR",
            WcStatus::LocProtErr => "IBV_WC_LOC_PROT_ERR",
            WcStatus::WrFlushErr => "IBV_WC_WR_FLUSH_ERR",
            WcStatus::MwBindErr => "IBV_WC_MW_BIND_ERR",
            WcStatus::BadRespErr => "IBV_WC_BAD_RESP_ERR",
            WcStatus::LocAccessErr => "IBV_WC_LOC_ACCESS_ERR",
            WcStatus::RemInvReqErr => "IBV_WC_REM_INV_REQ_ERR",
            WcStatus::RemAccessErr => "IBV_WC_REM_ACCESS_ERR",
            WcStatus::RemOpErr => "IBV_WC_REM_OP_ERR",
            WcStatus::RetryExcErr => "IBV_WC_RETRY_EXC_ERR",
            WcStatus::RnrRetryExcErr => "IBV_WC_RNR_RETRY_EXC_ERR",
            WcStatus::RemAbortErr => "IBV_WC_REM_ABORT_ERR",
            WcStatus::FatalErr => "IBV_WC_FATAL_ERR",
            WcStatus::RespTimeoutErr => "IBV_WC_RESP_TIMEOUT_ERR",
            WcStatus::GeneralErr => "IBV_WC_GENERAL_ERR",
        }
    }

    /// The likely causes of this status, from the field's experience, for error messages.
    pub const fn likely_cause(self) -> &'static str {
        match self {
            WcStatus::Success => "no error",
            WcStatus::LocLenErr => {
                "a posted receive is smaller than the incoming message, or a send exceeds the \
                 port's max message size"
            }
            WcStatus::LocQpOpErr => {
                "the work request is invalid for this QP (inline data over max_inline_data, too \
                 many SGEs, or an opcode the QP type does not support); Soft-RoCE (rxe) also \
                 completes with it when it cannot route a packet to the peer: the link is down \
                 or the netdev lost its address (check as for RETRY_EXC_ERR: link, MTU, GID, \
                 PFC)"
            }
            WcStatus::LocProtErr => {
                "an SGE points outside its memory region, the lkey is wrong or deregistered, or \
                 the region lacks LOCAL_WRITE for a receive/READ target"
            }
            WcStatus::WrFlushErr => {
                "the QP was already in ERROR: look for the first completion with another status \
                 on this QP; that one is the real failure"
            }
            WcStatus::MwBindErr => "memory window bind failed (bad window or region rights)",
            WcStatus::BadRespErr => "the responder sent an unexpected transport response",
            WcStatus::LocAccessErr => "the local region lacks the rights for a READ/atomic result",
            WcStatus::RemInvReqErr => {
                "the peer rejected the request: a SEND larger than its posted receive, an \
                 unaligned atomic, or an opcode its QP does not allow"
            }
            WcStatus::RemAccessErr => {
                "remote access denied: the rkey is wrong, stale or deregistered, the address \
                 range is outside the peer's region, or the region/QP lacks the remote right \
                 (REMOTE_READ/REMOTE_WRITE/REMOTE_ATOMIC)"
            }
            WcStatus::RemOpErr => {
                "the peer could not complete the operation (its receive had a bad lkey or SGE, \
                 or its QP failed)"
            }
            WcStatus::RetryExcErr => {
                "the peer never acknowledged: the peer process or host is gone, or the path is \
                 broken (RoCE: PFC/ECN not configured, MTU mismatch, wrong GID index or RoCE \
                 version, link flap; InfiniBand: subnet manager change, wrong LID)"
            }
            WcStatus::RnrRetryExcErr => {
                "receiver not ready: the peer posted no receive in time (it is overloaded or \
                 its receive ring is too small; raise rnr_retry to 7 to wait forever)"
            }
            WcStatus::RemAbortErr => "the peer aborted the operation",
            WcStatus::FatalErr => "the device reported a fatal error; the QP must be recreated",
            WcStatus::RespTimeoutErr => "the responder did not answer in time",
            WcStatus::GeneralErr => "unspecified device error (see the vendor error)",
        }
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), *self as u8)
    }
}

/// Flags of a completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct WcFlags(u8);

impl WcFlags {
    /// No flag.
    pub const NONE: WcFlags = WcFlags(0);
    /// `imm_data` is valid.
    pub const WITH_IMM: WcFlags = WcFlags(1);

    /// Whether every flag of `other` is set.
    pub const fn contains(self, other: WcFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for WcFlags {
    type Output = WcFlags;
    fn bitor(self, rhs: WcFlags) -> WcFlags {
        WcFlags(self.0 | rhs.0)
    }
}

/// An asynchronous event of a device (`ibv_get_async_event`): something that happened to a
/// port, the device or a queue pair outside of any work request. See
/// [`Context::poll_async_event`](super::Context::poll_async_event).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AsyncEvent {
    /// The port came (back) up (`IBV_EVENT_PORT_ACTIVE`).
    PortActive {
        /// Port number.
        port: u8,
    },
    /// The port went down (`IBV_EVENT_PORT_ERR`): link loss, cable, switch port.
    PortError {
        /// Port number.
        port: u8,
    },
    /// The port's GID table changed (`IBV_EVENT_GID_CHANGE`): an IP address of its netdev
    /// came or went (RoCE), the subnet prefix changed (InfiniBand).
    GidChange {
        /// Port number.
        port: u8,
    },
    /// The port's LID, P_Key table or subnet manager changed, or the SM asked clients to
    /// re-register (`IBV_EVENT_LID_CHANGE`, `PKEY_CHANGE`, `SM_CHANGE`, `CLIENT_REREGISTER`).
    PortChange {
        /// Port number.
        port: u8,
    },
    /// The device failed (`IBV_EVENT_DEVICE_FATAL`): every object of the context is dead;
    /// close it and open the device again.
    DeviceFatal,
    /// A completion queue overran or failed (`IBV_EVENT_CQ_ERR`).
    CqError,
    /// A QP failed outside a work request (`IBV_EVENT_QP_FATAL`, `QP_REQ_ERR`,
    /// `QP_ACCESS_ERR`, `PATH_MIG_ERR`): it is in ERROR.
    QpFatal {
        /// The QP's number.
        qp_num: u32,
    },
    /// Informational QP events (`COMM_EST`, `SQ_DRAINED`, `PATH_MIG`, `QP_LAST_WQE_REACHED`).
    QpInfo {
        /// The QP's number.
        qp_num: u32,
    },
    /// A shared receive queue holds fewer unconsumed receives than the limit armed with
    /// [`Srq::arm_limit`](crate::verbs::Srq::arm_limit) (`IBV_EVENT_SRQ_LIMIT_REACHED`); the
    /// limit is disarmed until armed again.
    SrqLimitReached {
        /// The SRQ's [`Srq::srq_num`](crate::verbs::Srq::srq_num).
        srq_num: u32,
    },
    /// Any other event (SRQ error, WQ), with its `ibv_event_type` number.
    Other {
        /// The raw event type.
        code: u32,
    },
}

impl AsyncEvent {
    /// Whether connections over the object named must be failed (port down, device fatal,
    /// CQ error, QP fatal).
    pub const fn is_fatal(&self) -> bool {
        matches!(
            self,
            AsyncEvent::PortError { .. }
                | AsyncEvent::DeviceFatal
                | AsyncEvent::CqError
                | AsyncEvent::QpFatal { .. }
        )
    }

    /// The cause to name in a connection failure or a log line.
    pub const fn cause(&self) -> &'static str {
        match self {
            AsyncEvent::PortActive { .. } => "port active again",
            AsyncEvent::PortError { .. } => {
                "port down (link loss: cable, switch port, or the netdev of a RoCE port down)"
            }
            AsyncEvent::GidChange { .. } => {
                "GID table changed (RoCE: an IP address of the netdev came or went)"
            }
            AsyncEvent::PortChange { .. } => "port LID, P_Key or subnet manager changed",
            AsyncEvent::DeviceFatal => "device fatal error: reopen the device",
            AsyncEvent::CqError => "completion queue error (overrun)",
            AsyncEvent::QpFatal { .. } => "queue pair failed outside a work request",
            AsyncEvent::QpInfo { .. } => "queue pair event (informational)",
            AsyncEvent::SrqLimitReached { .. } => {
                "shared receive queue below its limit: post more receives"
            }
            AsyncEvent::Other { .. } => "other device event",
        }
    }
}

/// A work completion. `Default` gives a zeroed completion for poll arrays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Wc {
    /// The `wr_id` of the completed work request.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// What completed (not meaningful when `status` is an error other than for receives).
    pub opcode: WcOpcode,
    /// Flags (`WITH_IMM`).
    pub flags: WcFlags,
    /// Bytes received (receives) or transferred (READ); 0 for other sends.
    pub byte_len: u32,
    /// Immediate data, valid when `flags` has `WITH_IMM`.
    pub imm_data: u32,
    /// Local QP number the work request belonged to.
    pub qp_num: u32,
    /// Vendor-specific error syndrome (0 when none).
    pub vendor_err: u32,
}

impl Wc {
    /// Whether the operation succeeded.
    pub const fn is_ok(&self) -> bool {
        matches!(self.status, WcStatus::Success)
    }

    /// The immediate data, if the completion carries one.
    pub const fn imm(&self) -> Option<u32> {
        if self.flags.contains(WcFlags::WITH_IMM) {
            Some(self.imm_data)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_attr_ranges() {
        assert!(ConnectAttr::default().validate().is_ok());
        let out_of_range: [fn(&mut ConnectAttr); 4] = [
            |a| a.retry_cnt = 8,
            |a| a.rnr_retry = 8,
            |a| a.min_rnr_timer = 32,
            |a| a.timeout = 32,
        ];
        for f in out_of_range {
            let mut a = ConnectAttr::default();
            f(&mut a);
            let e = a.validate().unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        }
        let a = ConnectAttr {
            retry_cnt: 9,
            min_rnr_timer: 40,
            ..ConnectAttr::default()
        };
        let e = a.validate().unwrap_err().to_string();
        assert!(
            e.contains("retry_cnt = 9") && e.contains("min_rnr_timer = 40"),
            "{e}"
        );
        assert_eq!(rnr_timer(12), std::time::Duration::from_micros(640));
        assert_eq!(rnr_timer(0), std::time::Duration::from_micros(655_360));
    }

    #[test]
    fn sends_and_writes_with_immediate_consume_a_receive() {
        let (remote_addr, rkey) = (0, 1);
        assert!(WrOp::Send.consumes_receive());
        assert!(WrOp::SendWithImm { imm: 7 }.consumes_receive());
        assert!(
            WrOp::WriteWithImm {
                remote_addr,
                rkey,
                imm: 7
            }
            .consumes_receive()
        );
        assert!(!WrOp::Write { remote_addr, rkey }.consumes_receive());
        assert!(!WrOp::Read { remote_addr, rkey }.consumes_receive());
        assert!(
            !WrOp::FetchAdd {
                remote_addr,
                rkey,
                add: 1
            }
            .consumes_receive()
        );
    }
}
