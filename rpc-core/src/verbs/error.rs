//! Errors of the verbs layer. Every error names the verb that failed, what kind of failure it
//! was, the OS error number when there is one, and the likely cause with its fix.

use std::borrow::Cow;
use std::fmt;

use super::types::{Wc, WcOpcode, WcStatus};

/// The verb (libibverbs function or our equivalent) that failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verb {
    /// `ibv_get_device_list`
    GetDeviceList,
    /// `ibv_open_device`
    OpenDevice,
    /// `ibv_query_device` / `ibv_query_port` / `ibv_query_gid`
    QueryDevice,
    /// `ibv_alloc_pd`
    AllocPd,
    /// `ibv_reg_mr`
    RegMr,
    /// Allocation of provider memory followed by `ibv_reg_mr`.
    AllocMr,
    /// `ibv_dereg_mr`
    DeregMr,
    /// `ibv_create_comp_channel`
    CreateCompChannel,
    /// `ibv_get_cq_event`
    GetCqEvent,
    /// `ibv_create_cq`
    CreateCq,
    /// `ibv_req_notify_cq`
    ReqNotifyCq,
    /// `ibv_poll_cq`
    PollCq,
    /// `ibv_create_qp`
    CreateQp,
    /// `ibv_modify_qp`
    ModifyQp,
    /// Connecting a QP to a peer endpoint (INIT -> RTR -> RTS).
    Connect,
    /// `ibv_post_send`
    PostSend,
    /// `ibv_post_recv`
    PostRecv,
    /// Lending a range of a region to one peer under a fresh key (`ibv_bind_mw`; the ib
    /// provider registers the range instead, see `Pd::bind_window`).
    BindMw,
    /// `ibv_resize_cq`
    ResizeCq,
    /// `ibv_create_srq`
    CreateSrq,
    /// `ibv_modify_srq`
    ModifySrq,
    /// `ibv_post_srq_recv`
    PostSrqRecv,
}

impl Verb {
    /// The libibverbs function name.
    pub const fn name(self) -> &'static str {
        match self {
            Verb::GetDeviceList => "ibv_get_device_list",
            Verb::OpenDevice => "ibv_open_device",
            Verb::QueryDevice => "ibv_query_device",
            Verb::AllocPd => "ibv_alloc_pd",
            Verb::RegMr => "ibv_reg_mr",
            Verb::AllocMr => "alloc_mr (allocate + ibv_reg_mr)",
            Verb::DeregMr => "ibv_dereg_mr",
            Verb::CreateCompChannel => "ibv_create_comp_channel",
            Verb::GetCqEvent => "ibv_get_cq_event",
            Verb::CreateCq => "ibv_create_cq",
            Verb::ReqNotifyCq => "ibv_req_notify_cq",
            Verb::PollCq => "ibv_poll_cq",
            Verb::CreateQp => "ibv_create_qp",
            Verb::ModifyQp => "ibv_modify_qp",
            Verb::Connect => "connect_qp (ibv_modify_qp INIT->RTR->RTS)",
            Verb::PostSend => "ibv_post_send",
            Verb::PostRecv => "ibv_post_recv",
            Verb::BindMw => "bind_window (ibv_bind_mw)",
            Verb::ResizeCq => "ibv_resize_cq",
            Verb::CreateSrq => "ibv_create_srq",
            Verb::ModifySrq => "ibv_modify_srq",
            Verb::PostSrqRecv => "ibv_post_srq_recv",
        }
    }
}

impl fmt::Display for Verb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What kind of failure, independent of provider.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// No RDMA device exists, or the named one does not.
    NoDevice,
    /// An argument is out of range or inconsistent (zero length, overflow, bad flags).
    InvalidArgument,
    /// A requested size exceeds the device capabilities.
    ExceedsCaps,
    /// Memory could not be allocated or pinned (ENOMEM; usually RLIMIT_MEMLOCK).
    OutOfMemory,
    /// The operation is not allowed in the QP's current state (e.g. posting before RTS).
    InvalidState,
    /// The queue is full: back-pressure. Poll completions and post the rest again.
    QueueFull,
    /// An object from another protection domain or device was used.
    WrongPd,
    /// An SGE is outside its memory region, or the lkey is unknown.
    BadSge,
    /// The peer's endpoint is malformed, forged or stale.
    InvalidEndpoint,
    /// The peer is gone.
    PeerGone,
    /// The operation is not supported by this provider or device.
    Unsupported,
    /// Permission denied by the OS.
    PermissionDenied,
    /// Other OS error.
    Os,
    /// The shared state written by a peer is corrupt.
    Corrupt,
}

/// A failed verb: which verb, what kind, the OS error number when there is one, and a message
/// that says the likely cause and the fix.
#[derive(Clone, PartialEq, Eq)]
pub struct VerbsError {
    verb: Verb,
    kind: ErrorKind,
    errno: Option<i32>,
    detail: Cow<'static, str>,
}

impl VerbsError {
    /// An error without an OS error number.
    pub fn new(verb: Verb, kind: ErrorKind, detail: impl Into<Cow<'static, str>>) -> VerbsError {
        VerbsError {
            verb,
            kind,
            errno: None,
            detail: detail.into(),
        }
    }

    /// An error carrying the OS error number `errno`; the kind and the likely cause are derived
    /// from it and the verb when `detail` is empty.
    pub fn from_errno(verb: Verb, errno: i32, detail: impl Into<Cow<'static, str>>) -> VerbsError {
        let kind = match errno {
            // ibv_post_send/recv/srq_recv answer ENOMEM when the queue is full: back-pressure.
            libc::ENOMEM if matches!(verb, Verb::PostSend | Verb::PostRecv | Verb::PostSrqRecv) => {
                ErrorKind::QueueFull
            }
            libc::ENOMEM => ErrorKind::OutOfMemory,
            libc::EINVAL | libc::EFAULT => ErrorKind::InvalidArgument,
            libc::ENODEV | libc::ENOSYS | libc::ENXIO | libc::ENOENT => ErrorKind::NoDevice,
            libc::EPERM | libc::EACCES => ErrorKind::PermissionDenied,
            libc::EOPNOTSUPP => ErrorKind::Unsupported,
            libc::ESRCH => ErrorKind::PeerGone,
            libc::EAGAIN => ErrorKind::QueueFull,
            _ => ErrorKind::Os,
        };
        let mut detail: Cow<'static, str> = detail.into();
        if detail.is_empty() {
            detail = Cow::Borrowed(default_cause(verb, errno));
        }
        VerbsError {
            verb,
            kind,
            errno: Some(errno),
            detail,
        }
    }

    /// The verb that failed.
    pub fn verb(&self) -> Verb {
        self.verb
    }

    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The OS error number, if any.
    pub fn errno(&self) -> Option<i32> {
        self.errno
    }

    /// The explanation (likely cause and fix).
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// Whether this is back-pressure (queue full) rather than a failure.
    pub fn is_queue_full(&self) -> bool {
        self.kind == ErrorKind::QueueFull
    }
}

/// The likely cause of an OS error from a verb, from the field's experience.
fn default_cause(verb: Verb, errno: i32) -> &'static str {
    match (verb, errno) {
        (Verb::RegMr | Verb::AllocMr, libc::ENOMEM) => {
            "cannot pin memory: RLIMIT_MEMLOCK is too low. Fix: `ulimit -l unlimited`, \
             LimitMEMLOCK=infinity in the systemd unit, or `--ulimit memlock=-1` for containers"
        }
        (Verb::RegMr | Verb::AllocMr, libc::EFAULT) => {
            "the address range is not mapped in this process"
        }
        (Verb::RegMr | Verb::AllocMr, libc::EINVAL) => {
            "invalid access flags (REMOTE_WRITE/REMOTE_ATOMIC need LOCAL_WRITE) or zero length"
        }
        (Verb::GetDeviceList | Verb::OpenDevice, libc::ENOSYS | libc::ENODEV) => {
            "no RDMA device: the kernel has no RDMA driver loaded (load mlx5_ib, or add a \
             Soft-RoCE link with `rdma link add rxe0 type rxe netdev eth0`), or use \
             RPC_PROVIDER=soft"
        }
        (Verb::ModifyQp | Verb::Connect, libc::EINVAL) => {
            "QP attributes rejected: wrong GID index (RoCE needs a GID, see RPC_IB_GID_INDEX), \
             path MTU above the port MTU, or an invalid state transition"
        }
        (Verb::CreateQp | Verb::CreateCq, libc::EINVAL) => {
            "queue sizes exceed the device capabilities"
        }
        (Verb::CreateQp | Verb::CreateCq, libc::ENOMEM) => {
            "out of memory for queues: lower the queue depth or raise RLIMIT_MEMLOCK"
        }
        (Verb::PostSend | Verb::PostRecv, libc::ENOMEM) => {
            "queue full: more outstanding work requests than the queue depth"
        }
        (_, libc::EPERM | libc::EACCES) => {
            "permission denied: check /dev/infiniband permissions or run as a user with access"
        }
        _ => "",
    }
}

impl fmt::Display for VerbsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed", self.verb)?;
        if let Some(e) = self.errno {
            let os = std::io::Error::from_raw_os_error(e);
            write!(f, ": errno {e} ({os})")?;
        } else {
            write!(f, ": {:?}", self.kind)?;
        }
        if !self.detail.is_empty() {
            write!(f, ": {}", self.detail)?;
        }
        Ok(())
    }
}

impl fmt::Debug for VerbsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsError")
            .field("verb", &self.verb)
            .field("kind", &self.kind)
            .field("errno", &self.errno)
            .field("detail", &self.detail)
            .finish()
    }
}

impl std::error::Error for VerbsError {}

impl From<VerbsError> for std::io::Error {
    fn from(e: VerbsError) -> std::io::Error {
        let kind = match e.kind {
            ErrorKind::NoDevice => std::io::ErrorKind::NotFound,
            ErrorKind::InvalidArgument | ErrorKind::InvalidEndpoint => {
                std::io::ErrorKind::InvalidInput
            }
            ErrorKind::OutOfMemory => std::io::ErrorKind::OutOfMemory,
            ErrorKind::QueueFull => std::io::ErrorKind::WouldBlock,
            ErrorKind::PermissionDenied => std::io::ErrorKind::PermissionDenied,
            ErrorKind::Unsupported => std::io::ErrorKind::Unsupported,
            ErrorKind::PeerGone => std::io::ErrorKind::ConnectionReset,
            _ => std::io::ErrorKind::Other,
        };
        std::io::Error::new(kind, e)
    }
}

/// A failed `post_send`/`post_recv`: the work requests before `posted` were accepted, the one
/// at index `posted` was not (the `bad_wr` of libibverbs), and nothing after it was looked at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PostError {
    /// How many work requests of the list were posted.
    pub posted: usize,
    /// Why the next one was refused. [`ErrorKind::QueueFull`] is back-pressure: poll
    /// completions, then post the rest again.
    pub error: VerbsError,
}

impl fmt::Display for PostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "work request #{} refused: {}", self.posted, self.error)
    }
}

impl std::error::Error for PostError {
    /// None: the refusal's [`VerbsError`] is part of `Display` already (and is the `error`
    /// field); returned here too, reporters that print the chain printed it twice.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        None
    }
}

/// A work completion with an error status, explained: the verb, the status name and number,
/// the vendor error and the likely cause.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WcError {
    /// The completion.
    pub wc: Wc,
}

impl WcError {
    /// Wraps a completion; `None` when it succeeded.
    pub fn check(wc: &Wc) -> Result<(), WcError> {
        if wc.is_ok() {
            Ok(())
        } else {
            Err(WcError { wc: *wc })
        }
    }

    /// The verb whose work request failed, from the completion opcode.
    pub fn verb(&self) -> Verb {
        match self.wc.opcode {
            WcOpcode::Recv | WcOpcode::RecvRdmaWithImm => Verb::PostRecv,
            _ => Verb::PostSend,
        }
    }
}

impl fmt::Display for WcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let wc = &self.wc;
        write!(
            f,
            "work completion error on QP {:#x}: {} ({:?}, wr_id {:#x}) completed with {}, vendor \
             error {:#x}: {}",
            wc.qp_num,
            self.verb(),
            wc.opcode,
            wc.wr_id,
            wc.status,
            wc.vendor_err,
            wc.status.likely_cause()
        )
    }
}

impl std::error::Error for WcError {}

/// Result of a verb.
pub type Result<T, E = VerbsError> = std::result::Result<T, E>;

impl From<WcStatus> for ErrorKind {
    fn from(s: WcStatus) -> ErrorKind {
        match s {
            WcStatus::RetryExcErr => ErrorKind::PeerGone,
            WcStatus::WrFlushErr => ErrorKind::InvalidState,
            WcStatus::RemAccessErr | WcStatus::LocProtErr | WcStatus::LocAccessErr => {
                ErrorKind::PermissionDenied
            }
            _ => ErrorKind::Os,
        }
    }
}
